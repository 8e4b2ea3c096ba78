"""Rotary position embedding (RoFormer, Su et al. 2021), shared by architectures.

Inverse frequencies are computed once on the host in plain Python (they are
``head_dim / 2`` numbers), rounded to float32 as the reference implementations
compute them, and uploaded; cos and sin for a forward pass come from the
positions through ops. The scaling variants change only the frequencies:

* ``linear`` (position interpolation, Chen et al. 2023): frequencies / factor.
* ``dynamic`` (dynamic NTK): the base grows with the sequence length beyond
  ``max_position_embeddings``; recomputed per forward from the current length.
* ``llama3``: low frequencies divided by ``factor``, high ones kept, and a
  smooth blend between (Llama 3.1 report, section 3.3 / Meta's reference code).
* ``yarn`` (Peng et al. 2023, "YaRN", section 3.2 "NTK-by-parts"): dimensions
  that turn fewer than ``beta_slow`` times over the original context are
  interpolated (divided by ``factor``), those turning more than ``beta_fast``
  times are kept, with a linear ramp between; cos and sin are multiplied by
  the attention factor (section 3.4: ``0.1 ln(factor) + 1``, or DeepSeek's
  ratio ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``), as
  transformers computes them. DeepSeek-V3 also scales the softmax by
  ``mscale(factor, mscale_all_dim)**2``; that is the architecture's part
  (:func:`yarn_mscale`).
* ``longrope`` (Ding et al. 2024, "LongRoPE"; Phi-3 128k, Phi-3.5, Phi-4-mini):
  each frequency divided by its own factor, ``short_factor`` while the
  sequence fits ``original_max_position_embeddings`` and ``long_factor``
  past it (chosen per forward from its longest position, as transformers
  does, so keys cached before keep their rotation); cos and sin times
  ``sqrt(1 + ln(factor) / ln(original))``, ``factor`` being
  ``max_position_embeddings / original`` unless given.
* ``proportional`` (Gemma 4's global layers): the first
  ``partial_rotary_factor * dim / 2`` frequencies are the default ones over
  the *whole* head (exponents ``2i / dim``), the rest zero, so the rotation
  pairs dimension ``i`` with ``i + dim / 2`` across the whole head and the
  tail pairs stay unrotated (unlike a partial rotary over the first
  dimensions only); all divided by ``factor`` (default 1).

Any of them but ``dynamic`` and ``longrope`` (whose frequencies change per
forward) may also carry ``freq_factors``: one divisor per frequency, applied
last, as llama.cpp applies a GGUF file's ``rope_freqs`` tensor whatever rule
produced it (:mod:`infer.formats.gguf_arch` reads such a tensor into it when
it follows no rule a config can name).
"""

from __future__ import annotations

import logging
import math
import struct
from typing import Any

from infer.architecture import host_array
from infer.errors import ConfigError
from infer.kv.attention import AttentionContext
from infer.ops import Array, Backend

log = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional")


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def inverse_frequencies(base: float, dim: int) -> list[float]:
    """``1 / base**(2i/dim)`` for ``i < dim/2`` (RoFormer eq. 15)."""
    return [_f32(1.0 / (base ** (_f32(i / dim)))) for i in range(0, dim, 2)]


