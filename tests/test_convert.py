"""`infer convert`: Hugging Face folders to GGUF files and back.

The tiny random models of ``reference.py`` are converted, read back by infer, by the
``gguf`` package and by transformers, and compared tensor by tensor: float32 round
trips must be bit-exact, quantized files must hold exactly what the reference
quantizers (``gguf.quants``; llama.cpp's own for the K types, through fixed blocks
in ``data/k_quants_llama_cpp.npz``) produce.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file
from tokenizers import Tokenizer

import infer
from infer.errors import ConversionError, OutputExistsError, UnsupportedArchitectureError
from infer.formats import gguf_quantize, gguf_write, gguf_write_tokenizer
from infer.formats.gguf import open_gguf
from infer.tools.cli import main
from reference import tiny_model_dir

FAMILIES = ("llama3", "llama_linear", "head_dim", "qwen2", "gemma3", "gemma3_softcap", "mistral", "smollm2_like")
DATA = Path(__file__).parent / "data"
TEXTS = ["Hello world, the quick brown fox 123 jumps.\n\tok", " leading space", "<|im_start|>user\nhi<|im_end|>",
         "numbers 3.14159 and 2024", ""]
#: Hyperparameters a round trip must keep (the rest are transformers' defaults either way).
KEPT = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "max_position_embeddings", "rms_norm_eps", "vocab_size", "tie_word_embeddings", "sliding_window",
        "query_pre_attn_scalar", "rope_parameters", "bos_token_id", "head_dim", "final_logit_softcapping",
        "attn_logit_softcapping")


def _weights(folder: Path) -> dict[str, np.ndarray]:
    return load_file(folder / "model.safetensors")


def _permuted(name: str, value: np.ndarray, config: dict) -> np.ndarray:
    """A llama-family Q/K projection in llama.cpp's row order (as the converter writes it)."""
    heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
    return value[gguf_write._permute_rows(value.shape[0], heads)]


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_round_trip_is_bit_exact(family, tmp_path):
    src = tiny_model_dir(family)
    file = infer.convert(src, tmp_path / "m.gguf", type="f32", progress=False)
    back = infer.convert(file, tmp_path / "hf", type="f32", progress=False)
    want, got = _weights(src), _weights(back)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        # Gemma's norms travel as w + 1 in float32, as llama.cpp stores them; (w + 1) - 1 is
        # exact for these weights (|w| < 1 with few low bits), so every tensor is compared exactly.
        assert got[name].dtype == value.dtype and np.array_equal(got[name].view(np.uint32),
                                                                 value.view(np.uint32)), name
    c_want, c_got = (json.loads((d / "config.json").read_text()) for d in (src, back))
    for key in KEPT:
        if key in c_want:
            assert c_got.get(key) == c_want[key], key
    t_want, t_got = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (src, back))
    for text in TEXTS:
        assert t_got.encode(text).ids == t_want.encode(text).ids, text
    template = json.loads((back / "tokenizer_config.json").read_text())["chat_template"]
    assert template == json.loads((src / "tokenizer_config.json").read_text())["chat_template"]
    generation = json.loads((back / "generation_config.json").read_text())
    assert generation["bos_token_id"] == c_want["bos_token_id"]


def test_round_trip_model_answers_as_the_original(tmp_path):
    # The folder written back is one infer (and transformers) load to the same logits.
    src = tiny_model_dir("smollm2_like")
    file = infer.convert(src, tmp_path / "m.gguf", type="f32", progress=False)
    back = infer.convert(file, tmp_path / "hf", progress=False)
    ids = [1, 17, 42, 99, 7]

    def greedy(folder):
        model = infer.load(folder, backend="numpy")
        return list(model.generate_tokens(ids, max_tokens=12, temperature=0, ignore_eos=True))

    assert greedy(back) == greedy(src)  # the same weights and config: the same float32 sums


