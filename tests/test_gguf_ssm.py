"""GGUF for the Mamba-2 families: ``infer convert`` writes mamba2, granitemoehybrid and
falcon_h1 as llama.cpp's converter does (``mamba2``, ``granitehybrid``, ``falcon-h1``), and
reads them back.

Each tiny transformers checkpoint (tests/reference.py) is written by infer's writer; the file
is then read with the ``gguf`` package's own reader and every tensor must equal, bit for bit,
what this test computes from the checkpoint by llama.cpp's rules (names from gguf-py's
``TensorNameMap``, ``A = -exp(A_log)`` as ``[heads, 1]``, ``D`` as ``[heads, 1]``, the
convolution squeezed, the gated norm as ``[groups, inner / groups]``, Granite's merged
gate/up projections split and Q/K rows permuted, Falcon-H1's multipliers multiplied in), the
metadata the converter's keys. infer's reader must give back every Hugging Face tensor
(exactly, but ``A_log``: ``log(-A)``, and Falcon-H1's rescaled weights), and the GGUF
model's logits must match transformers' float32 logits on the Hugging Face folder at
``reference.LOGIT_RTOL``. Checkpoints with what llama.cpp's graphs do not compute (mixer
projection biases, Falcon-H1's norm-before-gate) are refused; their variants without it are
built here (config edited, bias tensors dropped) and checked like the others.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from reference import assert_logits_close, backend_params, cache_root, encode, reference_logits, tiny_model_dir
from safetensors.numpy import load_file, save_file
from test_families import DECODE_TEXT, PROMPT
from test_format_gguf import llama_permute

import infer
from infer.errors import ConfigError, UnsupportedArchitectureError
from infer.formats.gguf import open_gguf

#: variant -> (GGUF architecture, config edits, dropped tensors' name endings): the edits make
#: a checkpoint llama.cpp can run out of a refused one.
VARIANTS: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "mamba2": ("mamba2", {}, ()),
    "granitemoehybrid": ("granitehybrid", {}, ()),
    "falcon_h1": ("falcon-h1", {}, ()),
    "mamba2_groups": ("mamba2", {"use_bias": False}, ("in_proj.bias", "out_proj.bias")),
    "granitemoehybrid_dense": ("granitehybrid", {"mamba_proj_bias": False}, ("in_proj.bias", "out_proj.bias")),
    "falcon_h1_norm": ("falcon-h1", {"mamba_norm_before_gate": False, "mamba_proj_bias": False,
                                     "projectors_bias": False, "attention_bias": False},
                       ("in_proj.bias", "out_proj.bias", "q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias")),
}
#: The refused checkpoints: variant -> the config field the error names.
REFUSED = {"mamba2_groups": "use_bias", "granitemoehybrid_dense": "mamba_proj_bias",
           "falcon_h1_norm": "mamba_proj_bias"}


def _folder(variant: str) -> Path:
    """The variant's Hugging Face folder, edited as :data:`VARIANTS` says (cached)."""
    src = tiny_model_dir(variant)
    _, edits, dropped = VARIANTS[variant]
    if not edits:
        return src
    out = cache_root() / "gguf_ssm" / variant
    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(edits)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    state = load_file(src / "model.safetensors")
    save_file({k: v for k, v in state.items() if not k.endswith(dropped)}, tmp / "model.safetensors")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _minus_exp(a_log: np.ndarray) -> np.ndarray:
    return (-np.exp(a_log.astype(np.float64))).astype(np.float32).reshape(-1, 1)


