"""The families of test_families.py from GGUF files, as llama.cpp's converter writes them.

Each tiny Hugging Face model (tests/reference.py, ``_FAMILIES``) is converted here with the
``gguf`` package's ``GGUFWriter`` and llama.cpp's own tensor-name table
(``gguf.get_tensor_name_map``, what convert_hf_to_gguf.py uses), applying the layout
changes that converter makes: the Q/K row permutation for the families it converts as
Llama (llama/Mixtral, Granite, SmolLM3), experts stacked into one ``[experts, rows,
cols]`` tensor per projection, GPT-2's Conv1D weights transposed, Phi-3's LongRoPE factors
as tensors. Reading the file back must give every Hugging Face tensor exactly (float32
files), and the logits must match transformers' on the Hugging Face folder at
``reference.LOGIT_RTOL`` (the same weights, so the same bound as the parity tests).
A Q8_0 file of each mixture-of-experts family checks that one expert's rows of a stacked
quantized tensor are that expert's blocks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from infer.formats.gguf import GGUFQuantizedTensor, open_gguf
from reference import assert_logits_close, encode, reference_logits, tiny_model_dir
from test_families import DECODE_TEXT, PROMPT
from test_format_gguf import llama_permute, llama_unpermute

import infer

#: variant -> (GGUF architecture, llama.cpp permutes Q/K rows).
FILES = {
    "qwen3": ("qwen3", False),
    "mixtral": ("llama", True),
    "qwen3_moe": ("qwen3moe", False),
    "phi3": ("phi3", False),
    "phi3_longrope": ("phi3", False),
    "olmo2": ("olmo2", False),
    "smollm3": ("smollm3", True),
    "granite": ("granite", True),
    "gpt2": ("gpt2", False),
    "deepseek_v3_gguf": ("deepseek2", False),
    "deepseek_v3_lite": ("deepseek2", False),
    "deepseek_v3": ("deepseek2", False),
    "lfm2": ("lfm2", False),
    "lfm2_conv_bias": ("lfm2", False),
    # Llama 3 rope over 64 original positions: llama.cpp's converter stores only the divisors
    # (rope_freqs), which follow no rule infer can name without the 64, so they are used as stored.
    "llama3": ("llama", True),
}
#: Variants whose logits are not compared, as no llama.cpp file can say what their config says:
#: deepseek_v3_lite's rope is half-split (llama.cpp's deepseek2 always rotates interleaved pairs),
#: deepseek_v3's YaRN has mscale 1.0 but mscale_all_dim 0.8 (GGUF stores only the latter, as
#: rope.scaling.yarn_log_multiplier). Their tensors are still compared; deepseek_v3_gguf's logits too.
TENSORS_ONLY = {"deepseek_v3_lite", "deepseek_v3"}
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")


def _metadata(arch: str, cfg: dict[str, Any], split_kv_b: bool = False) -> dict[str, Any]:
    """``{arch}.*`` keys as convert_hf_to_gguf.py writes them for this config."""
    if arch == "deepseek2":
        rope, nope, v, r = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
        md = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
              "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
              "attention.head_count": cfg["num_attention_heads"], "attention.head_count_kv": 1 if split_kv_b else
              cfg["num_attention_heads"], "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
              "rope.freq_base": cfg["rope_parameters"]["rope_theta"], "rope.dimension_count": rope,
              "attention.kv_lora_rank": r, "leading_dense_block_count": cfg["first_k_dense_replace"],
              "expert_feed_forward_length": cfg["moe_intermediate_size"], "expert_count": cfg["n_routed_experts"],
              "expert_shared_count": cfg["n_shared_experts"], "expert_used_count": cfg["num_experts_per_tok"],
              "expert_weights_scale": float(cfg["routed_scaling_factor"]), "expert_group_count": cfg["n_group"],
              "expert_group_used_count": cfg["topk_group"], "expert_gating_func": 2}
        if cfg.get("q_lora_rank"):
            md["attention.q_lora_rank"] = cfg["q_lora_rank"]
        if split_kv_b:  # llama.cpp's absorbed-MLA layout: keys and values of the latent
            md.update({"attention.key_length": r + rope, "attention.value_length": r,
                       "attention.key_length_mla": nope + rope, "attention.value_length_mla": v})
        else:
            md.update({"attention.key_length": nope + rope, "attention.value_length": v})
        return md
    if arch == "gpt2":
        return {"block_count": cfg["n_layer"], "context_length": cfg["n_positions"], "embedding_length": cfg["n_embd"],
                "feed_forward_length": cfg.get("n_inner") or 4 * cfg["n_embd"], "attention.head_count": cfg["n_head"],
                "attention.layer_norm_epsilon": cfg["layer_norm_epsilon"]}
    if arch == "lfm2":  # convert_hf_to_gguf.py's LFM2Model: kv heads per block (0: conv), the adjusted ff width
        from infer.architectures.lfm2 import read_config

        return {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
                "embedding_length": cfg["hidden_size"], "feed_forward_length": read_config(cfg).ff_dim(),
                "attention.head_count": cfg["num_attention_heads"],
                "attention.head_count_kv": [cfg["num_key_value_heads"] if t == "full_attention" else 0
                                            for t in cfg["layer_types"]],
                "attention.layer_norm_rms_epsilon": cfg["norm_eps"],
                "rope.freq_base": cfg["rope_parameters"]["rope_theta"], "shortconv.l_cache": cfg["conv_L_cache"],
                "vocab_size": cfg["vocab_size"]}
    rope = cfg["rope_parameters"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    md = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
          "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
          "attention.head_count": cfg["num_attention_heads"], "attention.head_count_kv": cfg["num_key_value_heads"],
          "attention.key_length": head_dim, "attention.value_length": head_dim,
          "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"], "rope.freq_base": rope["rope_theta"],
          "rope.dimension_count": int(head_dim * rope.get("partial_rotary_factor", 1.0))}
    if cfg.get("sliding_window"):
        md["attention.sliding_window"] = cfg["sliding_window"]
    if "num_local_experts" in cfg:
        md.update({"expert_count": cfg["num_local_experts"], "expert_used_count": cfg["num_experts_per_tok"]})
    if "moe_intermediate_size" in cfg:
        md["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    if arch == "granite":
        md.update({"embedding_scale": cfg["embedding_multiplier"], "residual_scale": cfg["residual_multiplier"],
                   "attention.scale": cfg["attention_multiplier"], "logit_scale": cfg["logits_scaling"]})
    if rope.get("rope_type") == "longrope":
        md.update({"rope.scaling.original_context_length": rope["original_max_position_embeddings"]})
    return md


def convert(variant: str, out: Path, qtype: str = "F32", split_kv_b: bool = False) -> dict[str, np.ndarray]:
    """Write ``variant`` as a GGUF file; returns what each Hugging Face tensor must read back as
    (2-D and 3-D weights quantized to ``qtype`` when it is not F32; DeepSeek's kv_b_proj split
    into attn_k_b and attn_v_b with ``split_kv_b``, as llama.cpp's converter does since 2025)."""
    from safetensors.numpy import load_file

    arch, permute = FILES[variant]
    folder = tiny_model_dir(variant)
    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    layers = cfg.get("num_hidden_layers") or cfg["n_layer"]
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers)
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, layers)
    w = gguf.GGUFWriter(str(out), arch)
    for key, value in _metadata(arch, cfg, split_kv_b).items():
        if isinstance(value, list):  # a per-block array (LFM2's kv heads)
            w.add_array(f"{arch}.{key}", value)
        else:
            (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    if arch == "deepseek2":
        w.add_bool("deepseek2.expert_weights_norm", cfg["norm_topk_prob"])
    expected: dict[str, np.ndarray] = {}

    def add(name: str, value: np.ndarray) -> np.ndarray:
        if qtype == "F32" or value.ndim < 2 or value.shape[-1] % 32:  # Q8_0 rows are blocks of 32
            w.add_tensor(name, value)
            return value
        raw = gguf.quants.quantize(value, gguf.GGMLQuantizationType[qtype])
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(value.shape)

    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf, value in sorted(state.items()):
        m = _EXPERT.fullmatch(hf)
        if m:  # stacked below, as the converter does
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = value
            continue
        base, _, suffix = hf.rpartition(".")
        if hf.endswith("e_score_correction_bias"):  # llama.cpp maps it with the ".bias" suffix split off
            base, suffix = hf[: -len("_bias")], "bias"
        if split_kv_b and base.endswith("kv_b_proj"):
            heads, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
            kv_b = value.reshape(heads, nope + cfg["v_head_dim"], -1)
            add(names.get_name(base.replace("kv_b", "k_b")) + ".weight", kv_b[:, :nope].transpose(0, 2, 1).copy())
            add(names.get_name(base.replace("kv_b", "v_b")) + ".weight", kv_b[:, nope:].copy())
            expected[hf] = value
            continue
        stored = value
        if permute and re.search(r"self_attn\.[qk]_proj$", base):
            heads = cfg["num_attention_heads" if "q_proj" in base else "num_key_value_heads"]
            stored = llama_permute(value, heads)
        if arch == "gpt2" and value.ndim == 2 and base.rsplit(".", 1)[-1].startswith("c_"):
            stored = value.T.copy()  # Conv1D [in, out] -> [out, in]
        if arch == "lfm2" and base.endswith("conv.conv") and suffix == "weight":
            stored = value.squeeze(1)  # the depthwise conv weight [C, 1, K] -> [C, K], as the converter does
        # (llama.cpp's qwen3moe has no dense blocks; the qwen3_moe variant's layer 0 is one, written
        # with the dense names, which infer reads where present.)
        gguf_name = names.get_name(base) or dense.get_name(base)
        back = add(f"{gguf_name}.{suffix}", stored)
        if arch == "gpt2" and stored is not value:
            back = back.T
        elif arch == "lfm2" and stored is not value:
            back = back.reshape(value.shape)
        elif stored is not value:  # permuted: the reader gives back the Hugging Face rows
            back = llama_unpermute(back, heads)
        expected[hf] = back
    for stacked, by_expert in experts.items():
        value = np.stack([by_expert[e] for e in sorted(by_expert)])  # [experts, rows, cols]
        back = add(names.get_name(stacked) + ".weight", value)
        for e in sorted(by_expert):
            expected[f"{stacked.rsplit('.', 1)[0]}.{e}.{stacked.rsplit('.', 1)[1]}.weight"] = back[e]
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(cfg))
    if rope.get("rope_type") == "longrope":
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def llama_cpp_rope_freqs(cfg: dict[str, Any]) -> np.ndarray:
    """The divisors convert_hf_to_gguf.py's LlamaModel writes for Llama 3 rope (its
    generate_extra_tensors): frequencies in float32 torch, the rule in Python floats."""
    import math

    import torch

    rope = cfg["rope_parameters"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def test_rope_freqs_that_follow_no_known_rule_are_used_as_stored(gguf_dir: Path) -> None:
    # The llama3 variant's divisors (64 original positions, not recorded in the file) are
    # neither 1 nor the factor in between: the interpolated band is what makes them unusual.
    cfg = json.loads((tiny_model_dir("llama3") / "config.json").read_text())
    factors = llama_cpp_rope_freqs(cfg)
    assert np.any((factors > 1) & (factors < cfg["rope_parameters"]["factor"]))
    path = gguf_dir / "llama3.gguf"
    convert("llama3", path)
    rope = open_gguf(path, tokenizer=False).config["rope_parameters"]
    assert rope["rope_type"] == "default" and rope["freq_factors"] == factors.tolist()


def test_freq_factors_divide_the_frequencies_and_are_checked() -> None:
    from architectures.rope import RotaryEmbedding, inverse_frequencies
    from infer.backends.numpy import NumpyBackend
    from infer.errors import ConfigError

    ops = NumpyBackend()
    factors = [1.0, 2.0, 8.0, 0.5]
    rope = RotaryEmbedding(ops, 8, {"rope_theta": 100.0, "freq_factors": factors}, 64)
    want = np.float32(inverse_frequencies(100.0, 8)) / np.float32(factors)
    assert np.array_equal(ops.to_numpy(rope._inv_freq).reshape(-1), want)
    for params, what in (({"freq_factors": factors[:3]}, "4 positive finite numbers"),
                         ({"freq_factors": [1.0, 0.0, 1.0, 1.0]}, "4 positive finite numbers"),
                         ({"rope_type": "dynamic", "factor": 2.0, "freq_factors": factors}, "'dynamic'")):
        with pytest.raises(ConfigError, match=what):
            RotaryEmbedding(ops, 8, {"rope_theta": 100.0, **params}, 64)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf_families")


@pytest.mark.parametrize("variant", list(FILES))
def test_gguf_file_reads_back_the_hugging_face_tensors_and_logits(variant: str, gguf_dir: Path) -> None:
    path = gguf_dir / f"{variant}.gguf"
    expected = convert(variant, path)
    package = open_gguf(path, tokenizer=False)
    hf_config = json.loads((tiny_model_dir(variant) / "config.json").read_text())
    assert package.model_type == hf_config["model_type"]
    src = package.tensors
    assert sorted(src.names()) == sorted(expected)
    for name, want in expected.items():
        got = np.asarray(src.get(name))
        assert got.dtype == np.float32 and got.shape == want.shape, name
        assert np.array_equal(got, want), name  # bit for bit
    if variant not in TENSORS_ONLY:
        _check_logits(variant, path)


def _check_logits(variant: str, path: Path) -> None:
    folder = tiny_model_dir(variant)
    prompt, decode = encode(folder, PROMPT), encode(folder, DECODE_TEXT)
    want = reference_logits(folder, prompt, decode)["full"]  # one forward over both: test_families' reference
    model = infer.load(path, backend="numpy")
    logits = model.backend.to_numpy(model.engine.forward(model.engine.new_sequence(), prompt + decode, all_logits=True))
    assert_logits_close(logits, want, f"{variant} from GGUF")


@pytest.mark.parametrize("variant", ["deepseek_v3_gguf", "deepseek_v3_lite"])
def test_deepseek2_with_kv_b_split_for_absorbed_mla(variant: str, gguf_dir: Path) -> None:
    # Newer llama.cpp files store kv_b_proj as attn_k_b (transposed per head) and attn_v_b, and
    # the MLA head widths under key_length_mla / value_length_mla: joined back, exactly.
    path = gguf_dir / f"{variant}_split.gguf"
    expected = convert(variant, path, split_kv_b=True)
    package = open_gguf(path, tokenizer=False)
    assert sorted(package.tensors.names()) == sorted(expected)
    for name, want in expected.items():
        assert np.array_equal(np.asarray(package.tensors.get(name)), want), name
    hf = json.loads((tiny_model_dir(variant) / "config.json").read_text())
    for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank", "n_group",
                "topk_group", "norm_topk_prob", "routed_scaling_factor", "first_k_dense_replace"):
        assert package.config.get(key) == hf[key], key
    if variant not in TENSORS_ONLY:
        _check_logits(variant, path)


