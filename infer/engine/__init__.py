"""The engine: runs the network over sequences, and the loops that drive it.

* :mod:`infer.engine.runner` — :class:`Engine`, the model runner (one forward
  over any mix of sequences; owns the KV caches);
* :mod:`infer.engine.generate` — one request: prefill, decode, speculative
  decoding, and the stop rules every loop shares;
* :mod:`infer.engine.batch` — many requests, continuous batching;
* :mod:`infer.engine.budget` — the batch engine's KV-memory strategy (paged
  or contiguous);
* :mod:`infer.engine.speculative` — draft sources and their statistics;
* :mod:`infer.engine.sampling` — sampling parameters and the sampler (and
  the log-probabilities it records);
* :mod:`infer.engine.scoring` — log-probabilities of given texts, in sliding
  windows;
* :mod:`infer.engine.structured` — constrained decoding: grammar matchers that
  mask the sampler's logits.

``from infer.engine import Engine`` is the runner; the loops are imported
from their modules.
"""

from __future__ import annotations

from infer.engine.runner import Batch, Engine, ForwardOutput, SequenceState

__all__ = ["Batch", "Engine", "ForwardOutput", "SequenceState"]