def _expected(variant: str, folder: Path) -> dict[str, np.ndarray]:
    """llama.cpp's tensors for the checkpoint, by convert_hf_to_gguf.py's rules."""
    arch_name, _, _ = VARIANTS[variant]
    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    layers = cfg["num_hidden_layers"]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    names = gguf.get_tensor_name_map(arch, layers)
    out: dict[str, np.ndarray] = {}
    falcon = arch_name == "falcon-h1"
    for hf, value in state.items():
        name = hf.removesuffix(".dt_bias") + ".dt_proj.bias" if hf.endswith(".dt_bias") else hf
        bid = int(name.split(".")[2]) if ".layers." in name else None
        value = value.astype(np.float32)
        if hf.endswith("input_linear.weight"):  # Granite's merged gate/up: split
            half = value.shape[-2] // 2
            kind = "exps" if "block_sparse_moe" in hf else ("shexp" if cfg["num_local_experts"] else "")
            for part, piece in (("gate", value[..., :half, :]), ("up", value[..., half:, :])):
                out[f"blk.{bid}.ffn_{part}{'_' + kind if kind else ''}.weight"] = np.ascontiguousarray(piece)
            continue
        if hf.endswith("shared_mlp.output_linear.weight") and not cfg["num_local_experts"]:
            out[f"blk.{bid}.ffn_down.weight"] = value
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name, hf
        if hf.endswith("A_log"):
            value = _minus_exp(value)
        elif hf.endswith((".D",)):
            value = value.reshape(-1, 1)
        elif "conv1d.weight" in hf:
            value = value.squeeze(1)
        elif hf.endswith("norm.weight") and (".mixer." in hf or ".mamba." in hf):
            groups = cfg.get("n_groups") or cfg.get("mamba_n_groups")
            value = value.reshape(groups, -1)
        elif arch_name == "granitehybrid" and (".q_proj." in hf or ".k_proj." in hf):
            value = llama_permute(value, cfg["num_attention_heads" if ".q_proj." in hf else "num_key_value_heads"])
        if falcon:
            value = _falcon_scaled(hf, value, cfg)
        out[gguf_name] = value
    return out


