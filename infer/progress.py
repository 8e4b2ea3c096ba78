"""Progress bars on stderr, with ``tqdm`` imported only when one is shown.

Importing ``tqdm.auto`` costs about 50 ms of CPU (it brings ``asyncio`` with
it), a tenth of a small model's whole load, for bars that are off unless a
caller asks for them.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["progress_bar"]


class _NoBar:
    """What a bar that is not shown does: nothing."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: float = 1) -> None:
        """Count progress nobody sees."""


def progress_bar(show: bool, **options: Any) -> Any:
    """A ``tqdm`` bar on stderr (``options`` are tqdm's) when ``show``, else a
    stand-in with ``update`` and the context-manager methods that does nothing."""
    if not show:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(file=sys.stderr, **options)
