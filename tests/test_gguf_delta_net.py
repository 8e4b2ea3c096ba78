"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next as GGUF files (llama.cpp ``qwen35``, ``qwen35moe``, ``qwen3next``).

:func:`llama_cpp_file` writes a tiny checkpoint the way llama.cpp's convert_hf_to_gguf.py does
(``Qwen3NextModel``, ``_LinearAttentionVReorderBase``; written out here independently of infer's
writer, from the converter's steps): tensor names from ``gguf.get_tensor_name_map``, ``A_log`` as
``-exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, the convolution squeezed, every norm but the
DeltaNet's gated one plus one, Qwen3-Next's ``in_proj_qkvz`` split into ``attn_qkv`` and
``attn_gate``, Qwen3.5's value heads reordered from grouped to tiled, experts stacked. Reading it
back must give the Hugging Face tensors (bit for bit, but ``A_log``, read back as ``log(-A)``
within a few float32 ulps), the logits transformers' float32 logits; ``infer convert`` must write
the same tensors, bit for bit, and the same metadata.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from infer.errors import ConfigError, UnsupportedArchitectureError
from infer.formats.gguf import GGUFQuantizedTensor, open_gguf
from infer.formats.gguf_delta_net import full_attention_interval
from infer.formats.gguf_file import read_gguf
from reference import assert_logits_close, backend_params, encode, reference_logits, tiny_model_dir
from test_families import DECODE_TEXT, PROMPT

import infer

#: variant -> llama.cpp architecture.
FILES = {"qwen3_5": "qwen35", "qwen3_5_interval": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next_gguf": "qwen3next"}
_ARCH = {"qwen35": gguf.MODEL_ARCH.QWEN35, "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE,
         "qwen3next": gguf.MODEL_ARCH.QWEN3NEXT}


def _metadata(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``{arch}.*`` as the converter writes them (TextModel, Qwen2MoeModel, Qwen3NextModel)."""
    rope = cfg["rope_parameters"]
    types = cfg["layer_types"]
    interval = full_attention_interval(types)  # the converter writes config.json's; transformers wrote types
    md: dict[str, Any] = {
        "block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"], "attention.head_count": cfg["num_attention_heads"],
        "attention.head_count_kv": cfg["num_key_value_heads"], "rope.freq_base": float(rope["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]), "attention.key_length": cfg["head_dim"],
        "attention.value_length": cfg["head_dim"], "ssm.conv_kernel": cfg["linear_conv_kernel_dim"],
        "ssm.state_size": cfg["linear_key_head_dim"], "ssm.group_count": cfg["linear_num_key_heads"],
        "ssm.time_step_rank": cfg["linear_num_value_heads"],
        "ssm.inner_size": cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"],
        "full_attention_interval": interval,
        "rope.dimension_count": int(cfg["head_dim"] * rope.get("partial_rotary_factor", 0.25)),
    }
    if cfg.get("intermediate_size") and arch != "qwen35moe":
        md["feed_forward_length"] = cfg["intermediate_size"]
    if arch != "qwen35":
        md.update({"expert_count": cfg["num_experts"], "expert_used_count": cfg["num_experts_per_tok"],
                   "expert_feed_forward_length": cfg["moe_intermediate_size"],
                   "expert_shared_feed_forward_length": cfg["shared_expert_intermediate_size"]})
    return md


def _tiled(value: np.ndarray, axis: int, nk: int, r: int, width: int) -> np.ndarray:
    """The converter's ``_reorder_v_heads``: [nk, r, width] along ``axis`` -> [r, nk, width]."""
    shape = list(value.shape)
    split = value.reshape(shape[:axis] + [nk, r, width] + shape[axis + 1:])
    return np.swapaxes(split, axis, axis + 1).reshape(shape)


def llama_cpp_file(variant: str, out: Path, interval: int | None = None,
                   legacy: bool = False) -> tuple[dict[str, np.ndarray], dict]:
    """Write ``variant`` as llama.cpp's converter does; returns (the stored tensors by GGUF name,
    the ``{arch}.*`` metadata). ``interval`` overrides full_attention_interval (a wrong file);
    ``legacy``: Qwen3-Next's in_proj_qkvz whole, as ``ssm_in`` (llama.cpp's first converter)."""
    from safetensors.numpy import load_file

    arch = FILES[variant]
    folder = tiny_model_dir(variant)
    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    names = gguf.get_tensor_name_map(_ARCH[arch], cfg["num_hidden_layers"])
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    hk, hv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv // nk
    kd = 2 * nk * hk
    stored: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf, value in sorted(state.items()):
        if cfg.get("tie_word_embeddings") and hf == "lm_head.weight":
            continue
        if ".mlp.experts." in hf:
            layer, e, proj = hf.split(".")[2], int(hf.split(".")[5]), hf.split(".")[6]
            experts.setdefault(f"model.layers.{layer}.mlp.experts.{proj}", {})[e] = value
            continue
        base, _, suffix = hf.rpartition(".")
        if hf.endswith(".A_log"):
            base, suffix, value = hf, "", -np.exp(value)
        elif hf.endswith(".dt_bias"):
            base, suffix = hf.replace(".dt_bias", ".dt_proj"), "bias"
        elif "conv1d" in hf:
            value = value.squeeze()
        elif hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
            value = value + np.float32(1)
        if arch != "qwen3next" and nk != nv and ".linear_attn." in hf:
            if ".in_proj_qkv." in hf or "conv1d" in hf:
                value = np.concatenate([value[:kd], _tiled(value[kd:], 0, nk, r, hv)])
            elif ".in_proj_z." in hf:
                value = _tiled(value, 0, nk, r, hv)
            elif ".in_proj_a." in hf or ".in_proj_b." in hf or hf.endswith((".A_log", ".dt_bias")):
                value = _tiled(value, 0, nk, r, 1)
            elif ".out_proj." in hf:
                value = _tiled(value, 1, nk, r, hv)
        if hf.endswith("in_proj_qkvz.weight") and not legacy:  # [q, k, v, z] per key head -> all q, k, v | all z
            t = value.T.reshape(cfg["hidden_size"], nk, -1)
            q, k, v, z = np.split(t, np.cumsum([hk, hk, r * hv]), axis=-1)
            flat = [p.reshape(cfg["hidden_size"], -1) for p in (q, k, v, z)]
            stored[names.get_name(base.replace("in_proj_qkvz", "in_proj_qkv")) + ".weight"] = \
                np.ascontiguousarray(np.concatenate(flat[:3], axis=-1).T)
            stored[names.get_name(base.replace("in_proj_qkvz", "in_proj_z")) + ".weight"] = \
                np.ascontiguousarray(flat[3].T)
            continue
        gguf_name = names.get_name(base)
        assert gguf_name is not None, hf
        stored[gguf_name + (f".{suffix}" if suffix else "")] = np.ascontiguousarray(value, dtype=np.float32)
    for base, by_expert in experts.items():
        stored[names.get_name(base) + ".weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    md = _metadata(arch, cfg)
    if interval is not None:
        md["full_attention_interval"] = interval
    w = gguf.GGUFWriter(str(out), arch)
    for key, value in md.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    if arch != "qwen3next":
        sections = cfg["rope_parameters"].get("mrope_section") or [md["rope.dimension_count"] // 2]
        w.add_array(f"{arch}.rope.dimension_sections", list(sections) + [0] * (4 - len(sections)))
    for name, value in stored.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored, md


def _check_tensors(path: Path, variant: str) -> None:
    from safetensors.numpy import load_file

    folder = tiny_model_dir(variant)
    state = load_file(folder / "model.safetensors")
    if json.loads((folder / "config.json").read_text()).get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    package = open_gguf(path, tokenizer=False)
    assert package.model_type == json.loads((folder / "config.json").read_text())["model_type"]
    assert sorted(package.tensors.names()) == sorted(state)
    for name, want in state.items():
        got = np.asarray(package.tensors.get(name))
        assert got.dtype == np.float32 and got.shape == want.shape, name
        if name.endswith("A_log"):  # log(-(-exp(a))) in float32: a few ulps
            np.testing.assert_allclose(got, want, rtol=0, atol=4 * np.spacing(np.abs(want).max()))
        else:
            assert np.array_equal(got, want), name  # bit for bit


def _check_logits(path: Path, variant: str, backend: str = "numpy") -> None:
    folder = tiny_model_dir(variant)
    prompt, decode = encode(folder, PROMPT), encode(folder, DECODE_TEXT)
    want = reference_logits(folder, prompt, decode)["full"]
    model = infer.load(path, backend=backend)
    logits = model.backend.to_numpy(model.engine.forward(model.engine.new_sequence(), prompt + decode, all_logits=True))
    assert_logits_close(logits, want, f"{variant} from GGUF")


@pytest.mark.parametrize("variant", list(FILES))
def test_llama_cpp_file_reads_back_the_hugging_face_tensors_and_logits(variant: str, tmp_path: Path) -> None:
    path = tmp_path / f"{variant}.gguf"
    llama_cpp_file(variant, path)
    _check_tensors(path, variant)
    _check_logits(path, variant)


def test_qwen3_next_file_with_the_whole_in_proj_qkvz(tmp_path: Path) -> None:
    path = tmp_path / "legacy.gguf"
    stored, _ = llama_cpp_file("qwen3_next_gguf", path, legacy=True)
    assert "blk.0.ssm_in.weight" in stored and "blk.0.attn_qkv.weight" not in stored
    _check_tensors(path, "qwen3_next_gguf")


@pytest.mark.parametrize("backend", backend_params("torch:cpu", "mlx:cpu"))
@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5_moe", "qwen3_next_gguf"])
def test_gguf_logits_on_other_backends(variant: str, backend: str, tmp_path: Path) -> None:
    path = tmp_path / f"{variant}.gguf"
    llama_cpp_file(variant, path)
    _check_logits(path, variant, backend=backend)


def test_vision_language_checkpoint_writes_its_text_model(tmp_path: Path) -> None:
    # A Qwen3_5ForConditionalGeneration folder: text_config nested, weights under model.language_model.,
    # MTP weights (not written): the same file as the text-only checkpoint's. (A vision tower goes to
    # llama.cpp's mmproj file beside it: tests/test_vision_gguf.py.)
    from safetensors.numpy import load_file, save_file

    folder = tiny_model_dir("qwen3_5")
    text = json.loads((folder / "config.json").read_text())
    nested = tmp_path / "vl"
    nested.mkdir()
    for f in folder.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (nested / f.name).write_bytes(f.read_bytes())
    (nested / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": text["tie_word_embeddings"], "text_config": {**text, "model_type": "qwen3_5_text"},
        "vision_config": {"depth": 1}}))
    state = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
             for k, v in load_file(folder / "model.safetensors").items()}
    state["mtp.fc.weight"] = np.ones((4, 4), np.float32)
    save_file(state, nested / "model.safetensors")
    a = read_gguf(infer.convert(folder, tmp_path / "text.gguf", type="f32", progress=False))
    b = read_gguf(infer.convert(nested, tmp_path / "vl.gguf", type="f32", progress=False))
    try:
        assert sorted(a.tensors) == sorted(b.tensors)
        for name, info in a.tensors.items():
            assert a.raw(info).tobytes() == b.raw(b.tensors[name]).tobytes(), name
        for key, value in a.metadata.items():
            if key.startswith("qwen35."):
                assert np.array_equal(b.metadata[key], value), key
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("variant", list(FILES))
def test_infer_convert_writes_what_llama_cpp_writes(variant: str, tmp_path: Path) -> None:
    stored, md = llama_cpp_file(variant, tmp_path / "llama_cpp.gguf")
    ours = infer.convert(tiny_model_dir(variant), tmp_path / "infer.gguf", type="f32", progress=False)
    file = read_gguf(ours)
    try:
        arch = FILES[variant]
        assert file.metadata["general.architecture"] == arch
        for key, value in md.items():
            got = file.metadata[f"{arch}.{key}"]
            assert (got == np.float32(value)) if isinstance(value, float) else got == value, key
        assert sorted(file.tensors) == sorted(stored)
        for name, want in stored.items():
            info = file.tensors[name]
            assert info.type.name == "F32", name
            got = file.raw(info).view("<f4").reshape(info.shape)
            assert np.array_equal(got, want), name  # bit for bit
    finally:
        file.close()
    _check_tensors(ours, variant)


def test_qwen3_next_with_dense_layers_is_refused(tmp_path: Path) -> None:
    # The qwen3_next variant's layer 0 is a dense MLP (mlp_only_layers): llama.cpp's qwen3next has none.
    with pytest.raises(ConfigError, match="mlp_only_layers.*qwen3next has a mixture of experts in every block"):
        infer.convert(tiny_model_dir("qwen3_next"), tmp_path / "m.gguf", type="f32", progress=False)
    assert not (tmp_path / "m.gguf").exists()


def test_a_layer_pattern_that_is_no_interval_is_written_per_layer(tmp_path: Path) -> None:
    # llama.cpp's converter writes only full_attention_interval; its loaders read a boolean per layer,
    # attention.recurrent_layers, first: infer writes that where no interval gives the pattern.
    assert full_attention_interval(["linear_attention", "linear_attention", "full_attention", "linear_attention"]) == 3
    variant = "qwen3_5_gguf_pattern"
    path = infer.convert(tiny_model_dir(variant), tmp_path / "m.gguf", type="f32", progress=False)
    file = read_gguf(path)
    try:
        assert "qwen35.full_attention_interval" not in file.metadata
        assert file.metadata["qwen35.attention.recurrent_layers"].tolist() == [False, True, False]
    finally:
        file.close()
    _check_tensors(path, variant)
    _check_logits(path, variant)


def test_layer_kinds_that_disagree_with_the_tensors_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "wrong.gguf"
    llama_cpp_file("qwen3_5", path, interval=4)  # its full-attention layer is 2, not 3
    with pytest.raises(ConfigError, match="block 2 is a DeltaNet by qwen35.full_attention_interval 4"):
        open_gguf(path, tokenizer=False)


def test_an_unsupported_family_is_refused_naming_the_supported_ones(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedArchitectureError, match=r"'lfm2' cannot be written as GGUF; supported: .*"
                                                           r"qwen3_5_moe_text.*qwen3_5_text.*qwen3_next"):
        infer.convert(tiny_model_dir("lfm2"), tmp_path / "m.gguf", type="f32", progress=False)


def test_quantized_file_keeps_rows_quantized_and_runs(tmp_path: Path) -> None:
    # Q8_0: experts and projections quantized, routers and convolutions float32 (as llama.cpp's
    # converter keeps them); Qwen3-Next's in_proj_qkvz joined from quantized attn_qkv and attn_gate rows.
    path = infer.convert(tiny_model_dir("qwen3_next_gguf"), tmp_path / "q8.gguf", type="q8_0", progress=False)
    package = open_gguf(path, tokenizer=False)
    src, file = package.tensors, package.tensors.file
    assert file.tensors["blk.0.ssm_conv1d.weight"].type.name == "F32"
    assert file.tensors["blk.0.ffn_gate_inp.weight"].type.name == "F32"
    assert file.tensors["blk.0.ffn_gate_exps.weight"].type.name == "Q8_0"
    qkvz = src.get("model.layers.0.linear_attn.in_proj_qkvz.weight")
    assert isinstance(qkvz, GGUFQuantizedTensor) and qkvz.qtype == "Q8_0"
    f32 = open_gguf(infer.convert(tiny_model_dir("qwen3_next_gguf"), tmp_path / "f32.gguf", type="f32",
                                  progress=False), tokenizer=False)
    want = np.asarray(f32.tensors.get("model.layers.0.linear_attn.in_proj_qkvz.weight"))
    np.testing.assert_allclose(qkvz.dequantize(), want, atol=np.abs(want).max() / 100)
    model = infer.load(path, backend="numpy")
    ids = encode(tiny_model_dir("qwen3_next_gguf"), PROMPT)
    logits = model.backend.to_numpy(model.engine.forward(model.engine.new_sequence(), ids, all_logits=True))
    assert logits.shape == (len(ids), 384) and np.all(np.isfinite(logits))


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5_moe", "qwen3_next_gguf"])
def test_gguf_back_to_a_folder_transformers_loads(variant: str, tmp_path: Path) -> None:
    # infer convert model.gguf folder: the config (layer_types, the DeltaNet sizes, rope share) and the
    # tensors in Hugging Face layout again; transformers' logits from it are the original's.
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(variant)
    file = infer.convert(folder, tmp_path / "m.gguf", type="f32", progress=False)
    back = infer.convert(file, tmp_path / "hf", progress=False)
    prompt, decode = encode(folder, PROMPT), encode(folder, DECODE_TEXT)
    model = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + decode])).logits[0].numpy()
    assert_logits_close(logits, reference_logits(folder, prompt, decode)["full"], f"{variant} GGUF -> folder")