def _falcon_scaled(hf: str, value: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """FalconH1Model.modify_tensors' multiplications (float32, in its order)."""
    f = np.float32
    mult = {k: cfg.get(k, 1.0) for k in ("key_multiplier", "attention_in_multiplier", "attention_out_multiplier",
                                         "ssm_in_multiplier", "ssm_out_multiplier", "lm_head_multiplier",
                                         "embedding_multiplier")}
    mlp, ssm = cfg.get("mlp_multipliers", [1.0, 1.0]), cfg.get("ssm_multipliers", [1.0] * 5)
    if "down_proj" in hf:
        return value * f(mlp[1])
    if "gate_proj" in hf:
        return value * f(mlp[0])
    if "k_proj" in hf:
        return value * f(mult["key_multiplier"]) * f(mult["attention_in_multiplier"])
    if "q_proj" in hf or "v_proj" in hf:
        return value * f(mult["attention_in_multiplier"])
    if "o_proj" in hf:
        return value * f(mult["attention_out_multiplier"])
    if "out_proj" in hf:
        return value * f(mult["ssm_out_multiplier"])
    if "in_proj" in hf:
        value = value * f(mult["ssm_in_multiplier"])
        inner = cfg.get("mamba_d_ssm") or cfg["mamba_expand"] * cfg["hidden_size"]
        gs = cfg["mamba_n_groups"] * cfg["mamba_d_state"]
        for (a, b), m in zip([(0, inner), (inner, 2 * inner), (2 * inner, 2 * inner + gs),
                              (2 * inner + gs, 2 * inner + 2 * gs), (2 * inner + 2 * gs, value.shape[0])], ssm):
            value[a:b] *= f(m)
        return value
    if "lm_head" in hf:
        return value * f(mult["lm_head_multiplier"])
    if "embed_tokens" in hf:
        return value * f(mult["embedding_multiplier"])
    return value


def _expected_metadata(variant: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``{arch}.*`` keys llama.cpp's converter writes for the checkpoint."""
    arch, _, _ = VARIANTS[variant]
    n = cfg["num_hidden_layers"]
    if arch == "mamba2":
        inner = cfg["num_heads"] * cfg["head_dim"]
        return {"context_length": 2**20, "embedding_length": cfg["hidden_size"], "feed_forward_length": 0,
                "attention.head_count": 0, "block_count": n, "ssm.conv_kernel": cfg["conv_kernel"],
                "ssm.inner_size": inner, "ssm.state_size": cfg["state_size"], "ssm.time_step_rank": cfg["num_heads"],
                "ssm.group_count": cfg["n_groups"], "attention.layer_norm_rms_epsilon": cfg["layer_norm_epsilon"]}
    inner = cfg.get("mamba_d_ssm") or cfg["mamba_expand"] * cfg["hidden_size"]
    md = {"block_count": n, "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
          "attention.head_count": cfg["num_attention_heads"], "ssm.conv_kernel": cfg["mamba_d_conv"],
          "ssm.inner_size": inner, "ssm.state_size": cfg["mamba_d_state"], "ssm.time_step_rank": cfg["mamba_n_heads"],
          "ssm.group_count": cfg["mamba_n_groups"], "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
          "rope.freq_base": cfg["rope_parameters"]["rope_theta"]}
    if arch == "granitehybrid":
        types = cfg["layer_types"]
        rope = cfg["position_embedding_type"] == "rope"
        md.update({"attention.head_count_kv": [cfg["num_key_value_heads"] if t in ("attention", "full_attention")
                                               else 0 for t in types],
                   "context_length": cfg["max_position_embeddings"] if rope else 2**20,
                   "rope.scaling.finetuned": rope, "expert_count": cfg["num_local_experts"],
                   "expert_shared_feed_forward_length": cfg["shared_intermediate_size"],
                   "attention.scale": cfg["attention_multiplier"], "embedding_scale": cfg["embedding_multiplier"],
                   "residual_scale": cfg["residual_multiplier"], "logit_scale": cfg["logits_scaling"],
                   "expert_used_count": cfg["num_experts_per_tok"]})
        return md
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    md.update({"vocab_size": cfg["vocab_size"], "context_length": cfg["max_position_embeddings"],
               "attention.head_count_kv": cfg["num_key_value_heads"], "attention.key_length": head_dim,
               "attention.value_length": head_dim})
    return md


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    f = reader.fields[key]
    values = [f.parts[i] for i in f.data]
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        return [v.item() for v in values]
    return values[0].item() if len(values[0]) == 1 else values[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf_ssm")
    return {v: infer.convert(_folder(v), out / f"{v}.gguf", type="f32", progress=False) for v in VARIANTS}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_written_file_is_llama_cpps_layout_bit_for_bit(variant: str, files: dict[str, Path]) -> None:
    folder = _folder(variant)
    reader = gguf.GGUFReader(files[variant])
    arch = VARIANTS[variant][0]
    assert _field(reader, "general.architecture").tobytes().decode() == arch
    want = _expected(variant, folder)
    got = {t.name: np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]) for t in reader.tensors}
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == np.float32 and got[name].shape == value.shape, name
        assert np.array_equal(got[name], value), name
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in _expected_metadata(variant, cfg).items():
        stored = _field(reader, f"{arch}.{key}")
        if isinstance(value, float):
            assert stored == pytest.approx(value, rel=1e-7), key
        else:
            assert stored == value, key


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_is_within_an_ulp_of_the_converters(variant: str, files: dict[str, Path]) -> None:
    # llama.cpp's converter computes -torch.exp(A_log) in float32; infer rounds the float64 value.
    import torch

    state = load_file(_folder(variant) / "model.safetensors")
    reader = gguf.GGUFReader(files[variant])
    stored = {t.name: np.asarray(t.data).reshape(-1) for t in reader.tensors}
    for name, value in state.items():
        if name.endswith("A_log"):
            i = int(name.split(".")[2])
            theirs = (-torch.exp(torch.from_numpy(value))).numpy()
            assert np.all(np.abs(stored[f"blk.{i}.ssm_a"] - theirs) <= np.spacing(np.abs(theirs))), name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_reads_back_the_hugging_face_tensors_and_logits(variant: str, files: dict[str, Path]) -> None:
    folder = _folder(variant)
    state = load_file(folder / "model.safetensors")
    cfg = json.loads((folder / "config.json").read_text())
    package = open_gguf(files[variant], tokenizer=False)
    assert package.model_type == cfg["model_type"]
    src = package.tensors
    tied = cfg.get("tie_word_embeddings", False)
    assert sorted(src.names()) == sorted(k for k in state if not (tied and k == "lm_head.weight"))
    for name in src.names():
        got, want = np.asarray(src.get(name)), state[name]
        assert got.dtype == np.float32 and got.shape == want.shape, name
        if name.endswith("A_log"):
            # log(-A) of the stored A: A itself comes back within float32 rounding
            np.testing.assert_allclose(np.exp(got.astype(np.float64)), np.exp(want.astype(np.float64)), rtol=3e-7,
                                       err_msg=name)
        elif cfg["model_type"] == "falcon_h1":
            assert np.array_equal(got, _falcon_scaled(name, want.copy(), cfg)), name
        else:
            assert np.array_equal(got, want), name  # bit for bit
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "tie_word_embeddings", "n_groups", "state_size",
                "num_heads", "head_dim", "conv_kernel", "use_conv_bias", "layer_types", "num_key_value_heads",
                "num_local_experts", "num_experts_per_tok", "shared_intermediate_size", "mamba_n_heads",
                "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_conv_bias", "position_embedding_type",
                "mamba_rms_norm", "mlp_bias", "intermediate_size"):
        if key in cfg and key in package.config:
            want_value = cfg[key]
            if key == "layer_types":  # transformers' older names
                want_value = ["attention" if t in ("attention", "full_attention") else "mamba" for t in want_value]
            assert package.config[key] == want_value, key
    prompt, decode = encode(folder, PROMPT), encode(folder, DECODE_TEXT)
    want = reference_logits(folder, prompt, decode)["full"]
    model = infer.load(files[variant], backend="numpy")
    logits = model.backend.to_numpy(model.engine.forward(model.engine.new_sequence(), prompt + decode, all_logits=True))
    assert_logits_close(logits, want, f"{variant} from GGUF")


