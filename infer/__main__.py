"""``python -m infer ...``: the ``infer`` command, for when its console script is
not on ``PATH`` (a venv not activated, ``pip install --user``)."""

import sys

from infer.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
