"""GGUF pairs: llama.cpp's text GGUF + mmproj GGUF, written by ``infer convert`` and read back.

The tiny vision-language folders of tests/vision_models.py and
tests/vision_models_b.py (exact against transformers in tests/test_vision*.py)
are converted to a float32 pair; ``infer.load(text, mmproj=...)`` must give
the folder's own logits for an image + text prompt. Both sides run the same
weights: the pair stores them as they are, except Gemma 3's soft-embedding
norm, which llama.cpp keeps as ``1 + w`` and the reader turns back into
``(1 + w) - 1`` (w rounded by at most half an ulp of 1, 6e-8), so the bound
is tests/reference.py's float32 rounding bound for the tower's and the
language model's layers (``RTOL``; measured: 0.0 for all six folders, the
same products on the same values).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import vision_models
import vision_models_b
from reference import assert_logits_close, rounding_rtol

import infer
from infer.errors import ImageError, MmprojError, MmprojMismatchError, UnknownProjectorError
from infer.formats.gguf_file import read_gguf
from infer.loading import find_mmproj

pytest.importorskip("PIL")
pytest.importorskip("torch")
pytest.importorskip("gguf")

#: family -> (its folder, the placeholder its prompts hold, the projector type of its mmproj file)
FAMILIES = {"gemma3": (vision_models.vlm_dir, "<start_of_image>", "gemma3"),
            "llava_clip": (vision_models.vlm_dir, "<image>", "mlp"),
            "llava_siglip": (vision_models.vlm_dir, "<image>", "mlp"),
            "idefics3": (vision_models_b.vlm_dir, "<image>", "idefics3"),
            "smolvlm": (vision_models_b.vlm_dir, "<image>", "idefics3"),
            "qwen3_5": (vision_models_b.vlm_dir, "<|vision_start|><|image_pad|><|vision_end|>", "qwen3vl_merger")}
RTOL = rounding_rtol(2 + 3 + 1, 256)

_PAIRS: dict[str, tuple[Path, Path]] = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pairs")


def pair(name: str, workdir: Path) -> tuple[Path, Path]:
    """``infer convert`` of the family's folder: (text GGUF, mmproj GGUF), float32."""
    if name not in _PAIRS:
        out = workdir / name
        out.mkdir()
        text = infer.convert(folder(name), out / "model.gguf", type="f32")
        _PAIRS[name] = (text, out / "mmproj-model.gguf")
    return _PAIRS[name]


def folder(name: str) -> Path:
    return FAMILIES[name][0](name)