def test_large_checkpoints_are_written_in_shards(tmp_path, monkeypatch):
    from infer.formats import huggingface_write

    src = tiny_model_dir("qwen2")
    file = infer.convert(src, tmp_path / "m.gguf", type="f32", progress=False)
    monkeypatch.setattr(huggingface_write, "SHARD_BYTES", 40_000)
    back = infer.convert(file, tmp_path / "hf", type="f16", progress=False)
    index = json.loads((back / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    got = {}
    for shard in shards:
        assert (back / shard).stat().st_size <= 50_000  # at most 40 kB a shard (or one tensor), plus its header: the limit plus its header
        got.update(load_file(back / shard))
    want = _weights(src)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value.astype(np.float16))
    package = infer.load(back, backend="numpy")  # infer reads the index
    assert package.config["vocab_size"] == want["model.embed_tokens.weight"].shape[0]


@pytest.mark.parametrize("family", ["llama3", "mistral", "gemma3"])
def test_transformers_loads_the_folder_written_back(family, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    src = tiny_model_dir(family)
    back = infer.convert(infer.convert(src, tmp_path / "m.gguf", type="f32", progress=False), tmp_path / "hf",
                         progress=False)
    ids = torch.tensor([[1, 5, 9, 30, 70, 100, 3, 4, 5, 6, 7, 8]])  # longer than Mistral's window of 8
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32)(ids).logits
    assert torch.equal(got, want)  # the same weights and configuration: the same float32 computation


def test_q8_0_holds_what_gguf_quants_writes_and_infer_reads_it_back(tmp_path):
    src = tiny_model_dir("llama3")
    config = json.loads((src / "config.json").read_text())
    file = infer.convert(src, tmp_path / "m.gguf", type="q8_0", progress=False)
    reader = gguf.GGUFReader(str(file))
    stored = {t.name: t for t in reader.tensors}
    assert reader.get_field("general.file_type").contents() == 7  # LlamaFileType.MOSTLY_Q8_0
    package = open_gguf(file)
    weights = _weights(src)
    for name, value in weights.items():
        gguf_name = gguf_write.gguf_tensor_name(gguf_write.architecture_for("llama"), name)
        t = stored[gguf_name]
        if value.ndim == 1:
            assert t.tensor_type == Q.F32
            continue
        assert t.tensor_type == Q.Q8_0, name
        layout = _permuted(name, value, config) if name.endswith(("q_proj.weight", "k_proj.weight")) else value
        np.testing.assert_array_equal(np.asarray(t.data).reshape(layout.shape[0], -1), gguf.quants.quantize(layout, Q.Q8_0))
        expected = gguf.quants.dequantize(gguf.quants.quantize(value, Q.Q8_0), Q.Q8_0)
        got = package.tensors.get(name)
        # Q8_0 blocks span 32 values of one row, so permuting rows commutes with quantizing.
        np.testing.assert_array_equal(got.dequantize(), expected)
    package.tensors.close()


@pytest.mark.parametrize("family,kind", [("qwen2", "f32"), ("smollm2_like", "f32"), ("gemma3", "f32"),
                                         ("smollm2_like", "q8_0")])
def test_transformers_loads_the_written_file(family, kind, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny_model_dir(family)
    file = infer.convert(src, tmp_path / "m.gguf", type=kind, progress=False)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=file.name, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    got, want = model.state_dict(), reference.state_dict()
    assert set(want) <= set(got)
    if kind != "f32":  # what infer reads from the file (dequantized as ggml does), in Hugging Face layout
        package = open_gguf(file, tokenizer=False)
        embed = "model.embed_tokens.weight"
        for name in want:
            value = package.tensors.get(embed if name == "lm_head.weight" else name)
            want[name] = torch.from_numpy(np.array(value.dequantize() if hasattr(value, "dequantize") else value))
        package.tensors.close()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=file.name)
    own = Tokenizer.from_file(str(src / "tokenizer.json"))
    for text in TEXTS:
        assert tokenizer(text, add_special_tokens=False).input_ids == own.encode(text, add_special_tokens=False).ids


def test_k_quants_equal_llama_cpp_reference_blocks():
    # Fixed inputs and the blocks llama.cpp's quantize_row_q{4,5,6}_K_ref made of them:
    # normal, scaled over 18 orders of magnitude, sparse, all-positive, heavy-tailed,
    # integer, zero and constant blocks (6 super-blocks each). Made once by compiling
    # vendor/llama.cpp/ggml/src/ggml-quants.c of the llama-cpp-python 0.3.36 sdist as a
    # shared library (gcc -O3, x86-64 without FMA, as ggml-base is built) and calling those
    # functions through ctypes on the x_* arrays stored beside the blocks.
    data = np.load(DATA / "k_quants_llama_cpp.npz")
    cases = [k[2:] for k in data if k.startswith("x_")]
    assert len(cases) == 7
    for case in cases:
        x = data[f"x_{case}"]
        for qtype, fn in (("Q4_K", gguf_quantize.quantize_q4_k), ("Q5_K", gguf_quantize.quantize_q5_k),
                          ("Q6_K", gguf_quantize.quantize_q6_k)):
            np.testing.assert_array_equal(fn(x), data[f"{qtype}_{case}"], err_msg=f"{qtype} {case}")


# Quantization error bound per type: a uniform quantizer with 2^b levels over a block's
# range r has a step r / (2^b - 1) and an RMS error of step / sqrt(12). The GGML types
# lose a little to float16 scales, to quantized sub-block scales (K types) and to the
# one-sided clamp of the symmetric types (range 2 * max|x|), so the bound allowed is 1.5x
# that, on the mean squared error over many Gaussian blocks. A wrong bit layout or scale
# is orders of magnitude beyond it.
BITS = {"Q8_0": (8, 32, True), "Q4_0": (4, 32, True), "Q4_1": (4, 32, False), "Q5_0": (5, 32, True),
        "Q5_1": (5, 32, False), "Q4_K": (4, 32, False), "Q5_K": (5, 32, False), "Q6_K": (6, 16, True)}


@pytest.mark.parametrize("qtype", sorted(BITS))
def test_quantization_error_within_the_type_bound(qtype):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 1024)).astype(np.float32)
    raw = gguf_quantize.quantize_rows(x, qtype)
    back = gguf.quants.dequantize(raw, Q[qtype]).reshape(x.shape)
    bits, group, symmetric = BITS[qtype]
    g = x.reshape(-1, group)
    span = 2 * np.abs(g).max(axis=1) if symmetric else g.max(axis=1) - np.minimum(g.min(axis=1), 0)
    bound = np.mean((span / (2**bits - 1)) ** 2 / 12) * 1.5**2
    assert np.mean((back - x) ** 2) <= bound


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_1", "Q4_K", "Q6_K"])
def test_quantization_error_within_the_type_bound_on_real_weights(qtype):
    # SmolLM2-135M's down projection of layer 5: rows of 1536 values, whole K super-blocks.
    from reference import smollm2_hf_dir

    x = load_file(smollm2_hf_dir() / "model.safetensors")["model.layers.5.mlp.down_proj.weight"]
    back = gguf.quants.dequantize(gguf_quantize.quantize_rows(x, qtype), Q[qtype]).reshape(x.shape)
    bits, group, symmetric = BITS[qtype]
    g = x.reshape(-1, group)
    span = 2 * np.abs(g).max(axis=1) if symmetric else g.max(axis=1) - np.minimum(g.min(axis=1), 0)
    assert np.mean((back - x) ** 2) <= np.mean((span / (2**bits - 1)) ** 2 / 12) * 1.5**2