_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
           "vocab_size", "max_position_embeddings", "tie_word_embeddings", "linear_conv_kernel_dim",
           "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
           "layer_types", "hidden_act")
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


@pytest.mark.parametrize("variant", list(FILES))
def test_the_config_reads_back(variant: str, tmp_path: Path) -> None:
    hf = json.loads((tiny_model_dir(variant) / "config.json").read_text())
    got = open_gguf(infer.convert(tiny_model_dir(variant), tmp_path / "m.gguf", type="f32", progress=False),
                    tokenizer=False).config
    for key in _FIELDS + (_MOE_FIELDS if "num_experts" in hf else ()):
        assert got[key] == hf[key], key
    assert got["rms_norm_eps"] == np.float32(hf["rms_norm_eps"])  # stored as float32
    assert got.get("attention_bias", False) == hf["attention_bias"]
    rope = hf["rope_parameters"]
    assert got["rope_parameters"]["rope_theta"] == rope["rope_theta"]
    assert got["rope_parameters"]["partial_rotary_factor"] == rope.get("partial_rotary_factor", 0.25)
    if variant == "qwen3_next_gguf":
        assert (got["mlp_only_layers"], got["decoder_sparse_step"], got["norm_topk_prob"]) == ([], 1, True)


def test_quantized_value_head_reorder(tmp_path: Path) -> None:
    # Qwen3.5 with 2 key heads for 4 value heads, Q8_0: reordered rows stay quantized (whole blocks),
    # out_proj's reordered columns come back in float32, each the stored blocks' values.
    from infer.formats.gguf_delta_net import grouped_order

    path = infer.convert(tiny_model_dir("qwen3_5"), tmp_path / "q8.gguf", type="q8_0", progress=False)
    src = open_gguf(path, tokenizer=False).tensors
    qkv = src.get("model.layers.0.linear_attn.in_proj_qkv.weight")
    assert isinstance(qkv, GGUFQuantizedTensor) and qkv.qtype == "Q8_0"
    out = src.get("model.layers.0.linear_attn.out_proj.weight")
    assert isinstance(out, np.ndarray) and src.storage_dtype("model.layers.0.linear_attn.out_proj.weight") == "float32"
    info = src.file.tensors["blk.0.ssm_out.weight"]  # 48 columns: F16, Q8_0's fallback for them
    stored = src._floats(info, src.file.raw(info))
    assert info.type.name in ("F16", "Q8_0") and np.array_equal(out, stored[:, grouped_order(2, 4, 12)])
    gate = src.get("model.layers.0.linear_attn.in_proj_z.weight")  # rows reordered, still Q8_0
    assert isinstance(gate, GGUFQuantizedTensor) and gate.qtype == "Q8_0"
    info = src.file.tensors["blk.0.attn_gate.weight"]
    assert np.array_equal(gate.dequantize(), src._floats(info, src.file.raw(info))[grouped_order(2, 4, 12)])
