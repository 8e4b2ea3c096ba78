"""Typed errors.

Every error infer raises on bad input is an :class:`InferError`. Messages say
what failed, where (file, tensor, key, byte offset), what was expected and
what was found, and what to do about it.
"""

from __future__ import annotations


class InferError(Exception):
    """Base class of every error infer raises on purpose."""


# -- model packages ---------------------------------------------------------


class ModelNotFoundError(InferError, FileNotFoundError):
    """A model reference names no file, folder, alias or cached repository."""


class DownloadError(InferError):
    """A model could not be downloaded, or what arrived failed its checksum."""


class FormatError(InferError):
    """A model file or folder is malformed, truncated or inconsistent."""


class UnsupportedFormatError(FormatError):
    """No registered format can open the given path."""


class UnsafeFormatError(FormatError):
    """The model is stored in a format that can execute code (pickle)."""


class ConfigError(FormatError):
    """A configuration value is missing, of the wrong type or out of range."""


class UnsupportedArchitectureError(InferError):
    """No registered architecture implements the model's type."""


class MissingTensorError(FormatError):
    """A tensor the architecture needs is absent from the model package."""


class ShapeMismatchError(FormatError):
    """A tensor's shape differs from the one the configuration implies."""


class UnsupportedDtypeError(FormatError):
    """A tensor is stored in a data type infer cannot read."""


class MmprojError(FormatError):
    """A vision projector file (llama.cpp's ``mmproj`` GGUF, ``general.architecture = clip``)
    cannot serve the model it was given with: missing, not such a file, or of a kind infer
    does not read."""


class UnknownProjectorError(MmprojError):
    """An mmproj file's ``clip.projector_type`` is not one infer reads (the message lists those)."""


class MmprojMismatchError(MmprojError):
    """An mmproj file does not fit its text model: its embeddings' width is not the text
    model's hidden size, or its family is not the text model's (the message says which)."""


# -- tokenizer and templates ------------------------------------------------


class TokenizerError(InferError):
    """The tokenizer is missing, malformed or was given unusable input."""


class ImageError(InferError, ValueError):
    """An image input cannot be used: unreadable, not an image, truncated, beyond
    the size or pixel limits, or given to a model without a vision part; the
    message names the input (a path, ``images[i]``, a message's content part)."""


class EncoderMemoryError(ImageError):
    """An image's vision-tower memory (its activations while it is encoded,
    with the request's image embeddings) exceeds the batch engine's
    ``encoder_memory`` even with nothing else running; the message names the
    image and the limit."""


class ChatTemplateError(InferError):
    """A chat template is missing, failed to render, or raised an exception."""


# -- backends and plugins ---------------------------------------------------


class BackendError(InferError):
    """A backend cannot be selected or failed to start."""


class BackendUnavailableError(BackendError):
    """The requested backend is not registered or not usable here."""


class UnsupportedOpError(BackendError):
    """A backend was asked for an op or dtype it does not implement."""


class InvalidQuantizationError(BackendError, ValueError):
    """``quantize=`` names no known scheme, or one the chosen backend does not provide."""


class CaptureError(BackendError):
    """A step cannot be captured as one graph or program (an op that reads a
    value on the host, an op the capture has no equivalent for, inputs it
    cannot take): the engine runs that step eagerly instead and says why."""


class BackendOutputError(BackendError):
    """A backend computed something impossible: NaN logits, or an array of the wrong shape."""


class PluginError(InferError):
    """A plugin registered something invalid or conflicting."""


# -- generation ---------------------------------------------------------------


class GenerationError(InferError):
    """A generation request is invalid."""


class SamplingParameterError(GenerationError, ValueError):
    """A sampling or stopping parameter is out of range or of the wrong type."""


class ContextLengthError(GenerationError):
    """A prompt (plus what must be generated) does not fit the context."""


class StructuredOutputError(GenerationError, ValueError):
    """A JSON schema, regex or grammar is invalid, or cannot be used with the
    other arguments (e.g. speculative decoding)."""


class IncompleteOutputError(GenerationError):
    """Constrained generation ended (``max_tokens``, the context or a stop string)
    before the output matched its constraint in full. ``text`` holds what was
    generated; ``Model.complete`` reports the same as ``valid=False`` instead."""

    def __init__(self, message: str, text: str) -> None:
        super().__init__(message)
        #: The text generated, which does not match the constraint in full.
        self.text = text


class CacheConfigError(InferError, ValueError):
    """A KV cache or page pool was configured or used inconsistently."""


class CacheFullError(GenerationError):
    """The KV cache cannot hold what a request needs."""