def _package_with(pre_tokenizer, ignore_merges=False):
    """A package whose only content is a byte-level BPE tokenizer with this pre-tokenizer."""
    from tokenizers import models

    from infer.package import ModelPackage
    from infer.tokenizer import Tokenizer as InferTokenizer

    backend = Tokenizer.from_str(Path(tiny_model_dir("llama2") / "tokenizer.json").read_text())
    spec = json.loads(backend.to_str())
    backend.model = models.BPE(vocab=spec["model"]["vocab"], merges=[tuple(m) if not isinstance(m, str) else
                                                                      tuple(m.split(" ")) for m in spec["model"]["merges"]],
                               ignore_merges=ignore_merges)
    backend.pre_tokenizer = pre_tokenizer
    return ModelPackage(model_type="llama", config={}, tensors=None, tokenizer=InferTokenizer(backend))


def test_pre_tokenizer_gets_the_name_llama_cpp_knows():
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as pt

    from infer.errors import TokenizerError
    from infer.formats.gguf_tokenizer import _LLAMA3, _QWEN2

    def name(pre, **kw):
        return gguf_write_tokenizer.tokenizer_metadata(_package_with(pre, **kw), 0)["tokenizer.ggml.pre"]

    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=False)
    assert name(pt.ByteLevel(add_prefix_space=False)) == "gpt-2"
    assert name(pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False)])) == "smollm"
    split = pt.Split(Regex(_LLAMA3), behavior="isolated")
    assert name(pt.Sequence([split, byte_level]), ignore_merges=True) == "llama-bpe"
    assert name(pt.Sequence([split, byte_level])) == "dbrx"  # the same split, merges not ignored
    assert name(pt.Sequence([pt.Split(Regex(_QWEN2), behavior="isolated"), byte_level])) == "qwen2"
    with pytest.raises(TokenizerError, match=r"pre-tokenizer .* has no name llama.cpp knows; known: gpt-2"):
        name(pt.Sequence([pt.Split(Regex(r"\\w+"), behavior="isolated"), byte_level]))


