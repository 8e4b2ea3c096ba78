"""Gemma 3's pan-and-scan crops against transformers float32.

With ``do_pan_and_scan`` in the processor config, an image whose aspect
ratio is at least ``pan_and_scan_min_ratio_to_activate`` is also cut into 2
to ``pan_and_scan_max_num_crops`` crops along its long side, each resized as
the whole image is; the prompt gets ``Here is the original image`` + the
whole image's tokens + `` and here are some crops to help you see better`` +
each crop's tokens (transformers' ``Gemma3ImageProcessorPil`` and
``Gemma3Processor``). The tiny Gemma 3 folder of tests/vision_models.py,
copied with pan-and-scan turned on (8-pixel minimum crops, so the 32-pixel
tiny images crop), against transformers: ``pixel_values`` within 1e-6
(measured: bit-equal) on wide, tall, near-square, RGBA and greyscale
images; the prompt's token ids; logits within the family tests' tolerance
(tests/test_vision.py: ``rounding_rtol(2 + 3 + 1, 256)`` of max|logit|);
greedy tokens equal to ``generate``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reference import assert_greedy_equal, assert_logits_close, rounding_rtol
from vision_models import reference_model, synthetic_image, vlm_dir

import infer

pytest.importorskip("PIL")
torch = pytest.importorskip("torch")

PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8, "pan_and_scan_max_num_crops": 4,
                "pan_and_scan_min_ratio_to_activate": 1.2}
RTOL = rounding_rtol(2 + 3 + 1, 256)
#: (width, height, mode) -> crops transformers makes: 97/23 rounds to 4; 20x50 to 3 (2.5 rounds half up);
#: 30x27 is below the 1.2 ratio; 40x24 (1.67) to 2.
CASES = {"wide": (97, 23, "RGB", 4), "tall": (20, 50, "RGB", 3), "square": (30, 27, "RGB", 0),
         "rgba": (40, 24, "RGBA", 2), "grey": (16, 44, "L", 3)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma 3 folder with pan-and-scan on in its processor config."""
    out = tmp_path_factory.mktemp("gemma3-pan-and-scan") / "model"
    shutil.copytree(vlm_dir("gemma3"), out)
    path = out / "processor_config.json"
    config = json.loads(path.read_text())
    config["image_processor"].update(PAN_AND_SCAN)
    path.write_text(json.dumps(config))
    return out


def _reference(folder: Path, text: str, images: list[Any]) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder)(text=text, images=images, return_tensors="pt", **PAN_AND_SCAN)


@pytest.mark.parametrize("case", list(CASES))
def test_pixel_values_equal_transformers_pil_processor(case: str) -> None:
    from transformers import Gemma3ImageProcessorPil

    from infer.image_processing import gemma3_processor

    width, height, mode, crops = CASES[case]
    image = synthetic_image(width, height, mode, seed=width)
    settings = {"size": {"height": 32, "width": 32}, **PAN_AND_SCAN}
    want = Gemma3ImageProcessorPil(**settings)(images=[image], return_tensors="np")
    assert int(want["num_crops"][0]) == crops
    got = gemma3_processor({"mm_tokens_per_image": 16}, settings, None).preprocess(image)
    assert got.meta["crops"] == crops and got.num_tokens == 16 * (1 + crops)
    pixels = got.pixel_values if crops else got.pixel_values[None]
    assert pixels.shape == want["pixel_values"].shape and pixels.dtype == np.float32
    assert np.abs(pixels - want["pixel_values"]).max() <= 1e-6


def test_logits_and_greedy_equal_transformers(folder: Path) -> None:
    model = infer.load(folder, backend="numpy", dtype="float32")
    wide = synthetic_image(*CASES["wide"][:3], seed=1)
    square = synthetic_image(*CASES["square"][:3], seed=2)
    text = "Compare <start_of_image> with <start_of_image> please"
    ref = _reference(folder, text, [wide, square])
    ids, media = model.image_prompt(text, [wide, square])
    assert ids == ref["input_ids"][0].tolist()
    assert media.image_tokens == 16 * (1 + 4) + 16  # the wide image's 4 crops, the square one whole
    assert [hi - lo for lo, hi in media.spans] == [16] * 6  # each view attends both ways within itself
    hf = reference_model(folder)
    with torch.no_grad():
        want = hf(**ref).logits[0].numpy()
        out = hf.generate(**ref, max_new_tokens=6, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    seq = model.engine.new_sequence()
    seq.media = media
    got = model.backend.to_numpy(model.engine.forward(seq, ids, all_logits=True))
    model.engine.release(seq)
    assert_logits_close(got, want, "gemma3 pan-and-scan", rtol=RTOL)
    want_tokens = out.sequences[0, len(ids):].tolist()
    got_tokens = model.complete(text, images=[wide, square], max_tokens=6, temperature=0).token_ids
    assert_greedy_equal(got_tokens[:len(want_tokens)], want_tokens, torch.cat(out.logits).numpy(), RTOL,
                        "gemma3 pan-and-scan greedy")
