"""Adapters attached to a loaded model: where their factors live, and which
rows of a forward use which.

Adapters attach where the weights are read (docs/design.md, rule 2): the
loader recorded which prepared weight each tensor went into, at which row
(:attr:`~infer.architecture.WeightLoader.sources`; q, k and v stacked into one
``qkv_proj`` sit at their row offsets). Each weight an adapter targets is
replaced, in the layer's weights dict that holds it, by an
:class:`~infer.ops.AdaptedWeight` around it, whose ``linear`` is the
contract's ``lora_linear``. So no architecture changes: any family on the
shared decoder (and any other that keeps its weights in dicts per layer) takes
adapters on every linear weight it reads.

Every loaded adapter has a slot: per adapted weight, ``a [slots, R, in]`` and
``b [slots, out, R]`` stack the slots' factors, zero-padded to the largest
rank ``R`` (a stacked weight's modules side by side: ``b`` block-diagonal
over their rows), each module's scale folded into ``b``. A forward's rows
name their slot and scale (:class:`~infer.ops.AdapterRows`): a batch mixes
adapters and the base model (scale 0) in one call per weight.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from infer.adapters.lora import LoraAdapter
from infer.errors import (
    AdapterError,
    AdapterInUseError,
    AdapterLimitError,
    AdapterMemoryError,
    AdapterMergeError,
    AdapterMismatchError,
    AdapterNotFoundError,
    AdapterResizesEmbeddingsError,
    UnsupportedAdapterError,
)
from infer.ops import AdaptedWeight, AdapterRows, Backend, PackedWeight, QuantizedTensor, ShardedWeight

log = logging.getLogger(__name__)

#: Defaults of the limits (vLLM's names): adapters in one batch, adapters loaded, largest rank.
MAX_LORAS = 8
MAX_CPU_LORAS = 32
MAX_LORA_RANK = 256


@dataclass(eq=False)
class LoadedAdapter:
    """An adapter loaded under a name."""

    name: str
    adapter: LoraAdapter
    #: The adapter's content hash (:meth:`LoraAdapter.content_hash`).
    key: bytes
    #: Merged into the base weights (``merge=True``): every row runs it, no slot.
    merged: bool = False
    #: The saved tensors (``modules_to_save``) prepared on the backend, by the holder attribute they replace.
    saved: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class AdapterUse:
    """One sequence's adapter: what it carries through the engine (forks,
    preemption and speculative decoding keep it with the sequence)."""

    loaded: LoadedAdapter
    #: Multiplies the adapter's term (the request's ``adapter_scale``).
    scale: float = 1.0
    #: Set when the sequence is released: it no longer holds the adapter.
    done: bool = False
    #: Where live uses are counted (:meth:`Adapters.use`).
    tracker: Any = None

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def extra_key(self) -> bytes:
        """The prefix-cache extra key of the sequence's blocks: the adapter's
        content and the scale (both change every key and value)."""
        return self.loaded.key + np.float64(self.scale).tobytes()

    def fork(self) -> AdapterUse:
        """The same adapter held for another sequence (``n > 1``)."""
        twin = AdapterUse(self.loaded, self.scale, tracker=self.tracker)
        if self.tracker is not None:
            self.tracker.add(twin)
        return twin


class Adapters:
    """The adapters of one model (``model.adapters``): loading, slots, and the
    rows of each forward."""

    def __init__(self, network: Any, backend: Backend, sources: dict[str, tuple[Any, int]], *,
                 max_loras: int = MAX_LORAS, max_cpu_loras: int = MAX_CPU_LORAS,
                 max_lora_rank: int = MAX_LORA_RANK, config: dict[str, Any] | None = None,
                 budgets: Any = None) -> None:
        for key, value in (("max_loras", max_loras), ("max_cpu_loras", max_cpu_loras),
                           ("max_lora_rank", max_lora_rank)):
            if not isinstance(value, int) or value < 1:
                raise AdapterLimitError(f"{key} must be a positive integer, got {value!r}")
        self.network, self.backend, self.sources = network, backend, sources
        self.max_loras, self.max_cpu_loras, self.max_lora_rank = max_loras, max_cpu_loras, max_lora_rank
        #: The base model's config.json (``model_type``, heads), which a GGUF adapter is checked against.
        self.config = config
        #: What every adapted weight reads for the current forward.
        self.rows = AdapterRows()
        #: Loaded adapters by name, in slot order (merged ones hold no slot).
        self.loaded: dict[str, LoadedAdapter] = {}
        #: The adapted weights by the id of the base weight they wrap.
        self.adapted: dict[int, AdaptedWeight] = {}
        #: The KV pools whose memory budget the adapters' bytes come out of
        #: (:attr:`~infer.engine.Engine.budget_pools`, a set the engine adds
        #: its pools to): each withholds pages covering :attr:`nbytes`.
        self.budgets: Any = weakref.WeakSet() if budgets is None else budgets
        self._uses: weakref.WeakSet[AdapterUse] = weakref.WeakSet()
        self._swapped: list[tuple[str, Any]] = []
        self._float_bytes: int | None = None

    # -- loading ------------------------------------------------------------------

    def load(self, name: str, source: str | Path | LoraAdapter, *, merge: bool = False) -> LoadedAdapter:
        """Load the adapter at ``source`` (a PEFT folder or a GGUF adapter
        file) under ``name``; one already loaded under it is replaced (refused
        while a sequence uses it). ``merge``: add it into the base weights
        instead (a float base, no other adapter loaded).

        Raises:
            AdapterLimitError: its rank is over ``max_lora_rank``, or ``max_cpu_loras`` are loaded.
            AdapterMemoryError: a KV pool sized by a memory budget (:attr:`budgets`) cannot spare
                the pages its bytes need (nothing is loaded or unloaded then).
            AdapterMismatchError: it targets modules or shapes the model does not have.
            AdapterInUseError: ``name`` is loaded and a running sequence uses it.
            AdapterMergeError: ``merge`` on a quantized base, or beside other adapters.
        """
        from infer.adapters import read_adapter

        if not isinstance(name, str) or not name:
            raise AdapterError(f"an adapter's name must be a non-empty string, got {name!r}")
        adapter = source if isinstance(source, LoraAdapter) else read_adapter(source, self.config)
        if adapter.rank > self.max_lora_rank:
            raise AdapterLimitError(f"adapter {name!r} ({adapter.path}) has rank {adapter.rank}, over "
                                    f"max_lora_rank={self.max_lora_rank}; load the model with a larger max_lora_rank")
        if name in self.loaded:
            self._check_unused(self.loaded[name])
        elif len(self.loaded) >= self.max_cpu_loras:
            raise AdapterLimitError(f"{len(self.loaded)} adapters are loaded (max_cpu_loras={self.max_cpu_loras}); "
                                    f"unload one first: {', '.join(self.loaded)}")
        targets = self._targets(name, adapter)
        loaded = LoadedAdapter(name, adapter, adapter.content_hash())
        loaded.saved = self._saved(name, adapter)
        if not merge:  # its bytes must fit the KV pools' budgets before anything changes
            self._check_memory(loaded, targets)
        if name in self.loaded:
            self.unload(name)
        if merge:
            self._merge(loaded, targets, sign=1.0)
            loaded.merged = True
            self.loaded[name] = loaded
            log.info("adapter %s merged into the weights (%d modules)", name, len(adapter.modules))
            return loaded
        if any(a.merged for a in self.loaded.values()):
            raise AdapterMergeError(f"adapter {name!r}: another adapter is merged into the weights; unload it first")
        for base, _ in targets.values():
            if id(base) not in self.adapted:
                self._install(base)
        self.loaded[name] = loaded
        self._rebuild()
        self._hold_pages()
        log.info("adapter %s loaded from %s: %d modules, rank %d, %d bytes held", name, adapter.path,
                 len(adapter.modules), adapter.rank, self.nbytes)
        return loaded

    def unload(self, name: str) -> None:
        """Unload adapter ``name`` (a merged one is subtracted from the weights again).

        Raises:
            AdapterNotFoundError: no adapter is loaded under ``name``.
            AdapterInUseError: a running sequence uses it.
        """
        loaded = self.get(name)
        self._check_unused(loaded)
        del self.loaded[name]
        if loaded.merged:
            self._merge(loaded, self._targets(name, loaded.adapter), sign=-1.0)
        else:
            self._rebuild()
            self._hold_pages()  # its pages go back to the KV pools

    def _check_unused(self, loaded: LoadedAdapter) -> None:
        users = sum(1 for u in list(self._uses) if u.loaded is loaded and not u.done)
        if users:
            raise AdapterInUseError(f"adapter {loaded.name!r} is used by {users} running sequence(s); unload it "
                                    f"when they finish")

    def get(self, name: str) -> LoadedAdapter:
        """The adapter loaded as ``name``; :class:`~infer.errors.AdapterNotFoundError` if none is."""
        try:
            return self.loaded[name]
        except KeyError:
            known = ", ".join(self.loaded) or "none"
            raise AdapterNotFoundError(f"no adapter named {name!r} is loaded (loaded: {known})") from None

    def use(self, name: str, scale: float = 1.0) -> AdapterUse:
        """A sequence's hold on adapter ``name`` at ``scale`` (released with ``use.done = True``)."""
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
            raise AdapterError(f"adapter_scale must be a finite number, got {scale!r}")
        use = AdapterUse(self.get(name), float(scale), tracker=self._uses)
        self._uses.add(use)
        return use

    def in_use(self, name: str) -> int:
        """Running sequences holding adapter ``name``."""
        return sum(1 for u in list(self._uses) if u.name == name and not u.done)

    # -- one forward --------------------------------------------------------------

    def slot_rows(self, uses: list[AdapterUse | None]) -> list[tuple[int, float]] | None:
        """Each sequence's ``(slot, scale)`` in the next forward (the base
        model and a merged adapter: ``(0, 0.0)``), checked as :meth:`bind`
        checks them; None when no sequence uses an unmerged adapter. What a
        captured step takes as its inputs (:mod:`infer.engine.capture`)."""
        self._check(uses)
        slot = {name: i for i, name in enumerate(n for n, a in self.loaded.items() if not a.merged)}
        if not any(u is not None and not u.loaded.merged for u in uses):
            return None
        return [(0, 0.0) if u is None or u.loaded.merged else (slot[u.name], u.scale) for u in uses]

    @property
    def nbytes(self) -> int:
        """Bytes the loaded adapters hold on the backend: every stacked pool
        and every saved module (what a KV pool sized by a memory budget
        leaves them: :meth:`~infer.engine.Engine.new_kv_pool`)."""
        held = [*self.pools(), *(v for a in self.loaded.values() for v in a.saved.values())]
        return sum(int(getattr(x, "nbytes", 0)) for x in held)  # numpy's, torch's and MLX's arrays have it

    def pools(self) -> list[Any]:
        """Every adapted weight's stacked factors, ``[a, b, a, b, ...]`` in a
        fixed order (the weights that some loaded adapter adapts)."""
        return [p for w in self.adapted.values() if w.a is not None for p in (w.a, w.b)]

    def swap_in(self, slots: Any, scales: Any, pools: list[Any]) -> list[tuple[Any, Any, Any]]:
        """Every row's slot and scale become ``slots`` and ``scales``
        (backend arrays ``[tokens]``), and the adapted weights read ``pools``
        (as :meth:`pools` orders them) instead of their own, until
        :meth:`swap_out` with what this returns: how a captured step's
        function sees its inputs (a plain call pair, not a context manager,
        so that ``torch.compile`` traces it without a break)."""
        weights = [w for w in self.adapted.values() if w.a is not None]
        if len(pools) != 2 * len(weights):
            raise AdapterError(f"{len(pools)} pools for {len(weights)} adapted weights: adapters changed mid-step")
        own = [(w, w.a, w.b) for w in weights]
        self.rows.slots, self.rows.scales = slots, scales
        for w, i in zip(weights, range(0, len(pools), 2)):
            w.a, w.b = pools[i], pools[i + 1]
        return own

    def swap_out(self, own: list[tuple[Any, Any, Any]]) -> None:
        """Undo :meth:`swap_in`: no row uses an adapter, the weights read their own pools."""
        self.rows.slots = self.rows.scales = None
        for w, a, b in own:
            w.a, w.b = a, b

    def _check(self, uses: list[AdapterUse | None]) -> None:
        """A forward's adapters: at most ``max_loras``, each still loaded, one replacing modules only alone."""
        active = [u for u in uses if u is not None and not u.loaded.merged]
        names = {u.name for u in active}
        if len(names) > self.max_loras:
            raise AdapterLimitError(f"one batch uses {len(names)} adapters, over max_loras={self.max_loras}")
        for u in active:
            if u.loaded is not self.loaded.get(u.name):
                raise AdapterError(f"adapter {u.name!r} was unloaded while a sequence used it")
        saving = {u.name for u in active if u.loaded.saved}
        if saving and (len(names) > 1 or any(u is None or u.loaded.merged for u in uses)):
            raise AdapterError(f"adapter {sorted(saving)[0]!r} replaces whole modules (modules_to_save): it runs "
                               f"alone in a batch, not beside other adapters or the base model")

    def bind(self, uses: list[AdapterUse | None], counts: list[int]) -> bool:
        """Set the rows of the next forward: sequence ``i`` has ``counts[i]``
        rows and uses ``uses[i]`` (None: the base model). Returns False (and
        binds nothing) when no row uses an unmerged adapter.

        Raises:
            AdapterLimitError: more distinct adapters than ``max_loras``.
            AdapterError: an adapter with ``modules_to_save`` beside other rows.
        """
        self._check(uses)
        slot = {name: i for i, name in enumerate(n for n, a in self.loaded.items() if not a.merged)}
        active = [u for u in uses if u is not None and not u.loaded.merged]
        saving = {u.name for u in active if u.loaded.saved}
        if not active:
            return False
        slots = np.concatenate([np.full(n, 0 if u is None or u.loaded.merged else slot[u.name], np.int32)
                                for u, n in zip(uses, counts)])
        scales = np.concatenate([np.full(n, 0.0 if u is None or u.loaded.merged else u.scale, np.float32)
                                 for u, n in zip(uses, counts)])
        ops = self.backend
        self.rows.slots, self.rows.scales = ops.from_numpy(slots), ops.from_numpy(scales)
        if saving:
            for attr, value in active[0].loaded.saved.items():
                self._swapped.append((attr, getattr(self.network, attr)))
                setattr(self.network, attr, value)
        return True

    def unbind(self) -> None:
        """After the forward: no row uses an adapter; swapped modules go back."""
        self.rows.slots = self.rows.scales = None
        while self._swapped:
            attr, value = self._swapped.pop()
            setattr(self.network, attr, value)

    # -- memory -------------------------------------------------------------------

    def _check_memory(self, loaded: LoadedAdapter, targets: dict[str, tuple[Any, int]]) -> None:
        """Whether every budgeted KV pool can give the pages the adapters would
        hold with ``loaded`` added (replacing one of its name): what
        :meth:`_rebuild` would stack, counted from the shapes before anything
        is built or changed.

        Raises:
            AdapterMemoryError: a pool's spare pages cannot cover them.
        """
        slotted = [a for n, a in self.loaded.items() if not a.merged and n != loaded.name] + [loaded]
        weights = {id(base): base for base, _ in targets.values()}
        total = self._stacked_nbytes(slotted, weights) + sum(
            int(getattr(v, "nbytes", 0)) for a in slotted for v in a.saved.values())
        now = self.nbytes
        for pool in list(self.budgets):
            want, have = pool.pages_for(total), pool.allocator.withheld
            spare = pool.spare_pages()
            if want - have <= spare:
                continue
            per = pool.page_bytes or 0
            free = (have + spare) * per - now  # what the pages the adapters may hold leave beyond what they hold
            stats = pool.stats()
            raise AdapterMemoryError(
                f"adapter {loaded.name!r} ({loaded.adapter.path}) needs {total - now:,} more bytes of the KV "
                f"pool's memory budget (the loaded adapters would hold {total:,} bytes: {want} pages of "
                f"{per:,}), but only {max(0, free):,} bytes are free ({spare} spare pages: {stats.used} pages "
                f"are used by running requests, {stats.cached} cached, {stats.free} free, {have} already held "
                f"for adapters, and the largest waiting or running request keeps its pages); unload an adapter, "
                f"wait for requests to finish, or raise the KV memory (kv_memory, --kv-memory)",
                adapter=loaded.name, bytes_needed=total - now, bytes_free=max(0, free))

    def _hold_pages(self) -> None:
        """Every budgeted KV pool withholds pages covering :attr:`nbytes` (more after a load,
        checked by :meth:`_check_memory`; fewer after an unload: given back)."""
        held = self.nbytes
        for pool in list(self.budgets):
            pool.hold_bytes(held)

    def _stacked_nbytes(self, slotted: list[LoadedAdapter], extra: dict[int, Any]) -> int:
        """Bytes of the pools :meth:`_rebuild` stacks for ``slotted`` (weights
        ``extra`` being adapted too): per adapted weight, ``a [slots, R, in]``
        and ``b [slots, out, R]`` at the backend's itemsize of float32."""
        shapes = {k: w.shape for k, w in self.adapted.items()}
        shapes.update({k: tuple(int(d) for d in base.shape) for k, base in extra.items()})
        ranks: dict[int, list[int]] = {k: [0] * len(slotted) for k in shapes}
        for i, loaded in enumerate(slotted):
            for module, m in loaded.adapter.modules.items():
                base, _ = self.sources[module + ".weight"]
                base = base.base if isinstance(base, AdaptedWeight) else base
                ranks[id(base)][i] += m.rank
        itemsize = self._itemsize()
        return sum(len(slotted) * max(r) * (shapes[k][0] + shapes[k][1]) * itemsize
                   for k, r in ranks.items() if max(r, default=0) > 0)

    def _itemsize(self) -> int:
        """Bytes per value of a pool: a float32 array on the backend."""
        if self._float_bytes is None:
            self._float_bytes = int(getattr(self.backend.from_numpy(np.zeros(1, np.float32)), "nbytes", 4))
        return self._float_bytes

    # -- internals ----------------------------------------------------------------

    def _targets(self, name: str, adapter: LoraAdapter) -> dict[str, tuple[Any, int]]:
        """Each module's base weight and first row there, checked against the adapter's factors."""
        out = {}
        for module, m in adapter.modules.items():
            tensor = module + ".weight"
            if module.endswith(".experts") or ".experts." in module:
                raise UnsupportedAdapterError(f"adapter {name!r} ({adapter.path}) adapts {module}: LoRA on "
                                              f"mixture-of-experts experts is not supported")
            if tensor not in self.sources:
                raise AdapterMismatchError(f"adapter {name!r} ({adapter.path}) adapts {module}, which the model "
                                           f"does not have (no weight {tensor}): it was made for another base model")
            base, first = self.sources[tensor]
            base = base.base if isinstance(base, AdaptedWeight) else base
            if isinstance(base, (QuantizedTensor, ShardedWeight)) or not hasattr(base, "shape") or \
                    len(base.shape) != 2:
                raise AdapterMismatchError(f"adapter {name!r}: {tensor} is not a linear weight infer can adapt")
            out_rows, in_cols = int(base.shape[0]), int(base.shape[1])
            # A weight stacked from several tensors (q, k and v as qkv_proj) holds this one's rows from `first` on.
            stacked = sum(1 for b, _ in self.sources.values() if b is base) > 1
            fits = first + m.b.shape[0] <= out_rows if stacked else m.b.shape[0] == out_rows
            if m.a.shape[1] != in_cols or not fits:
                raise AdapterMismatchError(
                    f"adapter {name!r} ({adapter.path}): {module} maps {m.a.shape[1]} inputs to {m.b.shape[0]} "
                    f"outputs, but the model's {tensor} takes {in_cols} inputs to "
                    f"{'part of ' if stacked else ''}{out_rows} outputs: the adapter was made for another base model")
            if not self._holders(base):
                raise AdapterMismatchError(f"adapter {name!r}: {tensor} is not read as a layer's linear weight here")
            out[module] = (base, first)
        return out

    def _holders(self, base: Any) -> list[tuple[Any, Any]]:
        """Where the network holds ``base`` (or an adapted weight around it):
        ``(container, key)`` pairs, a container being a weights dict, a list, or
        one of the architecture's objects (its attribute: the network, a
        layer). Searched through dicts, lists and the architecture's own
        objects, a few levels deep."""
        found: list[tuple[Any, Any]] = []

        def holds(value: Any) -> bool:
            return value is base or (isinstance(value, AdaptedWeight) and value.base is base)

        def walk(obj: Any, depth: int) -> None:
            if depth > 6:
                return
            if isinstance(obj, dict):
                items: Any = obj.items()
            elif isinstance(obj, list):
                items = enumerate(obj)
            elif type(obj).__module__.startswith("infer.architectures"):
                names = vars(obj) if hasattr(obj, "__dict__") else [
                    n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())]
                items = [(n, getattr(obj, n)) for n in names if hasattr(obj, n)]
            else:
                return
            for key, value in list(items):
                if holds(value):
                    found.append((obj, key))
                elif isinstance(value, (dict, list)) or type(value).__module__.startswith("infer.architectures"):
                    walk(value, depth + 1)

        walk(self.network, 0)
        return found

    @staticmethod
    def _put(container: Any, key: Any, value: Any) -> None:
        if isinstance(container, (dict, list)):
            container[key] = value
        else:
            setattr(container, key, value)

    def _install(self, base: Any) -> None:
        adapted = AdaptedWeight(base, tuple(int(d) for d in base.shape), self.rows)
        for container, key in self._holders(base):
            self._put(container, key, adapted)
        self.adapted[id(base)] = adapted

    def _rebuild(self) -> None:
        """Every adapted weight's pools from the loaded adapters, one slot each."""
        slotted = [a for a in self.loaded.values() if not a.merged]
        per_weight: dict[int, list[list[tuple[int, Any]]]] = {k: [[] for _ in slotted] for k in self.adapted}
        for i, loaded in enumerate(slotted):
            for module, m in loaded.adapter.modules.items():
                base, first = self.sources[module + ".weight"]
                base = base.base if isinstance(base, AdaptedWeight) else base
                per_weight[id(base)][i].append((first, m))
        ops = self.backend
        for key, adapted in self.adapted.items():
            parts = per_weight[key]
            if not any(parts):
                adapted.a = adapted.b = None
                continue
            out_rows, in_cols = adapted.shape
            rank = max(sum(m.rank for _, m in p) for p in parts)
            a = np.zeros((len(parts), rank, in_cols), np.float32)
            b = np.zeros((len(parts), out_rows, rank), np.float32)
            for i, p in enumerate(parts):
                at = 0
                for first, m in p:
                    a[i, at:at + m.rank] = m.a
                    b[i, first:first + m.b.shape[0], at:at + m.rank] = m.b * np.float32(m.scale)
                    at += m.rank
            adapted.a, adapted.b = ops.from_numpy(a), ops.from_numpy(b)

    def _saved(self, name: str, adapter: LoraAdapter) -> dict[str, Any]:
        """The adapter's whole modules prepared, by the network attribute they replace."""
        out = {}
        for tensor, value in adapter.saved.items():
            if tensor not in self.sources:
                raise AdapterMismatchError(f"adapter {name!r} ({adapter.path}) replaces {tensor}, which the model "
                                           f"does not read")
            base, _ = self.sources[tensor]
            attrs = [k for k, v in vars(self.network).items() if v is base]
            if not attrs:
                raise AdapterMismatchError(f"adapter {name!r}: {tensor} is not a module infer can replace "
                                           f"(modules_to_save: the embedding or the output head)")
            shape = tuple(int(d) for d in base.shape)
            if value.shape != shape:
                if value.ndim == 2 and value.shape[1:] == shape[1:]:
                    raise AdapterResizesEmbeddingsError(
                        f"adapter {name!r} ({adapter.path}): its {tensor} has {value.shape[0]} rows, the model's "
                        f"{shape[0]}: it adds tokens (resized embeddings), which infer does not support")
                raise AdapterMismatchError(f"adapter {name!r}: {tensor} is {list(value.shape)}, the model's "
                                           f"{list(shape)}")
            prepared = self.backend.prepare_weight(np.ascontiguousarray(value, np.float32), name=tensor)
            for attr in attrs:
                out[attr] = prepared
        return out

    def _merge(self, loaded: LoadedAdapter, targets: dict[str, tuple[Any, int]], sign: float) -> None:
        """Add (``sign`` 1) or subtract (-1) the adapter's dense update into the base weights."""
        name = loaded.name
        if sign > 0 and self.loaded:
            raise AdapterMergeError(f"merge=True for adapter {name!r}: other adapters are loaded "
                                    f"({', '.join(self.loaded)}); merging serves one adapter alone")
        if loaded.saved:
            raise AdapterMergeError(f"merge=True for adapter {name!r}: it replaces whole modules (modules_to_save)")
        ops = self.backend
        for module, (base, first) in targets.items():
            if isinstance(base, PackedWeight):
                raise AdapterMergeError(f"merge=True for adapter {name!r}: {module} is quantized "
                                        f"({base.qtype}); merging would change it to float. Load it unmerged")
        updated: dict[int, Any] = {}
        for module, (base, first) in targets.items():
            current = updated.get(id(base), base)
            host = np.array(ops.to_numpy(current), np.float32)
            delta = loaded.adapter.modules[module].delta()
            host[first:first + delta.shape[0]] += np.float32(sign) * delta
            new = ops.prepare_weight(host, name=module + ".weight")
            updated[id(base)] = new
            self._replace(base if current is base else current, new)
        # The loader's record follows the new weights (a later adapter attaches to them).
        for tensor, (base, first) in list(self.sources.items()):
            if id(base) in updated:
                self.sources[tensor] = (updated[id(base)], first)

    def _replace(self, old: Any, new: Any) -> None:
        adapted = self.adapted.pop(id(old), None)
        if adapted is not None:  # left installed by an adapter unloaded before: it wraps the new weight now
            adapted.base = new
            self.adapted[id(new)] = adapted
            return
        for container, key in self._holders(old):
            self._put(container, key, new)
