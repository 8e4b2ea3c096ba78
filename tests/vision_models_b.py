"""Tiny random Qwen3.5 (dense, MoE) and Idefics3 / SmolVLM vision-language folders, and their transformers references.

The recipe is tests/vision_models.py's, for these families:

1. a tokenizer: the tiny BPE of tests/reference.py plus the family's image
   tokens as special tokens (their ids become the config's token ids);
2. the model config with tiny text and vision parts, the image processor
   set small alike (Qwen: 4-pixel patches within 32 x 32 pixels; Idefics3:
   16-pixel tiles of 4-pixel patches, images scaled to 48 pixels: up to 3 x 3
   tiles and the global image);
3. ``from_config`` in float32, every weight re-randomized
   (:func:`reference._randomize`'s rules for the language model, the vision
   parts' below);
4. ``save_pretrained`` of the model, the image processor and the tokenizer
   (the processors themselves are not saved: transformers' ``Qwen3VLProcessor``
   and ``SmolVLMProcessor`` need torchvision's video processors to be built;
   infer reads ``preprocessor_config.json`` and the tokenizer, as from a
   downloaded checkpoint).

The reference inputs are made the way the transformers processors make them:
the image processor's ``pixel_values``, and the prompt's placeholder expanded
to the family's text (Qwen: ``<|image_pad|>`` times the image's tokens;
Idefics3: transformers' ``get_image_prompt_string``) before tokenizing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reference import _build_dir, _randomize, cache_root, tiny_tokenizer_json

VISION_B_VERSION = "2"

#: Qwen3.5's chat template's image part, as its tokenizer_config.json renders ``{"type": "image"}``.
QWEN_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: SmolVLM's: ``User:<image>text<end_of_utterance>``.
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

QWEN_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=3,
                 layer_types=["linear_attention", "full_attention"], max_position_embeddings=512,
                 # Half of each head rotates: 4 frequencies, dealt time, height, width, time.
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                  "mrope_section": [2, 1, 1], "mrope_interleaved": True})
#: Qwen3.5-MoE's language model: every MLP 4 experts of 24, top-2, a shared expert of 32.
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32)
QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                   num_position_embeddings=16, spatial_merge_size=2, temporal_patch_size=2)
QWEN_PROCESSOR = dict(patch_size=4, merge_size=2, temporal_patch_size=2,
                      size={"shortest_edge": 8 * 8, "longest_edge": 32 * 32})

IDEFICS3_TEXT = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
IDEFICS3_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       image_size=16, patch_size=4)
IDEFICS3_PROCESSOR = dict(size={"longest_edge": 48}, max_image_size={"longest_edge": 16})
ROW_COL = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]


def _tokenizer(specials: list[str]) -> tuple[Any, dict[str, int]]:
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(tiny_tokenizer_json())
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok, {s: tok.token_to_id(s) for s in specials}


def _fast(tok: Any, eos: str, template: str, extra: dict[str, str]) -> Any:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, unk_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", extra_special_tokens=extra)
    fast.chat_template = template
    return fast


def _randomize_vision(model: Any, parts: tuple[str, ...]) -> None:
    """The language model by reference._randomize's rules; the vision parts: LayerNorm weights ~1,
    biases ~0.1, learned positions ~0.5, matrices and kernels ~1/sqrt(fan-in)."""
    import torch

    class Text:  # the model without its vision parameters, under its text config
        config = getattr(model.config, "text_config", model.config)

        @staticmethod
        def named_parameters() -> list[Any]:
            return [(n, p) for n, p in model.named_parameters() if not any(v in n for v in parts)]

        @staticmethod
        def named_buffers() -> Any:
            return model.named_buffers()

    _randomize(Text)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not any(v in name for v in parts):
                continue
            if name.endswith(("norm1.weight", "norm2.weight", "norm.weight", "layer_norm1.weight",
                              "layer_norm2.weight", "post_layernorm.weight")):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
            elif name.endswith(("pos_embed.weight", "position_embedding.weight")):
                param.copy_(0.5 * torch.randn_like(param))
            elif param.dim() >= 2:
                param.copy_(torch.randn_like(param) / param[0].numel() ** 0.5)
            else:
                raise RuntimeError(f"tiny VLM: no init rule for parameter {name} {tuple(param.shape)}")


def _build_qwen3_5(out: Path, moe: bool = False, attention_only: bool = False) -> None:
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if moe:
        from transformers import Qwen3_5MoeConfig as Config
        from transformers import Qwen3_5MoeForConditionalGeneration as Model
    else:
        from transformers import Qwen3_5Config as Config
        from transformers import Qwen3_5ForConditionalGeneration as Model
    tok, ids = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    eos = tok.token_to_id("<|im_end|>")
    text = dict(QWEN_TEXT, **(QWEN_MOE if moe else {}))
    if attention_only:  # no DeltaNet layer: no recurrent state, so the contiguous captured step serves it
        text["layer_types"] = ["full_attention"] * text["num_hidden_layers"]
    config = Config(
        text_config=dict(text, vocab_size=tok.get_vocab_size(), eos_token_id=eos, pad_token_id=0),
        vision_config=QWEN_VISION, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(3 if moe else 0)
    model = Model(config).to(torch.float32).eval()
    _randomize_vision(model, ("visual.",))
    model.generation_config.eos_token_id = eos
    model.save_pretrained(out, safe_serialization=True)
    Qwen2VLImageProcessorPil(**QWEN_PROCESSOR).save_pretrained(out)
    _fast(tok, "<|im_end|>", QWEN_TEMPLATE,
          {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_start_token": "<|vision_start|>",
           "vision_end_token": "<|vision_end|>"}).save_pretrained(out)


def _build_idefics3(out: Path, family: str) -> None:
    import torch

    tok, ids = _tokenizer(["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>", *ROW_COL])
    eos = ids["<end_of_utterance>"]
    text = dict(IDEFICS3_TEXT, vocab_size=tok.get_vocab_size(), eos_token_id=eos, pad_token_id=0, bos_token_id=None)
    if family == "idefics3":
        from transformers import Idefics3Config as Config
        from transformers import Idefics3ForConditionalGeneration as Model
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil as Images
    else:
        from transformers import SmolVLMConfig as Config
        from transformers import SmolVLMForConditionalGeneration as Model
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as Images
    # SmolVLM's: text_config says tied, the top level (what transformers reads) untied: the head is its own.
    text["tie_word_embeddings"] = family == "smolvlm"
    config = Config(text_config=text, vision_config=IDEFICS3_VISION, scale_factor=2,
                    image_token_id=ids["<image>"], pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(1 if family == "idefics3" else 2)
    model = Model(config).to(torch.float32).eval()
    _randomize_vision(model, ("vision_model.", "connector."))
    model.generation_config.eos_token_id = eos
    model.save_pretrained(out, safe_serialization=True)
    Images(**IDEFICS3_PROCESSOR).save_pretrained(out)
    _fast(tok, "<end_of_utterance>", IDEFICS3_TEMPLATE,
          {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
           "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}).save_pretrained(out)


BUILDERS = {"qwen3_5": _build_qwen3_5, "qwen3_5_moe": lambda out: _build_qwen3_5(out, moe=True),
            "qwen3_5_attention": lambda out: _build_qwen3_5(out, attention_only=True),
            "idefics3": lambda out: _build_idefics3(out, "idefics3"),
            "smolvlm": lambda out: _build_idefics3(out, "smolvlm")}


def vlm_dir(name: str) -> Path:
    """The folder of tiny vision-language model ``name`` (a key of :data:`BUILDERS`), built on first use."""
    return _build_dir(cache_root() / f"tiny-vlm-b-v{VISION_B_VERSION}" / name, BUILDERS[name])


def reference_inputs(folder: Path, text: str, images: list[Any]) -> dict[str, Any]:
    """What transformers' processor gives for ``text`` with ``images`` (each
    placeholder expanded), built from the folder's image processor and tokenizer."""
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer

    config = _config(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    out: dict[str, Any] = {}
    if config["model_type"] in ("qwen3_5", "qwen3_5_moe"):
        if images:
            got = processor(images=images, return_tensors="pt")
            out.update(pixel_values=got["pixel_values"], image_grid_thw=got["image_grid_thw"])
            pieces = text.split("<|image_pad|>")
            counts = [int(g.prod()) // processor.merge_size ** 2 for g in got["image_grid_thw"]]
            text = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:]))
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        out["mm_token_type_ids"] = (ids == config["image_token_id"]).int()
    else:
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        if images:
            got = processor(images=[images], return_tensors="pt", return_row_col_info=True)
            out.update(pixel_values=got["pixel_values"], pixel_attention_mask=got["pixel_attention_mask"])
            vision = config["vision_config"]
            seq = (vision["image_size"] // vision["patch_size"]) ** 2 // config["scale_factor"] ** 2
            pieces = text.split("<image>")
            text = pieces[0] + "".join(
                get_image_prompt_string(r, c, seq, fake_token_around_image="<fake_token_around_image>",
                                        image_token="<image>", global_image_token="<global-img>") + rest
                for r, c, rest in zip(got["rows"][0], got["cols"][0], pieces[1:]))
        ids = torch.tensor([tokenizer(text)["input_ids"]])
    out["input_ids"] = ids
    out["attention_mask"] = torch.ones_like(ids)
    return out


def reference_model(folder: Path) -> Any:
    import torch
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


def _config(folder: Path) -> dict[str, Any]:
    import json

    return json.loads((folder / "config.json").read_text())
