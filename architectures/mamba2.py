"""Mamba2 (Dao & Gu 2024, "Transformers are SSMs: Generalized Models and
Efficient Algorithms Through Structured State Space Duality").

``model_type`` ``mamba2`` as transformers' ``Mamba2ForCausalLM`` computes it:
no attention and no MLP, a stack of pre-norm residual blocks around one
*mixer* each (the paper's section 7, "the Mamba-2 block"):

    h = h + out_proj(gated_norm(ssd(conv(xBC)), z))      x = norm(h)
    z, xBC, dt = in_proj(x)                              # [I], [I + 2 G N], [H]

* ``conv``: a depthwise causal convolution of width ``conv_kernel`` over
  ``xBC``, then the ``hidden_act`` (silu);
* ``ssd``: the selective state space (:meth:`~infer.ops.Backend.ssd`) over
  ``x`` ``[H, P]`` with ``B``, ``C`` ``[G, N]`` shared by the ``H / G``
  heads of each group, ``A = -exp(A_log)``, ``dt = softplus(dt + dt_bias)``
  clamped to ``time_step_limit``, and the ``D`` skip;
* ``gated_norm``: transformers' ``MambaRMSNormGated``: ``y * silu(z)``, then
  RMSNorm over each of ``n_groups`` equal slices of ``I``, then its weight
  (Mamba2's order; ``norm_before_gate`` normalises first and gates after).

Per sequence a layer carries the convolution's last ``conv_kernel - 1``
inputs and the SSM state ``[H, P, N]``: a
:class:`~infer.kv.attention.Recurrent` layer state, nothing that grows with
the sequence. transformers' ``chunk_size`` only chooses how its chunked scan
is blocked (the same sums in exact arithmetic); ``residual_in_fp32`` is a
no-op in float32.

:class:`Mamba2Mixer` is written to be reused by the hybrids (Granite 4.0-H,
Falcon-H1): the mixer of one layer from its weights under a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infer.architecture import CausalLM, WeightLoader
from infer.config import from_dict
from infer.errors import ConfigError
from infer.kv.attention import AttentionContext, LayerState, Recurrent
from infer.ops import Array, Backend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec

from .decoder import Weights, activation, add_rms_norm


class Mamba2Mixer:
    """One Mamba2 mixer's math (transformers' ``Mamba2Mixer.torch_forward``),
    shared by every layer with the same sizes; weights travel in a dict.

    Sizes: ``hidden`` in and out, ``heads`` of ``head_dim`` (``heads *
    head_dim`` is the inner width ``I``), ``state_size`` ``N``, ``groups``
    ``G`` of B/C (``heads % groups == 0``), ``conv_kernel`` ``K``.
    ``norm_before_gate`` None drops the gated norm's RMSNorm (the output is
    ``y * silu(z)``, as Falcon-H1 without ``mamba_rms_norm``); the norm is over
    ``norm_groups`` equal slices of ``I`` (default ``groups``, transformers'
    ``group_size = I // n_groups``).
    """

    def __init__(self, ops: Backend, hidden: int, heads: int, head_dim: int, state_size: int, groups: int,
                 conv_kernel: int, *, eps: float = 1e-6, act: str = "silu",
                 time_step_limit: tuple[float, float] = (0.0, float("inf")),
                 norm_before_gate: bool | None = False, norm_groups: int | None = None,
                 where: str = "config.json") -> None:
        if heads <= 0 or head_dim <= 0 or state_size <= 0 or groups <= 0 or conv_kernel <= 0:
            raise ConfigError(f"{where}: the Mamba2 mixer needs positive sizes, found heads {heads}, head_dim "
                              f"{head_dim}, state_size {state_size}, n_groups {groups}, conv_kernel {conv_kernel}")
        if heads % groups:
            raise ConfigError(f"{where}: the number of Mamba2 heads ({heads}) must be a multiple of n_groups "
                              f"({groups})")
        self.ops, self.hidden = ops, hidden
        self.heads, self.head_dim, self.state_size, self.groups = heads, head_dim, state_size, groups
        self.inner = heads * head_dim
        self.conv_kernel, self.conv_dim = conv_kernel, self.inner + 2 * groups * state_size
        self.eps, self.norm_before_gate = eps, norm_before_gate
        self.norm_groups = groups if norm_groups is None else norm_groups
        if self.norm_groups <= 0 or self.inner % self.norm_groups:
            raise ConfigError(f"{where}: the gated norm's {self.norm_groups} groups do not divide the Mamba2 "
                              f"inner width {self.inner}")
        self.act = activation("hidden_act", act)
        if len(time_step_limit) != 2:
            raise ConfigError(f"{where}: time_step_limit {list(time_step_limit)} is not [min, max]")
        self.dt_min, self.dt_max = float(time_step_limit[0]), float(time_step_limit[1])

    def state(self) -> Recurrent:
        """The layer's state per sequence: the convolution's window and the SSM state."""
        return Recurrent({"conv": (self.conv_kernel - 1, self.conv_dim),
                          "ssm": (self.heads, self.head_dim, self.state_size)})

    def load(self, w: WeightLoader, prefix: str) -> Weights:
        """The weights under ``prefix`` (``...mixer.``): biases of ``in_proj``,
        ``out_proj`` and ``conv1d`` where the checkpoint has them (transformers'
        ``use_bias``, ``use_conv_bias``)."""
        ops, d, inner, conv, k, nh = self.ops, self.hidden, self.inner, self.conv_dim, self.conv_kernel, self.heads
        out: Weights = {
            "in_proj": w.get(prefix + "in_proj.weight", (inner + conv + nh, d)),
            "conv1d": w.get(prefix + "conv1d.weight", (conv, 1, k), transform=lambda a: a.reshape(conv, k)),
            "dt_bias": w.get(prefix + "dt_bias", (nh,)),
            # A = -exp(A_log), once (transformers computes it each forward, in float32).
            "A": ops.mul(ops.exp(ops.astype(w.get(prefix + "A_log", (nh,)), "float32")), -1.0),
            "D": w.get(prefix + "D", (nh,)),
            "out_proj": w.get(prefix + "out_proj.weight", (d, inner)),
        }
        for name, shape in (("in_proj.bias", (inner + conv + nh,)), ("out_proj.bias", (d,)),
                            ("conv1d.bias", (conv,))):
            if w.has(prefix + name):
                out[name] = w.get(prefix + name, shape)
        if self.norm_before_gate is not None:
            out["norm"] = w.get(prefix + "norm.weight", (inner,))
        return out

    def __call__(self, x: Array, w: Weights, ctx: AttentionContext, layer: int) -> Array:
        """The mixer's output ``[tokens, hidden]`` for the normed input ``x``,
        reading and writing recurrent ``layer``'s state in ``ctx``."""
        ops, inner, conv, gn = self.ops, self.inner, self.conv_dim, self.groups * self.state_size
        t = ops.shape(x)[0]
        proj = self.project(x, w)  # [t, I + conv_dim + H]
        z = ops.slice(proj, 1, 0, inner)
        xbc = ops.slice(proj, 1, inner, inner + conv)
        dt = ops.slice(proj, 1, inner + conv, inner + conv + self.heads)  # [t, H]
        state = ctx.state(layer)
        fused = self.act == "silu"
        xbc, window, windows = ops.causal_conv1d(xbc, state["conv"], w["conv1d"], w.get("conv1d.bias"),
                                                 ctx.query_start, ctx.checkpoint_rows,
                                                 activation="silu" if fused else None)
        if not fused:
            xbc = getattr(ops, self.act)(xbc)
        xs = ops.reshape(ops.slice(xbc, 1, 0, inner), (t, self.heads, self.head_dim))
        b = ops.reshape(ops.slice(xbc, 1, inner, inner + gn), (t, self.groups, self.state_size))
        c = ops.reshape(ops.slice(xbc, 1, inner + gn, inner + 2 * gn), (t, self.groups, self.state_size))
        y, ssm, ssms = ops.ssd(xs, dt, w["A"], b, c, w["D"], w["dt_bias"], state["ssm"], ctx.query_start,
                               ctx.checkpoint_rows, dt_softplus=True, dt_min=self.dt_min, dt_max=self.dt_max)
        ctx.set_state(layer, {"conv": window, "ssm": ssm}, {"conv": windows, "ssm": ssms})
        y = self.gated_norm(ops.reshape(y, (t, inner)), z, w)
        return ops.linear(y, w["out_proj"], w.get("out_proj.bias"))  # [t, hidden]

    def project(self, x: Array, w: Weights) -> Array:
        """``in_proj``'s output ``[tokens, I + conv_dim + H]`` (``z``, ``xBC``, ``dt``)
        for the normed input; a hybrid may scale it (Falcon-H1's multipliers)."""
        return self.ops.linear(x, w["in_proj"], w.get("in_proj.bias"))

    def gated_norm(self, y: Array, z: Array, w: Weights) -> Array:
        """transformers' ``MambaRMSNormGated`` (``norm_before_gate`` False:
        gate, then RMSNorm per group of ``I / norm_groups`` channels, then
        the weight; True: RMSNorm, the weight, then the gate)."""
        ops, t = self.ops, self.ops.shape(y)[0]
        gate = ops.silu(z)
        if self.norm_before_gate is None:
            return ops.mul(y, gate)
        if not self.norm_before_gate:
            y = ops.mul(y, gate)
        grouped = ops.reshape(y, (t, self.norm_groups, self.inner // self.norm_groups))
        y = ops.mul(ops.reshape(ops.rms_norm(grouped, None, self.eps), (t, self.inner)), w["norm"])
        return ops.mul(y, gate) if self.norm_before_gate else y


@dataclass
class Mamba2Config:
    """``config.json`` fields read (transformers' ``Mamba2Config`` names and defaults)."""

    hidden_size: int = 4096
    num_hidden_layers: int = 64
    vocab_size: int = 32768
    num_heads: int = 128
    head_dim: int = 64
    state_size: int = 128
    n_groups: int = 8
    expand: float = 2
    conv_kernel: int = 4
    layer_norm_epsilon: float = 1e-5
    hidden_act: str = "silu"
    use_bias: bool = False
    use_conv_bias: bool = True
    # transformers 5 writes float("inf") as {"__float__": "Infinity"} (JSON has no infinity).
    time_step_limit: list[Any] = field(default_factory=lambda: [0.0, float("inf")])
    tie_word_embeddings: bool = False

    def validate(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "vocab_size", "num_heads", "head_dim", "state_size",
                     "n_groups", "conv_kernel"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, found {getattr(self, name)}")
        if int(self.expand * self.hidden_size) != self.num_heads * self.head_dim:
            raise ConfigError(f"config.json: hidden_size * expand ({int(self.expand * self.hidden_size)}) must "
                              f"equal num_heads * head_dim ({self.num_heads * self.head_dim})")
        activation("hidden_act", self.hidden_act)
        self.time_step_limit = time_step_limit(self.time_step_limit)


def time_step_limit(value: Any, key: str = "time_step_limit") -> list[float]:
    """``config.json``'s ``[min, max]`` clamp of the SSM step as floats: numbers,
    or transformers 5's ``{"__float__": "Infinity"}`` form, or ``"Infinity"``."""

    def number(v: Any) -> float:
        if isinstance(v, dict) and set(v) == {"__float__"}:
            v = v["__float__"]
        try:
            return float(v)  # float("Infinity") is inf
        except (TypeError, ValueError):
            raise ConfigError(f"config.json: {key} {value!r} is not a pair of numbers") from None

    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"config.json: {key} {value!r} is not [min, max]")
    low, high = number(value[0]), number(value[1])
    if not low <= high:
        raise ConfigError(f"config.json: {key} {value!r} has min above max")
    return [low, high]


class Mamba2ForCausalLM(CausalLM):
    """Embedding, Mamba2 blocks, final norm, output head."""

    def __init__(self, config: Mamba2Config, weights: WeightLoader, ops: Backend) -> None:
        super().__init__(config, weights, ops)
        cfg, w, d = config, weights, config.hidden_size
        # No positions: any length (the engine still wants a bound).
        self.num_layers, self.vocab_size, self.max_context = cfg.num_hidden_layers, cfg.vocab_size, 1 << 20
        self.eps = cfg.layer_norm_epsilon
        self.mixer = Mamba2Mixer(ops, d, cfg.num_heads, cfg.head_dim, cfg.state_size, cfg.n_groups, cfg.conv_kernel,
                                 eps=cfg.layer_norm_epsilon, act=cfg.hidden_act,
                                 time_step_limit=tuple(cfg.time_step_limit))
        # transformers renames the original checkpoints' "embedding." to "embeddings." on load.
        self.embed_tokens = w.get("backbone.embeddings.weight", (cfg.vocab_size, d),
                                  fallback="backbone.embedding.weight")
        self.layers = [(w.get(f"backbone.layers.{i}.norm.weight", (d,)),
                        self.mixer.load(w, f"backbone.layers.{i}.mixer.")) for i in range(cfg.num_hidden_layers)]
        self.norm = w.get("backbone.norm_f.weight", (d,))
        self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings
                        else w.get("lm_head.weight", (cfg.vocab_size, d)))

    def layer_states(self) -> list[LayerState]:
        return [self.mixer.state() for _ in range(self.num_cache_layers)]

    def forward(self, input_ids: Array, ctx: AttentionContext) -> Array:
        ops = self.ops
        h, residual = ops.embedding(self.embed_tokens, input_ids), None  # [tokens, hidden]
        for i, (norm, mixer) in enumerate(self.layers):  # h = h + mixer(norm(h)), the add kept pending
            x, residual = add_rms_norm(ops, h, residual, norm, self.eps)
            h = self.mixer(x, mixer, ctx, i)
        return add_rms_norm(ops, h, residual, self.norm, self.eps)[0]


def read_config(config: dict[str, Any]) -> Mamba2Config:
    """The config of a ``config.json`` dict, with transformers' defaults."""
    return from_dict(Mamba2Config, config)


def build(config: dict[str, Any], weights: WeightLoader, ops: Backend) -> Mamba2ForCausalLM:
    """Build a Mamba2 model from a ``config.json`` dict."""
    return Mamba2ForCausalLM(read_config(config), weights, ops)


@hookimpl
def infer_register_architectures(register) -> None:  # type: ignore[no-untyped-def]
    """Register Mamba2."""
    register(ArchitectureSpec(name="mamba2", model_types=("mamba2",), build=build, read_config=read_config,
                              description="Mamba2 state space models (SSD mixers, no attention)"))
