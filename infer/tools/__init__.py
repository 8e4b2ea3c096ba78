"""What is built on the library rather than part of it: the ``infer`` command
(:mod:`infer.tools.cli`), ``infer diff`` against a reference
(:mod:`infer.tools.diff`) and the benchmark harness (:mod:`infer.tools.bench`
and its worker, machine probe and report). Nothing in the core imports these.
"""
