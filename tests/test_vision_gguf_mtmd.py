"""llama.cpp's libmtmd reads the pairs ``infer convert`` writes (through llama-cpp-python's
``mtmd_cpp`` bindings; skipped where llama-cpp-python is not installed: never a CI requirement).

For each family llama.cpp runs: the text GGUF loads as a llama.cpp model, ``mtmd_init_from_file``
accepts the mmproj file for it, an image tokenizes into as many image tokens as infer gives it,
and mtmd's embeddings of the image equal infer's ``embed_image`` within llama.cpp's own precision.
The image is the tower's size (a no-op resize in both, so both see the same pixels); llama.cpp
computes GELU through a float16 table and sums in other orders, so the bound is loose (2% of the
largest value; measured below 0.2%) but a transposed or misnamed tensor moves them by 100%.
The SigLIP LLaVA is left out: clip.cpp concatenates feature layers in index order, not the
config's (docs/vision.md, "GGUF pairs").
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
            "idefics3": (vision_models_b.vlm_dir, "<image>", 16)}


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
    got = _embed_with_mtmd(text, mmproj, np.asarray(picture.convert("RGB")))
    model = infer.load(text, mmproj=mmproj, backend="numpy")
    _, media = model.image_prompt(f"Look: {placeholder} now", [picture])
    want = model.backend.to_numpy(media.embeddings)
    if name == "idefics3":  # one tile: llama.cpp's SmolVLM path encodes the image alone, without a global view
        want = want[-got.shape[0]:]
    assert got.shape == want.shape, f"{name}: mtmd gives {got.shape[0]} image tokens, infer {want.shape[0]}"
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max())
    assert err <= 2e-2 * scale, f"{name}: mtmd's embeddings differ from infer's by {err:.3g} ({err / scale:.2g})"
