"""Qwen3.5's vision tower: a ViT with 2D rotary and a 2x2 patch merger.

``vision_config`` of a ``qwen3_5`` checkpoint (``Qwen3_5ForConditionalGeneration``,
weights under ``model.visual.``), as transformers' ``Qwen3_5VisionModel``
computes it. Its input is what :mod:`infer.image_processors.qwen2_vl` makes
of an image: ``pixel_values`` ``[patches, c * tp * p * p]`` in merge-block
order and the image's ``grid_thw``. Against a plain ViT:

* **Patch embedding**: a ``Conv3d`` whose kernel equals its stride
  (``temporal_patch_size x patch_size x patch_size``), which on flattened
  patches is one matrix product: ``x @ proj.weight.reshape(hidden, -1).T + b``.
* **Learned positions, resampled**: ``pos_embed`` is a square grid of
  ``num_position_embeddings`` vectors, bilinearly interpolated
  (``align_corners=True``) to each image's ``grid_h x grid_w``: four taps
  per patch, whose indices and weights are computed on the host in float32,
  as transformers' ``get_vision_interpolation_indices_and_weights`` does.
* **2D rotary** (axial): each head's first half rotates by the patch's row,
  the second half by its column, both with the frequencies
  ``theta ** (-2i / (head_dim / 2))`` (``rope_parameters.rope_theta``,
  default 10000), so the table per patch is ``[row * f, col * f]``
  (``head_dim / 2`` angles, half-split pairs over the whole head).
* **Attention** is bidirectional within one frame of one image: each frame a
  sequence of the contract's attention op whose keys are the layer's own
  rows (:func:`bidirectional_batch`), ``causal=False``; every block attends
  fully (Qwen2.5-VL's windowed blocks are gone in Qwen3-VL / 3.5).
* Pre-norm blocks: LayerNorm (eps 1e-6), ``attn.qkv`` (one biased product
  for q, k, v), ``attn.proj``; LayerNorm, ``mlp.linear_fc1``,
  ``hidden_act`` (``gelu_pytorch_tanh``), ``mlp.linear_fc2``.
* **Merger**: LayerNorm over each patch, then the ``spatial_merge_size**2``
  patches of a merge block side by side (the pixel order already groups
  them), ``linear_fc1``, exact GELU, ``linear_fc2`` to ``out_hidden_size``
  (the language model's width): one vector per image token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from infer.architecture import VisionSpec, WeightLoader, host_array
from infer.config import from_dict
from infer.errors import ConfigError
from infer.ops import Array, AttentionBatch, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import activation
from .mrope import MRotaryEmbedding, mrope_positions
from . import qwen3_5, qwen3_next
from .qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM, model_config, text_config
from .qwen3_next import Qwen3_5MoeForCausalLM
from .rope import _f32
from .vision import activation_bytes, exact_gelu_bytes

Grid = tuple[int, int, int]


@dataclass
class Qwen3_5VisionConfig:
    """``vision_config`` fields read (transformers names and defaults)."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Positive sizes, heads dividing the width, a square position grid."""
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                     "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "num_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: vision_config.{name} must be positive, found {getattr(self, name)}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ConfigError(f"config.json: vision_config.hidden_size ({self.hidden_size}) must be num_heads "
                              f"({self.num_heads}) heads of a multiple of 4 (2D rotary)")
        if self.side ** 2 != self.num_position_embeddings:
            raise ConfigError(f"config.json: vision_config.num_position_embeddings ({self.num_position_embeddings}) "
                              "must be a square (a grid of learned positions)")
        activation("vision_config.hidden_act", self.hidden_act)

    @property
    def side(self) -> int:
        """Side of the learned position grid."""
        return int(self.num_position_embeddings ** 0.5)

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def patch_rows_cols(grid: Grid, merge: int) -> tuple[list[int], list[int]]:
    """Row and column of each patch of one frame of ``grid``, in the order the
    patches come (merge blocks row by row, the patches of a block row by row)."""
    _, h, w = grid
    rows, cols = [], []
    for br in range(h // merge):
        for bc in range(w // merge):
            for ir in range(merge):
                for ic in range(merge):
                    rows.append(br * merge + ir)
                    cols.append(bc * merge + ic)
    return rows, cols


def interpolation_taps(grid: Grid, merge: int, side: int) -> tuple[list[int], list[float]]:
    """Per patch of every frame, the four ``pos_embed`` rows and weights that
    resample a ``side x side`` grid to ``grid_h x grid_w`` (bilinear,
    ``align_corners=True``), in float32 as transformers computes them."""
    t, h, w = grid

    def axis(index: int, size: int) -> list[tuple[int, float]]:
        src = _f32(_f32(float(index) * (side - 1)) / max(size - 1, 1))
        floor = float(int(src // 1))
        out = []
        for offset in (0, 1):
            tap = min(max(int(floor) + offset, 0), side - 1)
            weight = max(_f32(1.0 - abs(_f32(_f32(src - floor) - offset))), 0.0)
            out.append((tap, weight))
        return out

    indices, weights = [], []
    for r, c in zip(*patch_rows_cols(grid, merge)):
        for hi, hw in axis(r, h):
            for wi, ww in axis(c, w):
                indices.append(hi * side + wi)
                weights.append(_f32(hw * ww))
    return indices * t, weights * t


def bidirectional_batch(ops: Backend, lengths: list[int]) -> AttentionBatch:
    """The attention description of a forward of sequences of ``lengths``
    rows whose keys are the forward's own rows (no cache): each sequence's
    "pool" its rows, in blocks of one row, so sequences of any lengths share
    one call and none sees another."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    width = max(lengths)
    tables = [list(range(s, s + n)) + [0] * (width - n) for s, n in zip(starts, lengths)]
    i32 = lambda values: ops.from_numpy(host_array(values, "int32"))  # noqa: E731
    return AttentionBatch(i32(starts), i32(lengths), i32(tables), 1, width)


class Qwen3_5VisionModel:
    """Patch embedding, position embeddings, ViT blocks and the merger (module docstring)."""

    def __init__(self, config: Qwen3_5VisionConfig, weights: WeightLoader, ops: Backend, *,
                 prefix: str = "model.visual.") -> None:
        config.validate()
        self.config, self.ops = config, ops
        cfg, w, d = config, weights, config.hidden_size
        self.act = activation("vision_config.hidden_act", cfg.hidden_act)
        self.head_dim = d // cfg.num_heads
        p = prefix

        def linear(name: str, rows: int, cols: int) -> tuple[Array, Array]:
            return w.get(name + ".weight", (rows, cols)), w.get(name + ".bias", (rows,))

        def norm(name: str, dim: int = d) -> tuple[Array, Array]:
            return w.get(name + ".weight", (dim,)), w.get(name + ".bias", (dim,))

        self.patch_embed = (
            w.get(p + "patch_embed.proj.weight",
                  (d, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
                  transform=lambda a: a.reshape(d, -1)),
            w.get(p + "patch_embed.proj.bias", (d,)))
        self.pos_embed = w.get(p + "pos_embed.weight", (cfg.num_position_embeddings, d))
        self.blocks = []
        for i in range(cfg.depth):
            b = f"{p}blocks.{i}."
            self.blocks.append({"norm1": norm(b + "norm1"), "norm2": norm(b + "norm2"),
                                "qkv": linear(b + "attn.qkv", 3 * d, d), "proj": linear(b + "attn.proj", d, d),
                                "fc1": linear(b + "mlp.linear_fc1", cfg.intermediate_size, d),
                                "fc2": linear(b + "mlp.linear_fc2", d, cfg.intermediate_size)})
        merged = d * cfg.spatial_merge_size ** 2
        self.merger = {"norm": norm(p + "merger.norm"), "fc1": linear(p + "merger.linear_fc1", merged, merged),
                       "fc2": linear(p + "merger.linear_fc2", cfg.out_hidden_size, merged)}
        theta = float((cfg.rope_parameters or {}).get("rope_theta", 10000.0))
        spatial = self.head_dim // 2
        self._inv_freq = ops.reshape(ops.from_numpy(host_array(
            [_f32(1.0 / (theta ** _f32(i / spatial))) for i in range(0, spatial, 2)])), (1, -1))

    def sequence_lengths(self, grids: list[Grid]) -> list[int]:
        """Patches per attention sequence: one frame of one image each."""
        return [h * w for t, h, w in grids for _ in range(t)]

    def num_tokens(self, grid: Grid) -> int:
        """Image tokens (merged patches) of an image of ``grid``."""
        t, h, w = grid
        return t * h * w // self.config.spatial_merge_size ** 2

    def rotary(self, grids: list[Grid]) -> tuple[Array, Array]:
        """cos, sin ``[patches, head_dim / 2]``: each patch's row angles, then its column angles."""
        ops, merge = self.ops, self.config.spatial_merge_size
        rows, cols = [], []
        for grid in grids:
            r, c = patch_rows_cols(grid, merge)
            rows += r * grid[0]
            cols += c * grid[0]
        angles = [ops.mul(ops.reshape(ops.from_numpy(host_array(pos)), (-1, 1)), self._inv_freq)
                  for pos in (rows, cols)]
        freqs = ops.concat(angles, axis=1)
        return ops.cos(freqs), ops.sin(freqs)

    def position_embeddings(self, grids: list[Grid]) -> Array:
        """``[patches, hidden]``: the learned grid resampled to each image's grid."""
        ops, cfg = self.ops, self.config
        indices, weights = [], []
        for grid in grids:
            i, w = interpolation_taps(grid, cfg.spatial_merge_size, cfg.side)
            indices += i
            weights += w
        rows = ops.embedding(self.pos_embed, ops.from_numpy(host_array(indices, "int32")))  # [patches * 4, hidden]
        rows = ops.mul(rows, ops.reshape(ops.from_numpy(host_array(weights)), (-1, 1)))
        return ops.sum(ops.reshape(rows, (-1, 4, cfg.hidden_size)), axis=1)

    def __call__(self, pixel_values: Array, grids: list[Grid]) -> Array:
        """Image embeddings ``[tokens, out_hidden_size]`` of ``pixel_values``
        ``[patches, patch_dim]`` (the images of ``grids``, in order), one row per
        image token."""
        ops, cfg = self.ops, self.config
        batch = bidirectional_batch(ops, self.sequence_lengths(grids))
        d, nh, hd = cfg.hidden_size, cfg.num_heads, self.head_dim
        x = ops.linear(pixel_values, *self.patch_embed)  # [patches, hidden]
        x = ops.add(x, self.position_embeddings(grids))
        cos, sin = self.rotary(grids)
        n = ops.shape(x)[0]
        for blk in self.blocks:
            y = ops.layer_norm(x, *blk["norm1"], 1e-6)
            qkv = ops.reshape(ops.linear(y, *blk["qkv"]), (n, 3, nh, hd))
            q, k, v = (ops.reshape(ops.slice(qkv, 1, j, j + 1), (n, nh, hd)) for j in range(3))
            q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
            o = ops.attention(q, k, v, batch, scale=hd ** -0.5, causal=False)  # [patches, heads, head_dim]
            x = ops.add(x, ops.linear(ops.reshape(o, (n, d)), *blk["proj"]))
            y = ops.layer_norm(x, *blk["norm2"], 1e-6)
            y = ops.linear(getattr(ops, self.act)(ops.linear(y, *blk["fc1"])), *blk["fc2"])
            x = ops.add(x, y)
        m = self.merger
        x = ops.reshape(ops.layer_norm(x, *m["norm"], 1e-6), (n // cfg.spatial_merge_size ** 2, -1))
        return ops.linear(ops.gelu(ops.linear(x, *m["fc1"])), *m["fc2"])


def vision_config(config: dict[str, Any]) -> Qwen3_5VisionConfig:
    """The vision tower's settings from a ``qwen3_5`` config.json dict."""
    nested = config.get("vision_config")
    if not isinstance(nested, dict):
        raise ConfigError("config.json: a qwen3_5 vision model needs a vision_config")
    return from_dict(Qwen3_5VisionConfig, nested)


class QwenVision:
    """What a Qwen3.5 language model (dense or MoE) gains with its vision
    tower: one row per ``<|image_pad|>`` token (``image_token_id``) from the
    tower above, attention still causal, and M-RoPE rotary positions
    (:mod:`.mrope`): a prompt with images carries three position streams, a
    text-only one plain indices."""

    ops: Backend
    rope: dict[str, Any]

    def attach_vision(self, config: dict[str, Any], text: Any, weights: WeightLoader) -> None:
        """Read the tower (``model.visual.``) and switch the rotary tables to
        M-RoPE; ``text`` is the language model's settings."""
        ops = self.ops
        self.rope = {"default": MRotaryEmbedding(ops, text.head_dim, text.rope, text.max_position_embeddings)}
        vision = vision_config(config)
        if vision.out_hidden_size != text.hidden_size:
            raise ConfigError(f"config.json: vision_config.out_hidden_size ({vision.out_hidden_size}) must be the "
                              f"language model's hidden_size ({text.hidden_size})")
        self.visual = Qwen3_5VisionModel(vision, weights, ops, prefix="model.visual.")
        self.vision = VisionSpec("qwen2_vl", int(config.get("image_token_id", 248056)), config=config)

    def image_activation_bytes(self, shape: Sequence[int], meta: Mapping[str, Any]) -> int:
        """The most memory :meth:`embed_image` holds at once: a tower layer over the image's ``t * h * w`` patches."""
        cfg = self.visual.config
        t, h, w = (int(x) for x in meta["grid_thw"])
        merged = cfg.hidden_size * cfg.spatial_merge_size ** 2  # the merger's exact GELU over merged rows
        return (activation_bytes(self.ops, t * h * w, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads)
                + exact_gelu_bytes(t * h * w // cfg.spatial_merge_size ** 2, merged))

    def embed_image(self, pixel_values: Array, meta: Mapping[str, Any]) -> Array:
        """One image's rows ``[t * h * w / merge**2, hidden]`` from its patches and ``meta["grid_thw"]``."""
        return self.visual(pixel_values, [tuple(int(x) for x in meta["grid_thw"])])  # type: ignore[list-item]

    def prompt_positions(self, token_ids: Sequence[int], images: Sequence[Any]) -> tuple[Any, int]:
        """M-RoPE's three streams of the prompt and the delta after it (:func:`.mrope.mrope_positions`)."""
        layout = [(image.start, tuple(int(x) for x in image.processed.meta["grid_thw"])) for image in images]
        streams, delta = mrope_positions(len(token_ids), layout, self.visual.config.spatial_merge_size)
        return host_array(streams, "int32"), delta


class Qwen3_5ForConditionalGeneration(QwenVision, Qwen3_5ForCausalLM):
    """Qwen3.5 (``Qwen3_5ForConditionalGeneration``) with its vision tower."""


class Qwen3_5MoeForConditionalGeneration(QwenVision, Qwen3_5MoeForCausalLM):
    """Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``) with its vision tower (the same as Qwen3.5's)."""


def has_tower(config: dict[str, Any], weights: WeightLoader) -> bool:
    """Whether a nested checkpoint holds its vision tower (a text-only export does not)."""
    return isinstance(config.get("vision_config"), dict) and weights.has("model.visual.patch_embed.proj.weight")


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> Qwen3_5ForCausalLM:
    """A ``qwen3_5`` checkpoint: with its vision tower where it holds one, else its language model alone."""
    if not has_tower(config, weights):
        return qwen3_5.build(config, weights, ops)
    text, prefix = text_config(config)
    cfg = model_config(Qwen3_5Config, text)
    network = Qwen3_5ForConditionalGeneration(cfg, weights, ops, prefix=prefix)
    network.attach_vision(config, cfg, weights)
    return network


def build_moe(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> Qwen3_5ForCausalLM:
    """A ``qwen3_5_moe`` checkpoint: with its vision tower where it holds one, else its language model alone."""
    if not has_tower(config, weights):
        return qwen3_next.build_qwen3_5_moe(config, weights, ops)
    cfg, prefix = qwen3_next.qwen3_5_moe_config(config, weights)
    network = Qwen3_5MoeForConditionalGeneration(cfg, weights, ops, prefix=prefix)
    network.attach_vision(config, cfg, weights)
    return network


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register Qwen3.5's and Qwen3.5-MoE's vision-language checkpoints."""
    register(ArchitectureSpec(name="qwen3_5_vl", model_types=("qwen3_5",), build=build,
                              description="Qwen3.5 (Qwen3_5ForConditionalGeneration): its vision tower with 2D rope "
                                          "and 2x2 merger, M-RoPE positions; the language model alone without it"))
    register(ArchitectureSpec(name="qwen3_5_moe_vl", model_types=("qwen3_5_moe",), build=build_moe,
                              description="Qwen3.5-MoE (Qwen3_5MoeForConditionalGeneration): the same vision tower "
                                          "and positions; the language model alone without it"))
