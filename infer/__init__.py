"""infer: run large language models on pluggable compute backends.

>>> import infer
>>> model = infer.load("path/to/model")          # doctest: +SKIP
>>> model.generate("The capital of France is")    # doctest: +SKIP

The model (what to compute), the engine (when, and with which KV cache) and
the backend (how the math runs) are separate: see docs/concepts.md.
"""

from __future__ import annotations

import logging

from infer import _moved
from infer.chat import ChatReply
from infer.completion import Completion, CompletionChunk, Stream, Usage
from infer.convert import convert
from infer.engine.batch import BatchEngine, BatchStats, RequestHandle
from infer.engine.generate import StopConditions
from infer.engine.sampling import SamplingParams, TokenLogprob
from infer.engine.scoring import Score
from infer.errors import InferError
from infer.loading import load
from infer.model import Model
from infer.ops import API_VERSION, Backend
from infer.plugins import get_registry
from infer.plugins.registry import ArchitectureSpec, FormatSpec
from infer.plugins.selection import BackendInfo, list_backends
from infer.request import GenerationRequest

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())
_moved.install()


def list_architectures() -> list[ArchitectureSpec]:
    """Registered architectures, each with the ``model_type`` values it implements."""
    return sorted(get_registry().architectures.values(), key=lambda s: s.name)


def list_formats() -> list[FormatSpec]:
    """Registered model formats."""
    return sorted(get_registry().formats.values(), key=lambda s: s.name)


__all__ = [
    "API_VERSION", "Backend", "BackendInfo", "BatchEngine", "BatchStats", "ChatReply", "Completion",
    "CompletionChunk", "GenerationRequest", "InferError", "Model", "RequestHandle", "SamplingParams", "Score", "StopConditions", "Stream", "TokenLogprob",
    "Usage", "convert",
    "__version__", "list_architectures", "list_backends", "list_formats", "load",
]
