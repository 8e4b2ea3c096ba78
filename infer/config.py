"""Config helpers for architectures.

An architecture's config is a dataclass whose fields are the ``config.json``
names. :func:`from_dict` fills it, checking types, so a wrong or missing
value is a :class:`~infer.errors.ConfigError` naming the key, never a
``KeyError`` deep inside a forward pass.

Model files are untrusted input (docs/security.md), so this is also the one
layer that bounds hyperparameters before anything is sized from them: every
field named in :data:`RANGES` (whichever architecture declares it) must lie in
its range, and :func:`rope_parameters` checks the rope settings for type,
range and completeness. What a value implies about the weights (head_dim
times heads against the projections) is checked by the weight loader's shape
checks, which an architecture runs before it builds anything sized by the
config (the rope tables).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Collection
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
            try:
                return float(value)
            except OverflowError:  # an integer beyond float's range
                raise ConfigError(f"{where}: {name!r} is too large for a float: "
                                  f"an integer of {value.bit_length()} bits") from None
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


#: The allowed closed range of every hyperparameter with one of these names,
#: in any architecture's config. The bounds are far above every published
#: model (DeepSeek-V3: hidden 7,168, 128 heads, 61 layers, 129,280 tokens;
#: head_dim at most 512) and low enough that nothing sized from them
#: (rope tables, per-layer lists) can take noticeable time or memory before
#: the weight shapes are compared.
RANGES: dict[str, tuple[float, float]] = {
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "moe_intermediate_size": (1, 1 << 20),
    "num_hidden_layers": (1, 1 << 12),
    "num_attention_heads": (1, 1 << 12),
    "num_key_value_heads": (1, 1 << 12),
    "head_dim": (1, 1 << 13),
    "qk_rope_head_dim": (1, 1 << 13),
    "qk_nope_head_dim": (0, 1 << 13),
    "v_head_dim": (1, 1 << 13),
    "kv_lora_rank": (1, 1 << 17),
    "q_lora_rank": (1, 1 << 17),
    "vocab_size": (1, 1 << 24),
    "max_position_embeddings": (1, 1 << 30),
    "sliding_window": (0, 1 << 30),  # 0 or null: no window
    "sliding_window_pattern": (1, 1 << 12),
    "max_window_layers": (0, 1 << 12),
    "n_routed_experts": (0, 1 << 16),
    "n_shared_experts": (0, 1 << 10),
    "num_experts_per_tok": (1, 1 << 16),
    "n_group": (1, 1 << 16),
    "topk_group": (1, 1 << 16),
    "first_k_dense_replace": (0, 1 << 12),
    "num_nextn_predict_layers": (0, 1 << 6),
    "rms_norm_eps": (0.0, 1.0),
    "query_pre_attn_scalar": (1e-6, 1e12),
    "routed_scaling_factor": (1e-6, 1e6),
    "final_logit_softcapping": (1e-6, 1e12),
    "attn_logit_softcapping": (1e-6, 1e12),
}


def check_range(name: str, value: Any, low: float, high: float, where: str = "config.json") -> None:
    """Raise :class:`ConfigError` unless ``low <= value <= high`` (a finite number)."""
    allowed = f"[{_number(low)}, {_number(high)}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: {name!r} must be a number in {allowed}, found {value!r}")
    if isinstance(value, float) and not math.isfinite(value) or not low <= value <= high:
        raise ConfigError(f"{where}: {name!r} = {_number(value)} is out of range; allowed: {allowed}")


def check_layer_types(layer_types: list[str], num_layers: int, supported: Collection[str] | None = None,
                      where: str = "config.json") -> None:
    """Raise :class:`ConfigError` unless ``layer_types`` has one entry per
    layer, each one of ``supported`` (None: any name)."""
    if len(layer_types) != num_layers:
        raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - set(supported)) if supported is not None else []
    if unknown:
        raise ConfigError(f"{where}: layer_types holds {', '.join(map(repr, unknown))}; "
                          f"supported: {', '.join(supported or ())}")


def _number(value: float) -> str:
    """A bound or value as a reader wants it: ints in full up to 2**64, else in bits."""
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 2**53):
        value = int(value)
        return str(value) if value.bit_length() < 64 else f"an integer of {value.bit_length()} bits"
    return f"{value:g}"


def from_dict(cls: type[T], data: dict[str, Any], where: str = "config.json") -> T:
    """Build the config dataclass ``cls`` from a ``config.json`` dict.

    Unknown keys are ignored; missing keys without a default raise
    :class:`ConfigError`; a field named in :data:`RANGES` must lie in its
    range. After construction, a ``validate()`` method on the class (if any)
    runs for cross-field checks.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, found {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in data and data[f.name] is not None:
            kwargs[f.name] = _check(f.name, data[f.name], hints[f.name], where)
            if f.name in RANGES and kwargs[f.name] is not None:
                check_range(f.name, kwargs[f.name], *RANGES[f.name], where)
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


#: Rope settings that must be present for a rope type (transformers'
#: ``rope_config_validation``), and the range of every numeric rope setting.
ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
}
ROPE_RANGES: dict[str, tuple[float, float]] = {
    "rope_theta": (1.0, 1e15),
    "factor": (1e-3, 1e6),
    "original_max_position_embeddings": (1, 1 << 30),
    "low_freq_factor": (1e-6, 1e6),
    "high_freq_factor": (1e-6, 1e6),
    "beta_fast": (1e-6, 1e6),
    "beta_slow": (1e-6, 1e6),
    "attention_factor": (1e-6, 1e6),
    "mscale": (0.0, 1e6),
    "mscale_all_dim": (0.0, 1e6),
    "partial_rotary_factor": (1e-6, 1.0),
}


def _normalize_rope(params: dict[str, Any], data: dict[str, Any], default_theta: float) -> dict[str, Any]:
    where = "config.json"
    out = dict(params)
    rope_type = out.get("rope_type", out.get("type", "default"))
    if rope_type is None:
        rope_type = "default"
    if not isinstance(rope_type, str):
        raise ConfigError(f"{where}: rope type must be a string, found {rope_type!r}")
    out["rope_type"] = rope_type
    out.pop("type", None)
    theta = out.get("rope_theta", data.get("rope_theta", default_theta))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"{where}: rope_theta must be a positive number, found {theta!r}")
    out["rope_theta"] = theta
    if "partial_rotary_factor" not in out and "partial_rotary_factor" in data:
        out["partial_rotary_factor"] = data["partial_rotary_factor"]
    for key in ROPE_REQUIRED.get(rope_type, ()):
        if out.get(key) is None:
            raise ConfigError(f"{where}: rope type {rope_type!r} needs {key!r} "
                              f"(a number in [{_number(ROPE_RANGES[key][0])}, {_number(ROPE_RANGES[key][1])}]), found none")
    for key, (low, high) in ROPE_RANGES.items():
        if key in out and out[key] is None:  # null means the default, as in transformers
            del out[key]
        elif key in out:
            check_range(key if key.startswith("rope") else f"rope {key}", out[key], low, high, where)
            out[key] = float(out[key])
    if rope_type == "llama3" and not out.get("low_freq_factor", 1.0) < out.get("high_freq_factor", 4.0):
        raise ConfigError(f"{where}: rope llama3 needs low_freq_factor < high_freq_factor, found "
                          f"{out.get('low_freq_factor', 1.0)} and {out.get('high_freq_factor', 4.0)}")
    return out