def test_deepseek2_softmax_routing_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "v2.gguf"
    convert("deepseek_v3_gguf", path)
    data = path.read_bytes()
    key = b"deepseek2.expert_gating_func"
    at = data.index(key) + len(key) + 4  # then the uint32 type tag, then the value
    path.write_bytes(data[:at] + (1).to_bytes(4, "little") + data[at + 4:])  # 2 (sigmoid) -> 1 (softmax)
    with pytest.raises(infer.errors.ConfigError, match="expert_gating_func is 1.*sigmoid"):
        open_gguf(path, tokenizer=False)


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe"])
def test_quantized_experts_are_each_experts_own_blocks(variant: str, gguf_dir: Path) -> None:
    path = gguf_dir / f"{variant}_q8.gguf"
    expected = convert(variant, path, qtype="Q8_0")
    src = open_gguf(path, tokenizer=False).tensors
    experts = [n for n in expected if ".experts." in n]
    assert experts
    assert sum(src.stored_nbytes(n) for n in src.names()) == sum(i.end - i.begin for i in src.file.tensors.values())
    for name in experts:
        got = src.get(name)
        if expected[name].shape[-1] % 32 == 0:
            assert isinstance(got, GGUFQuantizedTensor) and got.qtype == "Q8_0", name
            got = got.dequantize()
        assert np.array_equal(got, expected[name]), name
    model = infer.load(path, backend="numpy")  # runs on the quantized experts
    assert model.network.num_layers == json.loads((tiny_model_dir(variant) / "config.json").read_text())[
        "num_hidden_layers"]


