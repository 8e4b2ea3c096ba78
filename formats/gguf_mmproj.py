"""llama.cpp's vision pairs: a text GGUF and its ``mmproj`` GGUF, read as one vision-language model.

llama.cpp keeps a vision-language model in two files. The text GGUF is the
language model alone (``general.architecture`` ``gemma3``, ``llama``...) and
loads as its text family. The mmproj file (``general.architecture = clip``,
``general.type = mmproj``) holds the vision tower and the projector: keys
``clip.projector_type``, ``clip.vision.*`` and tensors ``v.*`` (the tower,
``v.blk.N.*`` per layer) and ``mm.*`` (the projector), named as llama.cpp's
converter (``MmprojModel`` and its subclasses) and ``tools/mtmd/clip.cpp``
name them. :func:`pair_package` (through the GGUF format's ``open_pair``)
reads the two as the Hugging Face vision-language checkpoint they came from:
the ``config.json`` of the family (``gemma3``, ``llava``, ``idefics3``,
``qwen3_5``) with ``text_config`` from the text file and ``vision_config``
from the mmproj keys, and every tensor under its Hugging Face name, so the
architectures load a pair as they load a folder.

The projector types read (``clip.projector_type`` -> ``model_type``):

* ``gemma3`` -> ``gemma3``: a SigLIP tower, average pool by
  ``clip.vision.projector.scale_factor`` (default 4), ``mm.soft_emb_norm``
  (stored as ``1 + w``, as llama.cpp's converter writes Gemma's norms: 1 is
  subtracted in float32 on reading) and ``mm.input_projection`` (``[vision,
  text]``, as the checkpoint's ``mm_input_projection_weight``).
* ``mlp`` -> ``llava``: a CLIP tower (``v.class_embd``, ``v.pre_ln``) or a
  SigLIP one (neither), features after the layers of
  ``clip.vision.feature_layer`` (non-negative ``hidden_states`` indices; unset:
  the layer before the file's last, as clip.cpp's LLaVA graph), CLIP's class
  row dropped, ``mm.0`` / ``mm.2`` the two linears around a GELU.
* ``idefics3`` -> ``idefics3``: a SigLIP tile encoder, pixel shuffle by
  ``clip.vision.projector.scale_factor``, ``mm.model.fc`` (no bias).
* ``qwen3vl_merger`` -> ``qwen3_5`` (``qwen3_5_moe``): Qwen's ViT (:func:`_read_qwen`),
  M-RoPE's sections from the text file.

The layouts are Hugging Face's: the patch kernel ``[hidden, 3, p, p]`` as the
convolution stores it, every matrix ``[out, in]``. Files from llama.cpp's
older converters named the tower's MLP the other way round (``ffn_down`` for
``fc1``); clip.cpp swaps them back by their shapes, and so does this reader.

Activation: ``clip.use_gelu`` is GELU (SigLIP's tanh form; for a CLIP tower,
as llama.cpp's LLaVA converter set it, ``hidden_act == "gelu"``), else CLIP's
quick-GELU. The LLaVA projector's activation is GELU (clip.cpp has no other).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from infer.errors import MmprojError, MmprojMismatchError, UnknownProjectorError
from infer.package import ModelPackage, TensorSource

from .gguf_file import GGUFFile, TensorInfo, read_gguf

#: ``clip.projector_type`` -> the Hugging Face ``model_type`` of the pair (Qwen3.5's: by its text model).
PROJECTORS = {"gemma3": "gemma3", "mlp": "llava", "idefics3": "idefics3", "qwen3vl_merger": "qwen3_5"}
#: The text families each projector feeds (the text GGUF's ``model_type``).
TEXT_FAMILIES = {"gemma3": ("gemma3_text",), "mlp": ("llama", "mistral", "qwen2", "qwen3", "gemma3_text"),
                 "idefics3": ("llama", "mistral", "qwen2"), "qwen3vl_merger": ("qwen3_5_text", "qwen3_5_moe_text")}
#: Where each family's checkpoint keeps its language model, tower and projector.
PREFIXES = {"gemma3": ("model.language_model.", "model.vision_tower.vision_model.", "model.multi_modal_projector."),
            "mlp": ("model.language_model.", "model.vision_tower.vision_model.", "model.multi_modal_projector."),
            "idefics3": ("model.text_model.", "model.vision_model.", "model.connector."),
            "qwen3vl_merger": ("model.language_model.", "model.visual.", "model.visual.merger.")}

#: The tower's tensors: GGUF name -> Hugging Face name under the tower's prefix.
TOWER = {"v.patch_embd.weight": "embeddings.patch_embedding.weight",
         "v.patch_embd.bias": "embeddings.patch_embedding.bias",
         "v.position_embd.weight": "embeddings.position_embedding.weight",
         "v.class_embd": "embeddings.class_embedding",
         "v.pre_ln.weight": "pre_layrnorm.weight", "v.pre_ln.bias": "pre_layrnorm.bias",
         "v.post_ln.weight": "post_layernorm.weight", "v.post_ln.bias": "post_layernorm.bias"}
#: One encoder layer's tensors: ``v.blk.N.<key>.{weight,bias}`` -> ``encoder.layers.N.<value>``.
BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
         "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
#: The projector's tensors per projector type: GGUF name -> name under the projector's prefix.
PROJECTOR = {"gemma3": {"mm.input_projection.weight": "mm_input_projection_weight",
                        "mm.soft_emb_norm.weight": "mm_soft_emb_norm.weight"},
             "mlp": {"mm.0.weight": "linear_1.weight", "mm.0.bias": "linear_1.bias",
                     "mm.2.weight": "linear_2.weight", "mm.2.bias": "linear_2.bias"},
             "idefics3": {"mm.model.fc.weight": "modality_projection.proj.weight"}}
#: Tensors stored as ``1 + w`` (Gemma's norm), by GGUF name.
PLUS_ONE = frozenset({"mm.soft_emb_norm.weight"})
#: Qwen3.5's tower (Qwen3-VL's ViT, llama.cpp's ``Qwen3VLVisionModel``): GGUF name -> name under ``model.visual.``;
#: the two-frame patch kernel is stored as two frames (``v.patch_embd.weight`` and ``.weight.1``).
QWEN_TOWER = {"v.patch_embd.bias": "patch_embed.proj.bias", "v.position_embd.weight": "pos_embed.weight",
              "v.post_ln.weight": "merger.norm.weight", "v.post_ln.bias": "merger.norm.bias",
              "mm.0.weight": "merger.linear_fc1.weight", "mm.0.bias": "merger.linear_fc1.bias",
              "mm.2.weight": "merger.linear_fc2.weight", "mm.2.bias": "merger.linear_fc2.bias"}
QWEN_BLOCK = {"attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2",
              "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}

#: The placeholder tokens each family's prompts hold, by config key (looked up in the text file's vocabulary).
IMAGE_TOKENS = {"gemma3": {"image_token_index": "<image_soft_token>", "boi_token_index": "<start_of_image>",
                           "eoi_token_index": "<end_of_image>"},
                "mlp": {"image_token_index": "<image>"},
                "idefics3": {"image_token_id": "<image>"},
                "qwen3vl_merger": {"image_token_id": "<|image_pad|>", "vision_start_token_id": "<|vision_start|>",
                                   "vision_end_token_id": "<|vision_end|>"}}

_BLOCK_NAME = re.compile(r"v\.blk\.(0|[1-9][0-9]*)\.([a-z0-9_]+)\.(weight|bias)")


def is_mmproj(file: GGUFFile) -> bool:
    """Whether ``file`` is a vision projector (``general.architecture = clip``)."""
    return file.metadata.get("general.architecture") == "clip"


def _float(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (0.48145466, not 0.4814546597...)."""
    return float(str(np.float32(value)))


