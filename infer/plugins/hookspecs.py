"""Plugin hooks: the contracts a plugin implements.

A plugin is a module (or object) published under the ``infer`` entry-point
group. It implements any of these hooks with :data:`hookimpl`. Each hook
receives a ``register`` callback; call it once per thing contributed. The
first-party numpy backend, Hugging Face format and llama architecture
register through exactly these hooks.

Example::

    from infer.plugins.hookspecs import hookimpl
    from infer.plugins.registry import BackendSpec

    @hookimpl
    def infer_register_backends(register):
        register(BackendSpec(name="mybackend", device="cpu", factory=make, probe=probe))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("infer")
hookimpl = pluggy.HookimplMarker("infer")


@hookspec
def infer_register_backends(register: Callable[[Any], None]) -> None:
    """Register compute backends.

    Call ``register(spec)`` with an :class:`infer.plugins.registry.BackendSpec` for
    each backend/device pair the plugin provides (e.g. ``torch``/``cuda`` and
    ``torch``/``cpu``). The spec's ``probe`` must be cheap and must not raise:
    it reports whether the pair is usable here and why not. Heavy imports
    (the framework itself) belong in the spec's ``factory``, which runs only
    when the backend is selected. ``name/device`` pairs must be unique.
    """


@hookspec
def infer_register_architectures(register: Callable[[Any], None]) -> None:
    """Register model architectures.

    Call ``register(spec)`` with an :class:`infer.plugins.registry.ArchitectureSpec`
    naming the Hugging Face ``model_type`` values it implements and the
    callable that builds the model from a config and weights. An architecture
    is written only against the op contract (:mod:`infer.ops`) and the
    attention context (:mod:`infer.kv.attention`).
    """


@hookspec
def infer_register_formats(register: Callable[[Any], None]) -> None:
    """Register model formats.

    Call ``register(spec)`` with an :class:`infer.plugins.registry.FormatSpec`: a
    ``detect(path)`` predicate that must not raise, and an ``open(path)``
    that returns an :class:`infer.package.ModelPackage` or raises a
    :class:`~infer.errors.FormatError` naming the file and what is wrong.
    """
