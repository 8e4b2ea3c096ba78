"""GGUF LoRA adapters through the ``gguf`` format's spec (the core reaches
formats only through the registry: docs/design.md, "Layering"); the file
layout is the format's, in ``formats/gguf_adapter.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infer.adapters.lora import LoraAdapter, LoraModule
from infer.errors import AdapterFormatError


def _spec() -> Any:
    from infer.plugins import get_registry

    spec = get_registry().formats.get("gguf")
    if spec is None or spec.read_adapter is None:
        raise AdapterFormatError("no registered format reads GGUF adapters (the gguf format plugin is missing)")
    return spec


def read_gguf_adapter(path: str | Path, config: dict[str, Any] | None = None) -> LoraAdapter:
    """The LoRA adapter in GGUF file ``path``; ``config`` (the base model's
    config.json) checks its architecture and gives the heads of llama.cpp's
    Q/K permutation.

    Raises:
        AdapterFormatError: not a GGUF LoRA adapter, or malformed.
        AdapterMismatchError: made for another architecture than ``config``'s.
    """
    arch, modules = _spec().read_adapter(Path(path), config)
    return LoraAdapter(str(path), {name: LoraModule(a, b, float(scale)) for name, (a, b, scale) in modules.items()},
                       architecture=arch)


def write_gguf_adapter(adapter: LoraAdapter, path: str | Path, model_type: str, config: dict[str, Any]) -> None:
    """Write ``adapter`` as a GGUF LoRA adapter for a base of ``model_type``
    (``config``: its config.json). Every module's scale (rsLoRA,
    ``rank_pattern``, ``alpha_pattern``) is folded into its ``lora_b`` against
    the file's one ``adapter.lora.alpha``.

    Raises:
        AdapterFormatError: the adapter replaces whole modules (``modules_to_save``), which GGUF adapters cannot hold.
    """
    if adapter.saved:
        raise AdapterFormatError(f"{adapter.path}: modules_to_save ({', '.join(sorted(adapter.saved))}) cannot be "
                                 f"stored in a GGUF adapter")
    modules = {name: (m.a, m.b, m.scale) for name, m in adapter.modules.items()}
    _spec().write_adapter(Path(path), model_type, modules, config, alpha=adapter.alpha)
