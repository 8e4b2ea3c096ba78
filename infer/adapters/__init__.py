"""LoRA adapters: read from PEFT folders or GGUF adapter files, attached to a
loaded model where its weights are read, several in one batch
(docs/adapters.md).

* :mod:`infer.adapters.lora` — the one form every reader produces (:class:`LoraAdapter`);
* :mod:`infer.adapters.peft` — PEFT folders (``adapter_config.json`` + ``adapter_model.safetensors``);
* :mod:`infer.adapters.gguf` — GGUF adapters (``general.type = adapter``), and writing one;
* :mod:`infer.adapters.slots` — a model's loaded adapters (:class:`Adapters`): slots, pools, rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infer.adapters.lora import LoraAdapter, LoraModule
from infer.adapters.peft import is_peft_folder, read_peft
from infer.errors import AdapterFormatError


def read_adapter(path: str | Path, config: dict[str, Any] | None = None) -> LoraAdapter:
    """The adapter at ``path``: a PEFT folder, or a GGUF adapter file
    (``config``: the base model's config.json, which a GGUF adapter is checked against).

    Raises:
        AdapterFormatError: ``path`` is neither, or is malformed.
        UnsupportedAdapterError: it uses what infer does not run (the message names it).
    """
    p = Path(path)
    if is_peft_folder(p):
        return read_peft(p)
    if p.is_file() and p.suffix == ".gguf":
        from infer.adapters.gguf import read_gguf_adapter

        return read_gguf_adapter(p, config)
    if not p.exists():
        raise AdapterFormatError(f"adapter {p}: no such file or folder")
    raise AdapterFormatError(f"adapter {p}: neither a PEFT folder (with adapter_config.json) nor a .gguf adapter")


__all__ = ["LoraAdapter", "LoraModule", "read_adapter", "read_peft"]
