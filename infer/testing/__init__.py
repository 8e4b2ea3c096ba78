"""infer's conformance kit: checks a backend op by op against the reference backend.

Run it on an installed backend with one command (pytest and hypothesis needed:
``pip install 'infer-engine[conformance]'``)::

    pytest --pyargs infer.testing --infer-backend mybackend

See :mod:`infer.testing.conformance` for the Python API and the tolerances,
and :mod:`infer.testing.pytest_plugin` for the command-line options.
Nothing here is imported by ``import infer``.
"""

from __future__ import annotations

from infer.errors import MissingDependencyError

#: How to install what the kit needs beyond infer itself.
INSTALL = "pip install 'infer-engine[conformance]' (or: pip install hypothesis pytest)"


def missing_hypothesis(exc: ImportError) -> MissingDependencyError:
    """The error to raise when importing hypothesis failed with ``exc``.

    The kit's case table and strategies draw every op call with hypothesis,
    which is not a dependency of infer: without it they cannot be imported,
    and this error says what to install instead of a bare ``No module named``.
    """
    if exc.name == "hypothesis":
        why = "hypothesis, which is not installed here"
    else:  # installed, but something it imports is missing or broken
        why = f"hypothesis, which is installed but fails to import ({type(exc).__name__}: {exc})"
    return MissingDependencyError(f"infer's conformance kit draws its op calls with {why}: {INSTALL}")