def test_q4_1_of_smollm2_is_llama_cpps_own_file_byte_for_byte(tmp_path):
    # The suite's SmolLM2 folder is the Q4_1 release (quantized by llama.cpp) dequantized:
    # quantizing it again must give llama.cpp's tensors back exactly, the tied embedding
    # included (Q8_0: llama-quantize's output rule with its fallback for 576-wide rows).
    from infer.formats.gguf_file import read_gguf
    from reference import smollm2_gguf_path, smollm2_hf_dir

    file = infer.convert(smollm2_hf_dir(), tmp_path / "m.gguf", type="q4_1", progress=False)
    ours, theirs = read_gguf(file), read_gguf(smollm2_gguf_path())
    try:
        assert list(ours.tensors) == list(theirs.tensors)
        for name, info in theirs.tensors.items():
            mine = ours.tensors[name]
            assert (mine.type.name, mine.dims) == (info.type.name, info.dims), name
            assert np.array_equal(ours.raw(mine), theirs.raw(info)), name
    finally:
        ours.close(), theirs.close()


def test_sentencepiece_vocabulary_is_written_as_llama_cpp_does():
    # Gemma 3's tokenizer.json (from the real 270M file, through transformers) written back
    # as GGUF metadata equals what llama.cpp's converter stored in that file, and tokenizes alike.
    from infer.formats.gguf_file import read_gguf
    from infer.formats.gguf_tokenizer import tokenizer_from_gguf
    from infer.formats.huggingface import open_folder
    from real_models import gemma3_gguf_path, gemma3_hf_dir

    package = open_folder(gemma3_hf_dir())
    md = gguf_write_tokenizer.tokenizer_metadata(package, package.config["vocab_size"], "gemma3")
    original = read_gguf(gemma3_gguf_path())
    try:
        theirs = original.metadata
        assert md["tokenizer.ggml.model"] == theirs["tokenizer.ggml.model"] == "llama"
        assert md["tokenizer.ggml.tokens"] == list(theirs["tokenizer.ggml.tokens"])
        np.testing.assert_array_equal(md["tokenizer.ggml.token_type"], np.asarray(theirs["tokenizer.ggml.token_type"]))
        for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "add_bos_token",
                    "add_eos_token", "add_space_prefix"):
            assert md[f"tokenizer.ggml.{key}"] == theirs[f"tokenizer.ggml.{key}"], key
        assert md.get("tokenizer.chat_template") == theirs.get("tokenizer.chat_template")
        mine = tokenizer_from_gguf({**md, "general.architecture": "gemma3"}, source="written")
        reference = tokenizer_from_gguf(theirs, source="llama.cpp's")
        for text in TEXTS + ["  two  spaces\n\nnewlines", "<start_of_turn>user\nhi<end_of_turn>", "émoji 🤖 中文"]:
            assert mine.encode(text) == reference.encode(text), text
    finally:
        original.close()


def test_quantize_rows_works_in_slabs_with_progress(monkeypatch):
    monkeypatch.setattr(gguf_quantize, "SLAB_VALUES", 1024)
    x = np.random.default_rng(1).standard_normal((40, 256)).astype(np.float32)
    done = []
    raw = gguf_quantize.quantize_rows(x, "Q6_K", advance=done.append)
    assert done == [1024] * 10  # four rows a slab
    np.testing.assert_array_equal(raw, gguf_quantize.quantize_q6_k(x).reshape(40, -1))