@dataclass
class Mmproj:
    """An mmproj file read: the family, its config.json parts and the tensors under Hugging Face names."""

    projector: str
    #: ``vision_config`` (transformers' names).
    vision_config: dict[str, Any]
    #: The family's other config.json keys the file gives (feature layers, tokens per image...).
    config: dict[str, Any]
    #: preprocessor_config.json's keys the file gives (mean, std, sizes).
    preprocessor: dict[str, Any]
    #: Hugging Face name -> (tensor info, value subtracted after reading).
    tensors: dict[str, tuple[TensorInfo, float]] = field(default_factory=dict)
    #: Hugging Face name -> (its GGUF tensors, the function of their float32 values that gives it).
    rebuilt: dict[str, tuple[tuple[TensorInfo, ...], Any]] = field(default_factory=dict)
    #: The width of the projector's output rows (the text model's hidden size it was made for).
    output_width: int = 0
    #: ``clip.vision.projection_dim`` where the file gives it (llama.cpp's converter: the text hidden size).
    projection_dim: int | None = None


def read_mmproj(file: GGUFFile) -> Mmproj:
    """The vision side in ``file`` (an mmproj GGUF), under Hugging Face names and keys.

    Raises:
        MmprojError: not an mmproj file, or a key or tensor it needs is missing.
        UnknownProjectorError: ``clip.projector_type`` is not one infer reads.
    """
    md, path = file.metadata, file.path
    if not is_mmproj(file):
        raise MmprojError(f"{path} is not an mmproj file: general.architecture is "
                          f"{md.get('general.architecture')!r}, not 'clip'")
    kind = md.get("clip.projector_type", md.get("clip.vision.projector_type"))
    if kind not in PROJECTORS:
        raise UnknownProjectorError(f"{path}: clip.projector_type {kind!r} is not one infer reads; supported: "
                                    f"{', '.join(f'{k} ({v})' for k, v in PROJECTORS.items())}")
    if md.get("clip.has_vision_encoder") is False:
        raise MmprojError(f"{path}: the file has no vision encoder (clip.has_vision_encoder is false)")

    def need(key: str) -> Any:
        if key not in md:
            raise MmprojError(f"{path}: key {key!r} is missing; an mmproj file of projector {kind!r} needs it")
        return md[key]

    if kind == "qwen3vl_merger":
        return _read_qwen(file, need)
    _, tower, projector = PREFIXES[kind]
    tensors: dict[str, tuple[TensorInfo, float]] = {}
    unknown = []
    for info in file.tensors.values():
        block = _BLOCK_NAME.fullmatch(info.name)
        if info.name in TOWER:
            tensors[tower + TOWER[info.name]] = (info, 0.0)
        elif block is not None and block[2] in BLOCK:
            tensors[f"{tower}encoder.layers.{block[1]}.{BLOCK[block[2]]}.{block[3]}"] = (info, 0.0)
        elif info.name in PROJECTOR[kind]:
            tensors[projector + PROJECTOR[kind][info.name]] = (info, 1.0 if info.name in PLUS_ONE else 0.0)
        else:
            unknown.append(info.name)
    if unknown:
        raise MmprojError(f"{path}: tensors infer does not read for projector {kind!r}: {', '.join(unknown[:8])}"
                          f"{' ...' if len(unknown) > 8 else ''}")
    hidden = int(need("clip.vision.embedding_length"))
    layers = int(need("clip.vision.block_count"))
    _swap_legacy_mlp(tensors, tower, layers, hidden)
    clip = "v.class_embd" in file.tensors
    gelu = bool(md.get("clip.use_gelu", False))
    if md.get("clip.use_silu"):
        raise MmprojError(f"{path}: clip.use_silu is set; the towers infer reads use GELU or quick-GELU")
    vision = {
        "model_type": "clip_vision_model" if clip else "siglip_vision_model",
        "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": int(need("clip.vision.feed_forward_length")),
        "num_attention_heads": int(need("clip.vision.attention.head_count")),
        "image_size": int(need("clip.vision.image_size")), "patch_size": int(need("clip.vision.patch_size")),
        "layer_norm_eps": _float(md.get("clip.vision.attention.layer_norm_epsilon", 1e-5 if clip else 1e-6)),
        "hidden_act": ("gelu" if gelu else "quick_gelu") if clip else "gelu_pytorch_tanh",
    }
    # A SigLIP tower is GELU (tanh) whatever the flag says: llama.cpp's legacy LLaVA converter set use_gelu
    # only for hidden_act "gelu", so its SigLIP files say quick-GELU, which no SigLIP checkpoint computes.
    if not clip and not gelu and kind != "mlp":
        raise MmprojError(f"{path}: a SigLIP tower with quick-GELU (clip.use_gelu unset) is not one infer reads")
    mean = [_float(v) for v in need("clip.vision.image_mean")]
    std = [_float(v) for v in need("clip.vision.image_std")]
    out = Mmproj(kind, vision, {}, {"image_mean": mean, "image_std": std}, tensors)
    if md.get("clip.vision.projection_dim"):
        out.projection_dim = int(md["clip.vision.projection_dim"])
    side = vision["image_size"] // vision["patch_size"]
    scale = int(md.get("clip.vision.projector.scale_factor", 4 if kind == "gemma3" else 2))
    if kind == "gemma3":
        if scale <= 0 or side % scale:
            raise MmprojError(f"{path}: clip.vision.projector.scale_factor {scale} does not divide the {side} "
                              "patches per side")
        out.config["mm_tokens_per_image"] = (side // scale) ** 2
        out.output_width = _shape(file, "mm.input_projection.weight")[1]
    elif kind == "mlp":
        if "v.post_ln.weight" in file.tensors:
            raise MmprojError(f"{path}: a LLaVA projector file with v.post_ln: clip.cpp norms the last feature "
                              "layer with it, which no LLaVA checkpoint does; infer does not read such a file")
        chosen = [int(x) for x in md.get("clip.vision.feature_layer", [])] or [layers - 1]
        out.config["vision_feature_layer"] = chosen[0] if len(chosen) == 1 else chosen
        out.config["vision_feature_select_strategy"] = "default" if clip else "full"
        out.config["projector_hidden_act"] = "gelu"
        out.config["multimodal_projector_bias"] = "mm.0.bias" in file.tensors
        out.output_width = _shape(file, "mm.2.weight" if "mm.2.weight" in file.tensors else "mm.0.weight")[0]
        if clip:
            out.preprocessor.update(size={"shortest_edge": vision["image_size"]},
                                    crop_size={"height": vision["image_size"], "width": vision["image_size"]})
        else:
            out.preprocessor["size"] = {"height": vision["image_size"], "width": vision["image_size"]}
    else:
        out.config["scale_factor"] = scale
        out.output_width = _shape(file, "mm.model.fc.weight")[0]
        tile = int(md.get("clip.vision.preproc_image_size", vision["image_size"]))
        out.preprocessor.update(max_image_size={"longest_edge": vision["image_size"]},
                                size={"longest_edge": tile})
    return out


def _read_qwen(file: GGUFFile, need: Any) -> Mmproj:
    """Qwen3.5's vision side (``qwen3vl_merger``): the ViT with fused QKV, learned positions
    resampled to each image's grid (and 2D rotary, computed, not stored), the 2x2 merger
    (``v.post_ln``, ``mm.0``, GELU, ``mm.2``); deepstack layers (Qwen3-VL) are not read."""
    md, path, tower = file.metadata, file.path, PREFIXES["qwen3vl_merger"][1]
    tensors: dict[str, tuple[TensorInfo, float]] = {}
    unknown = []
    for info in file.tensors.values():
        block = _BLOCK_NAME.fullmatch(info.name)
        if info.name in QWEN_TOWER:
            tensors[tower + QWEN_TOWER[info.name]] = (info, 0.0)
        elif block is not None and block[2] in QWEN_BLOCK:
            tensors[f"{tower}blocks.{block[1]}.{QWEN_BLOCK[block[2]]}.{block[3]}"] = (info, 0.0)
        elif info.name not in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
            unknown.append(info.name)
    if unknown:
        raise MmprojError(f"{path}: tensors infer does not read for projector 'qwen3vl_merger': "
                          f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''} (deepstack layers are "
                          "Qwen3-VL's, which infer does not run)")
    frames = [file.tensors.get(n) for n in ("v.patch_embd.weight", "v.patch_embd.weight.1")]
    if frames[0] is None or frames[1] is None or frames[0].shape != frames[1].shape:
        raise MmprojError(f"{path}: Qwen's patch kernel needs v.patch_embd.weight and v.patch_embd.weight.1 of one "
                          "shape (its two frames)")
    hidden, layers = int(need("clip.vision.embedding_length")), int(need("clip.vision.block_count"))
    out_width = _shape(file, "mm.2.weight")[0]
    vision = {"model_type": "qwen3_5", "depth": layers, "hidden_size": hidden,
              "intermediate_size": int(need("clip.vision.feed_forward_length")),
              "num_heads": int(need("clip.vision.attention.head_count")),
              "patch_size": int(need("clip.vision.patch_size")), "in_channels": frames[0].shape[1],
              "spatial_merge_size": int(md.get("clip.vision.spatial_merge_size", 2)), "temporal_patch_size": 2,
              "out_hidden_size": out_width, "num_position_embeddings": _shape(file, "v.position_embd.weight")[0],
              "hidden_act": "gelu_pytorch_tanh" if md.get("clip.use_gelu", True) else "silu"}
    mean = [_float(v) for v in need("clip.vision.image_mean")]
    std = [_float(v) for v in need("clip.vision.image_std")]
    preprocessor: dict[str, Any] = {"image_mean": mean, "image_std": std, "patch_size": vision["patch_size"],
                                    "merge_size": vision["spatial_merge_size"], "temporal_patch_size": 2}
    size = {k: int(md[key]) for k, key in (("shortest_edge", "clip.vision.image_min_pixels"),
                                           ("longest_edge", "clip.vision.image_max_pixels")) if key in md}
    if size:
        preprocessor["size"] = size
    out = Mmproj("qwen3vl_merger", vision, {}, preprocessor, tensors, output_width=out_width)
    if md.get("clip.vision.projection_dim"):
        out.projection_dim = int(md["clip.vision.projection_dim"])
    out.rebuilt[tower + "patch_embed.proj.weight"] = (tuple(frames), lambda a, b: np.stack([a, b], axis=2))
    return out


def _shape(file: GGUFFile, name: str) -> tuple[int, ...]:
    info = file.tensors.get(name)
    if info is None:
        raise MmprojError(f"{file.path}: tensor {name!r} is missing")
    return info.shape


def _swap_legacy_mlp(tensors: dict[str, tuple[TensorInfo, float]], tower: str, layers: int, hidden: int) -> None:
    """Older converters stored ``fc1`` as ``ffn_down`` and ``fc2`` as ``ffn_up``: where
    ``fc2`` (``[hidden, intermediate]``) has the shape of an ``fc1``, swap them back (as clip.cpp does)."""
    for i in range(layers):
        base = f"{tower}encoder.layers.{i}.mlp."
        fc1, fc2 = tensors.get(base + "fc1.weight"), tensors.get(base + "fc2.weight")
        if fc1 is None or fc2 is None or fc2[0].shape[0] == hidden or fc2[0].shape == fc1[0].shape:
            continue
        for suffix in ("weight", "bias"):
            a, b = base + "fc1." + suffix, base + "fc2." + suffix
            if a in tensors and b in tensors:
                tensors[a], tensors[b] = tensors[b], tensors[a]


class JoinedTensorSource(TensorSource):
    """Tensors of several sources under new names: ``{name: (source, name in that source)}``."""

    def __init__(self, table: dict[str, tuple[TensorSource, str]]) -> None:
        self._table = table
        self._sources = list({id(s): s for s, _ in table.values()}.values())

    def _at(self, name: str) -> tuple[TensorSource, str]:
        try:
            return self._table[name]
        except KeyError:
            raise self._missing(name) from None

    def names(self) -> list[str]:
        return list(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def shape(self, name: str) -> tuple[int, ...]:
        source, inner = self._at(name)
        return source.shape(inner)

    def storage_dtype(self, name: str) -> str:
        source, inner = self._at(name)
        return source.storage_dtype(inner)

    def get(self, name: str) -> Any:
        source, inner = self._at(name)
        return source.get(inner)

    def stored_nbytes(self, name: str) -> int:
        source, inner = self._at(name)
        return source.stored_nbytes(inner)

    def location(self, name: str) -> str:
        entry = self._table.get(name)
        if entry is None:
            return " + ".join(s.location("") for s in self._sources)
        return entry[0].location(entry[1])

    def release(self, name: str) -> None:
        entry = self._table.get(name)
        if entry is not None:
            entry[0].release(entry[1])

    def close(self) -> None:
        for source in self._sources:
            source.close()


def pair_package(proj: Mmproj, vision: TensorSource, text: ModelPackage, model: Path, mmproj: Path) -> ModelPackage:
    """The text GGUF's package ``text`` and the mmproj file read as ``proj`` (its tensors
    ``vision``, under Hugging Face names) as one vision-language :class:`ModelPackage`
    (module docstring): ``model_type`` ``gemma3``, ``llava``, ``idefics3`` or ``qwen3_5``
    (``qwen3_5_moe``), the text model's weights under the family's language-model prefix.

    Raises:
        MmprojMismatchError: the projector's output width is not the text model's
            hidden size, the text family is not the projector's, or the text
            model's vocabulary lacks the family's image tokens.
    """
    config = _pair_config(proj, text, model, mmproj)
    lm = PREFIXES[proj.projector][0]
    table: dict[str, tuple[TensorSource, str]] = {}
    for name in text.tensors.names():
        table[lm + name[len("model."):] if name.startswith("model.") else name] = (text.tensors, name)
    for name in vision.names():
        table[name] = (vision, name)
    return ModelPackage(model_type=config["model_type"], config=config, tensors=JoinedTensorSource(table),
                        tokenizer=text.tokenizer, generation=text.generation, path=model, format="gguf",
                        preprocessor=proj.preprocessor)


def _mrope(text_config: dict[str, Any], model: Path) -> None:
    """Qwen3.5's text GGUF keeps M-RoPE's sections as ``{arch}.rope.dimension_sections``
    (llama.cpp's interleaved M-RoPE); a text model alone never needs them (its three
    position streams are equal), its vision pair does."""
    file = read_gguf(model)
    try:
        arch = file.metadata.get("general.architecture")
        sections = file.metadata.get(f"{arch}.rope.dimension_sections")
    finally:
        file.close()
    if sections is None:
        raise MmprojMismatchError(f"{model}: no {arch}.rope.dimension_sections, which images' M-RoPE positions need")
    rope = dict(text_config.get("rope_parameters") or {})
    rope.update(mrope_section=[int(x) for x in list(sections)[:3]], mrope_interleaved=True)
    text_config["rope_parameters"] = rope


def _pair_config(proj: Mmproj, text: ModelPackage, model: Path, mmproj: Path) -> dict[str, Any]:
    """The family's config.json from the two files, checked against each other."""
    text_config = dict(text.config)
    kind, family = proj.projector, text.model_type
    if family not in TEXT_FAMILIES[kind]:
        raise MmprojMismatchError(f"{mmproj} (projector {kind!r}) does not go with {model}, a {family!r} text model; "
                                  f"its projector feeds {', '.join(TEXT_FAMILIES[kind])}")
    hidden = int(text_config["hidden_size"])
    if proj.output_width != hidden:
        raise MmprojMismatchError(f"{mmproj}: its image embeddings are {proj.output_width} wide but {model}'s "
                                  f"hidden size is {hidden}: the files are not one model's")
    # (llama.cpp's legacy LLaVA converter wrote CLIP's own projection width there, so only the others say)
    if kind != "mlp" and proj.projection_dim is not None and proj.projection_dim != hidden:
        raise MmprojMismatchError(f"{mmproj}: clip.vision.projection_dim is {proj.projection_dim} but {model}'s "
                                  f"hidden size is {hidden}: the files are not one model's")
    text_config.setdefault("model_type", family)
    if kind == "qwen3vl_merger":  # M-RoPE: the streams' shares of the rotated pairs, from the text file
        _mrope(text_config, model)
    model_type = "qwen3_5_moe" if family == "qwen3_5_moe_text" else PROJECTORS[kind]
    config: dict[str, Any] = {"model_type": model_type, "text_config": text_config,
                              "vision_config": proj.vision_config, **proj.config,
                              "tie_word_embeddings": bool(text_config.get("tie_word_embeddings", False))}
    for key, token in IMAGE_TOKENS[kind].items():
        found = text.tokenizer.token_to_id(token) if text.tokenizer is not None else None
        if found is None:
            raise MmprojMismatchError(f"{model}: the vocabulary has no {token!r} token, which {kind!r} prompts use "
                                      "for images")
        config[key] = int(found)
    return config



# -- writing a pair -------------------------------------------------------------------------------------

#: Hugging Face ``model_type`` -> the projector type its mmproj file has.
WRITTEN = {"gemma3": "gemma3", "llava": "mlp", "idefics3": "idefics3", "smolvlm": "idefics3",
           "qwen3_5": "qwen3vl_merger", "qwen3_5_moe": "qwen3vl_merger"}
#: The towers' activations as ``clip.use_gelu`` says them (False: quick-GELU).
_USE_GELU = {"gelu_pytorch_tanh": True, "gelu_new": True, "gelu": True, "quick_gelu": False}
#: Embedding tensors llama.cpp's converter keeps in float32 whatever the file type.
_F32 = frozenset({"v.patch_embd.weight", "v.position_embd.weight", "v.class_embd"})


def _prefix(names: set[str], candidates: tuple[str, ...], member: str) -> str | None:
    return next((p for p in candidates if p + member in names), None)


def split_pair(package: ModelPackage) -> tuple[ModelPackage, str] | None:
    """A vision-language package as (its text model's package, the projector type of
    its mmproj file), or None for a package no mmproj file serves. The text package
    holds the language model's tensors under text names (``model.*``, ``lm_head.weight``)
    and ``text_config`` (with ``tie_word_embeddings`` from the top, where transformers reads it)."""
    kind = WRITTEN.get(package.model_type)
    text = package.config.get("text_config")
    if kind is None or not isinstance(text, dict):
        return None
    names = set(package.tensors.names())
    if kind == "qwen3vl_merger" and "model.visual.patch_embed.proj.weight" not in names:
        return None  # a text-only export of a Qwen3.5 folder: the text GGUF alone, as before
    lm = _prefix(names, ("model.language_model.", "language_model.model.", "model.text_model."), "embed_tokens.weight")
    if lm is None:
        raise MmprojError(f"{package.path}: no language model's embed_tokens.weight under a known prefix")
    head = next((h for h in ("lm_head.weight", "language_model.lm_head.weight") if h in names), None)
    table: dict[str, tuple[TensorSource, str]] = {}
    for name in package.tensors.names():
        if name.startswith(lm):
            table["model." + name[len(lm):]] = (package.tensors, name)
    if head is not None:
        table["lm_head.weight"] = (package.tensors, head)
    default_tie = kind == "gemma3"
    config = {**text, "model_type": text.get("model_type") or ("gemma3_text" if kind == "gemma3" else "llama"),
              "tie_word_embeddings": bool(package.config.get("tie_word_embeddings",
                                                             text.get("tie_word_embeddings", default_tie)))}
    return (ModelPackage(model_type=config["model_type"], config=config, tensors=JoinedTensorSource(table),
                         tokenizer=package.tokenizer, generation=package.generation, path=package.path,
                         format=package.format), kind)


def write_mmproj(package: ModelPackage, path: Path, *, type: str = "f16") -> None:
    """Write the vision tower and projector of the vision-language ``package``
    (``gemma3``, ``llava``, ``idefics3`` / ``smolvlm``) as llama.cpp's mmproj
    file ``path``: float32 throughout for ``type`` ``"f32"``, else float16
    matrices with float32 norms, biases and embeddings (the converter's choice).
    ``package.preprocessor`` gives the image mean and std (the folder's
    preprocessor_config.json over its processor's defaults).

    Raises:
        ConversionError: the model has a setting clip.cpp cannot express (an
            activation, feature selection or projector it does not have); the
            message names it.
    """
    from infer.errors import ConversionError

    try:
        _write_mmproj(package, path, type)
    except KeyError as exc:  # a config.json without a size the file must state
        raise ConversionError(f"{package.path}: config.json has no {exc} (vision_config or text_config), which "
                              "the mmproj file states") from None


def _write_mmproj(package: ModelPackage, path: Path, type: str) -> None:
    import gguf  # noqa: F401  (the writer's dependency, checked before any work)

    from infer.errors import ConversionError

    kind = WRITTEN[package.model_type]
    config, src = package.config, package.tensors
    vision, text = dict(config["vision_config"]), text_width(config)
    if kind == "qwen3vl_merger":
        md, plan = _qwen_plan(package, vision, text)
        _write_file(package, path, type, md, plan)
        return
    names = set(src.names())
    tower = _prefix(names, ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                            "vision_tower.", "model.vision_model."), "embeddings.patch_embedding.weight")
    projector = _prefix(names, ("model.multi_modal_projector.", "multi_modal_projector.", "model.connector."),
                        next(iter(PROJECTOR[kind].values())))
    if tower is None or projector is None:
        raise ConversionError(f"{package.path}: no vision tower or projector weights under the names a "
                              f"{package.model_type} checkpoint uses")
    act = vision.get("hidden_act", "gelu_pytorch_tanh")
    clip = vision.get("model_type") == "clip_vision_model"
    if act not in _USE_GELU or (not clip and not _USE_GELU[act]):
        raise ConversionError(f"{package.path}: vision_config.hidden_act {act!r} has no form in an mmproj file "
                              "(clip.cpp runs GELU or quick-GELU towers)")
    layers = int(vision["num_hidden_layers"])
    preprocessor = package.preprocessor or {}
    md: dict[str, Any] = {
        "general.type": "mmproj", "clip.projector_type": kind, "clip.has_vision_encoder": True,
        "clip.vision.projection_dim": text, "clip.vision.image_size": int(vision.get("image_size", 224)),
        "clip.vision.patch_size": int(vision.get("patch_size", 16)),
        "clip.vision.embedding_length": int(vision["hidden_size"]),
        "clip.vision.feed_forward_length": int(vision["intermediate_size"]),
        "clip.vision.attention.head_count": int(vision["num_attention_heads"]),
        "clip.vision.attention.layer_norm_epsilon": float(vision.get("layer_norm_eps", 1e-5 if clip else 1e-6)),
        "clip.use_gelu": _USE_GELU[act],
        "clip.vision.image_mean": np.asarray(preprocessor.get("image_mean", (0.5, 0.5, 0.5)), np.float32),
        "clip.vision.image_std": np.asarray(preprocessor.get("image_std", (0.5, 0.5, 0.5)), np.float32),
    }
    side = md["clip.vision.image_size"] // md["clip.vision.patch_size"]
    post_norm = True
    if kind == "gemma3":
        tokens = int(config.get("mm_tokens_per_image", 256))
        md["clip.vision.projector.scale_factor"] = side // int(round(tokens ** 0.5))
    elif kind == "idefics3":
        md["clip.vision.projector.scale_factor"] = int(config.get("scale_factor", 2))
        longest = (preprocessor.get("size") or {}).get("longest_edge")
        if longest:
            md["clip.vision.preproc_image_size"] = int(longest)
    else:
        chosen = config.get("vision_feature_layer", -2)
        chosen = [chosen] if isinstance(chosen, int) else list(chosen)
        chosen = [int(x) if x >= 0 else layers + 1 + int(x) for x in chosen]
        strategy = config.get("vision_feature_select_strategy", "default")
        if (strategy == "default") != clip:
            raise ConversionError(f"{package.path}: vision_feature_select_strategy {strategy!r} with a "
                                  f"{'CLIP' if clip else 'SigLIP'} tower has no form in an mmproj file (clip.cpp drops "
                                  "the first row exactly when the tower has a class token)")
        projector_act = config.get("projector_hidden_act", "gelu")
        if projector_act not in ("gelu", "gelu_pytorch_tanh", "gelu_new"):
            raise ConversionError(f"{package.path}: projector_hidden_act {projector_act!r} has no form in an mmproj "
                                  "file (clip.cpp's LLaVA projector is GELU)")
        if not config.get("multimodal_projector_bias", True):
            raise ConversionError(f"{package.path}: a LLaVA projector without biases has no form in an mmproj file")
        md["clip.vision.feature_layer"] = np.asarray(chosen, np.int32)  # in the checkpoint's order
        layers, post_norm = max(chosen), False  # later layers are never read; LLaVA skips the post-norm
    md["clip.vision.block_count"] = layers
    plan: list[tuple[str, str, float]] = []  # (gguf name, hf name, added after reading)
    inverse_tower = {hf: g for g, hf in TOWER.items()}
    for name in src.names():
        if name.startswith(tower):
            rest = name[len(tower):]
            block = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", rest)
            if block is not None:
                part = next((g for g, hf in BLOCK.items() if hf == block[2]), None)
                if part is not None and int(block[1]) < layers:
                    plan.append((f"v.blk.{block[1]}.{part}.{block[3]}", name, 0.0))
                continue
            gguf_name = inverse_tower.get(rest)
            if gguf_name is not None and (post_norm or not gguf_name.startswith("v.post_ln")):
                plan.append((gguf_name, name, 0.0))
        elif name.startswith(projector):
            gguf_name = next((g for g, hf in PROJECTOR[kind].items() if projector + hf == name), None)
            if gguf_name is not None:
                plan.append((gguf_name, name, 1.0 if gguf_name in PLUS_ONE else 0.0))
    _write_file(package, path, type, md, [(g, hf, (lambda v, plus=plus: v + np.float32(plus)) if plus else None)
                                          for g, hf, plus in plan])


#: One tensor of an mmproj file: (GGUF name, Hugging Face name, a function of its float32 values or None).
_Planned = tuple[str, str, Any]


def _write_file(package: ModelPackage, path: Path, type: str, md: dict[str, Any], plan: list[_Planned]) -> None:
    """The mmproj file: ``md`` and the planned tensors, float32 for ``type`` f32, else float16
    matrices (:data:`_F32` and every vector float32)."""
    import gguf

    from .gguf_write import _add

    src = package.tensors
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_name(str(package.config.get("_name_or_path") or (package.path.name if package.path else "model")))
    writer.add_file_type(0 if type == "f32" else 1)
    for key, value in md.items():
        _add(writer, key, value)

    def values(hf: str, make: Any) -> np.ndarray:
        value = src.get(hf)
        value = value.dequantize() if hasattr(value, "dequantize") else np.asarray(value)
        value = value.astype(np.float32)
        return make(value) if make is not None else value

    shapes = {}
    for gguf_name, hf, make in plan:
        shape = tuple(src.shape(hf)) if make is None else values(hf, make).shape
        if gguf_name == "v.class_embd":
            shape = (shape[-1],)
        f16 = type != "f32" and len(shape) >= 2 and gguf_name not in _F32
        dtype = np.dtype(np.float16 if f16 else np.float32)
        shapes[gguf_name] = (shape, dtype)
        writer.add_tensor_info(gguf_name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for gguf_name, hf, make in plan:
            shape, dtype = shapes[gguf_name]
            value = values(hf, make)
            writer.write_tensor_data(np.ascontiguousarray(value.reshape(shape).astype(dtype.newbyteorder("<"))))
    finally:
        writer.close()


def _qwen_plan(package: ModelPackage, vision: dict[str, Any], text: int) -> tuple[dict[str, Any], list[_Planned]]:
    """Qwen3.5's mmproj keys and tensors, as llama.cpp's ``Qwen3VLVisionModel`` writes them: the
    two-frame patch kernel split into its frames, the merger as ``v.post_ln`` / ``mm.0`` / ``mm.2``."""
    from infer.errors import ConversionError

    act = vision.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu"):
        raise ConversionError(f"{package.path}: vision_config.hidden_act {act!r} has no form in an mmproj file")
    if int(vision.get("temporal_patch_size", 2)) != 2:
        raise ConversionError(f"{package.path}: llama.cpp's Qwen vision reads a temporal patch of 2, not "
                              f"{vision['temporal_patch_size']}")
    if vision.get("deepstack_visual_indexes"):
        raise ConversionError(f"{package.path}: deepstack layers (Qwen3-VL) are not written")
    pre = package.preprocessor or {}
    patch, positions = int(vision.get("patch_size", 16)), int(vision.get("num_position_embeddings", 2304))
    text_cfg = package.config.get("text_config") or {}
    md: dict[str, Any] = {
        "general.type": "mmproj", "clip.projector_type": "qwen3vl_merger", "clip.has_vision_encoder": True,
        "clip.vision.projection_dim": text, "clip.vision.image_size": int(round(positions ** 0.5)) * patch,
        "clip.vision.patch_size": patch, "clip.vision.embedding_length": int(vision["hidden_size"]),
        "clip.vision.feed_forward_length": int(vision["intermediate_size"]),
        "clip.vision.block_count": int(vision["depth"]),
        "clip.vision.attention.head_count": int(vision["num_heads"]),
        "clip.vision.attention.layer_norm_epsilon": float(text_cfg.get("rms_norm_eps", 1e-6)),
        "clip.use_gelu": True, "clip.vision.spatial_merge_size": int(vision.get("spatial_merge_size", 2)),
        "clip.vision.image_mean": np.asarray(pre.get("image_mean", (0.5, 0.5, 0.5)), np.float32),
        "clip.vision.image_std": np.asarray(pre.get("image_std", (0.5, 0.5, 0.5)), np.float32),
    }
    size = pre.get("size") or {}
    # as transformers' processor reads them: the older min_pixels / max_pixels keys first
    low, high = pre.get("min_pixels") or size.get("shortest_edge"), pre.get("max_pixels") or size.get("longest_edge")
    if low:
        md["clip.vision.image_min_pixels"] = int(low)
    if high:
        md["clip.vision.image_max_pixels"] = int(high)
    tower = "model.visual."
    plan: list[_Planned] = [
        ("v.patch_embd.weight", tower + "patch_embed.proj.weight", lambda v: v[:, :, 0]),
        ("v.patch_embd.weight.1", tower + "patch_embed.proj.weight", lambda v: v[:, :, 1])]
    inverse = {hf: g for g, hf in QWEN_TOWER.items()}
    for name in package.tensors.names():
        if not name.startswith(tower) or name == tower + "patch_embed.proj.weight":
            continue
        rest = name[len(tower):]
        block = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", rest)
        if block is not None:
            part = next((g for g, hf in QWEN_BLOCK.items() if hf == block[2]), None)
            if part is not None:
                plan.append((f"v.blk.{block[1]}.{part}.{block[3]}", name, None))
        elif rest in inverse:
            plan.append((inverse[rest], name, None))
    return md, plan


def text_width(config: dict[str, Any]) -> int:
    """The text model's hidden size (what the projector's rows must be)."""
    return int(config["text_config"]["hidden_size"])