@pytest.mark.parametrize("variant", list(REFUSED))
def test_what_llama_cpp_does_not_compute_is_refused(variant: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"{REFUSED[variant]} is True; llama.cpp"):
        infer.convert(tiny_model_dir(variant), tmp_path / "m.gguf", type="f32", progress=False)
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_mamba2_clamped_time_step_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir("mamba2"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["time_step_limit"] = [0.001, 100.0]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="time_step_limit"):
        infer.convert(src, tmp_path / "m.gguf", type="f32", progress=False)


def test_unsupported_family_names_what_is_supported(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedArchitectureError, match=r"cannot be written as GGUF; supported: .*falcon_h1.*"
                                                           r"granitemoehybrid.*mamba2"):
        infer.convert(tiny_model_dir("lfm2"), tmp_path / "m.gguf", type="f32", progress=False)


def test_quantized_file_keeps_the_ssm_vectors_float32(tmp_path: Path) -> None:
    path = infer.convert(tiny_model_dir("granitemoehybrid"), tmp_path / "q.gguf", type="q8_0", progress=False)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    for name, kind in types.items():
        if name.split(".")[-1] in ("ssm_a", "ssm_d") or "ssm_conv1d" in name or "ssm_norm" in name \
                or "ffn_gate_inp" in name:
            assert kind == "F32", name
    assert types["blk.0.ssm_in.weight"] == "Q8_0"
    model = infer.load(path, backend="numpy")
    assert model.network.num_layers == 4