def test_k_m_mix_follows_llama_quantize():
    # llama-quantize's Q4_K_M for a dense model without imatrix: output (or tied embedding)
    # Q6_K; attn_v and ffn_down Q6_K in layers use_more_bits picks (for 8 layers: 0, 3, 6, 7).
    out, layers = gguf_write.TYPES["q4_k_m"], 8
    pick = [i for i in range(layers) if gguf_write.tensor_type(f"blk.{i}.attn_v.weight", 256, 2, out, layers,
                                                                  False) == "Q6_K"]
    assert pick == [0, 3, 6, 7]
    assert gguf_write.tensor_type("blk.2.ffn_down.weight", 256, 2, out, layers, False) == "Q4_K"
    assert gguf_write.tensor_type("blk.2.attn_q.weight", 256, 2, out, layers, False) == "Q4_K"
    assert gguf_write.tensor_type("output.weight", 256, 2, out, layers, False) == "Q6_K"
    assert gguf_write.tensor_type("token_embd.weight", 256, 2, out, layers, True) == "Q6_K"
    assert gguf_write.tensor_type("token_embd.weight", 256, 2, out, layers, False) == "Q4_K"
    assert gguf_write.tensor_type("blk.0.attn_norm.weight", 256, 1, out, layers, False) == "F32"
    # Rows that are not whole super-blocks fall back as llama.cpp does.
    assert gguf_write.tensor_type("blk.1.attn_q.weight", 64, 2, out, layers, False) == "Q5_0"
    assert gguf_write.tensor_type("blk.1.attn_q.weight", 48, 2, out, layers, False) == "F16"
    # Every block type gives the output Q6_K (Q8_0 keeps Q8_0; a 576-wide row falls back to Q8_0).
    for kind, want in (("q4_0", "Q6_K"), ("q5_k", "Q6_K"), ("q8_0", "Q8_0"), ("f16", "F16")):
        assert gguf_write.tensor_type("output.weight", 256, 2, gguf_write.TYPES[kind], layers, False) == want
        assert gguf_write.tensor_type("blk.0.attn_v.weight", 256, 2, gguf_write.TYPES[kind], layers,
                                      False) == gguf_write.TYPES[kind].ggml
    assert gguf_write.tensor_type("token_embd.weight", 576, 2, gguf_write.TYPES["q4_1"], layers, True) == "Q8_0"


@pytest.mark.parametrize("kind", ["q4_k_m", "q6_k", "q5_1"])
def test_quantized_file_loads_and_stays_near_the_weights(kind, tmp_path):
    src = tiny_model_dir("smollm2_like")
    file = infer.convert(src, tmp_path / "m.gguf", type=kind, progress=False)
    package = open_gguf(file, tokenizer=False)
    for name, value in _weights(src).items():
        got = package.tensors.get(name)
        got = got.dequantize() if hasattr(got, "dequantize") else np.asarray(got)
        scale = np.abs(value).max()
        assert np.abs(got - value).max() <= 0.25 * scale, name  # 4-bit steps of a 64-wide row at worst
    package.tensors.close()
    model = infer.load(file, backend="numpy")
    assert len(list(model.generate_tokens([1, 2, 3], max_tokens=3, temperature=0, ignore_eos=True))) == 3


# -- bad input ---------------------------------------------------------------------------------


def test_unknown_type_is_refused_with_the_choices(tmp_path):
    with pytest.raises(ConversionError, match=r"unknown --type 'q3_k'.*q4_k_m"):
        infer.convert(tiny_model_dir("llama3"), tmp_path / "m.gguf", type="q3_k")
    with pytest.raises(ConversionError, match=r"'q8_0' for a huggingface output.*f32, f16, bf16"):
        infer.convert(tiny_model_dir("llama3"), tmp_path / "hf", type="q8_0")
    with pytest.raises(ConversionError, match=r"the folder .*no-such-folder does not exist"):
        infer.convert(tiny_model_dir("llama3"), tmp_path / "no-such-folder" / "m.gguf")
    assert not any(tmp_path.iterdir())


def test_gguf_to_folder_dequantizes_to_the_chosen_float_type(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as load_torch

    file = infer.convert(tiny_model_dir("llama3"), tmp_path / "m.gguf", type="q6_k", progress=False)
    package = open_gguf(file, tokenizer=False)
    folder = infer.convert(file, tmp_path / "hf", type="bf16", progress=False)
    got = load_torch(folder / "model.safetensors")
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    for name in package.tensors.names():
        value = package.tensors.get(name)
        want = torch.from_numpy(np.array(value.dequantize() if hasattr(value, "dequantize") else value))
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], want.to(torch.bfloat16)), name
    package.tensors.close()


