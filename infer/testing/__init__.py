"""infer's conformance kit: checks a backend op by op against the numpy backend.

Run it on an installed backend with one command (pytest and hypothesis needed)::

    pytest --pyargs infer.testing --infer-backend mybackend

See :mod:`infer.testing.conformance` for the Python API and the tolerances,
and :mod:`infer.testing.pytest_plugin` for the command-line options.
Nothing here is imported by ``import infer``.
"""
