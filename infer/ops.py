"""The op contract: what a compute backend implements.

A backend is a subclass of :class:`Backend`. Architectures compute only
through these methods, so a model runs on every backend that implements them.
Backend-native arrays (``numpy.ndarray``, ``torch.Tensor``, ``mlx.core.array``,
...) pass through untouched: there is no wrapper object per tensor.

Two kinds of ops:

* **Required ops** are abstract. A backend works as soon as they do.
* **Optional ops** (fused or special kernels) have a default built from the
  required ops. A backend that implements one natively overrides it and lists
  its name in :attr:`Backend.native_ops`; callers ask with
  :meth:`Backend.supports` instead of catching errors.

Conventions that hold for every op unless its docstring says otherwise:

* Shapes are written ``[tokens, heads, head_dim]``; ``...`` means any number
  of leading axes.
* Dtypes are strings: ``"float32"``, ``"float16"``, ``"bfloat16"``,
  ``"int32"``, ``"int64"``. Float ops return the dtype of their first float
  input; a backend may compute internally in higher precision.
* Binary elementwise ops broadcast like numpy, and either operand may be a
  Python scalar.
* Ops do not modify their inputs, except :meth:`Backend.scatter_rows`, which
  may write into ``dst`` and returns the array to use from then on.

The contract is versioned: :data:`API_VERSION` ``(major, minor)``. A backend
built for a different major version is refused at registration; a minor
version adds optional ops only.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from infer import oplib

API_VERSION: tuple[int, int] = (2, 0)

Array = Any
"""A backend-native array (``numpy.ndarray``, ``torch.Tensor``, ...)."""

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
INT_DTYPES = ("int32", "int64")

REQUIRED_OPS: tuple[str, ...] = (
    "from_numpy", "to_numpy", "astype", "shape", "dtype", "zeros", "arange",
    "matmul", "linear",
    "add", "sub", "mul", "div", "exp", "sqrt", "tanh", "cos", "sin",
    "silu", "gelu", "gelu_tanh",
    "sum", "mean", "max", "argmax", "softmax",
    "rms_norm", "layer_norm", "rope", "embedding", "take",
    "reshape", "transpose", "concat", "slice", "scatter_rows",
)

OPTIONAL_OPS: tuple[str, ...] = (
    "prepare_weight", "fused_add_rms_norm", "swiglu", "softcap",
    "quantized_linear", "attention", "synchronize", "topk", "compile",
    "all_reduce", "all_gather", "broadcast",
    "causal_conv1d", "ssd", "softplus", "gated_delta_rule",
    "clip", "lora_linear", "expert_linear",
)


class QuantizedTensor(abc.ABC):
    """A weight still in a quantized storage format (e.g. GGUF blocks).

    Formats hand these out; :meth:`Backend.prepare_weight` decides whether to
    keep them quantized (for a native :meth:`Backend.quantized_linear`) or to
    dequantize them.
    """

    #: Name of the storage type, e.g. ``"Q4_K"``.
    qtype: str
    #: Logical shape in canonical (Hugging Face) layout.
    shape: tuple[int, ...]

    @abc.abstractmethod
    def dequantize(self) -> np.ndarray:
        """Return the float32 values, shaped :attr:`shape`."""

    def dequantize_rows(self, rows: np.ndarray) -> np.ndarray:
        """The float32 values of the rows ``rows`` (1-D integer indices along
        the first axis), ``[len(rows), *shape[1:]]``. Default: :meth:`dequantize`
        everything, then index; formats override it to read only those rows."""
        return self.dequantize()[np.asarray(rows)]

    def stacked(self, parts: Sequence[QuantizedTensor]) -> QuantizedTensor | None:
        """``parts`` (2-D, this tensor among them) stacked by rows into one
        tensor of the same storage, or None where that is not possible (the
        default; formats whose rows are independent blocks override it)."""
        return None

    def rows(self, start: int, stop: int) -> QuantizedTensor | None:
        """Rows ``[start, stop)`` of a 2-D tensor in the same storage (a view
        where the format can), or None where its rows are not independent
        blocks. Tensor parallelism keeps a rank's rows quantized through it.
        Default: None."""
        return None

    def release_rows(self, start: int, stop: int) -> None:
        """A hint that rows ``[start, stop)`` of the stored data will not be
        read again by this load (a conversion has consumed them): a format
        whose data is a memory-mapped file may drop those pages from memory.
        Reading them again must still work. Default: nothing."""

    @property
    def nbytes(self) -> int:
        """Bytes of the stored data (sizes conversions done a slab of rows at
        a time). Default: what float32 values of :attr:`shape` would take;
        formats override it with their storage's size."""
        return 4 * int(np.prod(self.shape))

    def affine_layout(self) -> tuple[int, int] | None:
        """``(bits, group)`` when the stored values are exactly ``scale * code
        + bias`` per ``group`` consecutive values of a row, with unsigned codes
        of ``bits`` bits (GGUF's Q4_0 ... Q8_0 in groups of 32, Q6_K in groups
        of 16): backends with affine kernels then compute on the codes (see
        :func:`infer.quantize.from_gguf`). None where the storage has no such
        form. Default: None."""
        return None

    def ggml_blocks(self) -> tuple[str, np.ndarray] | None:
        """``(type, raw)`` for a 2-D tensor stored as GGML blocks (GGUF's
        quantized types; the layouts of ggml's ``ggml-common.h``): ``type``
        the GGML type's name (``"Q4_K"``), ``raw`` the stored bytes, uint8
        ``[rows, bytes_per_row]``, row ``i`` of :attr:`shape` in row ``i``,
        a view of the file where it can be. Backends whose kernels read such
        blocks compute on them where they lie: nothing converted at load, and
        a memory-mapped file's pages are the weight. None where the storage
        is not GGML blocks. Default: None."""
        return None

    def affine_rows(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The exact affine form of rows ``[start, stop)`` of a 2-D tensor whose
        :meth:`affine_layout` is ``(bits, group)``: ``(codes, scales,
        biases)``, codes uint8 ``[n, cols]`` below ``2**bits``, scales and
        biases float32 ``[n, cols / group]``, such that ``scales * codes +
        biases`` per group (in float32, fused or not) gives the values of
        :meth:`dequantize`. A format may also hand out 4-bit codes already
        packed two to a byte (``[n, cols / 2]``, in GGML's order: per group of
        32 columns, byte ``j`` holds column ``j`` in its low nibble and
        column ``j + 16`` in its high one) and float16 scales and biases where those are the exact
        values: it saves a conversion :func:`infer.quantize.from_gguf` would
        undo. Default: :class:`NotImplementedError` (no affine form)."""
        raise NotImplementedError(f"{type(self).__name__} {self.qtype} has no affine form")


class PackedWeight:
    """A weight a backend keeps in its own quantized layout.

    :meth:`Backend.prepare_weight` returns one for a tensor it computes on
    without dequantizing; the backend's :meth:`Backend.linear` hands it to
    :meth:`Backend.quantized_linear` and its :meth:`Backend.embedding`
    gathers rows from :attr:`rows`. Architectures never see the difference:
    they call ``linear`` and ``embedding`` on whatever ``prepare_weight``
    returned.
    """

    __slots__ = ("shape", "qtype", "scheme", "data", "rows", "kernel")

    def __init__(self, shape: tuple[int, ...], qtype: str, scheme: str, data: Any,
                 rows: QuantizedTensor | None = None) -> None:
        #: Logical shape ``[out, in]``.
        self.shape = tuple(int(d) for d in shape)
        #: What the weight was stored as before: a GGUF type (``"Q4_1"``) or an
        #: on-load scheme (``"q8"``, ``"q4"``).
        self.qtype = qtype
        #: The backend's layout, in words, for logs (``"int4pack g32 f32"``).
        self.scheme = scheme
        #: Backend-specific arrays (packed codes, scales, ...).
        self.data = data
        #: An exact host form of the same values, for :meth:`Backend.embedding`
        #: and for the default :meth:`Backend.quantized_linear`; None when the
        #: backend needs neither (the weight is only ever a ``linear`` weight).
        self.rows = rows
        #: Free for the backend: e.g. its kernel's arguments for this weight,
        #: worked out once at load instead of at every product. None by default.
        self.kernel: Any = None

    def __repr__(self) -> str:
        return f"PackedWeight({self.qtype} as {self.scheme}, shape={list(self.shape)})"


class ShardedWeight:
    """This rank's part of a weight split across the ranks of a process
    group (tensor parallelism, docs/distributed.md).

    ``linear`` of it is :meth:`Backend.sharded_linear`: the local product
    with :attr:`local`, then the collective that :attr:`combine` names, so
    every rank holds the whole result afterwards:

    * ``"sum"`` — a row-parallel weight (this rank's *columns* ``[out,
      in / ranks]``, e.g. ``o_proj``, ``down_proj``): the ranks' partial
      products are summed (:meth:`Backend.all_reduce`), then the bias, which
      every rank holds whole, is added once;
    * ``"concat"`` — a weight split by output rows (the output head split by
      vocabulary, ``[ceil(out / ranks), in]``, the last rank's padded with
      zero rows): the ranks' outputs are concatenated
      (:meth:`Backend.all_gather`) and cut to :attr:`shape`'s ``out``.

    Architectures never see the difference: they call ``linear`` on what the
    weight loader returned.
    """

    __slots__ = ("local", "shape", "combine")

    def __init__(self, local: Any, shape: tuple[int, ...], combine: str) -> None:
        if combine not in ("sum", "concat"):
            raise ValueError(f"ShardedWeight combine must be 'sum' or 'concat', got {combine!r}")
        #: This rank's part, as :meth:`Backend.prepare_weight` returned it.
        self.local = local
        #: The whole weight's logical shape ``[out, in]``.
        self.shape = tuple(int(d) for d in shape)
        #: ``"sum"`` (row-parallel) or ``"concat"`` (split by output rows).
        self.combine = combine

    def __repr__(self) -> str:
        return f"ShardedWeight({self.combine}, shape={list(self.shape)})"


class AdapterRows:
    """Which adapter each row of the current forward uses: what every
    :class:`AdaptedWeight` of a model reads (one instance per model, set by
    the engine before each forward, cleared after).

    ``slots`` ``[tokens]`` int32 and ``scales`` ``[tokens]`` float, backend
    arrays: row ``i`` adds ``scales[i]`` times the low-rank product of pool
    slot ``slots[i]`` (a row of the base model has scale 0). ``slots`` None:
    no row uses an adapter, and an adapted weight is its base weight."""

    __slots__ = ("slots", "scales")

    def __init__(self) -> None:
        self.slots: Any = None
        self.scales: Any = None


class AdaptedWeight:
    """A linear weight with low-rank adapters beside it (LoRA: Hu et al.
    2021, "LoRA: Low-Rank Adaptation of Large Language Models").

    ``linear`` of it is :meth:`Backend.adapted_linear`: the base product, on
    :attr:`base` as :meth:`Backend.prepare_weight` returned it (quantized
    stays quantized), plus each row's adapter term through
    :meth:`Backend.lora_linear`. :attr:`a` ``[slots, rank, in]`` and
    :attr:`b` ``[slots, out, rank]`` stack every loaded adapter's factors
    (zero-padded to one rank; the adapter's scale folded into ``b``), and
    :attr:`rows` says which slot each row of the forward reads. Backends
    dispatch on it in ``linear`` as on :class:`PackedWeight`; architectures
    never see the difference (docs/adapters.md)."""

    __slots__ = ("base", "a", "b", "rows", "shape")

    def __init__(self, base: Any, shape: tuple[int, ...], rows: AdapterRows) -> None:
        #: The weight the model was loaded with.
        self.base = base
        #: Logical shape ``[out, in]``.
        self.shape = tuple(int(d) for d in shape)
        #: ``[slots, rank, in]`` and ``[slots, out, rank]``, or None (no adapter adapts this weight).
        self.a: Any = None
        self.b: Any = None
        self.rows = rows

    def __repr__(self) -> str:
        return f"AdaptedWeight({self.base!r:.60}, shape={list(self.shape)})"


@dataclass(frozen=True)
class AttentionBatch:
    """Where a forward's queries are and where each sequence's keys live: the
    batch description :meth:`Backend.attention` reads (docs/kv-cache.md).

    Every forward, whatever its mix of prompt chunks, decode rows and
    speculative verification rows, and whether its sequences' caches are pages
    of a pool or one contiguous buffer each (one block of the buffer's size),
    is one such description. The arrays are the backend's (the op reads them
    as data, so a captured step keeps one graph for every step); ``host`` is
    the same description as numpy arrays where the host knows it (never inside
    a captured step), for kernels that choose their path per sequence.
    """

    #: int32 ``[sequences + 1]``: sequence ``b``'s query rows are
    #: ``query_start[b]:query_start[b + 1]`` of the forward's tokens.
    query_start: Array
    #: int32 ``[sequences]``: sequence ``b``'s positions after this forward's
    #: writes; its queries are the last of them.
    seq_lens: Array
    #: int32 ``[sequences, width]``: sequence ``b``'s physical blocks in
    #: logical order (entries past its keys are never read).
    block_tables: Array
    #: Positions per block (a contiguous cache: its capacity, one block).
    block_size: int
    #: Most query rows of any one sequence: 1 when every sequence decodes. A
    #: bound known on the host, even in a captured step.
    max_query: int
    #: The same description as numpy arrays, or None.
    host: AttentionBatch | None = None
    #: int32 ``[tokens, 2]`` or None: bidirectional spans inside the causal
    #: sequences (Gemma 3's image tokens). With ``causal``, query row ``t``
    #: also sees the keys at positions ``spans[t, 0] <= j < spans[t, 1]`` of
    #: its sequence, those ahead of it whatever a ``window`` (which bounds the
    #: keys behind, as transformers' sliding overlay on Gemma 3's image
    #: blocks); ``(0, 0)``: no span. A span
    #: lies wholly within its sequence's positions of this forward and before.
    #: Backends that read it list ``"attention_spans"`` in :attr:`Backend.native_ops`;
    #: for the others the attention context calls the contract's default.
    spans: Array | None = None

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch (the tables' first axis)."""
        shape = getattr(self.block_tables, "shape", None)
        return int(shape[0]) if shape is not None else len(self.block_tables)

    def on_host(self, ops: Backend) -> AttentionBatch:
        """This description with numpy arrays: :attr:`host`, or the arrays
        read back (an eager default's way; a captured step has no host copy)."""
        if self.host is not None:
            return self.host
        if isinstance(self.query_start, np.ndarray):
            return self
        read = [np.asarray(ops.to_numpy(a), dtype=np.int32) for a in
                (self.query_start, self.seq_lens, self.block_tables)]
        spans = None if self.spans is None else np.asarray(ops.to_numpy(self.spans), np.int32).reshape(-1, 2)
        return AttentionBatch(read[0].reshape(-1), read[1].reshape(-1), read[2].reshape(len(read[1].reshape(-1)), -1),
                              self.block_size, self.max_query, spans=spans)

    def visible(self, b: int, queries: int, causal: bool, window: int | None) -> tuple[int, int]:
        """``(lo, hi)``: the key positions any of sequence ``b``'s ``queries``
        last positions sees (a host description only): :func:`infer.oplib.visible_keys`."""
        return oplib.visible_keys(b, int(self.seq_lens[b]), queries, causal, window)

    def sequences(self, causal: bool, window: int | None) -> Iterator[tuple[int, int, int, int, int]]:
        """``(b, q0, q1, lo, hi)`` for each sequence with query rows (a host
        description only): its rows ``q0..q1`` of the forward's tokens and the
        key positions ``lo..hi`` they see (:meth:`visible`, which checks them)."""
        for b in range(self.num_seqs):
            q0, q1 = int(self.query_start[b]), int(self.query_start[b + 1])
            if q1 > q0:
                yield (b, q0, q1, *self.visible(b, q1 - q0, causal, window))

    def key_rows(self, b: int, lo: int, hi: int, pool_rows: int | None = None) -> np.ndarray:
        """int32 pool rows of sequence ``b``'s key positions ``lo..hi`` (a host
        description only); ``IndexError`` when its table lists too few blocks,
        or (given the pool's ``pool_rows``) a block outside the pool:
        :func:`infer.oplib.key_rows`."""
        return oplib.key_rows(np.asarray(self.block_tables[b]), self.block_size, b, lo, hi, pool_rows)


#: The on-load quantization schemes ``infer.load(quantize=...)`` knows (their
#: bits: :data:`infer.quantize.SCHEME_BITS`); a backend honours those it lists
#: in :attr:`Backend.quantize_schemes`.
QUANTIZE_SCHEMES: tuple[str, ...] = ("q8", "q4")
#: KV pool dtypes stored as blocks, not as one float per value
#: (``infer.load(kv_dtype=...)``; a backend honours those it lists in
#: :attr:`Backend.kv_dtypes`): name -> (values per block, bytes per block).
#: ``"q8_0"``: per 32 values of a row, a little-endian IEEE float16 scale
#: ``d`` then 32 int8 codes ``q``, the values ``d * q`` (ggml's
#: ``block_q8_0``, as llama.cpp stores its q8_0 cache). Such a pool is a
#: ``uint8`` array ``[rows, heads, d // 32 * 34]`` (:func:`kv_pool_width`);
#: :meth:`Backend.scatter_rows` of float rows into it quantizes them and
#: :meth:`Backend.attention` reads it (docs/kv-cache.md, "Keys and values in 8 bits").
KV_BLOCK_DTYPES: dict[str, tuple[int, int]] = {"q8_0": (32, 34)}


def kv_pool_width(kv_dtype: str | None, width: int) -> tuple[int, str | None]:
    """The last axis and dtype of a KV pool storing rows of ``width`` values
    in ``kv_dtype``: ``(width, kv_dtype)`` for a float dtype (None: as
    written), the block bytes and ``"uint8"`` for one of
    :data:`KV_BLOCK_DTYPES`. ``CacheConfigError`` where ``width`` is not a
    whole number of blocks."""
    if kv_dtype not in KV_BLOCK_DTYPES:
        return width, kv_dtype
    values, nbytes = KV_BLOCK_DTYPES[kv_dtype]
    if width % values:
        from infer.errors import CacheConfigError

        raise CacheConfigError(f"kv_dtype={kv_dtype!r} stores blocks of {values} values; this model's keys or "
                               f"values have {width} per head, not a multiple of {values}")
    return width // values * nbytes, "uint8"


#: The activation quantization schemes ``infer.load(activations=...)`` knows;
#: a backend honours those it lists in :attr:`Backend.activation_schemes`.
ACTIVATION_SCHEMES: tuple[str, ...] = ("q8",)


@dataclass(frozen=True)
class LoadSettings:
    """How a loaded model asks its backend to compute: the options of
    :func:`infer.load` that reach the backend, made once per load from its
    arguments. Their values are checked here when the object is made, and
    against what a backend can do in :meth:`check`.

    A load hands them to the backend with :meth:`Backend.configure`, which
    returns the backend the model runs on; backend code reads
    ``self.settings``. They are passed in rather than written onto the
    backend because one backend instance may serve several models
    (``infer.load(path, backend=ops)`` twice, a draft model beside its
    target), each with its own settings: an attribute the second load wrote
    would change how the first model computes. As one value they also reach
    the tensor-parallel ranks whole (``dataclasses.asdict`` and back), and a
    recorded step reads the backend it records, so it sees the settings the
    eager ops do.

    A new load option that changes how the backend computes (an adapter, a
    KV storage format) is a new field here, with its check.
    """

    #: None (default): float weights stay float, quantized (GGUF) ones stay
    #: quantized where the backend computes on them exactly; one of
    #: :data:`QUANTIZE_SCHEMES` (which the backend must list in
    #: :attr:`Backend.quantize_schemes`): float linear weights are also
    #: quantized on load; ``"off"``: every weight is dequantized.
    quantize: str | None = None
    #: None (default): the products compute on exact float activations; one of
    #: :data:`ACTIVATION_SCHEMES` (which the backend must list in
    #: :attr:`Backend.activation_schemes`): ``"q8"`` rounds the inputs of the
    #: products with quantized weights to int8 per 32 values, one float scale
    #: each, for integer dot products on the weights' codes.
    activations: str | None = None
    #: The dtype KV pools store keys and values in: None (default) or the
    #: compute dtype, exact; otherwise one the backend lists in
    #: :attr:`Backend.kv_dtypes` (the engine makes the pools).
    kv_dtype: str | None = None
    #: ``infer.load``'s ``compile``: True asks for graph capture with the
    #: backend's compiler (:attr:`Backend.graph_capture`); False for none;
    #: None (default) for the backend's default
    #: (:attr:`Backend.capture_by_default`).
    compile: bool | None = None

    def __post_init__(self) -> None:
        from infer.errors import InvalidQuantizationError

        if self.quantize is not None and self.quantize != "off" and self.quantize not in QUANTIZE_SCHEMES:
            raise InvalidQuantizationError(
                f"quantize={self.quantize!r}: expected None, 'off' or one of "
                f"{', '.join(repr(s) for s in QUANTIZE_SCHEMES)}")
        if self.activations is not None and (not isinstance(self.activations, str)
                                             or self.activations not in ACTIVATION_SCHEMES):
            raise InvalidQuantizationError(
                f"activations={self.activations!r}: expected None (exact float activations) or one of "
                f"{', '.join(repr(s) for s in ACTIVATION_SCHEMES)}")

    def check(self, backend: Backend) -> None:
        """Raise unless ``backend`` can honour these settings:
        ``InvalidQuantizationError`` for a ``quantize`` or ``activations``
        scheme it does not list, ``CacheConfigError`` for a ``kv_dtype`` it
        cannot store pools in (:meth:`kv_pool_dtype`)."""
        from infer.errors import InvalidQuantizationError

        if self.quantize in QUANTIZE_SCHEMES and self.quantize not in backend.quantize_schemes:
            raise InvalidQuantizationError(
                f"quantize={self.quantize!r}: backend {backend.name}/{backend.device} has no on-load quantization "
                f"{self.quantize!r}; it has {', '.join(sorted(backend.quantize_schemes)) or 'none'}")
        if self.activations is not None and self.activations not in backend.activation_schemes:
            raise InvalidQuantizationError(
                f"activations={self.activations!r}: backend {backend.name}/{backend.device} has no activation "
                f"quantization {self.activations!r}; it has {', '.join(sorted(backend.activation_schemes)) or 'none'}")
        self.kv_pool_dtype(backend)

    def kv_pool_dtype(self, backend: Backend) -> str | None:
        """:attr:`kv_dtype` where ``backend`` stores KV pools in it, None for
        its compute dtype (``None``, or the compute dtype named): keys and
        values exactly as computed. A narrower dtype (``"float16"``,
        ``"bfloat16"``, where the backend lists it in
        :attr:`Backend.kv_dtypes`) halves the cache's memory and the bytes
        attention reads per position; the keys and values are rounded once,
        when written (docs/kv-cache.md, "Storing keys and values narrower").
        ``CacheConfigError`` where the backend has no such KV dtype."""
        from infer.errors import CacheConfigError

        kv_dtype = self.kv_dtype
        if kv_dtype is None or kv_dtype == backend.compute_dtype:
            return None
        if kv_dtype not in backend.kv_dtypes:
            options = sorted({backend.compute_dtype, *backend.kv_dtypes})
            raise CacheConfigError(f"kv_dtype={kv_dtype!r}: backend {backend.name}/{backend.device} stores keys "
                                   f"and values in {', '.join(map(repr, options))}")
        return kv_dtype


class Backend(abc.ABC):
    """A compute backend: the ops an architecture may call.

    Subclasses set :attr:`name` and :attr:`device`, implement every required
    op, and may override optional ops (listing them in :attr:`native_ops`).
    """

    #: Backend family, e.g. ``"numpy"``.
    name: str = "abstract"
    #: Device within the family, e.g. ``"cpu"`` or ``"cuda"``.
    device: str = "cpu"
    #: Version of this contract the backend was written against.
    api_version: tuple[int, int] = API_VERSION
    #: Optional ops this backend implements natively.
    native_ops: frozenset[str] = frozenset()
    #: Float dtypes the backend computes in; the first is its default.
    float_dtypes: tuple[str, ...] = ("float32",)
    #: Dtypes other than :attr:`compute_dtype` that KV pools may be stored in
    #: (the engine's ``kv_dtype``: ``"float16"``, ``"bfloat16"``): the
    #: backend's :meth:`scatter_rows` rounds rows into them and its
    #: :meth:`attention` reads them widened. A block dtype of
    #: :data:`KV_BLOCK_DTYPES` (``"q8_0"``) listed here means both ops take
    #: ``uint8`` pools of its blocks (:func:`kv_pool_width`). Empty: pools in
    #: the compute dtype only.
    kv_dtypes: frozenset[str] = frozenset()
    #: On-load quantization schemes :meth:`prepare_weight` honours
    #: (``"q8"``, ``"q4"``); empty for a backend that has none.
    quantize_schemes: frozenset[str] = frozenset()
    #: Activation quantization schemes the backend's products honour
    #: (``"q8"``: the inputs of the products with quantized weights rounded
    #: to int8 per 32 values, one float scale each, multiplied with the
    #: weights' codes in integer dot products); empty: activations always exact.
    activation_schemes: frozenset[str] = frozenset()
    #: Most prompt tokens one forward of a generation takes: the default of
    #: :attr:`infer.engine.runner.Engine.prefill_chunk` (None: the whole prompt
    #: at once). A forward's activations grow with its tokens; where larger
    #: forwards run no faster, smaller ones hold less.
    prefill_chunk: int | None = 512
    #: The settings of the load this backend serves (:class:`LoadSettings`;
    #: the defaults where no load configured it). :meth:`configure` gives a
    #: backend with other settings; nothing writes them onto an instance.
    settings: LoadSettings = LoadSettings()

    def __init__(self, dtype: str | None = None) -> None:
        from infer.errors import UnsupportedOpError

        dtype = dtype or self.float_dtypes[0]
        if dtype not in self.float_dtypes:
            raise UnsupportedOpError(
                f"backend {self.name}/{self.device} does not compute in {dtype!r}; "
                f"it supports {', '.join(self.float_dtypes)}"
            )
        #: The float dtype weights and activations are held in.
        self.compute_dtype: str = dtype

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}/{self.device} {self.compute_dtype}>"

    def supports(self, op: str) -> bool:
        """True if ``op`` runs natively: every required op, and the optional
        ops listed in :attr:`native_ops`. Optional ops still work when this is
        False, through their default."""
        return op in REQUIRED_OPS or op in self.native_ops

    def configure(self, settings: LoadSettings) -> Backend:
        """The backend a model loaded with ``settings`` runs on, before any of
        its weights is prepared: ``settings.check(self)``, then this very
        instance where :attr:`settings` already are those, otherwise a shallow
        copy of it (``copy.copy``) holding them. This instance is never
        changed, so models loaded on it with different settings do not
        interfere (:class:`LoadSettings` says why). The copies share what the
        instance holds (its caches, kernels, a process group it joined);
        a backend whose state must not be shared overrides this."""
        settings.check(self)
        if settings == self.settings:
            return self
        configured = copy.copy(self)
        configured.settings = settings  # the copy's own: ``self`` keeps its settings
        return configured

    # The settings backends read as attributes before LoadSettings existed: read
    # on, for backends written against them; assigning one is deprecated.

    @property
    def quantize(self) -> str | None:
        """``settings.quantize`` (:attr:`LoadSettings.quantize`)."""
        return self.settings.quantize

    @quantize.setter
    def quantize(self, value: str | None) -> None:
        self._set_deprecated(quantize=value)

    @property
    def activations(self) -> str | None:
        """``settings.activations`` (:attr:`LoadSettings.activations`)."""
        return self.settings.activations

    @activations.setter
    def activations(self, value: str | None) -> None:
        self._set_deprecated(activations=value)

    @property
    def graph_capture(self) -> bool:
        """Whether ``infer.load(..., compile=True)`` asked for graph capture
        (``settings.compile``): the engine's captured steps then use the
        backend's compiler (torch.compile) even where a cheaper capture is the
        default (numpy's recorded program on torch/cpu). Off by default:
        compiling costs time at each new shape."""
        return bool(self.settings.compile)

    @graph_capture.setter
    def graph_capture(self, value: bool) -> None:
        self._set_deprecated(compile=bool(value))

    def _set_deprecated(self, **change: Any) -> None:
        name = next(iter(change))
        warnings.warn(f"setting backend.{'graph_capture' if name == 'compile' else name} is deprecated: pass it to "
                      "infer.load, or use backend.configure(LoadSettings(...))", DeprecationWarning, stacklevel=3)
        self.settings = dataclasses.replace(self.settings, **change)

    # ------------------------------------------------------------------
    # Transfer, creation, casting
    # ------------------------------------------------------------------

    @abc.abstractmethod
    def from_numpy(self, array: np.ndarray, dtype: str | None = None) -> Array:
        """Copy a numpy array to the backend.

        ``dtype`` None keeps the array's dtype, except that float arrays
        become :attr:`compute_dtype`. The result must not share memory that
        the caller may later modify (a read-only memory map may be shared).
        """

    @abc.abstractmethod
    def to_numpy(self, x: Array) -> np.ndarray:
        """Copy ``x`` to a numpy array; bfloat16 becomes float32."""

    @abc.abstractmethod
    def astype(self, x: Array, dtype: str) -> Array:
        """Cast to ``dtype``; float to int truncates toward zero."""

    @abc.abstractmethod
    def shape(self, x: Array) -> tuple[int, ...]:
        """Shape of ``x`` as a tuple of Python ints."""

    @abc.abstractmethod
    def dtype(self, x: Array) -> str:
        """Dtype name of ``x`` (one of the contract's dtype strings)."""

    @abc.abstractmethod
    def zeros(self, shape: Sequence[int], dtype: str | None = None) -> Array:
        """A zero-filled array; ``dtype`` None means :attr:`compute_dtype`."""

    @abc.abstractmethod
    def arange(self, start: int, stop: int, dtype: str = "int32") -> Array:
        """Integers ``start .. stop-1`` as a 1-D array."""

    # ------------------------------------------------------------------
    # Linear algebra
    # ------------------------------------------------------------------

    @abc.abstractmethod
    def matmul(self, a: Array, b: Array) -> Array:
        """Matrix product with numpy's ``matmul`` semantics (batch axes
        broadcast; 1-D operands are promoted and the added axis removed)."""

    @abc.abstractmethod
    def linear(self, x: Array, weight: Array, bias: Array | None = None) -> Array:
        """``x @ weight.T + bias``.

        x: ``[..., in]``; weight: ``[out, in]`` as returned by
        :meth:`prepare_weight`; bias: ``[out]`` or None. Returns ``[..., out]``.
        A backend whose :meth:`prepare_weight` returns :class:`PackedWeight`
        objects dispatches on them here: ``linear`` of a ``PackedWeight`` is
        :meth:`quantized_linear`. A backend with :meth:`all_reduce` also
        dispatches :class:`ShardedWeight` objects (tensor parallelism) to
        :meth:`sharded_linear`. Architectures only ever call ``linear``.
        """

    # ------------------------------------------------------------------
    # Elementwise
    # ------------------------------------------------------------------

    @abc.abstractmethod
    def add(self, a: Array, b: Array | float) -> Array:
        """``a + b`` (broadcasting)."""

    @abc.abstractmethod
    def sub(self, a: Array, b: Array | float) -> Array:
        """``a - b`` (broadcasting)."""

    @abc.abstractmethod
    def mul(self, a: Array, b: Array | float) -> Array:
        """``a * b`` (broadcasting)."""

    @abc.abstractmethod
    def div(self, a: Array, b: Array | float) -> Array:
        """``a / b`` (broadcasting); float division."""

    @abc.abstractmethod
    def exp(self, x: Array) -> Array:
        """Elementwise ``e**x``."""

    @abc.abstractmethod
    def sqrt(self, x: Array) -> Array:
        """Elementwise square root (NaN for negative inputs)."""

    @abc.abstractmethod
    def tanh(self, x: Array) -> Array:
        """Elementwise hyperbolic tangent."""

    @abc.abstractmethod
    def cos(self, x: Array) -> Array:
        """Elementwise cosine (radians)."""

    @abc.abstractmethod
    def sin(self, x: Array) -> Array:
        """Elementwise sine (radians)."""

    @abc.abstractmethod
    def silu(self, x: Array) -> Array:
        """``x * sigmoid(x)``."""

    @abc.abstractmethod
    def gelu(self, x: Array) -> Array:
        """Exact GELU: ``0.5 * x * (1 + erf(x / sqrt(2)))``."""

    @abc.abstractmethod
    def gelu_tanh(self, x: Array) -> Array:
        """Tanh-approximated GELU:
        ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x**3)))``."""

    # ------------------------------------------------------------------
    # Reductions
    # ------------------------------------------------------------------

    @abc.abstractmethod
    def sum(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        """Sum over one axis."""

    @abc.abstractmethod
    def mean(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        """Mean over one axis."""

    @abc.abstractmethod
    def max(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        """Maximum over one axis."""

    @abc.abstractmethod
    def argmax(self, x: Array, axis: int = -1) -> Array:
        """Index of the maximum over one axis (int64 or int32); the first
        index wins ties, as in numpy."""

    @abc.abstractmethod
    def softmax(self, x: Array, axis: int = -1) -> Array:
        """Numerically stable softmax. Rows that are entirely ``-inf`` give
        NaN, as in numpy; the attention op never produces such rows."""

    # ------------------------------------------------------------------
    # Normalisation and position encoding
    # ------------------------------------------------------------------

    @abc.abstractmethod
    def rms_norm(self, x: Array, weight: Array | None, eps: float) -> Array:
        """``x / sqrt(mean(x**2, -1) + eps) * weight`` over the last axis.

        x: ``[..., d]``; weight: ``[d]`` or None (no scale). The mean is
        computed in at least float32 and the result cast back to ``x``'s dtype
        before the weight is applied, as in Llama's reference implementation.
        """

    @abc.abstractmethod
    def layer_norm(self, x: Array, weight: Array | None, bias: Array | None, eps: float) -> Array:
        """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis,
        with the biased variance."""

    @abc.abstractmethod
    def rope(self, x: Array, cos: Array, sin: Array, interleaved: bool = False) -> Array:
        """Rotary position embedding.

        x: ``[tokens, heads, head_dim]``; cos, sin: ``[tokens, rot/2]`` with
        ``rot <= head_dim`` even. Only the first ``rot`` features rotate; the
        rest pass through (partial rotary).

        * ``interleaved=False`` (GPT-NeoX / Hugging Face "half-split"): the
          pairs are ``(x[i], x[i + rot/2])``.
        * ``interleaved=True`` (original RoFormer / GPT-J): the pairs are
          ``(x[2i], x[2i+1])``.

        Each pair ``(a, b)`` becomes ``(a cos - b sin, a sin + b cos)``.
        """

    @abc.abstractmethod
    def embedding(self, table: Array, ids: Array) -> Array:
        """Rows of ``table`` (``[vocab, d]``, as returned by
        :meth:`prepare_weight`) at integer ``ids`` (``[n]``): ``[n, d]``.
        Ids out of range are an error, never a silent wrap (inside a
        captured step, :meth:`compile`, where ids are not known while
        tracing, the engine checks them before the step instead). A
        :class:`PackedWeight` table (a tied embedding and output head kept
        quantized) gives its rows through :meth:`packed_rows`."""

    @abc.abstractmethod
    def take(self, x: Array, indices: Array, axis: int = 0) -> Array:
        """Select ``indices`` (1-D integer array) along ``axis``."""

    # ------------------------------------------------------------------
    # Shape manipulation
    # ------------------------------------------------------------------

    @abc.abstractmethod
    def reshape(self, x: Array, shape: Sequence[int]) -> Array:
        """Reshape; one dimension may be -1."""

    @abc.abstractmethod
    def transpose(self, x: Array, axes: Sequence[int]) -> Array:
        """Permute axes like ``numpy.transpose``."""

    @abc.abstractmethod
    def concat(self, xs: Sequence[Array], axis: int = 0) -> Array:
        """Concatenate along an existing axis."""

    @abc.abstractmethod
    def slice(self, x: Array, axis: int, start: int, stop: int) -> Array:
        """``x[..., start:stop, ...]`` along ``axis`` (Python slice rules)."""

    @abc.abstractmethod
    def scatter_rows(self, dst: Array, rows: Array, src: Array) -> Array:
        """Row ``i`` of ``src`` written to row ``rows[i]`` of ``dst`` (axis 0).

        ``rows`` is a device int32 array ``[n]`` of distinct rows, so the rows
        are data, not Python ints: a captured step keeps one graph for every
        step. This is the one write of per-sequence state: a forward's keys and
        values go to the pool rows its :class:`AttentionBatch` names (their
        *slots*), recurrent state to its sequences' state slots, and a
        copy-on-write block copy is a :meth:`take` and a write.

        May modify ``dst`` in place (numpy, torch) or build a new array
        (functional frameworks such as MLX): callers must use the returned
        array afterwards. ``src`` is cast to ``dst``'s dtype. A row outside
        ``dst`` raises ``IndexError`` (or, inside a captured step, the
        backend's own error): it is never written somewhere else.

        Float rows ``[n, heads, d]`` into a ``uint8`` pool of q8_0 blocks
        ``[rows, heads, d // 32 * 34]`` (``kv_dtype="q8_0"``, where the
        backend lists it in :attr:`kv_dtypes`) are quantized, each 32 values
        ``x`` as :func:`infer.oplib.quantize_q8_0` does it: ``d = max|x| /
        127`` stored as float16, codes ``rint(x * (127 / max|x|))`` computed
        in float32 from the unrounded maximum (all zero when it is 0). Rows of
        the pool's own ``uint8`` (a block copy) are copied as they are.
        """

    # ------------------------------------------------------------------
    # Optional ops, each with its default
    # ------------------------------------------------------------------

    def prepare_weight(self, tensor: np.ndarray | QuantizedTensor, *, name: str = "") -> Array:
        """Turn a weight from a format into what :meth:`linear` and
        :meth:`embedding` accept. Called once per tensor at load.

        ``name`` is the tensor's canonical (Hugging Face) name: a backend may
        treat linear weights, embeddings and norms differently by it.

        Default: dequantize a :class:`QuantizedTensor` and copy to the
        backend in :attr:`compute_dtype`. A backend with native quantized
        kernels returns a :class:`PackedWeight` for the types it computes on
        exactly, and honours ``settings.quantize`` (on-load quantization of float
        weights) when it lists the scheme in :attr:`quantize_schemes`.
        """
        if isinstance(tensor, QuantizedTensor):
            tensor = tensor.dequantize()
        return self.from_numpy(tensor)

    def fused_add_rms_norm(
        self, x: Array, residual: Array, weight: Array | None, eps: float
    ) -> tuple[Array, Array]:
        """``h = x + residual``; returns ``(rms_norm(h, weight, eps), h)``.
        Default: :meth:`add` then :meth:`rms_norm`."""
        h = self.add(x, residual)
        return self.rms_norm(h, weight, eps), h

    def swiglu(self, gate: Array, up: Array) -> Array:
        """``silu(gate) * up``. Default: :meth:`silu` then :meth:`mul`."""
        return self.mul(self.silu(gate), up)

    def softcap(self, x: Array, cap: float) -> Array:
        """``cap * tanh(x / cap)``. Default: from :meth:`div`, :meth:`tanh`,
        :meth:`mul`."""
        return self.mul(self.tanh(self.div(x, cap)), cap)

    def clip(self, x: Array, lo: float | None, hi: float | None) -> Array:
        """``numpy.clip(x, lo, hi)``: every entry limited to ``[lo, hi]``, a
        None bound leaving that side open; ``x``'s shape and dtype. gpt-oss's
        clamped SwiGLU uses it. Default: each bound as the larger of ``x``
        and a constant array, from :meth:`concat` and :meth:`max` over a new
        last axis (exact: it only selects values)."""
        return oplib.clip(self, x, lo, hi)

    def quantized_linear(self, x: Array, weight: PackedWeight, bias: Array | None = None) -> Array:
        """:meth:`linear` of a :class:`PackedWeight` kept quantized by
        :meth:`prepare_weight`: ``x @ dequantized(weight).T + bias``, with
        the weight's values exactly those of its source (GGUF blocks or an
        on-load quantization). Backends call it from :meth:`linear` when the
        weight is a ``PackedWeight``.

        Default: dequantize ``weight.rows`` on the host and call
        :meth:`linear` (a backend whose :meth:`prepare_weight` never packs
        never gets here)."""
        return oplib.quantized_linear(self, x, weight, bias)

    def packed_rows(self, table: PackedWeight, ids: Array) -> Array:
        """:meth:`embedding` of a :class:`PackedWeight`: the rows at ``ids``
        dequantized on the host from ``table.rows`` (only those rows), then
        copied to the backend. A helper for backends, not an op."""
        return oplib.packed_rows(self, table, ids)

    def attention(
        self,
        q: Array,
        k_pool: Array,
        v_pool: Array,
        batch: AttentionBatch,
        *,
        scale: float,
        causal: bool = True,
        window: int | None = None,
        softcap: float | None = None,
        sinks: Array | None = None,
    ) -> Array:
        """Scaled dot-product attention of every sequence of a forward over
        its keys in a pool: the one attention op of the contract.

        q: ``[tokens, hq, dk]``, each sequence's query rows together
        (``batch.query_start``); k_pool: ``[rows, hkv, dk]`` and v_pool
        ``[rows, hkv, dv]``, the pool rows the forward's keys and values were
        written to (:meth:`scatter_rows`), ``hq`` a multiple of ``hkv``
        (grouped-query attention: query head ``h`` reads key/value head
        ``h // (hq // hkv)``). Returns ``[tokens, hq, dv]``. The pools may be
        stored in a narrower float dtype than ``q`` (the engine's
        ``kv_dtype``, e.g. float16 keys for float32 queries): the op reads
        their values widened to ``q``'s dtype, exactly (every float16 is a
        float32), so the result is the attention over the widened pool.
        Pools of q8_0 blocks (``uint8``, :data:`KV_BLOCK_DTYPES`; ``dk`` and
        ``dv`` multiples of 32) are approximate by design, and the op is
        defined on them as :func:`infer.oplib.attend_one` computes it: each
        query row and head quantized once to q8_0 codes with a float32 scale
        per 32 values (:func:`infer.oplib.q8_0_query`), the scores ``sum_b dk_b * dq_b * (codes · codes)``
        in integer dot products per block, the values dequantized (``d * q``).

        Sequence ``b``'s ``n`` query rows are the *last* ``n`` of its
        ``batch.seq_lens[b]`` positions (query ``i`` sits at position
        ``p = seq_lens[b] - n + i``); its key at position ``j`` is pool row
        ``block_tables[b, j // block_size] * block_size + j % block_size``.
        With ``causal``, a query sees keys ``j <= p``, and those of its
        bidirectional span where ``batch.spans`` gives one
        (:attr:`AttentionBatch.spans`), else every key of its sequence; with
        a ``window`` only keys with ``|p - j| < window`` (causal: ``p - j <
        window``, so a span's keys ahead stay seen).
        Scores are ``q·k * scale``, then, with ``softcap``,
        ``softcap * tanh(s / softcap)``, then masking and a softmax computed in
        float32. ``sinks`` (``[hq]``, gpt-oss's attention sinks) adds one
        logit per head to each softmax's denominator, with no value.

        Default: built from required ops, one sequence at a time, reading
        the batch description back to the host (:meth:`AttentionBatch.on_host`);
        it is also the contract's plainly readable reference
        (:func:`infer.oplib.attention`).
        """
        return oplib.attention(self, q, k_pool, v_pool, batch, scale=scale, causal=causal, window=window,
                               softcap=softcap, sinks=sinks)

    def synchronize(self) -> None:
        """Wait for queued work to finish (for timing). Default: nothing to
        wait for."""

    # ------------------------------------------------------------------
    # Collectives (tensor parallelism, docs/distributed.md)
    # ------------------------------------------------------------------

    #: This process's rank in its process group (0: the driver).
    rank: int = 0
    #: Ranks in the process group (1: no group, a single process).
    world_size: int = 1

    def join_group(self, rank: int, world_size: int, *, init_method: str | None = None,
                   timeout: float = 60.0) -> None:
        """Join a process group of ``world_size`` ranks as ``rank``, before
        any weight is prepared: then :meth:`all_reduce`, :meth:`all_gather`
        and :meth:`broadcast` run over it. ``init_method`` is a rendezvous
        address (``"tcp://host:port"``) or None for the environment that
        ``torchrun`` sets (``MASTER_ADDR``, ``MASTER_PORT``); a collective
        that waits longer than ``timeout`` seconds for a peer raises.
        Default: only a group of one (no collectives needed) is possible."""
        oplib.join_group(self, world_size)

    def leave_group(self) -> None:
        """Leave the process group :meth:`join_group` joined (nothing when
        there is none). Default: nothing."""

    def all_reduce(self, x: Array) -> Array:
        """The elementwise sum of ``x`` over every rank of the process group
        (each rank passes its own ``x`` of the same shape and dtype, and
        every rank gets the sum). The order of the sum is the collective's:
        results differ from a single process's sum by float rounding.
        Default: ``x`` (a group of one)."""
        return x

    def all_gather(self, x: Array, axis: int = -1) -> Array:
        """Every rank's ``x`` (the same shape on each) concatenated along
        ``axis`` in rank order, on every rank. Default: ``x`` (a group of one)."""
        return x

    def broadcast(self, x: Array, src: int = 0) -> Array:
        """Rank ``src``'s ``x`` on every rank (the others pass an array of
        the same shape and dtype, whose values are ignored). Default: ``x``
        (a group of one)."""
        return x

    def sharded_linear(self, x: Array, weight: ShardedWeight, bias: Array | None = None) -> Array:
        """``linear`` of a :class:`ShardedWeight`: the local product, then
        :meth:`all_reduce` (``"sum"``, the bias added after it, once) or
        :meth:`all_gather` cut to the whole output (``"concat"``, the bias
        added to the whole output). Backends call it from :meth:`linear`."""
        return oplib.sharded_linear(self, x, weight, bias)

    def lora_linear(self, x: Array, weight: Array, bias: Array | None, a: Array, b: Array, slots: Array,
                    scales: Array) -> Array:
        """:meth:`linear` plus each row's low-rank adapter term, rows using
        different adapters or none in one call (Punica's segmented/gathered
        products, Chen et al. 2023):

            y[i] = x[i] @ weight.T + bias + scales[i] * (x[i] @ a[slots[i]].T) @ b[slots[i]].T

        x: ``[tokens, in]``; weight and bias as for :meth:`linear` (any form
        :meth:`prepare_weight` returns: the base product is :meth:`linear`'s);
        a: ``[slots, rank, in]``; b: ``[slots, out, rank]``; slots:
        ``[tokens]`` int32 in ``[0, slots)``; scales: ``[tokens]`` float (a
        row with scale 0 is the base model's). Returns ``[tokens, out]``.

        Default: the gathered form from required ops (:meth:`take` of each
        row's factors, two batched :meth:`matmul`); a backend may compute it
        by segments of rows sharing a slot instead."""
        return oplib.lora_linear(self, x, weight, bias, a, b, slots, scales)

    def expert_linear(self, x: Array, weights: Sequence[Array], ids: Array) -> Array:
        """Each row times the weight its id names (mixture-of-experts
        products; ggml's ``mul_mat_id``):

            y[i] = x[i] @ weights[ids[i]].T

        x: ``[rows, in]``; weights: the experts' ``[out, in]`` weights, each
        as :meth:`linear` takes it (:meth:`prepare_weight`'s forms), all of one
        shape; ids: ``[rows]`` int32 or int64 in ``[0, len(weights))``. Returns
        ``[rows, out]``. The ids are data: a captured step computes them.

        Default: the ids on the host (``to_numpy``), each expert's rows
        gathered in order (:meth:`take`) and multiplied in one :meth:`linear`,
        experts in increasing order, the products put back in row order: the
        form a backend's program should keep (the rows a product sees decide
        its rounding)."""
        return oplib.expert_linear(self, x, weights, ids)

    def adapted_linear(self, x: Array, weight: AdaptedWeight, bias: Array | None = None) -> Array:
        """``linear`` of an :class:`AdaptedWeight`: :meth:`lora_linear` over
        its pools where a row of this forward uses an adapter, else
        :meth:`linear` of its base. Backends call it from :meth:`linear`; a
        helper, not an op."""
        rows = weight.rows
        if rows.slots is None or weight.a is None:
            return self.linear(x, weight.base, bias)
        shape = self.shape(x)
        x2 = self.reshape(x, (-1, shape[-1])) if len(shape) != 2 else x
        y = self.lora_linear(x2, weight.base, bias, weight.a, weight.b, rows.slots, rows.scales)
        return self.reshape(y, (*shape[:-1], weight.shape[0])) if len(shape) != 2 else y

    def topk(self, x: Array, k: int) -> tuple[Array, Array]:
        """The ``k`` largest entries along the last axis: ``(values, indices)``,
        each ``[..., k]``, largest first; among equal values the lower index
        comes first (as :meth:`argmax`). ``values`` has ``x``'s dtype,
        ``indices`` is int32 or int64. ``-inf`` entries sort last. Used by
        mixture-of-experts routing. Default: sorted on the host (``to_numpy``,
        a stable sort, ``from_numpy``), one device round trip per call.
        """
        return oplib.topk(self, x, k)

    # -- recurrent layers' ops (docs/backends.md, "Recurrent ops") ---------------------------
    #
    # Each takes a ragged batch as attention does: the forward's rows ``[T, ...]``, sequence
    # ``b``'s being ``query_start[b]:query_start[b + 1]``, its state before them ``[B, ...]``,
    # and ``checkpoint_rows`` ``[N]`` (rows after which the engine keeps the state: block
    # boundaries and prompt ends, :attr:`~infer.kv.attention.AttentionContext.checkpoint_rows`);
    # each returns its outputs, the states after each sequence's last row and the states
    # after the checkpoint rows.

    def causal_conv1d(self, x: Array, window: Array, weight: Array, bias: Array | None, query_start: Array,
                      checkpoint_rows: Array | None = None, *,
                      activation: str | None = None) -> tuple[Array, Array, Array]:
        """Depthwise causal convolution over a ragged batch, carrying each
        sequence's last inputs (Mamba2's, LFM2's and gated DeltaNet's short
        convolution; a decode step is the one-row case).

        x: ``[T, C]``; window: ``[B, K - 1, C]``, sequence ``b``'s ``K - 1``
        inputs before its rows, oldest first (zeros for a new sequence);
        weight: ``[C, K]``, tap ``K - 1`` multiplying the current row (a
        PyTorch ``Conv1d(C, C, K, groups=C, padding=K - 1)``'s weight
        ``[C, 1, K]`` reshaped); bias: ``[C]`` or None; query_start: int32
        ``[B + 1]``; checkpoint_rows: int32 ``[N]`` or None (no rows);
        activation: None or ``"silu"``, applied after the bias.

        Returns ``(y [T, C], window after each sequence's last row [B, K - 1, C],
        window after each checkpoint row [N, K - 1, C])``, in ``x``'s dtype.
        ``query_start`` must rise from 0 to ``T``, and each checkpoint row must
        be one of the rows (``ValueError`` otherwise). Default: on the host
        in float32 (``to_numpy``, numpy, ``from_numpy``): :func:`infer.oplib.conv1d_reference`.
        """
        return oplib.causal_conv1d(self, x, window, weight, bias, query_start, checkpoint_rows,
                                   activation=activation)

    def ssd(self, x: Array, dt: Array, A: Array, B: Array, C: Array, D: Array | None, dt_bias: Array | None,
            state: Array, query_start: Array, checkpoint_rows: Array | None = None, *, dt_softplus: bool = True,
            dt_min: float = 0.0, dt_max: float = float("inf")) -> tuple[Array, Array, Array]:
        """Mamba2's selective state space over a ragged batch, carrying each
        sequence's state (the SSD layer of Dao & Gu 2024, "Transformers are
        SSMs", section 7; a decode step is the one-row case).

        For each sequence, row by row (heads ``h``, ``g = h // (H / G)`` the
        group whose ``B``/``C`` head ``h`` reads)::

            dt_t = clamp(softplus(dt_t + dt_bias), dt_min, dt_max)     # [H]
            S    = exp(dt_t * A) * S + dt_t * x_t outer B_t[g]           # [H, P, N]
            y_t  = S @ C_t[g] + D * x_t                                  # [H, P]

        x: ``[T, H, P]``; dt: ``[T, H]`` (before the bias and softplus);
        A: ``[H]``, the caller's negative decay rates (Mamba2 passes
        ``-exp(A_log)``); B, C: ``[T, G, N]`` with ``H % G == 0``; D: ``[H]``
        skip or None; dt_bias: ``[H]`` or None; state: ``[B, H, P, N]``
        (zeros for a new sequence); query_start: int32 ``[B + 1]``;
        checkpoint_rows: int32 ``[N]`` or None. ``dt_softplus`` False skips
        the softplus (softplus as PyTorch's: ``x`` itself above 20); the clamp
        is transformers' ``time_step_limit`` (``Mamba2Mixer.torch_forward``'s
        chunked scan, which equals this recurrence in exact arithmetic).

        Returns ``(y [T, H, P], state after each sequence's last row
        [B, H, P, N], state after each checkpoint row [N, H, P, N])``, in
        ``x``'s dtype. Bad shapes or batches: ``ValueError``. Default: on the
        host (``to_numpy``, numpy, ``from_numpy``): :func:`infer.oplib.ssd_reference`.
        """
        return oplib.ssd(self, x, dt, A, B, C, D, dt_bias, state, query_start, checkpoint_rows,
                         dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max)

    def softplus(self, x: Array) -> Array:
        """``log(1 + exp(x))``, elementwise, without overflow for large ``x``
        (gated DeltaNet's and Mamba's step size). Default: on the host in
        float32 (``numpy.logaddexp(0, x)``), in ``x``'s dtype."""
        return oplib.softplus(self, x)

    def gated_delta_rule(self, q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array,
                         query_start: Array, checkpoint_rows: Array | None = None, *, scale: float | None = None,
                         l2norm_qk: bool = True) -> tuple[Array, Array, Array]:
        """The gated delta rule over a ragged batch (Yang et al. 2024, "Gated
        Delta Networks", eq. 10; Qwen3-Next's and Qwen3.5's linear attention),
        carrying each sequence's state ``S`` ``[K, V]`` per value head. Per row
        ``t`` and value head:

            S = exp(g_t) * S;  S = S + k_t (beta_t * (v_t - S^T k_t))^T;  o_t = S^T (scale * q_t)

        with ``q_t``, ``k_t`` first divided by ``sqrt(|x|^2 + 1e-6)`` when
        ``l2norm_qk`` (transformers' ``l2norm``, as FLA's kernels compute it).

        q, k: ``[T, Hk, K]``; v: ``[T, H, V]`` with ``H`` a multiple of ``Hk``
        (key head ``j`` serves value heads ``j * H / Hk`` up to ``(j + 1) * H / Hk``:
        transformers' ``repeat_interleave``); g (the log of the decay, <= 0) and
        beta: ``[T, H]``; state: ``[B, H, K, V]`` (zeros for a new sequence);
        query_start: int32 ``[B + 1]``; checkpoint_rows: int32 ``[N]`` or None;
        scale: multiplies q (None: ``K ** -0.5``, transformers' choice).

        Returns ``(o [T, H, V], state after each sequence's last row [B, H, K, V],
        state after each checkpoint row [N, H, K, V])``: ``o`` in ``v``'s dtype,
        the states in ``state``'s. ``ValueError`` for a bad batch or shapes.
        Default: on the host in float32 (``to_numpy``, numpy, ``from_numpy``):
        :func:`infer.oplib.gated_delta_rule_reference`.
        """
        return oplib.gated_delta_rule(self, q, k, v, g, beta, state, query_start, checkpoint_rows, scale=scale,
                                      l2norm_qk=l2norm_qk)

    #: Whether ``infer.load`` captures the greedy decode step
    #: (:mod:`infer.engine.capture`, through :meth:`compile` with ``static``)
    #: when its ``compile`` argument is not given: for backends whose capture
    #: is measured faster than their eager step and costs no compile time.
    capture_by_default: bool = False

    #: The most tokens one captured step runs at once (None: any number): a
    #: forward of more runs as several steps of at most this many, whole
    #: sequences each (exact for their rows), or eagerly when one sequence
    #: alone has more. For a backend whose captured products take only so
    #: many rows (numpy's programs: its kernel rows).
    max_capture_tokens: int | None = None

    def compile(self, fn: Callable[..., Any], *, static: bool = False) -> Callable[..., Any]:
        """A graph-captured (compiled) version of ``fn``.

        ``static``: the caller keeps the input shapes fixed from call to call
        (a captured decode step), so the backend may specialize its graph on
        them and never trade it for a shape-generic one.

        ``fn`` is a pure function of backend arrays (and tuples, lists and
        dicts of them) computed only through this backend's ops, returning
        arrays or tuples of them; the result must compute the same values,
        within the dtype's rounding (fused kernels round differently). The
        engine captures whole forwards with it (:mod:`infer.engine.capture`:
        the forward's description is data, so attention and the cache writes
        are inside the graph); architectures never call it.

        The result has a ``graphs()`` method where the backend compiles: how
        many graphs it has built for ``fn`` so far (one per new input shape
        or dtype; a count that grows with every call means it recompiles).

        Default: ``fn`` itself (nothing to capture, e.g. numpy).
        """
        return fn


def is_float_dtype(dtype: str) -> bool:
    """True for the contract's float dtype names."""
    return dtype in FLOAT_DTYPES


#: Names :mod:`infer.oplib` took over from this module, still importable from
#: here (with a DeprecationWarning) for code written before it existed.
_MOVED_TO_OPLIB = frozenset({"attention_mask", "conv1d_reference", "gated_delta_rule_reference", "ragged_rows",
                             "row_run", "rows_within", "ssd_reference"})


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_OPLIB:
        warnings.warn(f"infer.ops.{name} moved to infer.oplib.{name}; import it from there", DeprecationWarning,
                      stacklevel=2)
        return getattr(oplib, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ACTIVATION_SCHEMES", "API_VERSION", "AdaptedWeight", "AdapterRows", "Array", "AttentionBatch", "Backend", "FLOAT_DTYPES", "INT_DTYPES",
    "LoadSettings", "OPTIONAL_OPS", "PackedWeight", "QUANTIZE_SCHEMES", "QuantizedTensor", "REQUIRED_OPS",
    "ShardedWeight", "is_float_dtype",
]