def logits(model: infer.Model, text: str, images: list) -> tuple[list[int], np.ndarray]:
    ids, media = model.image_prompt(text, images)
    engine = model.engine
    seq = engine.new_sequence()
    seq.media = media
    try:
        return ids, model.backend.to_numpy(engine.forward(seq, ids, all_logits=True))
    finally:
        engine.release(seq)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_pair_gives_the_folders_logits(name: str, workdir: Path) -> None:
    text, mmproj = pair(name, workdir)
    assert mmproj.is_file()
    placeholder = FAMILIES[name][1]
    prompt = f"Look: {placeholder} The capital of France is"
    image = [vision_models.synthetic_image(40, 24, seed=3)]
    want_ids, want = logits(infer.load(folder(name), backend="numpy"), prompt, image)
    model = infer.load(text, mmproj=mmproj, backend="numpy")
    got_ids, got = logits(model, prompt, image)
    assert got_ids == want_ids
    assert_logits_close(got, want, f"{name} pair", rtol=RTOL)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_mmproj_file_is_llama_cpps_layout(name: str, workdir: Path) -> None:
    _, mmproj = pair(name, workdir)
    file = read_gguf(mmproj)
    try:
        md, tensors = file.metadata, file.tensors
        assert md["general.architecture"] == "clip" and md["general.type"] == "mmproj"
        assert md["clip.projector_type"] == FAMILIES[name][2]
        assert md["clip.has_vision_encoder"] is True
        config = json.loads((folder(name) / "config.json").read_text())
        assert md["clip.vision.projection_dim"] == config["text_config"]["hidden_size"]
        assert md["clip.vision.block_count"] == sum(1 for n in tensors if n.endswith(".ln1.weight"))
        assert md["clip.vision.embedding_length"] == config["vision_config"]["hidden_size"]
        blocks = {n.split(".")[3] for n in tensors if n.startswith("v.blk.0.")}
        attention = {"attn_qkv"} if name == "qwen3_5" else {"attn_q", "attn_k", "attn_v"}
        assert blocks == attention | {"attn_out", "ln1", "ln2", "ffn_up", "ffn_down"}
        d = md["clip.vision.embedding_length"]
        assert tensors["v.blk.0.ffn_up.weight"].shape == (md["clip.vision.feed_forward_length"], d)  # [out, in]
        assert tensors["v.patch_embd.weight"].shape[:2] == (d, 3)  # the convolution's kernel as it is
        if name == "gemma3":
            assert {"mm.input_projection.weight", "mm.soft_emb_norm.weight", "v.post_ln.weight"} <= set(tensors)
            assert md["clip.vision.projector.scale_factor"] == 2  # 8 x 8 patches pooled to 4 x 4 soft tokens
        elif name == "llava_clip":
            assert {"v.class_embd", "v.pre_ln.weight", "mm.0.weight", "mm.2.bias"} <= set(tensors)
            assert "v.post_ln.weight" not in tensors  # LLaVA reads the tower before its post-norm
            assert list(md["clip.vision.feature_layer"]) == [2] and md["clip.vision.block_count"] == 2
        elif name == "llava_siglip":
            assert list(md["clip.vision.feature_layer"]) == [3, 1]  # -1 and -3 of 3 layers, in the config's order
        elif name in ("idefics3", "smolvlm"):
            assert "mm.model.fc.weight" in tensors and md["clip.vision.projector.scale_factor"] == 2
            assert md["clip.vision.preproc_image_size"] == 48
        else:  # Qwen's two-frame kernel as two frames; the merger as post-norm and two linears
            assert tensors["v.patch_embd.weight.1"].shape == tensors["v.patch_embd.weight"].shape
            assert {"v.post_ln.weight", "mm.0.weight", "mm.2.weight", "v.position_embd.weight"} <= set(tensors)
            assert md["clip.vision.spatial_merge_size"] == 2
            assert (md["clip.vision.image_min_pixels"], md["clip.vision.image_max_pixels"]) == (64, 1024)
    finally:
        file.close()


def test_text_gguf_alone_is_its_text_family(workdir: Path) -> None:
    text, _ = pair("gemma3", workdir)
    model = infer.load(text, backend="numpy")
    assert model.package.model_type == "gemma3_text"
    with pytest.raises(ImageError):
        model.complete("Look: <start_of_image>", images=[vision_models.synthetic_image(8, 8)], max_tokens=1)


def test_mmproj_alone_is_refused_by_name(workdir: Path) -> None:
    _, mmproj = pair("gemma3", workdir)
    with pytest.raises(MmprojError, match="mmproj file"):
        infer.load(mmproj, backend="numpy")


def test_mismatched_pairs_are_refused(workdir: Path) -> None:
    gemma_text, gemma_mmproj = pair("gemma3", workdir)
    llava_text, llava_mmproj = pair("llava_clip", workdir)
    with pytest.raises(MmprojMismatchError, match="no '<image>' token"):  # LLaVA over Gemma 3 text exists
        infer.load(gemma_text, mmproj=llava_mmproj, backend="numpy")
    with pytest.raises(MmprojMismatchError, match="does not go with"):
        infer.load(llava_text, mmproj=gemma_mmproj, backend="numpy")
    with pytest.raises(MmprojError, match="no mmproj file"):
        infer.load(gemma_text, mmproj=workdir / "absent.gguf", backend="numpy")
    with pytest.raises(MmprojError, match="not an mmproj file"):
        infer.load(gemma_text, mmproj=llava_text, backend="numpy")