# -- gpt-oss: llama.cpp's gpt-oss files, MXFP4 experts -------------------------------------------

#: The variants llama.cpp's gpt-oss can hold (its clamped SwiGLU is hard-coded at alpha 1.702, limit 7).
GPT_OSS = ["gpt_oss_gguf", "gpt_oss_gguf_tied"]


def convert_gpt_oss(variant: str, out: Path, experts: str = "F32") -> dict[str, np.ndarray]:
    """Write ``variant`` as convert_hf_to_gguf.py's GptOssModel does: ``gate_up_proj`` (``[experts,
    in, 2 * out]``, gate and up interleaved) split into ``ffn_gate_exps`` and ``ffn_up_exps``
    (``[experts, out, in]``), ``down_proj`` transposed, the sinks as ``attn_sinks.weight``, the
    experts' matrices as ``experts`` (F32, or MXFP4 as the released files). Returns what each
    tensor must read back as, under the reader's names (one expert's rows each)."""
    from safetensors.numpy import load_file

    folder = tiny_model_dir(variant)
    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    layers, arch = cfg["num_hidden_layers"], "gpt-oss"
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, layers)
    w = gguf.GGUFWriter(str(out), arch)
    md = _metadata("gpt_oss", cfg)
    md.update({"expert_count": cfg["num_local_experts"], "expert_used_count": cfg["num_experts_per_tok"],
               "expert_feed_forward_length": cfg["intermediate_size"],
               "attention.sliding_window": cfg["sliding_window"]})
    rope = cfg["rope_parameters"]
    if rope["rope_type"] == "yarn":
        md.update({"rope.scaling.factor": float(rope["factor"]),
                   "rope.scaling.original_context_length": rope["original_max_position_embeddings"]})
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
    for key, value in md.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    expected: dict[str, np.ndarray] = {}

    def add(name: str, value: np.ndarray, qtype: str = "F32") -> np.ndarray:
        value = np.ascontiguousarray(value, np.float32)
        if qtype == "F32":
            w.add_tensor(name, value)
            return value
        raw = gguf.quants.quantize(value, gguf.GGMLQuantizationType[qtype])
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(value.shape)

    def stacked(hf_prefix: str, kind: str, value: np.ndarray) -> None:  # [experts, out, in]
        back = add(names.get_name(f"{hf_prefix}.{kind}") + ".weight", value, experts)
        for e in range(back.shape[0]):
            expected[f"{hf_prefix}.{e}.{kind}.weight"] = back[e]

    for hf, value in sorted(state.items()):
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?", hf)
        if m and m[2] == "gate_up_proj" and m[3]:
            for kind, part in (("gate_proj", value[..., 0::2]), ("up_proj", value[..., 1::2])):
                expected[f"{m[1]}.{kind}_bias"] = add(names.get_name(f"{m[1]}.{kind}") + ".bias", part)
        elif m and m[3]:
            expected[hf] = add(names.get_name(f"{m[1]}.down_proj") + ".bias", value)
        elif m and m[2] == "gate_up_proj":
            t = value.transpose(0, 2, 1)
            stacked(m[1], "gate_proj", t[:, 0::2])
            stacked(m[1], "up_proj", t[:, 1::2])
        elif m:
            stacked(m[1], "down_proj", value.transpose(0, 2, 1))
        elif hf.endswith(".sinks"):
            expected[hf] = add(names.get_name(hf) + ".weight", value)
        else:
            base, _, suffix = hf.rpartition(".")
            expected[hf] = add(f"{names.get_name(base)}.{suffix}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("variant", GPT_OSS)
def test_gpt_oss_file_reads_back_and_gives_transformers_logits(variant: str, gguf_dir: Path) -> None:
    path = gguf_dir / f"{variant}.gguf"
    expected = convert_gpt_oss(variant, path)
    package = open_gguf(path, tokenizer=False)
    hf = json.loads((tiny_model_dir(variant) / "config.json").read_text())
    assert package.model_type == "gpt_oss"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window", "layer_types",
                "attention_bias", "tie_word_embeddings", "swiglu_limit", "swiglu_alpha", "rms_norm_eps"):
        want = hf[key]
        assert package.config[key] == (pytest.approx(want, rel=1e-7) if isinstance(want, float) else want), key
    rope = {k: v for k, v in package.config["rope_parameters"].items()}
    assert rope == hf["rope_parameters"]
    src = package.tensors
    assert sorted(src.names()) == sorted(expected)
    for name, want in expected.items():
        got = np.asarray(src.get(name))
        assert got.dtype == np.float32 and got.shape == want.shape, name
        assert np.array_equal(got, want), name  # bit for bit
    _check_logits(variant, path)
    _check_logits_on_torch(variant, path)


