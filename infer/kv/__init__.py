"""Where keys and values live: what the engine owns and architectures never see.

* :mod:`infer.kv.attention` — the attention context, the one object an
  architecture is handed per forward, and the layer-state kinds it declares
  (part of the contract architectures are written against);
* :mod:`infer.kv.state` — recurrent layers' per-sequence state slots and checkpoints;
* :mod:`infer.kv.cache` — the sequence-cache lifecycle every layout shares
  (:class:`~infer.kv.cache.SequenceCache`) and the contiguous cache;
* :mod:`infer.kv.paged` — the paged pool and its sequence caches;
* :mod:`infer.kv.blocks` — the block allocator under the paged pool (reference
  counts, prefix hashes, eviction);
* :mod:`infer.kv.state_file` — the state file (safetensors, a description, a checksum);
* :mod:`infer.kv.fingerprint` — what a saved state was computed with;
* :mod:`infer.kv.snapshot` — a sequence's state into a state file and back into a
  pool's prefix cache;
* :mod:`infer.kv.disk` — the prefix cache's disk tier (``prompt_cache_dir``).

Nothing here imports the engine (docs/design.md, "Layering").
"""