def test_llama3_rope_with_other_frequency_factors_round_trips_through_gguf(tmp_path):
    # low/high frequency factors 2/8: stored as rope_freqs divisors, read back as freq_factors
    # (the same frequencies), which have no config.json form to convert back to.
    from infer.errors import ConfigError

    folder = tmp_path / "src"
    shutil.copytree(tiny_model_dir("llama3"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"].update(low_freq_factor=2.0, high_freq_factor=8.0)
    (folder / "config.json").write_text(json.dumps(config))
    file = infer.convert(folder, tmp_path / "m.gguf", type="f32", progress=False)
    rope = open_gguf(file, tokenizer=False).config["rope_parameters"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    want = gguf_write._llama3_divisors(config["rope_parameters"], head_dim).astype(np.float32)
    assert rope["rope_type"] == "default" and np.array_equal(np.float32(rope["freq_factors"]), want)
    with pytest.raises(ConfigError, match="rope_freqs tensor that follows no rule"):
        infer.convert(file, tmp_path / "hf", type="f32", progress=False)


def test_rope_scaling_without_a_gguf_form_is_refused(tmp_path):
    from infer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rope scaling 'dynamic' has no GGUF form.*linear, yarn, llama3"):
        infer.convert(tiny_model_dir("llama_dynamic"), tmp_path / "m.gguf", progress=False)
    assert not any(tmp_path.iterdir())


def test_unsupported_architecture_is_named(tmp_path):
    with pytest.raises(UnsupportedArchitectureError, match=r"'deepseek_v3'.*supported: .*gemma3_text, .*llama"):
        infer.convert(tiny_model_dir("deepseek_v3"), tmp_path / "m.gguf", progress=False)
    assert not any(tmp_path.iterdir())


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(OutputExistsError, match="--force"):
        infer.convert(tiny_model_dir("qwen2"), out, type="f32")
    assert out.read_bytes() == b"keep me"
    infer.convert(tiny_model_dir("qwen2"), out, type="f32", force=True, progress=False)
    assert out.read_bytes()[:4] == b"GGUF"
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "old.txt").write_text("old")
    infer.convert(out, folder, force=True, progress=False)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                       "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.gguf"]


def _fail_after(count, exc):
    calls = {"n": 0}

    def hook(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > count:
            raise exc
        return original(*args, **kwargs)

    original = gguf.GGUFWriter.write_tensor_data
    return hook


def test_disk_full_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", _fail_after(3, OSError(errno.ENOSPC, "No space left")))
    with pytest.raises(ConversionError, match=r"writing .*m\.gguf failed: .*No space left; nothing was left"):
        infer.convert(tiny_model_dir("llama3"), tmp_path / "m.gguf", type="q8_0", progress=False)
    assert not any(tmp_path.iterdir())  # neither the output nor its partial file


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", _fail_after(2, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        infer.convert(tiny_model_dir("llama3"), tmp_path / "m.gguf", type="f16", progress=False)
    assert not any(tmp_path.iterdir())
    # A folder output too: the half-written folder goes.
    monkeypatch.undo()
    file = infer.convert(tiny_model_dir("llama3"), tmp_path / "m.gguf", type="f32", progress=False)
    import safetensors.numpy

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    with pytest.raises(ConversionError, match="No space left"):
        infer.convert(file, tmp_path / "hf", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_cli_converts_and_reports_errors(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["-q", "convert", str(tiny_model_dir("qwen2")), str(out), "--type", "q4_0"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert gguf.GGUFReader(str(out)).get_field("general.file_type").contents() == 2  # MOSTLY_Q4_0
    assert main(["-q", "convert", str(tiny_model_dir("qwen2")), str(out)]) == 1
    assert "exists; pass force=True (--force)" in capsys.readouterr().err


# -- llama.cpp ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["f32", "q8_0", "q4_k_m"])
def test_llama_cpp_reads_the_file_as_infer_does(kind, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")  # installed apart (docs/performance.md)
    src = tiny_model_dir("smollm2_like")
    file = infer.convert(src, tmp_path / "m.gguf", type=kind, progress=False)
    llm = llama_cpp.Llama(model_path=str(file), n_ctx=128, n_threads=2, verbose=False)
    model = infer.load(file, backend="numpy")
    for text in TEXTS[:-1]:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == model.tokenizer.encode(
            text, add_special_tokens=False), text
    if kind != "f32":
        # llama.cpp multiplies quantized weights by activations it quantizes too (Q8_K / Q8_0),
        # so its logits differ from a float32 computation by more than rounding: only that it
        # reads the file and generates is asserted here, beyond the tokenizer.
        assert len(llm.tokenize(b"the quick")) > 0
        out = llm("the quick", max_tokens=4, temperature=0.0)
        assert out["usage"]["completion_tokens"] >= 1
        return
    prompt = model.tokenizer.encode("the quick", add_special_tokens=False)
    want = list(model.generate_tokens(prompt, max_tokens=8, temperature=0, ignore_eos=True))
    got = []
    for token in llm.generate(prompt, temp=0.0, top_k=1):
        got.append(token)
        if len(got) == 8:
            break
    assert got == list(want)