class StateFileError(InferError):
    """A saved sequence state (``Model.save_state``, a server slot, the disk
    prompt cache) is unreadable: truncated, altered (its checksum does not
    match), not a state file, or of another format version."""


class StateMismatchError(StateFileError):
    """A saved state was computed by another model or cache setting than the
    one loading it: :attr:`field` (``"weights"``, ``"kv_dtype"``,
    ``"block_size"``, ``"tokenizer"``, ...) was :attr:`found` in the file and
    :attr:`expected` here. Loading it would give wrong keys and values."""

    def __init__(self, message: str, field: str = "", expected: object = None, found: object = None) -> None:
        super().__init__(message)
        self.field, self.expected, self.found = field, expected, found


class StateUnsupportedError(InferError):
    """Saving or restoring a sequence state is not possible for this model
    (tensor parallelism; a model loaded from no file, whose weights cannot be
    fingerprinted)."""


# -- tensor parallelism ----------------------------------------------------------


class TensorParallelError(InferError):
    """A tensor-parallel model (``infer.load(..., tensor_parallel=N)``) could
    not be set up or stopped working."""


class TensorParallelConfigError(TensorParallelError, ValueError):
    """``tensor_parallel`` does not fit the model or the backend: N below 1,
    heads or an intermediate size N does not divide, a backend without
    collectives, a family whose math needs statistics over all heads."""


class WorkerError(TensorParallelError):
    """A rank of a tensor-parallel model died, failed or stopped answering;
    the model cannot be used further (close it and load it again)."""


# -- serving -------------------------------------------------------------------


class RequestError(InferError, ValueError):
    """An HTTP request to ``infer serve`` is malformed or asks for something
    infer does not do; :attr:`param` names the parameter at fault (None when
    no one parameter is), :attr:`status` is the HTTP status it answers with."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


class ServerBusyError(InferError):
    """The server's queue of waiting requests is full; retry after :attr:`retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# -- tools ---------------------------------------------------------------------


class BenchmarkError(InferError, ValueError):
    """A benchmark was configured inconsistently (options, engines, baseline)."""


class MissingDependencyError(InferError, ImportError):
    """An optional package a tool needs is not installed; the message says what to install."""


class ConversionError(InferError, ValueError):
    """``infer convert`` cannot do what was asked (an unknown ``--type``, a target format
    that cannot be written) or writing the output failed (disk full...); nothing is left
    at the output path."""


class OutputExistsError(ConversionError, FileExistsError):
    """The output path of a conversion exists; pass ``force=True`` (``--force``) to replace it."""


class EmbeddingError(InferError, ValueError):
    """An embedding or reranking call is malformed: no texts, an empty text,
    ``dimensions`` out of range, an unknown pooling mode or prompt name."""


# -- adapters ------------------------------------------------------------------


class AdapterError(InferError, ValueError):
    """A LoRA adapter cannot be read, attached or used (docs/adapters.md)."""


class AdapterFormatError(AdapterError, FormatError):
    """An adapter folder or file is missing a part, or holds what it should not."""


class UnsupportedAdapterError(AdapterError):
    """The adapter uses something infer does not run (DoRA, LoRA on
    embeddings, trained biases, another PEFT method); the message names it."""


class AdapterMismatchError(AdapterError):
    """The adapter was trained for another base model: an architecture, a
    module or a shape differs from the loaded model's."""


class AdapterResizesEmbeddingsError(UnsupportedAdapterError):
    """The adapter adds tokens (its embedding or output head has another
    vocabulary size than the base model's)."""


class AdapterLimitError(AdapterError):
    """A limit was exceeded: ``max_lora_rank``, ``max_cpu_loras`` (adapters
    loaded), ``max_loras`` (adapters in one batch) or a KV pool's memory
    budget (:class:`AdapterMemoryError`)."""


class AdapterMemoryError(AdapterLimitError):
    """Loading the adapter needs more of a KV pool's memory budget than its
    free pages give: its factors' bytes come out of the pool's pages
    (docs/adapters.md, "Memory"). ``adapter``, ``bytes_needed`` and
    ``bytes_free`` say which and how much."""

    def __init__(self, message: str, *, adapter: str, bytes_needed: int, bytes_free: int) -> None:
        super().__init__(message)
        self.adapter, self.bytes_needed, self.bytes_free = adapter, bytes_needed, bytes_free


class AdapterNotFoundError(AdapterError, KeyError):
    """No adapter of that name is loaded."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class AdapterInUseError(AdapterError):
    """The adapter is used by a running sequence (a stream still reading):
    it cannot be unloaded or replaced now."""


class AdapterMergeError(AdapterError):
    """``merge=True`` is refused: a quantized base, or other adapters loaded."""
