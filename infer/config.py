"""Config helpers for architectures.

An architecture's config is a dataclass whose fields are the ``config.json``
names. :func:`from_dict` fills it, checking types, so a wrong or missing
value is a :class:`~infer.errors.ConfigError` naming the key, never a
``KeyError`` deep inside a forward pass.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from infer.errors import ConfigError

T = TypeVar("T")

_MISSING = dataclasses.MISSING


def _check(name: str, value: Any, annotation: Any, where: str) -> Any:
    """Coerce ``value`` to ``annotation`` where that is lossless, else raise."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(name, value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: {name!r} may not be null")
    if annotation is Any or annotation is object:
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif annotation is str:
        if isinstance(value, str):
            return value
    elif origin in (list, tuple) or annotation in (list, tuple):
        if isinstance(value, (list, tuple)):
            inner = args[0] if args else Any
            return [_check(f"{name}[{i}]", v, inner, where) for i, v in enumerate(value)]
    elif origin is dict or annotation is dict:
        if isinstance(value, dict):
            return value
    else:
        return value
    expected = getattr(annotation, "__name__", str(annotation))
    raise ConfigError(f"{where}: {name!r} must be {expected}, found {value!r}")


def from_dict(cls: type[T], data: dict[str, Any], where: str = "config.json") -> T:
    """Build the config dataclass ``cls`` from a ``config.json`` dict.

    Unknown keys are ignored; missing keys without a default raise
    :class:`ConfigError`. After construction, a ``validate()`` method on the
    class (if any) runs for cross-field checks.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, found {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in data and data[f.name] is not None:
            kwargs[f.name] = _check(f.name, data[f.name], hints[f.name], where)
        elif f.default is _MISSING and f.default_factory is _MISSING:  # type: ignore[misc]
            raise ConfigError(f"{where}: required key {f.name!r} is missing")
    config = cls(**kwargs)
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate()
    return config


def rope_parameters(data: dict[str, Any], default_theta: float = 10000.0) -> dict[str, Any]:
    """The rope settings of a config in one form, whichever transformers wrote it.

    transformers 5 writes ``rope_parameters`` (with ``rope_theta`` inside);
    4.x wrote top-level ``rope_theta`` and an optional ``rope_scaling``. A
    reader that knows only one form silently falls back to defaults on the
    other, so both are read. Returns a dict with at least ``rope_type`` and
    ``rope_theta``. Per-layer-type dicts (``{"full_attention": {...}}``) are
    returned as is for the caller to pick from.
    """
    params = data.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return {k: _normalize_rope(v, data, default_theta) for k, v in params.items()}
    merged: dict[str, Any] = {}
    if isinstance(data.get("rope_scaling"), dict):
        merged.update(data["rope_scaling"])
    if isinstance(params, dict):
        merged.update(params)
    return _normalize_rope(merged, data, default_theta)


def _normalize_rope(params: dict[str, Any], data: dict[str, Any], default_theta: float) -> dict[str, Any]:
    out = dict(params)
    rope_type = out.get("rope_type", out.get("type", "default"))
    if rope_type is None:
        rope_type = "default"
    if not isinstance(rope_type, str):
        raise ConfigError(f"config.json: rope type must be a string, found {rope_type!r}")
    out["rope_type"] = rope_type
    out.pop("type", None)
    theta = out.get("rope_theta", data.get("rope_theta", default_theta))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"config.json: rope_theta must be a positive number, found {theta!r}")
    out["rope_theta"] = float(theta)
    if "partial_rotary_factor" not in out and "partial_rotary_factor" in data:
        out["partial_rotary_factor"] = data["partial_rotary_factor"]
    return out
