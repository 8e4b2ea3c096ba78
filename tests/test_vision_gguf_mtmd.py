"""llama.cpp's libmtmd reads the pairs ``infer convert`` writes (through llama-cpp-python's
``mtmd_cpp`` bindings; skipped where llama-cpp-python is not installed: never a CI requirement).

For each family: the text GGUF loads as a llama.cpp model, ``mtmd_init_from_file`` accepts the
mmproj file for it, an image tokenizes into as many image tokens as infer gives it, and mtmd's
embeddings of the image equal infer's within llama.cpp's own precision. The image is the tower's
size (a no-op resize in both, so both see the same pixels); llama.cpp computes GELU through a
float16 table and sums in other orders, so the bound is 0.5% of the largest value (measured:
3.3e-4 Gemma 3, 4.6e-4 LLaVA-CLIP, 5.5e-4 LLaVA-SigLIP, 5.9e-4 Idefics3, 3.6e-4 Qwen3.5), where a transposed
or misnamed tensor moves them by 100%.

Where this llama.cpp computes something else than transformers, infer's weights are run the way
clip.cpp runs them (from the pair infer reads, so the check is still of the files):

* LLaVA with CLIP: clip.cpp's LLaVA graph appends the class token *after* the patches while
  adding the position rows in order, and keeps rows 1..n (a regression of its graph rewrite;
  transformers puts the class token first): without that emulation its embeddings differ by 110%.
* LLaVA with two feature layers: clip.cpp keeps them as a set and concatenates in index order
  (for the config's ``[-1, -3]``: 57% away from transformers' rows).
* Idefics3: this llama.cpp encodes one view of the whole image at the tile size, infer's global
  view (the last tile), which infer resamples from the 48-pixel resize: pixels differ slightly.
* Qwen3.5: llama.cpp refuses the tiny test model's text GGUF (its linear-attention key and value
  heads differ in size, which llama.cpp's qwen35 loader assumes equal), so the mmproj file is
  initialised against another text model of the same width (the LLaVA pair's): the projector
  and its image rows do not depend on the text model.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import vision_models
import vision_models_b

import infer

llama_cpp = pytest.importorskip("llama_cpp")
mtmd = pytest.importorskip("llama_cpp.mtmd_cpp")
pytest.importorskip("gguf")
pytest.importorskip("PIL")

FAMILIES = {"gemma3": (vision_models.vlm_dir, "<start_of_image>", 32),
            "llava_clip": (vision_models.vlm_dir, "<image>", 32),
            "llava_siglip": (vision_models.vlm_dir, "<image>", 32),
            "idefics3": (vision_models_b.vlm_dir, "<image>", 16),
            "qwen3_5": (vision_models_b.vlm_dir, "<|image_pad|>", 32)}


def _embed_with_mtmd(text: Path, mmproj: Path, image: np.ndarray) -> np.ndarray:
    """mtmd's embeddings ``[image tokens, hidden]`` of one RGB uint8 image."""
    llm = llama_cpp.Llama(model_path=str(text), n_ctx=256, n_threads=1, verbose=False)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, 1, False, False
    ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), llm._model.model, params)
    assert ctx, f"mtmd_init_from_file refused {mmproj}"
    try:
        assert mtmd.mtmd_support_vision(ctx)
        height, width = image.shape[:2]
        data = (ctypes.c_uint8 * image.size).from_buffer_copy(np.ascontiguousarray(image).tobytes())
        bitmap = mtmd.mtmd_bitmap_init(width, height, data)
        chunks = mtmd.mtmd_input_chunks_init()
        prompt = b"Look: " + mtmd.mtmd_default_marker() + b" now"
        text_in = mtmd.mtmd_input_text(prompt, len(prompt), True, True)
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text_in), bitmaps, 1) == 0
        found = None
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                found = chunk
        assert found is not None, "mtmd made no image chunk"
        n = mtmd.mtmd_input_chunk_get_n_tokens(found)
        assert mtmd.mtmd_encode_chunk(ctx, found) == 0
        width_out = llama_cpp.llama_model_n_embd(llm._model.model)
        out = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n * width_out,)).copy()
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
        return out.reshape(n, width_out)
    finally:
        mtmd.mtmd_free(ctx)
        llm.close()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_libmtmd_reads_the_pair_and_embeds_as_infer_does(name: str, tmp_path: Path) -> None:
    make, placeholder, size = FAMILIES[name]
    folder = make(name)
    text = infer.convert(folder, tmp_path / "model.gguf", type="f32")
    mmproj = tmp_path / "mmproj-model.gguf"
    picture = vision_models.synthetic_image(size, size, seed=5)
    host = text
    if name == "qwen3_5":  # the tiny Qwen3.5 text model is not one llama.cpp loads (module docstring)
        (tmp_path / "host").mkdir()
        host = infer.convert(vision_models.vlm_dir("llava_clip"), tmp_path / "host" / "model.gguf", type="f32")
    got = _embed_with_mtmd(host, mmproj, np.asarray(picture.convert("RGB")))
    model = infer.load(text, mmproj=mmproj, backend="numpy")
    _, media = model.image_prompt(f"Look: {placeholder} now", [picture])
    want = model.backend.to_numpy(media.embeddings)
    if name == "idefics3":  # the global view (module docstring)
        want = want[-got.shape[0]:]
    elif name.startswith("llava"):
        want = _as_clip_cpp_runs_llava(model, media.images[0].processed.pixel_values)
    assert got.shape == want.shape, f"{name}: mtmd gives {got.shape[0]} image tokens, infer {want.shape[0]}"
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max())
    assert err <= 5e-3 * scale, f"{name}: mtmd's embeddings differ from infer's by {err:.3g} ({err / scale:.2g})"


def _as_clip_cpp_runs_llava(model: infer.Model, pixel_values: np.ndarray) -> np.ndarray:
    """LLaVA's image rows computed from infer's weights the way clip.cpp's LLaVA graph computes
    them (module docstring): the class token after the patches, positions in order, rows 1..n,
    feature layers in index order."""
    net, ops = model.network, model.backend
    tower, cfg = net.vision_tower, net.vision_tower.config
    c, p, side = cfg.num_channels, cfg.patch_size, cfg.patches_per_side
    x = pixel_values.reshape(c, side, p, side, p).transpose(1, 3, 0, 2, 4).reshape(side * side, c * p * p)
    h = ops.linear(ops.from_numpy(np.ascontiguousarray(x)), tower.patch_weight, tower.patch_bias)
    if tower.class_embedding is not None:
        h = ops.concat([h, tower.class_embedding], 0)
    h = ops.add(h, tower.positions)
    if tower.pre_norm is not None:
        h = ops.layer_norm(h, *tower.pre_norm, cfg.layer_norm_eps)
    states = [h]
    for layer in tower.layers[:max(net.feature_rows)]:
        states.append(tower.block(states[-1], layer))
    chosen = [states[i] for i in sorted(net.feature_rows)]
    x = chosen[0] if len(chosen) == 1 else ops.concat(chosen, -1)
    if tower.class_embedding is not None:
        x = ops.slice(x, 0, 1, side * side + 1)
    x = ops.gelu(ops.linear(x, *net.linear_1))
    return ops.to_numpy(ops.linear(x, *net.linear_2))