def _llama3(inv_freq: list[float], params: dict[str, Any]) -> list[float]:
    factor = float(params["factor"])
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    old_context = float(params["original_max_position_embeddings"])
    low_wavelen = old_context / low
    high_wavelen = old_context / high
    out = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return [_f32(f) for f in out]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, params: dict[str, Any], max_position_embeddings: int) -> tuple[list[float], float]:
    """YaRN's inverse frequencies and attention factor (module docstring)."""
    base = float(params["rope_theta"])
    if base <= 1.0:
        raise ConfigError(f"config.json: yarn rope needs rope_theta > 1 (it divides by log(rope_theta)), found {base}")
    old_context = float(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:  # DeepSeek configs may leave it to the context ratio
        factor = max_position_embeddings / old_context
    factor = float(factor)
    attention = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all_dim:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention = yarn_mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    out = []
    for i in range(dim // 2):
        pos_freq = _f32(base ** _f32(2 * i / dim))
        extrapolation, interpolation = _f32(1.0 / pos_freq), _f32(1.0 / _f32(factor * pos_freq))
        keep = 1.0 - min(max((i - low) / (high - low), 0.0), 1.0)  # 1: keep the frequency, 0: interpolate
        out.append(_f32(interpolation * (1 - keep) + extrapolation * keep))
    return out, float(attention)


def context_length(params: dict[str, Any], max_position_embeddings: int) -> int:
    """The longest sequence a model with these rope settings runs: dynamic NTK
    scaling exists to run past the trained length, by its factor."""
    if params.get("rope_type") == "dynamic":
        return int(max_position_embeddings * float(params["factor"]))
    return max_position_embeddings


class RotaryEmbedding:
    """cos/sin tables for a rope configuration (see the module docstring)."""

    def __init__(self, ops: Backend, dim: int, params: dict[str, Any], max_position_embeddings: int) -> None:
        if not isinstance(params.get("rope_theta"), (int, float)):  # e.g. rope_parameters given per layer type
            raise ConfigError(
                f"config.json: the rope settings need a number rope_theta, found keys {sorted(params)} "
                "(rope_parameters per layer type are read only by architectures that have layer types)"
            )
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"config.json: rope type {rope_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        for key in {"linear": ("factor",), "dynamic": ("factor",),
                    "llama3": ("factor", "original_max_position_embeddings"),
                    "yarn": ("original_max_position_embeddings",),
                    "longrope": ("original_max_position_embeddings",)}.get(rope_type, ()):
            if not isinstance(params.get(key), (int, float)):
                raise ConfigError(f"config.json: rope type {rope_type!r} needs a numeric {key!r}")
        self.ops = ops
        partial = float(params.get("partial_rotary_factor", 1.0))
        self.dim = dim if rope_type == "proportional" else int(dim * partial)
        self.dim -= self.dim % 2
        if self.dim < (4 if rope_type == "dynamic" else 2):
            raise ConfigError(
                f"config.json: rope rotates {self.dim} of {dim} dimensions (partial_rotary_factor "
                f"{params.get('partial_rotary_factor', 1.0)}); it needs at least "
                f"{4 if rope_type == 'dynamic' else 2}"
            )
        self.rope_type = rope_type
        self.params = params
        self.base = params["rope_theta"]
        self.max_position_embeddings = max_position_embeddings
        inv = inverse_frequencies(self.base, self.dim)
        if rope_type == "linear":
            inv = [_f32(f / float(params["factor"])) for f in inv]
        elif rope_type == "proportional":
            angles = int(partial * dim // 2)
            inv = [_f32(f / float(params.get("factor", 1.0))) for f in inv[:angles]] + [0.0] * (self.dim // 2 - angles)
        elif rope_type == "llama3":
            inv = _llama3(inv, params)
        #: Multiplies cos and sin (YaRN's attention factor; 1 otherwise).
        self.attention_factor = 1.0
        if rope_type == "yarn":
            inv, self.attention_factor = _yarn(self.dim, params, max_position_embeddings)
        if rope_type == "longrope":
            inv, self._long_inv_freq, self.attention_factor = self._longrope(params, max_position_embeddings)
        if params.get("freq_factors") is not None:
            inv = self._divide(inv, params["freq_factors"], rope_type)
        self._inv_freq = self._upload(inv)
        self._dynamic_len = 0
        self._warned = False

    def _longrope(self, params: dict[str, Any], max_position_embeddings: int) -> tuple[list[float], Array, float]:
        """Short-factor frequencies, long-factor frequencies (uploaded) and the attention factor."""
        original = float(params["original_max_position_embeddings"])
        half = self.dim // 2
        for key in ("short_factor", "long_factor"):
            factors = params.get(key)
            if not isinstance(factors, list) or len(factors) != half:
                raise ConfigError(f"config.json: rope type 'longrope' needs {key} as a list of {half} numbers "
                                  f"(rotary dimensions / 2), found {factors!r}")
        factor = float(params.get("factor") or max_position_embeddings / original)
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

        def frequencies(factors: list[float]) -> list[float]:
            return [_f32(1.0 / _f32(_f32(float(f)) * _f32(self.base ** _f32(2 * i / self.dim))))
                    for i, f in enumerate(factors)]

        return frequencies(params["short_factor"]), self._upload(frequencies(params["long_factor"])), float(attention)

    def _divide(self, inv: list[float], factors: Any, rope_type: str) -> list[float]:
        """``inv`` divided by ``freq_factors`` one to one (the module docstring)."""
        if rope_type in ("dynamic", "longrope"):
            raise ConfigError(f"config.json: rope freq_factors cannot be combined with rope type {rope_type!r}, "
                              "whose frequencies change with the sequence length")
        ok = isinstance(factors, (list, tuple)) and len(factors) == len(inv) and all(
            isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f < math.inf for f in factors)
        if not ok:
            raise ConfigError(f"config.json: rope freq_factors must be {len(inv)} positive finite numbers "
                              f"(rotary dimensions / 2), found {factors!r}")
        return [_f32(f / _f32(float(d))) for f, d in zip(inv, factors)]

    def _upload(self, values: list[float]) -> Array:
        return self.ops.reshape(self.ops.from_numpy(host_array(values), "float32"), (1, -1))

    def _dynamic_frequencies(self, seq_len: int) -> Array:
        # Stateless form of transformers' dynamic update: the base follows the
        # current sequence length, never shorter than max_position_embeddings.
        seq_len = max(seq_len, self.max_position_embeddings)
        if seq_len != self._dynamic_len:
            factor = float(self.params["factor"])
            base = self.base * ((factor * seq_len / self.max_position_embeddings) - (factor - 1)) ** (
                self.dim / (self.dim - 2)
            )
            self._dynamic_inv = self._upload(inverse_frequencies(base, self.dim))
            self._dynamic_len = seq_len
        return self._dynamic_inv

    def __call__(self, ctx: AttentionContext) -> tuple[Array, Array]:
        """cos, sin ``[tokens, dim/2]`` for the context's positions."""
        ops = self.ops
        inv = self._inv_freq
        if self.rope_type == "dynamic":
            inv = self._dynamic_frequencies(ctx.max_position)
        elif self.rope_type == "longrope" and ctx.max_position > (
                original := self.params["original_max_position_embeddings"]):
            if not self._warned and any(0 < s.start <= original < s.start + s.length for s in ctx.sequences):
                self._warned = True  # a sequence grew past the original length with keys cached before it
                log.warning("longrope: a sequence grew past original_max_position_embeddings (%s); its cached "
                            "keys keep the short factors' rotation (transformers' generate() recomputes them)",
                            original)
            inv = self._long_inv_freq
        pos = ops.reshape(ops.astype(ctx.positions, "float32"), (-1, 1))
        freqs = ops.mul(pos, inv)  # [tokens, dim/2]
        cos, sin = ops.cos(freqs), ops.sin(freqs)
        if self.attention_factor != 1.0:
            cos, sin = ops.mul(cos, self.attention_factor), ops.mul(sin, self.attention_factor)
        dtype = ops.compute_dtype
        if dtype != "float32":
            cos, sin = ops.astype(cos, dtype), ops.astype(sin, dtype)
        return cos, sin

