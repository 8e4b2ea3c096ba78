"""The GGUF format: parsing, dequantization, config and tensor normalization.

Small files are written with the ``gguf`` package's ``GGUFWriter`` the way llama.cpp's
converter would write them (Q/K rows permuted for llama, norms stored as w + 1 for
gemma3), then read back. The real SmolLM2 and Gemma 3 files are checked tensor by
tensor against the ``gguf`` package's dequantization and against the weights
transformers produces from the same files.
"""

from __future__ import annotations

import itertools
import json
import time

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from infer.errors import ConfigError, FormatError, UnsupportedArchitectureError, UnsupportedDtypeError
from infer.formats import gguf_quants
from infer.formats.gguf import GGUFQuantizedTensor, detect, open_gguf, read_gguf

# Byte offsets of the float16 scale fields in each type's block (made finite in random blocks).
F16_FIELDS = {"F16": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
              "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
              "IQ4_NL": [0], "IQ4_XS": [0], "BF16": [], "F32": [], "MXFP4": []}
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf.quants.quantize supports these
RAW_ONLY = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")


def random_blocks(qtype: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for ``n_blocks`` blocks of ``qtype``, with finite float16 scales."""
    t = gguf_quants.TYPES_BY_NAME[qtype]
    if qtype == "F32":
        return rng.standard_normal(n_blocks).astype("<f4").view(np.uint8).reshape(n_blocks, 4)
    raw = rng.integers(0, 256, size=(n_blocks, t.type_size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        raw[:, at:at + 2] = (rng.standard_normal(n_blocks) * 0.1).astype("<f2").view(np.uint8).reshape(-1, 2)
    return raw


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(
        a.view(np.uint32), b.view(np.uint32))


# -- dequantization ---------------------------------------------------------------------


@pytest.mark.parametrize("qtype", gguf_quants.SUPPORTED)
def test_dequantize_is_bit_exact_on_random_blocks(qtype):
    rng = np.random.default_rng(sum(map(ord, qtype)))
    for n_blocks in (1, 3, 4099):  # 4099: several chunks, uneven last one
        raw = random_blocks(qtype, n_blocks, rng)
        expected = gguf.quants.dequantize(raw, Q[qtype]).reshape(-1)
        assert same_bits(gguf_quants.dequantize(raw, qtype), expected)


def test_type_table_matches_ggml():
    for t in gguf_quants.GGML_TYPES.values():
        if t.name == "Q8_1":  # gguf-py says 40 bytes; ggml's block_q8_1 (two halves + 32 int8) is 36
            continue
        assert gguf.GGML_QUANT_SIZES[Q(t.id)] == (t.block_size, t.type_size), t.name
        assert Q(t.id).name == t.name


def test_dequantize_rejects_unsupported_types_and_partial_blocks():
    with pytest.raises(UnsupportedDtypeError, match=r"'blk\.0\.x'.*IQ2_XXS.*supported: F32"):
        gguf_quants.dequantize(np.zeros(66, np.uint8), "IQ2_XXS", "blk.0.x")
    with pytest.raises(ValueError, match="whole number"):
        gguf_quants.dequantize(np.zeros(35, np.uint8), "Q8_0")


# -- writing small files the way llama.cpp's converter does -------------------------------


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py, LlamaModel.permute (applied to Q and K)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' LlamaTensorProcessor._reverse_permute_weights."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 256, 4, 2, 512, 64
HEAD_DIM = HIDDEN // HEADS
LAYER_NAMES = {  # GGUF block tensor -> (HF module in the layer, shape)
    "attn_q": ("self_attn.q_proj", (HIDDEN, HIDDEN)),
    "attn_k": ("self_attn.k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "attn_v": ("self_attn.v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "attn_output": ("self_attn.o_proj", (HIDDEN, HIDDEN)),
    "ffn_gate": ("mlp.gate_proj", (FFN, HIDDEN)), "ffn_up": ("mlp.up_proj", (FFN, HIDDEN)),
    "ffn_down": ("mlp.down_proj", (HIDDEN, FFN)),
}
LLAMA_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
GEMMA3_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def write_model(path, arch="llama", layers=2, types=("Q8_0",), tied=False, extra=None, tensors_extra=None,
                skip_hparams=(), biases=None):
    """A tiny model file as llama.cpp would convert it; returns {hf name: expected float32 array}.

    2-D weights cycle through ``types``; quantizable types are quantized from random
    weights, the others get random blocks.
    """
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    hparams = {"block_count": layers, "context_length": 128, "embedding_length": HIDDEN,
               "feed_forward_length": FFN, "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
               "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 5000.0}
    if arch == "gemma3":
        hparams.update({"attention.key_length": HEAD_DIM, "attention.value_length": HEAD_DIM,
                        "attention.sliding_window": 16})
    for key, value in hparams.items():
        if key in skip_hparams:
            continue
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for key, (kind, value) in (extra or {}).items():
        getattr(w, f"add_{kind}")(key, value)
    expected = {}
    qtypes = itertools.cycle(types)

    def add(gguf_name, hf_name, value, heads=None, norm=False):
        """Store ``value`` (HF layout) as the converter does; record what reading it back must give."""
        shift = norm and arch == "gemma3"  # Gemma norms are stored as w + 1
        value = value + np.float32(1) if shift else value
        stored = llama_permute(value, heads) if heads else value
        if stored.ndim == 1:
            w.add_tensor(gguf_name, stored)
            back = stored
        else:
            qtype = next(qtypes)
            if qtype in ("F32", "F16"):
                data = stored.astype(np.float32 if qtype == "F32" else np.float16)
                w.add_tensor(gguf_name, data)
                back = data.astype(np.float32)
            else:
                if qtype in QUANTIZABLE or qtype == "BF16":
                    raw = gguf.quants.quantize(stored, Q[qtype])
                else:
                    rows, cols = stored.shape
                    n_blocks = rows * cols // gguf_quants.TYPES_BY_NAME[qtype].block_size
                    raw = random_blocks(qtype, n_blocks, rng).reshape(rows, -1)
                w.add_tensor(gguf_name, raw, raw_dtype=Q[qtype])
                back = gguf.quants.dequantize(raw, Q[qtype]).reshape(stored.shape)
        back = llama_unpermute(back, heads) if heads else back
        expected[hf_name] = back - np.float32(1) if shift else back

    add("token_embd.weight", "model.embed_tokens.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32))
    for i in range(layers):
        for g, (hf, shape) in LAYER_NAMES.items():
            value = rng.standard_normal(shape).astype(np.float32)
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(g) if arch == "llama" else None
            add(f"blk.{i}.{g}.weight", f"model.layers.{i}.{hf}.weight", value, heads)
            if (arch == "qwen2" if biases is None else biases) and g in ("attn_q", "attn_k", "attn_v"):
                bias = rng.standard_normal(shape[0]).astype(np.float32)
                add(f"blk.{i}.{g}.bias", f"model.layers.{i}.{hf}.bias", bias, heads)
        for g, hf in (GEMMA3_NORMS if arch == "gemma3" else LLAMA_NORMS).items():
            add(f"blk.{i}.{g}.weight", f"model.layers.{i}.{hf}.weight",
                rng.standard_normal(HIDDEN).astype(np.float32), norm=True)
        if arch == "gemma3":
            for g in ("attn_q_norm", "attn_k_norm"):
                add(f"blk.{i}.{g}.weight", f"model.layers.{i}.self_attn.{g[5]}_norm.weight",
                    rng.standard_normal(HEAD_DIM).astype(np.float32), norm=True)
    add("output_norm.weight", "model.norm.weight", rng.standard_normal(HIDDEN).astype(np.float32), norm=True)
    if not tied:
        add("output.weight", "lm_head.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32))
    for name, (array, raw_dtype) in (tensors_extra or {}).items():
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def check_tensors(package, expected):
    src = package.tensors
    assert sorted(src.names()) == sorted(expected)
    for name, want in expected.items():
        got = src.get(name)
        assert src.shape(name) == want.shape, name
        if isinstance(got, GGUFQuantizedTensor):
            assert got.shape == want.shape and got.qtype == src.storage_dtype(name)
            assert got.raw.dtype == np.uint8 and got.raw.shape[0] == int(np.prod(want.shape[:-1]))
            got = got.dequantize()
        assert got.shape == want.shape, name
        assert np.array_equal(got.astype(np.float32), want), name


# -- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("types", [("F32",), ("F16", "BF16"), QUANTIZABLE, RAW_ONLY])
def test_llama_round_trip_undoes_the_qk_permutation(tmp_path, types):
    expected = write_model(tmp_path / "m.gguf", "llama", types=types)
    package = open_gguf(tmp_path / "m.gguf")
    try:
        assert package.model_type == "llama" and package.format == "gguf" and package.tokenizer is None
        check_tensors(package, expected)
        c = package.config
        assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
                c["intermediate_size"], c["head_dim"], c["vocab_size"]) == (HIDDEN, 2, HEADS, KV_HEADS, FFN,
                                                                           HEAD_DIM, VOCAB)
        assert c["rope_parameters"] == {"rope_type": "default", "rope_theta": 5000.0}
        assert c["rope_theta"] == 5000.0 and c["rope_scaling"] is None
        assert c["rms_norm_eps"] == np.float32(1e-5) and c["max_position_embeddings"] == 128
        assert c["tie_word_embeddings"] is False and c["hidden_act"] == "silu"
        assert package.generation.eos_token_ids == (2,) and package.generation.bos_token_id == 1
    finally:
        package.tensors.close()


def test_storage_dtypes_views_and_zero_copy(tmp_path):
    write_model(tmp_path / "m.gguf", "llama", types=("F16", "F32", "BF16", "Q4_K"), layers=1)
    package = open_gguf(tmp_path / "m.gguf")
    src = package.tensors
    dtypes = {n: src.storage_dtype(n) for n in src.names()}
    assert dtypes["model.layers.0.input_layernorm.weight"] == "float32"
    assert dtypes["model.embed_tokens.weight"] == "float16"
    assert src.get("model.embed_tokens.weight").dtype == np.float16
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "float32"
    assert src.get("model.layers.0.self_attn.q_proj.weight").flags.writeable  # rows reordered: a copy
    assert dtypes["model.layers.0.self_attn.v_proj.weight"] == "Q4_K"
    assert dtypes["model.layers.0.self_attn.k_proj.weight"] == "bfloat16"
    assert src.get("model.layers.0.self_attn.k_proj.weight").dtype == np.float32  # widened
    v = src.get("model.layers.0.self_attn.v_proj.weight")  # Q4_K, not permuted: a view of the file
    assert isinstance(v, GGUFQuantizedTensor) and not v.raw.flags.owndata and not v.raw.flags.writeable
    assert v.raw.shape == (KV_HEADS * HEAD_DIM, HIDDEN // 256 * 144)
    norm = src.get("model.layers.0.input_layernorm.weight")
    assert not norm.flags.owndata and not norm.flags.writeable
    assert src.gguf_name("model.layers.0.self_attn.v_proj.weight") == "blk.0.attn_v.weight"
    assert "blk.0.attn_v.weight" in src.location("model.layers.0.self_attn.v_proj.weight")
    src.close()


def test_gemma3_norms_config_and_tied_embeddings(tmp_path):
    expected = write_model(tmp_path / "m.gguf", "gemma3", layers=7, tied=True, types=("Q4_K", "Q6_K", "Q5_0"))
    package = open_gguf(tmp_path / "m.gguf")
    check_tensors(package, expected)  # norms come back as (w + 1) - 1, Q/K rows untouched
    c = package.config
    assert package.model_type == "gemma3_text" and c["tie_word_embeddings"] is True
    assert c["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"]
    assert c["sliding_window"] == 16 and c["sliding_window_pattern"] == 6
    assert c["rope_parameters"] == {"full_attention": {"rope_type": "default", "rope_theta": 5000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert c["rope_local_base_freq"] == 10000.0 and c["rope_theta"] == 5000.0
    assert c["query_pre_attn_scalar"] == HEAD_DIM and c["head_dim"] == HEAD_DIM
    assert c["hidden_activation"] == "gelu_pytorch_tanh"
    assert "final_logit_softcapping" not in c
    package.tensors.close()


def test_gemma3_optional_keys(tmp_path):
    extra = {"gemma3.final_logit_softcapping": ("float32", 30.0), "gemma3.attention.scale": ("float32", 0.125),
             "gemma3.rope.freq_base_swa": ("float32", 20000.0), "gemma3.attention.sliding_window_pattern":
             ("uint32", 2), "gemma3.rope.scaling.type": ("string", "linear"),
             "gemma3.rope.scaling.factor": ("float32", 8.0)}
    write_model(tmp_path / "m.gguf", "gemma3", layers=4, extra=extra)
    c = open_gguf(tmp_path / "m.gguf").config
    assert c["final_logit_softcapping"] == 30.0 and c["query_pre_attn_scalar"] == 64.0
    assert c["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert c["rope_parameters"]["sliding_attention"]["rope_theta"] == 20000.0
    assert c["rope_parameters"]["full_attention"] == {"rope_type": "linear", "rope_theta": 5000.0, "factor": 8.0}
    assert c["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}


def test_llama_biases_are_unpermuted_too(tmp_path):
    expected = write_model(tmp_path / "m.gguf", "llama", layers=1, biases=True)
    check_tensors(open_gguf(tmp_path / "m.gguf"), expected)


def test_qwen2_biases_and_no_permutation(tmp_path):
    expected = write_model(tmp_path / "m.gguf", "qwen2", layers=1, types=("Q8_0", "F32"))
    package = open_gguf(tmp_path / "m.gguf")
    check_tensors(package, expected)
    assert package.model_type == "qwen2" and "model.layers.0.self_attn.q_proj.bias" in package.tensors


def test_llama3_rope_freqs_become_rope_parameters(tmp_path):
    from infer.formats.gguf_arch import _llama3_divisors

    rope = {"rope_theta": 5000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    factors = _llama3_divisors(rope, HEAD_DIM).astype(np.float32)
    mid = np.flatnonzero((factors > 1) & (factors < 32))
    assert factors[0] == 1 and factors[-1] == 32 and len(mid)
    write_model(tmp_path / "a.gguf", layers=1, tensors_extra={"rope_freqs.weight": (factors, None)})
    package = open_gguf(tmp_path / "a.gguf")
    assert package.config["rope_parameters"] == {"rope_type": "llama3", **rope}
    assert package.config["rope_scaling"]["rope_type"] == "llama3"
    assert "rope_freqs.weight" not in package.tensors.names()
    # Divisors that follow no rule are used as stored (llama.cpp applies the tensor whatever made it).
    odd = factors.copy()
    odd[mid[0]] *= 1.5
    write_model(tmp_path / "b.gguf", layers=1, tensors_extra={"rope_freqs.weight": (odd, None)})
    package = open_gguf(tmp_path / "b.gguf")
    assert package.config["rope_parameters"] == {"rope_type": "default", "rope_theta": 5000.0,
                                                 "freq_factors": odd.tolist()}
    assert package.config["rope_scaling"] == {"rope_type": "default", "freq_factors": odd.tolist()}
    for bad in (np.zeros_like(odd), np.full_like(odd, np.nan), odd[:-1]):
        write_model(tmp_path / "c.gguf", layers=1, tensors_extra={"rope_freqs.weight": (bad, None)})
        with pytest.raises(ConfigError, match="positive finite factors"):
            open_gguf(tmp_path / "c.gguf")


def test_eos_includes_end_of_turn(tmp_path):
    write_model(tmp_path / "m.gguf", layers=1, extra={"tokenizer.ggml.eot_token_id": ("uint32", 7)})
    assert open_gguf(tmp_path / "m.gguf").generation.eos_token_ids == (2, 7)


# -- errors ----------------------------------------------------------------------------------------


def test_string_arrays_read_like_lists_and_stay_small(tmp_path):
    """Arrays of strings (a vocabulary) are held as their bytes and decoded on
    access: they behave as sequences of str and compare equal to lists, and a
    50k-token vocabulary costs a fraction of what Python strings would."""
    import tracemalloc

    words = [f"tok{i}" for i in range(50_000)] + ["", "é€😀", "\n"]
    write_model(tmp_path / "m.gguf", extra={"tokenizer.ggml.tokens": ("array", words),
                                            "tokenizer.ggml.merges": ("array", ["a b", "ab c"])})
    tracemalloc.start()
    try:
        file = read_gguf(tmp_path / "m.gguf")
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    tokens = file.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == len(words) and tokens == words and words == tokens and list(tokens) == words
    assert (tokens[0], tokens[-1], tokens[-3], tokens[50_001]) == ("tok0", "\n", "", "é€😀")
    assert tokens[10:13] == ["tok10", "tok11", "tok12"] and tokens.index("tok777") == 777
    assert tokens != words[:-1] and tokens != "tok0" and file.metadata["tokenizer.ggml.merges"] == ["a b", "ab c"]
    with pytest.raises(IndexError, match="out of range"):
        tokens[len(words)]
    # As a list: ~50k str objects of ~55 bytes plus 8-byte pointers, about 3 MiB.
    assert held < 1.5 * 2**20, f"{held / 2**20:.1f} MiB held after parsing"


def test_unknown_architecture_lists_supported(tmp_path):
    write_model(tmp_path / "m.gguf", "falcon", layers=1)
    from infer.formats.gguf_arch import ARCHITECTURES

    supported = ", ".join(sorted(ARCHITECTURES))  # deepseek2, falcon-h1, gemma3, ... smollm3
    assert {"llama", "gemma3", "mamba2", "granitehybrid", "falcon-h1"} <= set(ARCHITECTURES)
    assert "qwen3moe" in supported and "qwen3next" in supported
    with pytest.raises(UnsupportedArchitectureError, match=rf"'falcon'.*supported: {supported}"):
        open_gguf(tmp_path / "m.gguf")


def test_unsupported_type_names_type_and_tensor(tmp_path):
    raw = np.zeros((4, 66), np.uint8)
    # A known but unreadable type: IQ2_XXS in place of a projection.
    w = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    for key, value in {"block_count": 1, "embedding_length": 256, "feed_forward_length": 256,
                       "attention.head_count": 4, "vocab_size": 10}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=Q.IQ2_XXS)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UnsupportedDtypeError, match=r"'blk\.0\.ffn_up\.weight'.*IQ2_XXS"):
        open_gguf(tmp_path / "iq.gguf")


def test_nextn_blocks_become_mtp_modules_in_deepseek_naming(tmp_path):
    # llama.cpp counts the MTP ("NextN") blocks in block_count and says how many trail it;
    # their blk.N.nextn.* tensors take DeepSeek-V3's names (docs/mtp.md).
    rng = np.random.default_rng(1)
    nextn = {f"blk.2.nextn.{g}.weight": rng.standard_normal(shape).astype(np.float32) for g, shape in (
        ("eh_proj", (HIDDEN, 2 * HIDDEN)), ("enorm", (HIDDEN,)), ("hnorm", (HIDDEN,)),
        ("shared_head_norm", (HIDDEN,)), ("embed_tokens", (VOCAB, HIDDEN)), ("shared_head_head", (VOCAB, HIDDEN)))}
    expected = write_model(tmp_path / "m.gguf", layers=3, types=("F32",), extra={
        "llama.nextn_predict_layers": ("uint32", 1)}, tensors_extra={k: (v, None) for k, v in nextn.items()})
    hf = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm", "shared_head_norm": "shared_head.norm",
          "embed_tokens": "embed_tokens", "shared_head_head": "shared_head.head"}
    for name, value in nextn.items():
        expected[f"model.layers.2.{hf[name.split('.')[3]]}.weight"] = value
    package = open_gguf(tmp_path / "m.gguf", tokenizer=False)
    assert package.config["num_hidden_layers"] == 2 and package.config["num_nextn_predict_layers"] == 1
    check_tensors(package, expected)
    write_model(tmp_path / "bad.gguf", layers=2, extra={"llama.nextn_predict_layers": ("uint32", 2)})
    with pytest.raises(ConfigError, match="nextn_predict_layers is 2, but block_count is 2"):
        open_gguf(tmp_path / "bad.gguf", tokenizer=False)


def test_unknown_tensor_and_missing_key(tmp_path):
    write_model(tmp_path / "a.gguf", layers=1, tensors_extra={"blk.0.mystery.weight": (np.zeros(4, np.float32), None)})
    with pytest.raises(FormatError, match=r"unknown for architecture 'llama': blk\.0\.mystery\.weight"):
        open_gguf(tmp_path / "a.gguf")
    write_model(tmp_path / "b.gguf", layers=1, skip_hparams=("embedding_length",))
    with pytest.raises(ConfigError, match=r"llama\.embedding_length is missing"):
        open_gguf(tmp_path / "b.gguf")
    write_model(tmp_path / "c.gguf", layers=1, tensors_extra={"blk.5.attn_q.weight": (np.zeros(4, np.float32), None)})
    with pytest.raises(FormatError, match=r"blk\.5\.attn_q\.weight"):  # beyond block_count
        open_gguf(tmp_path / "c.gguf")


def test_bad_files_name_file_and_offset(tmp_path):
    path = tmp_path / "m.gguf"
    write_model(path, layers=1)
    data = path.read_bytes()
    (tmp_path / "short.gguf").write_bytes(data[:1000])
    with pytest.raises(FormatError, match=r"short\.gguf: .*at byte \d+"):
        open_gguf(tmp_path / "short.gguf")
    (tmp_path / "v9.gguf").write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    with pytest.raises(FormatError, match="unsupported GGUF version 9: expected 2 or 3"):
        open_gguf(tmp_path / "v9.gguf")
    (tmp_path / "be.gguf").write_bytes(data[:4] + (3).to_bytes(4, "big") + data[8:])
    with pytest.raises(FormatError, match="big-endian"):
        open_gguf(tmp_path / "be.gguf")
    (tmp_path / "count.gguf").write_bytes(data[:8] + (2**62).to_bytes(8, "little") + data[16:])
    with pytest.raises(FormatError, match=r"tensor count 4611686018427387904 cannot fit"):
        open_gguf(tmp_path / "count.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(FormatError, match="too short"):
        open_gguf(tmp_path / "empty.gguf")
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(FormatError, match="not a GGUF file"):
        open_gguf(tmp_path / "magic.gguf")


@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_bad_alignment(tmp_path, alignment):
    write_model(tmp_path / "m.gguf", layers=1, extra={"general.alignment": ("uint32", alignment)})
    with pytest.raises(FormatError, match="power of two"):
        open_gguf(tmp_path / "m.gguf")


def test_other_alignments_read_back(tmp_path):
    expected = write_model(tmp_path / "m.gguf", layers=1, extra={"general.alignment": ("uint32", 64)})
    file = read_gguf(tmp_path / "m.gguf")
    assert file.alignment == 64 and file.data_start % 64 == 0
    assert all(t.begin % 64 == file.data_start % 64 for t in file.tensors.values())
    file.close()
    check_tensors(open_gguf(tmp_path / "m.gguf"), expected)


def test_detect(tmp_path):
    write_model(tmp_path / "m.gguf", layers=1)
    (tmp_path / "x.bin").write_bytes(b"GGU")
    assert detect(tmp_path / "m.gguf")
    assert not detect(tmp_path / "x.bin") and not detect(tmp_path) and not detect(tmp_path / "missing")


def test_registered_through_entry_point(tmp_path):
    from infer.plugins import get_registry

    write_model(tmp_path / "m.gguf", layers=1)
    registry = get_registry()
    assert registry.formats["gguf"].open is open_gguf
    assert registry.format_for(tmp_path / "m.gguf").name == "gguf"


# -- the real files ---------------------------------------------------------------------------------


def _every_tensor_matches_gguf_package(file):
    """Dequantize every stored tensor both ways; returns infer's total time."""
    total = 0.0
    for info in file.tensors.values():
        raw = file.raw(info)
        start = time.perf_counter()
        ours = gguf_quants.dequantize(raw, info.type.name, info.name)
        total += time.perf_counter() - start
        assert same_bits(ours, gguf.quants.dequantize(raw, Q[info.type.name]).reshape(-1)), info.name
    return total


def _same_as_gguf_reader(file):
    """Metadata and tensor infos equal those of the gguf package's reader (slow on big vocabularies)."""
    reader = gguf.GGUFReader(file.path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(file.metadata)
    for key, field in fields.items():
        ours, theirs = file.metadata[key], field.contents()
        assert file.value_types[key] == field.types[0], key
        if isinstance(ours, np.ndarray):
            assert ours.tolist() == list(theirs), key
        else:
            assert ours == theirs, key
    assert [t.name for t in reader.tensors] == list(file.tensors)
    for t in reader.tensors:
        info = file.tensors[t.name]
        assert (info.type.name, info.dims, info.begin, info.end - info.begin) == (
            t.tensor_type.name, tuple(int(d) for d in t.shape), t.data_offset, t.n_bytes), t.name


def _matches_transformers(package, hf_dir):
    from safetensors.numpy import load_file

    state = load_file(str(hf_dir / "model.safetensors"))
    src = package.tensors
    expected = set(state) | ({"lm_head.weight"} if package.config["tie_word_embeddings"] else set())
    assert set(src.names()) | {"lm_head.weight"} == expected | {"lm_head.weight"}
    for name in src.names():
        value = src.get(name)
        value = value.dequantize() if isinstance(value, GGUFQuantizedTensor) else value
        assert value.shape == state[name].shape, name
        assert np.array_equal(value.astype(np.float32), state[name]), name
    return json.loads((hf_dir / "config.json").read_text())


@pytest.mark.slow
def test_smollm2_file():
    from reference import smollm2_gguf_path, smollm2_hf_dir

    path = smollm2_gguf_path()
    file = read_gguf(path)
    _same_as_gguf_reader(file)
    seconds = _every_tensor_matches_gguf_package(file)
    file.close()
    print(f"SmolLM2: infer dequantized every tensor in {seconds:.2f} s")
    package = open_gguf(path, tokenizer=False)
    c = package.config
    assert (c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
            c["num_key_value_heads"], c["rope_parameters"]["rope_theta"], c["tie_word_embeddings"]) == (
        49152, 576, 30, 9, 3, 100000.0, True)
    hf = _matches_transformers(package, smollm2_hf_dir())
    for key, value in hf.items():
        if key in c and key not in ("model_type",):
            assert c[key] == value, key
    package.tensors.close()


@pytest.mark.slow
def test_gemma3_file():
    from real_models import gemma3_gguf_path, gemma3_hf_dir

    path = gemma3_gguf_path()
    file = read_gguf(path)  # (not compared with GGUFReader: it takes ~20 s on the 262k-token vocabulary)
    seconds = _every_tensor_matches_gguf_package(file)
    file.close()
    print(f"Gemma 3: infer dequantized every tensor in {seconds:.2f} s")
    package = open_gguf(path, tokenizer=False)
    hf = _matches_transformers(package, gemma3_hf_dir())
    c = package.config
    assert package.model_type == hf["model_type"] == "gemma3_text"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "sliding_window",
                "layer_types", "rope_parameters", "query_pre_attn_scalar", "tie_word_embeddings",
                "hidden_activation", "bos_token_id", "eos_token_id"):
        assert c[key] == hf[key], key
    assert hf.get("final_logit_softcapping") is None and "final_logit_softcapping" not in c
    package.tensors.close()


@pytest.mark.slow
def test_release_drops_a_tensors_pages_and_reads_still_work() -> None:
    # After the backend has its own copy, the loader tells the source; the map's
    # pages may leave the resident set, and a later read faults them back in.
    import infer

    model = infer.load("smollm2-135m", backend="numpy")
    source = model.package.tensors
    name = "model.layers.0.mlp.up_proj.weight"
    before = np.asarray(source.get(name).dequantize())
    source.release(name)
    source.release("no.such.tensor")  # unknown names are ignored
    assert np.array_equal(np.asarray(source.get(name).dequantize()), before)


def test_the_write_types_listed_at_registration_are_the_writer_s():
    """gguf.py lists them so that registering the format imports no writer."""
    from infer.formats import gguf, gguf_write

    assert gguf.WRITE_TYPES == ("f16", *(t for t in gguf_write.TYPES if t != "f16"))