def _rewritten(src: Path, out: Path, renamed: dict[str, str] | None = None, **changes: object) -> Path:
    """``src`` with some metadata values changed and some tensors renamed (through the gguf
    package's reader and writer)."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(out), "clip")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = changes.get(field.name, field.contents())
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, vtype)
    for t in reader.tensors:
        writer.add_tensor((renamed or {}).get(t.name, t.name), np.asarray(t.data),
                          raw_shape=tuple(int(x) for x in reversed(t.shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_unknown_projector_and_wrong_width_are_named(workdir: Path) -> None:
    text, mmproj = pair("gemma3", workdir)
    odd = _rewritten(mmproj, workdir / "mmproj-resampler.gguf", **{"clip.projector_type": "resampler"})
    with pytest.raises(UnknownProjectorError, match="'resampler'.*gemma3"):
        infer.load(text, mmproj=odd, backend="numpy")
    wide = _rewritten(mmproj, workdir / "mmproj-wide.gguf", **{"clip.vision.projection_dim": 96})
    with pytest.raises(MmprojMismatchError, match="projection_dim is 96.*hidden size is 64"):
        infer.load(text, mmproj=wide, backend="numpy")


def test_find_mmproj_beside_the_model(tmp_path: Path) -> None:
    model = tmp_path / "gemma-3-4b-it-Q4_K_M.gguf"
    model.write_bytes(b"GGUF")
    assert find_mmproj(model) is None
    (tmp_path / "mmproj-F16.gguf").write_bytes(b"GGUF")
    assert find_mmproj(model) == tmp_path / "mmproj-F16.gguf"
    (tmp_path / "mmproj-gemma-3-4b-it-Q4_K_M.gguf").write_bytes(b"GGUF")
    assert find_mmproj(model) == tmp_path / "mmproj-gemma-3-4b-it-Q4_K_M.gguf"
    (tmp_path / "mmproj-gemma-3-4b-it-Q4_K_M-f32.gguf").write_bytes(b"GGUF")
    with pytest.raises(MmprojError, match="3 mmproj files"):
        find_mmproj(model)


def test_cli_run_with_an_image_finds_the_neighbouring_mmproj(workdir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from infer.tools.cli import main

    text, _ = pair("llava_clip", workdir)
    image = tmp_path / "picture.png"
    vision_models.synthetic_image(40, 24, seed=3).save(image)
    want = infer.load(folder("llava_clip"), backend="numpy").complete(
        "Look: <image> The capital of France is", images=[str(image)], max_tokens=3, temperature=0).text
    capsys.readouterr()
    assert main(["-q", "run", str(text), "Look: <image> The capital of France is", "--image", str(image),
                 "-n", "3", "-t", "0", "--backend", "numpy"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_older_converters_swapped_mlp_names_are_recognised(workdir: Path) -> None:
    # llama.cpp's older converters named a tower's fc1 ffn_down and its fc2 ffn_up; clip.cpp (and infer)
    # tell them apart by their shapes.
    text, mmproj = pair("gemma3", workdir)
    swap = {}
    for i in range(3):
        for suffix in ("weight", "bias"):
            up, down = f"v.blk.{i}.ffn_up.{suffix}", f"v.blk.{i}.ffn_down.{suffix}"
            swap.update({up: down, down: up})
    legacy = _rewritten(mmproj, workdir / "mmproj-legacy.gguf", renamed=swap)
    prompt, image = "Look: <start_of_image> The capital of France is", [vision_models.synthetic_image(40, 24, seed=3)]
    _, want = logits(infer.load(text, mmproj=mmproj, backend="numpy"), prompt, image)
    _, got = logits(infer.load(text, mmproj=legacy, backend="numpy"), prompt, image)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("change", "message"), [
    ({"projector_hidden_act": "silu"}, "projector_hidden_act 'silu'"),
    ({"vision_feature_select_strategy": "full"}, "'full' with a CLIP tower"),
    ({"multimodal_projector_bias": False}, "without biases"),
])
def test_llava_settings_clip_cpp_cannot_run_are_refused(change: dict, message: str, tmp_path: Path) -> None:
    from infer.errors import ConversionError
    from infer.formats.gguf_mmproj import write_mmproj
    from infer.plugins import get_registry

    source = folder("llava_clip")
    package = get_registry().format_for(source).open(source)
    try:
        package.config = {**package.config, **change}
        with pytest.raises(ConversionError, match=message):
            write_mmproj(package, tmp_path / "mmproj.gguf", type="f32")
    finally:
        package.tensors.close()


def test_cli_convert_and_serve_take_mmproj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import infer.serve
    from infer.tools.cli import main

    out, projector = tmp_path / "gemma.gguf", tmp_path / "vision" / "projector.gguf"
    projector.parent.mkdir()
    assert main(["-q", "convert", str(folder("gemma3")), str(out), "--type", "f32", "--mmproj", str(projector)]) == 0
    assert out.is_file() and projector.is_file() and not (tmp_path / "mmproj-gemma.gguf").exists()
    seen: dict = {}
    monkeypatch.setattr(infer.serve, "serve", lambda model, **kwargs: seen.update(model=model))
    assert main(["-q", "serve", str(out), "--mmproj", str(projector), "--backend", "numpy"]) == 0
    assert seen["model"].reads_images and seen["model"].package.model_type == "gemma3"