def _check_logits_on_torch(variant: str, path: Path) -> None:
    folder = tiny_model_dir(variant)  # numpy's check, on torch:cpu
    prompt, decode = encode(folder, PROMPT), encode(folder, DECODE_TEXT)
    model = infer.load(path, backend="torch")
    logits = model.backend.to_numpy(model.engine.forward(model.engine.new_sequence(), prompt + decode, all_logits=True))
    assert_logits_close(logits, reference_logits(folder, prompt, decode)["full"], f"{variant} from GGUF on torch")


def test_gpt_oss_mxfp4_experts_stay_blocks_and_match_gguf_py(gguf_dir: Path) -> None:
    # The released files' experts: MXFP4 (GGML type 39). Each expert's rows are its own blocks,
    # dequantized exactly as gguf-py's reference; the numpy backend computes on the blocks.
    path = gguf_dir / "gpt_oss_mxfp4.gguf"
    expected = convert_gpt_oss("gpt_oss_gguf", path, experts="MXFP4")
    src = open_gguf(path, tokenizer=False).tensors
    experts = [n for n in expected if re.search(r"experts\.\d+\.", n)]
    assert experts
    for name in experts:
        got = src.get(name)
        assert isinstance(got, GGUFQuantizedTensor) and got.qtype == "MXFP4", name
        assert np.array_equal(got.dequantize(), expected[name]), name
    model = infer.load(path, backend="numpy")
    for expert in model.network.layers[0].weights["experts"]:  # gate and up rows stacked, as blocks still
        assert {w.scheme for w in expert.values()} == {"MXFP4 blocks as stored, numpy kernel"}
    folder = tiny_model_dir("gpt_oss_gguf")
    prompt = encode(folder, PROMPT)
    logits = model.backend.to_numpy(model.engine.forward(model.engine.new_sequence(), prompt, all_logits=True))
    # The reference: the same model with the experts' dequantized values as float32 weights.
    dense = gguf_dir / "gpt_oss_mxfp4_dense.gguf"
    _dense_copy(path, dense)
    want = infer.load(dense, backend="numpy")
    ref = want.backend.to_numpy(want.engine.forward(want.engine.new_sequence(), prompt, all_logits=True))
    np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4)


