"""Tiny PEFT LoRA adapters on the tiny reference models, and PEFT's own logits.

How the adapter tests build an adapter, in one function anyone can reuse:

    path = build_peft_adapter(tiny_model_dir("llama3"), tmp / "a", r=4, lora_alpha=8, seed=1)

It loads the base folder with transformers (float32), wraps it with PEFT's
``get_peft_model(LoraConfig(...))`` (every ``LoraConfig`` field is a keyword:
``target_modules`` a list or a regex, ``use_rslora``, ``rank_pattern``,
``alpha_pattern``, ``modules_to_save``, ``fan_in_fan_out`` for GPT-2's
Conv1D), redraws every LoRA factor (PEFT starts B at zero, which would make
any adapter equal the base model), and saves the folder with
``save_pretrained``: ``adapter_config.json`` + ``adapter_model.safetensors``.

The factors: ``A ~ N(0, 1/in)`` (as PEFT's Kaiming init scales it) and
``B ~ N(0, 0.5 / r)``, so that a scale-2 adapter moves the logits by about as
much as the base model's own spread (a test that ignored the adapter, or a
wrong scale, fails by far), and a saved module (``modules_to_save``) is
redrawn as the base recipe draws it.

:func:`peft_logits` runs PEFT: every row's logits of ``ids`` with the named
adapters loaded onto the base model (``PeftModel.from_pretrained`` +
``load_adapter``), one ``adapter_names`` entry per row of a batch
(``"__base__"``: the base model), as PEFT's mixed-batch inference does. The
base model is loaded once per process and unwrapped (``unload()``) after each use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

#: The seven projections of a Llama-style decoder layer.
ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_BASES: dict[str, Any] = {}


def _base(base_dir: Path | str) -> Any:
    """The transformers model of ``base_dir``, loaded once per process: PEFT wraps it in
    place, and each user hands it back unwrapped (``unload()``), so it stays the base."""
    from reference import load_reference_model

    key = str(base_dir)
    if key not in _BASES:
        _BASES[key] = load_reference_model(base_dir)
    return _BASES.pop(key)


def _give_back(base_dir: Path | str, model: Any) -> None:
    """Keep ``model``'s base for the next use, unwrapped; not one whose modules an adapter
    replaced (``modules_to_save``): unwrapping might leave the adapter's copies in place."""
    if not any(getattr(c, "modules_to_save", None) for c in model.peft_config.values()):
        _BASES[str(base_dir)] = model.unload()


def build_peft_adapter(base_dir: Path | str, out: Path | str, *, r: int = 4, lora_alpha: float = 8,
                       target_modules: Any = ALL_SEVEN, seed: int = 0, **config: Any) -> Path:
    """A PEFT LoRA folder at ``out`` for the model in ``base_dir`` (see the
    module docstring); ``config``: any other ``LoraConfig`` field."""
    import peft
    import torch

    out = Path(out)
    base = _base(base_dir)
    lora = peft.LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules)
                           if isinstance(target_modules, (list, tuple)) else target_modules,
                           lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **config)
    model = peft.get_peft_model(base, lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if ".lora_A." in name:  # [r, in]
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            elif ".lora_B." in name:  # [out, r]
                param.copy_(torch.randn(param.shape, generator=gen) * (0.5 / param.shape[1]) ** 0.5)
            elif ".modules_to_save." in name:  # a whole embedding or head, redrawn like the base's
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    model.save_pretrained(str(out), safe_serialization=True)
    _give_back(base_dir, model)
    return out


_PEFT_LOGITS: dict[Any, np.ndarray] = {}


def peft_logits(base_dir: Path | str, adapters: dict[str, Path], ids: list[list[int]],
                names: list[str] | None = None) -> np.ndarray:
    """PEFT's float32 logits ``[rows, len, vocab]`` for equal-length rows ``ids``,
    row ``i`` under adapter ``names[i]`` (``"__base__"``: none; ``names``
    None: the first adapter for every row). Kept per process (the backends'
    tests compare with the same reference)."""
    key = (str(base_dir), tuple((k, str(v)) for k, v in adapters.items()), tuple(map(tuple, ids)),
           None if names is None else tuple(names))
    if key not in _PEFT_LOGITS:
        _PEFT_LOGITS[key] = _peft_logits(base_dir, adapters, ids, names)
    return _PEFT_LOGITS[key]


def _peft_logits(base_dir: Path | str, adapters: dict[str, Path], ids: list[list[int]],
                 names: list[str] | None = None) -> np.ndarray:
    import peft
    import torch

    items = list(adapters.items())
    model = peft.PeftModel.from_pretrained(_base(base_dir), str(items[0][1]), adapter_name=items[0][0])
    try:
        for name, path in items[1:]:
            model.load_adapter(str(path), adapter_name=name)
        model.eval()
        x = torch.tensor(ids)
        with torch.no_grad():
            if names is None:
                return model(input_ids=x).logits.numpy()
            return model(input_ids=x, adapter_names=list(names)).logits.numpy()
    finally:
        _give_back(base_dir, model)


def peft_greedy(base_dir: Path | str, adapter: Path, ids: list[int], max_new_tokens: int) -> list[int]:
    """PEFT's greedy continuation of ``ids`` under ``adapter``."""
    import peft
    import torch

    model = peft.PeftModel.from_pretrained(_base(base_dir), str(adapter)).eval()
    try:
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist()
    finally:
        _give_back(base_dir, model)