@pytest.mark.parametrize("backend", backend_params("torch:cpu", "mlx:cpu"))
@pytest.mark.parametrize("variant", ["mamba2", "granitemoehybrid", "falcon_h1"])
def test_gguf_logits_on_other_backends(variant: str, backend: str, files: dict[str, Path]) -> None:
    folder = _folder(variant)
    prompt, decode = encode(folder, PROMPT), encode(folder, DECODE_TEXT)
    want = reference_logits(folder, prompt, decode)["full"]
    model = infer.load(files[variant], backend=backend)
    logits = model.backend.to_numpy(model.engine.forward(model.engine.new_sequence(), prompt + decode, all_logits=True))
    assert_logits_close(logits, want, f"{variant} from GGUF on {backend}")


def test_falcon_h1_tied_head_needs_equal_multipliers(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(_folder("falcon_h1_norm"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["embedding_multiplier"] = 2.0  # the one tied tensor cannot carry both 2.0 and lm_head_multiplier 1.0
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="embedding_multiplier"):
        infer.convert(src, tmp_path / "m.gguf", type="f32", progress=False)


def test_granitehybrid_absent_scales_are_llama_cpps_defaults(files: dict[str, Path], tmp_path: Path) -> None:
    # A file without attention.scale / embedding_scale / residual_scale / logit_scale and without
    # rope.scaling.finetuned: llama.cpp then uses 1/sqrt(head_dim), 1, 1, 1 and no rope.
    reader = gguf.GGUFReader(files["granitemoehybrid"])
    out = tmp_path / "plain.gguf"
    w = gguf.GGUFWriter(str(out), "granitehybrid")
    skip = {f"granitehybrid.{k}" for k in ("attention.scale", "embedding_scale", "residual_scale", "logit_scale",
                                           "rope.scaling.finetuned")}
    for key, f in reader.fields.items():
        if key.startswith("granitehybrid.") and key not in skip:
            vtype = f.types[0]
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_key_value(key, [int(v) for v in _field(reader, key)], vtype, sub_type=f.types[1])
            else:
                w.add_key_value(key, _field(reader, key), vtype)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = open_gguf(out, tokenizer=False).config
    heads = config["num_attention_heads"]
    assert config["attention_multiplier"] == pytest.approx((config["hidden_size"] // heads) ** -0.5)
    assert (config["embedding_multiplier"], config["residual_multiplier"], config["logits_scaling"]) == (1.0, 1.0, 1.0)
    assert config["position_embedding_type"] == "nope"
    assert config["layer_types"] == ["mamba", "attention", "mamba", "attention"]


@pytest.mark.parametrize("variant", ["mamba2", "granitemoehybrid", "falcon_h1_norm"])
def test_gguf_to_hugging_face_folder_runs_in_transformers(variant: str, files: dict[str, Path],
                                                          tmp_path: Path) -> None:
    # GGUF -> folder: the config infer read from the file is one transformers builds the same model from
    # (Falcon-H1's with every multiplier 1 over the rescaled weights).
    folder = _folder(variant)
    out = infer.convert(files[variant], tmp_path / "hf", type="f32", progress=False)
    prompt, decode = encode(folder, PROMPT), encode(folder, DECODE_TEXT)
    want = reference_logits(folder, prompt, decode)["full"]
    assert_logits_close(reference_logits(out, prompt, decode)["full"], want, f"{variant} GGUF -> folder")


def test_falcon_h1_file_with_projection_biases_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    reader = gguf.GGUFReader(files["falcon_h1"])
    out = tmp_path / "biased.gguf"
    w = gguf.GGUFWriter(str(out), "falcon-h1")
    for key, f in reader.fields.items():
        if key.startswith("falcon-h1.") and f.types[0] != gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, _field(reader, key), f.types[0])
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]))
    w.add_tensor("blk.0.attn_q.bias", np.zeros(128, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(infer.errors.FormatError, match="attn_q.bias are not supported"):
        open_gguf(out, tokenizer=False)