def _dense_copy(path: Path, out: Path) -> None:
    """``path`` rewritten with every tensor dequantized to F32 (gguf-py's reference dequantizer)."""
    reader = gguf.GGUFReader(str(path))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    w = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith(arch + "."):
            value = field.contents()
            if field.types[0] == gguf.GGUFValueType.STRING:
                w.add_string(field.name, value)
            elif field.types[0] == gguf.GGUFValueType.FLOAT32:
                w.add_float32(field.name, value)
            else:
                w.add_uint32(field.name, value)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        w.add_tensor(t.name, np.ascontiguousarray(values, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("variant", GPT_OSS)
def test_infer_convert_writes_gpt_oss_as_llama_cpps_converter(variant: str, gguf_dir: Path) -> None:
    # infer's writer gives the tensors (names, shapes, values) and metadata of convert_gpt_oss's file
    # (convert_hf_to_gguf.py's layout), and the file gives transformers' logits.
    ours = infer.convert(tiny_model_dir(variant), gguf_dir / f"{variant}_ours.gguf", type="f32", progress=False)
    theirs = gguf_dir / f"{variant}_theirs.gguf"
    convert_gpt_oss(variant, theirs)
    a, b = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
    assert {t.name: (list(t.shape), t.tensor_type) for t in a.tensors} == \
        {t.name: (list(t.shape), t.tensor_type) for t in b.tensors}
    mine = {t.name: np.asarray(t.data) for t in a.tensors}
    for t in b.tensors:
        assert np.array_equal(mine[t.name], np.asarray(t.data)), t.name
    keys = {f.name for f in b.fields.values() if f.name.startswith("gpt-oss.")}
    for key in keys:
        assert a.fields[key].contents() == pytest.approx(b.fields[key].contents()), key
    _check_logits(variant, ours)


@pytest.mark.parametrize("variant,edit,what", [
    ("gpt_oss", {}, "swiglu_limit is 1.5; GGUF's gpt-oss computes 7.0"),
    ("gpt_oss_top3", {}, "swiglu_alpha is 1.0; GGUF's gpt-oss computes 1.702"),
    ("gpt_oss_gguf_tied", {"layer_types": ["full_attention", "sliding_attention", "sliding_attention"]},
     "layer_types .* no GGUF form: llama.cpp's gpt-oss makes even layers sliding"),
    ("gpt_oss_gguf_tied", {"sliding_window": None}, "sliding_window is null"),
    ("gpt_oss_gguf", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 64, "truncate": True}},
     "truncate true has no GGUF form"),
])
def test_infer_convert_refuses_gpt_oss_that_llama_cpp_cannot_hold(variant: str, edit: dict[str, Any], what: str,
                                                                   tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / variant
    shutil.copytree(tiny_model_dir(variant), folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(infer.errors.ConfigError, match=what):
        infer.convert(folder, tmp_path / "m.gguf", type="f32", progress=False)


def test_infer_convert_refuses_unsupported_families_naming_what_it_writes(tmp_path: Path) -> None:
    with pytest.raises(infer.errors.UnsupportedArchitectureError, match=r"'lfm2'.*supported: .*gpt_oss"):
        infer.convert(tiny_model_dir("lfm2"), tmp_path / "m.gguf", type="f32", progress=False)


def _mxfp4_folder(variant: str, out: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``variant``'s folder with its experts replaced by random MXFP4 ones as the released
    checkpoints store them (``X_blocks`` ``[experts, out, groups, 16]``, low nibble the even
    value; ``X_scales`` the exponent + 127; ``quantization_config`` ``mxfp4``). Returns each
    expert tensor's (codes ``[experts, out, in]``, exponents ``[experts, out, groups]``)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(tiny_model_dir(variant), out)
    cfg = json.loads((out / "config.json").read_text())
    state = load_file(out / "model.safetensors")
    rng = np.random.default_rng(7)
    packed: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name in [n for n in state if re.search(r"experts\.(gate_up_proj|down_proj)$", n)]:
        e, cols, rows = state.pop(name).shape  # the parameter is [experts, in, out]
        codes = rng.integers(0, 16, (e, rows, cols), dtype=np.uint8)
        scales = rng.integers(127 - 6, 127 - 1, (e, rows, cols // 32), dtype=np.uint8)
        pairs = codes.reshape(e, rows, cols // 32, 16, 2)
        state[name + "_blocks"] = pairs[..., 0] | (pairs[..., 1] << np.uint8(4))
        state[name + "_scales"] = scales
        packed[name] = (codes, scales)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(cfg))
    return packed


def test_infer_convert_keeps_mxfp4_experts_as_llama_cpp_repacks_them(tmp_path: Path) -> None:
    # A released-style checkpoint's MXFP4 experts are written as GGML MXFP4 blocks whatever the
    # output type (convert_hf_to_gguf.py's repack_mxfp4): the same codes and exponents, gate and up
    # rows apart; read back and run, they give the folder's logits.
    folder = tmp_path / "mxfp4"
    packed = _mxfp4_folder("gpt_oss_gguf", folder)
    path = infer.convert(folder, tmp_path / "m.gguf", type="f32", progress=False)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    for name, (codes, scales) in packed.items():
        layer = re.search(r"layers\.(\d+)\.", name)[1]
        parts = ({"gate": (0, 2), "up": (1, 2)} if "gate_up" in name else {"down": (0, 1)})
        for kind, (start, step) in parts.items():
            t = tensors[f"blk.{layer}.ffn_{kind}_exps.weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4, t.name
            c, s = codes[:, start::step], scales[:, start::step]  # the rows of this part
            e, rows, cols = c.shape
            halves = c.reshape(e, rows, cols // 32, 2, 16)
            want = np.concatenate([s[..., None], halves[..., 0, :] | (halves[..., 1, :] << np.uint8(4))], axis=-1)
            assert np.array_equal(np.asarray(t.data).reshape(want.shape), want), t.name
    model = infer.load(path, backend="numpy")
    assert {w.scheme for w in model.network.layers[0].weights["experts"][0].values()} == \
        {"MXFP4 blocks as stored, numpy kernel"}
    prompt = encode(folder, PROMPT)
    want = infer.load(folder, backend="numpy")
    ref = want.backend.to_numpy(want.engine.forward(want.engine.new_sequence(), prompt, all_logits=True))
    got = model.backend.to_numpy(model.engine.forward(model.engine.new_sequence(), prompt, all_logits=True))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)  # the same values; sums in another order


# -- Gemma 4: llama.cpp's gemma4 -------------------------------------------------------------

GEMMA4 = ["gemma4", "gemma4_moe_gguf"]


def _gemma4_layers(config: dict[str, Any]) -> tuple[list[int], list[int]]:
    """Each layer's head size and key/value heads, as infer's Gemma 4 reads the config (either
    form: transformers 5.24's ``per_layer_config`` or the released ``global_head_dim``)."""
    from infer.architectures.gemma4 import Gemma4Config, layer_rope
    from infer.config import from_dict

    c = from_dict(Gemma4Config, {**config, "rope": layer_rope(config)})
    return ([c.layer_head_dim(i) for i in range(c.num_hidden_layers)],
            [c.kv_heads(i) for i in range(c.num_hidden_layers)])


def convert_gemma4(variant: str, out: Path) -> dict[str, np.ndarray]:
    """Write ``variant`` as convert_hf_to_gguf.py's Gemma4Model does (no norm offset; per-layer
    arrays for the layer pattern, key/value heads and double-wide MLPs; the full layers'
    proportional rope as ``rope_freqs`` factors 1 / 1e30; the router's scales as
    ``ffn_gate_inp.scale`` and ``ffn_down_exps.scale``; ``layer_scalar`` as
    ``layer_output_scale.weight``). Returns what each Hugging Face tensor must read back as."""
    from safetensors.numpy import load_file

    folder = tiny_model_dir(variant)
    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    n, arch = cfg["num_hidden_layers"], "gemma4"
    heads, kv_heads = _gemma4_layers(cfg)
    cfg["global_head_dim"] = next(h for h, t in zip(heads, cfg["layer_types"]) if t == "full_attention")
    full_kv = {k for k, t in zip(kv_heads, cfg["layer_types"]) if t == "full_attention"}
    if full_kv != {cfg["num_key_value_heads"]}:  # the released configs' num_global_key_value_heads
        cfg["num_global_key_value_heads"] = full_kv.pop()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n)
    w = gguf.GGUFWriter(str(out), arch)
    swa = [t == "sliding_attention" for t in cfg["layer_types"]]
    shared = cfg.get("num_kv_shared_layers") or 0
    rope = cfg["rope_parameters"]
    md: dict[str, Any] = {
        "context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"], "block_count": n,
        "attention.head_count": cfg["num_attention_heads"], "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
        "attention.key_length": cfg["global_head_dim"], "attention.value_length": cfg["global_head_dim"],
        "attention.key_length_swa": cfg["head_dim"], "attention.value_length_swa": cfg["head_dim"],
        "rope.freq_base": float(rope["full_attention"]["rope_theta"]),
        "rope.freq_base_swa": float(rope["sliding_attention"]["rope_theta"]),
        "attention.sliding_window": cfg["sliding_window"], "attention.shared_kv_layers": shared,
        "embedding_length_per_layer_input": cfg.get("hidden_size_per_layer_input") or 0,
        "rope.dimension_count": cfg["global_head_dim"], "rope.dimension_count_swa": cfg["head_dim"],
    }
    if cfg.get("final_logit_softcapping"):
        md["final_logit_softcapping"] = float(cfg["final_logit_softcapping"])
    if cfg.get("enable_moe_block"):
        md.update({"expert_count": cfg["num_experts"], "expert_used_count": cfg["top_k_experts"],
                   "expert_feed_forward_length": cfg["moe_intermediate_size"]})
    for key, value in md.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    ff = cfg["intermediate_size"]
    if cfg.get("use_double_wide_mlp"):
        w.add_array(f"{arch}.feed_forward_length", [ff if i < n - shared else 2 * ff for i in range(n)])
    else:
        w.add_uint32(f"{arch}.feed_forward_length", ff)
    if cfg.get("num_global_key_value_heads") is not None:
        w.add_array(f"{arch}.attention.head_count_kv",
                    [cfg["num_key_value_heads"] if s else cfg["num_global_key_value_heads"] for s in swa])
    else:
        w.add_uint32(f"{arch}.attention.head_count_kv", cfg["num_key_value_heads"])
    w.add_array(f"{arch}.attention.sliding_window_pattern", swa)
    rotated = int(cfg["global_head_dim"] * rope["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (cfg["global_head_dim"] // 2 - rotated),
                                               np.float32))
    expected: dict[str, np.ndarray] = {}
    for hf, value in sorted(state.items()):
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
        if m and m[2] == "router.scale":
            gguf_name = f"blk.{m[1]}.ffn_gate_inp.scale"
        elif m and m[2] == "router.per_expert_scale":
            gguf_name = f"blk.{m[1]}.ffn_down_exps.scale"
        elif m and m[2] in ("layer_scalar", "experts.gate_up_proj", "experts.down_proj"):
            gguf_name = names.get_name(hf) + ".weight"
        else:
            base, _, suffix = hf.rpartition(".")
            gguf_name = f"{names.get_name(base)}.{suffix}"
        w.add_tensor(gguf_name, np.ascontiguousarray(value, np.float32))
        expected[hf] = value
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("variant", GEMMA4)
def test_gemma4_file_reads_back_and_gives_transformers_logits(variant: str, gguf_dir: Path) -> None:
    path = gguf_dir / f"{variant}.gguf"
    expected = convert_gemma4(variant, path)
    package = open_gguf(path, tokenizer=False)
    hf = json.loads((tiny_model_dir(variant) / "config.json").read_text())
    assert package.model_type == "gemma4_text"
    assert _gemma4_layers(package.config) == _gemma4_layers(hf)  # head sizes, key/value heads per layer
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "sliding_window", "layer_types", "num_kv_shared_layers",
                "hidden_size_per_layer_input", "attention_k_eq_v", "use_double_wide_mlp", "enable_moe_block",
                "tie_word_embeddings", "final_logit_softcapping", "rms_norm_eps"):
        want = hf.get(key)
        assert package.config.get(key) == (pytest.approx(want, rel=1e-7) if isinstance(want, float) else want), key
    src = package.tensors
    assert sorted(src.names()) == sorted(expected)
    for name, want in expected.items():
        got = np.asarray(src.get(name))
        assert got.dtype == np.float32 and got.shape == want.shape, name
        assert np.array_equal(got, want), name  # bit for bit
    _check_logits(variant, path)
    _check_logits_on_torch(variant, path)


def _same_file(ours: Path, theirs: Path, arch: str) -> None:
    """The two GGUF files hold the same tensors (names, shapes, types, bytes) and ``{arch}.*`` keys."""
    a, b = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
    assert {t.name: (list(t.shape), t.tensor_type) for t in a.tensors} == \
        {t.name: (list(t.shape), t.tensor_type) for t in b.tensors}
    mine = {t.name: np.asarray(t.data) for t in a.tensors}
    for t in b.tensors:
        assert np.array_equal(mine[t.name], np.asarray(t.data)), t.name
    keys = {f.name for f in b.fields.values() if f.name.startswith(arch + ".")}
    assert keys <= {f.name for f in a.fields.values()}
    for key in keys:
        assert a.fields[key].contents() == pytest.approx(b.fields[key].contents()), key


@pytest.mark.parametrize("variant", GEMMA4)
def test_infer_convert_writes_gemma4_as_llama_cpps_converter(variant: str, gguf_dir: Path) -> None:
    ours = infer.convert(tiny_model_dir(variant), gguf_dir / f"{variant}_ours.gguf", type="f32", progress=False)
    theirs = gguf_dir / f"{variant}_theirs.gguf"
    convert_gemma4(variant, theirs)
    _same_file(ours, theirs, "gemma4")
    _check_logits(variant, ours)


@pytest.mark.parametrize("variant,what", [("gemma4_moe", "attention_bias is true"),
                                          ("gemma4_moe_gguf", "proportional rope with factor 2.0")])
def test_infer_convert_refuses_gemma4_that_llama_cpp_cannot_hold(variant: str, what: str, tmp_path: Path) -> None:
    folder = tiny_model_dir(variant)
    if variant == "gemma4_moe_gguf":  # the MoE variant's scaled rope, without its biases
        import shutil

        folder = tmp_path / "scaled"
        shutil.copytree(tiny_model_dir(variant), folder)
        cfg = json.loads((folder / "config.json").read_text())
        cfg["rope_parameters"]["full_attention"]["factor"] = 2.0
        (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(infer.errors.ConfigError, match=what):
        infer.convert(folder, tmp_path / "m.gguf", type="f32", progress=False)
