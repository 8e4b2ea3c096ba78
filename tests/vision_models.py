"""Tiny random vision-language models, built the way transformers' own users build them.

Each folder is what ``save_pretrained`` of a transformers model *and* its
processor writes (config.json, model.safetensors, preprocessor_config.json /
processor_config.json, tokenizer.json, tokenizer_config.json, chat template),
so ``infer.load(folder)`` reads it as it reads a downloaded checkpoint, and
``transformers.AutoProcessor.from_pretrained(folder)`` gives the reference
``input_ids`` and ``pixel_values``. The recipe, for any family:

1. a tokenizer: the tiny BPE of tests/reference.py plus the family's image
   tokens as special tokens (their ids become the config's token ids);
2. the model config with tiny text and vision parts; the image size goes
   small through ``vision_config.image_size`` *and* the image processor's
   ``size`` (so one image is a few dozen patches);
3. ``from_config`` in float32, then every weight re-randomized
   (:func:`reference._randomize` plus the vision parts' rules below: Gemma 3's
   projector starts at zero, which would make the image invisible);
4. ``model.save_pretrained(folder)`` and ``processor.save_pretrained(folder)``.

Built once per content under ~/.cache/infer-tests (tests/reference.py's cache).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from reference import CHATML_TEMPLATE, _build_dir, _randomize, cache_root, tiny_tokenizer_json

VISION_VERSION = "1"

#: A chat template that renders image parts as Gemma 3's does ({"type": "image"} -> <start_of_image>).
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

#: LLaVA's: each image part is an <image>, text parts follow.
LLAVA_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=32,
              patch_size=4)


def _tokenizer(specials: list[str]) -> tuple[Any, dict[str, int]]:
    """The tiny BPE with ``specials`` added; their ids."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(tiny_tokenizer_json())
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok, {s: tok.token_to_id(s) for s in specials}


def _randomize_vlm(model: Any) -> None:
    """Every weight redrawn: reference._randomize's rules for the language model, and for the
    tower and projector: LayerNorm weights ~1, biases ~0.1, matrices ~1/sqrt(fan-in), position
    and class embeddings ~0.5, Gemma's ``1 + w`` norm w ~0.1 (its projector starts at zero)."""
    import torch

    vision = ("vision_tower", "multi_modal_projector")
    _randomize(_Only(model, vision))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not any(v in name for v in vision):
                continue
            if name.endswith("mm_input_projection_weight"):  # [vision, text], applied as x @ W
                param.copy_(torch.randn_like(param) / param.shape[0] ** 0.5)
            elif name.endswith("mm_soft_emb_norm.weight"):
                param.copy_(0.1 * torch.randn_like(param))
            elif name.endswith(("norm1.weight", "norm2.weight", "layernorm.weight", "layrnorm.weight")):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
            elif name.endswith(("position_embedding.weight", "class_embedding")):
                param.copy_(0.5 * torch.randn_like(param))
            elif param.dim() >= 2:  # [out, in] and the patch kernel [out, 3, p, p]
                param.copy_(torch.randn_like(param) / param[0].numel() ** 0.5)
            else:
                raise RuntimeError(f"tiny VLM: no init rule for parameter {name} {tuple(param.shape)}")


class _Only:
    """A model seen without its vision parameters, under its text config (for reference._randomize)."""

    def __init__(self, model: Any, exclude: tuple[str, ...]) -> None:
        self.model, self.exclude = model, exclude
        self.config = getattr(model.config, "text_config", model.config)

    def named_parameters(self) -> Any:
        return [(n, p) for n, p in self.model.named_parameters() if not any(e in n for e in self.exclude)]

    def named_buffers(self) -> Any:
        return self.model.named_buffers()


def _write_tokenizer(out: Path, tok: Any, bos: str, eos: str, template: str, extra: dict[str, str]) -> Any:
    """tokenizer.json + tokenizer_config.json through transformers (what a processor's tokenizer saves)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", extra_special_tokens=extra)
    fast.chat_template = template
    return fast


def _build_gemma3(out: Path) -> None:
    import torch
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil,
                              Gemma3Processor)

    tok, ids = _tokenizer(["<bos>", "<eos>", "<start_of_image>", "<end_of_image>", "<image_soft_token>",
                           "<start_of_turn>", "<end_of_turn>"])
    vocab = tok.get_vocab_size()
    config = Gemma3Config(
        text_config=dict(TEXT, vocab_size=vocab, sliding_window=8, query_pre_attn_scalar=16,
                         layer_types=["sliding_attention", "full_attention"], rope_parameters={
                             "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                         bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=0),
        vision_config=dict(VISION, model_type="siglip_vision_model", vision_use_head=False),
        mm_tokens_per_image=16, boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"], bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    _randomize_vlm(model)
    model.save_pretrained(out, safe_serialization=True)
    fast = _write_tokenizer(out, tok, "<bos>", "<eos>", GEMMA3_TEMPLATE,
                            {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                             "eoi_token": "<end_of_image>"})
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
                                tokenizer=fast, image_seq_length=16, chat_template=GEMMA3_TEMPLATE)
    processor.save_pretrained(out)


def _build_llava(out: Path, tower: str) -> None:
    import torch
    from transformers import (CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor,
                              SiglipImageProcessorPil)

    tok, ids = _tokenizer(["<image>"])
    vocab = tok.get_vocab_size()
    clip = tower == "clip"
    vision = dict(VISION, model_type="clip_vision_model", hidden_act="quick_gelu", projection_dim=32) if clip \
        else dict(VISION, model_type="siglip_vision_model", vision_use_head=False)
    config = LlavaConfig(
        text_config=dict(TEXT, model_type="llama", vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=vision, image_token_index=ids["<image>"], projector_hidden_act="gelu",
        vision_feature_layer=-2 if clip else [-1, -3],
        vision_feature_select_strategy="default" if clip else "full",
        image_seq_length=64 if not clip else 64,
    )
    torch.manual_seed(1)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    _randomize_vlm(model)
    model.save_pretrained(out, safe_serialization=True)
    fast = _write_tokenizer(out, tok, "<|im_start|>", "<|im_end|>", LLAVA_TEMPLATE, {"image_token": "<image>"})
    if clip:
        images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    else:
        images = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=images, tokenizer=fast, patch_size=4,
                               vision_feature_select_strategy=config.vision_feature_select_strategy,
                               num_additional_image_tokens=1 if clip else 0, chat_template=LLAVA_TEMPLATE)
    processor.save_pretrained(out)


BUILDERS = {"gemma3": _build_gemma3, "llava_clip": lambda out: _build_llava(out, "clip"),
            "llava_siglip": lambda out: _build_llava(out, "siglip")}


def vlm_dir(name: str) -> Path:
    """The folder of tiny vision-language model ``name`` (a key of :data:`BUILDERS`), built on first use."""
    return _build_dir(cache_root() / f"tiny-vlm-v{VISION_VERSION}" / name, BUILDERS[name])


def synthetic_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Any:
    """A PIL image of random pixels (so every pixel and channel matters)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(data[:, :, 0] if channels == 1 else data, mode)


def reference_inputs(folder: Path, text: str, images: list[Any]) -> dict[str, Any]:
    """The transformers processor's ``input_ids`` and ``pixel_values`` (and the rest) for ``text``."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    return processor(text=text, images=images or None, return_tensors="pt")


def reference_model(folder: Path) -> Any:
    import torch
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


def config_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


_ = CHATML_TEMPLATE
