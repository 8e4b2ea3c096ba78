"""Qwen3.5's vision input against transformers float32, part by part.

* Preprocessing: :class:`infer.image_processors.qwen2_vl.Qwen2VLImageProcessor`
  gives the same ``pixel_values`` and ``grid_thw`` as transformers'
  ``Qwen2VLImageProcessorPil`` (what ``AutoImageProcessor`` picks for ``qwen3_5``
  without torchvision) on RGB, RGBA, greyscale, palette, odd-aspect and tiny
  images, under the default settings and Qwen3.5's (16-pixel patches, mean and
  std 0.5).
* The vision tower: :class:`infer.architectures.qwen3_5_vision.Qwen3_5VisionModel`
  gives transformers' ``Qwen3_5VisionModel`` pooler output (the image tokens'
  embeddings) for two images of different grids in one call, on every backend.

A tiny tower is built the way every test here builds one: transformers' config
class with small sizes, the module made from it, every weight re-randomized
(``N(0, 0.2)``), its state dict read through infer's weight loader under
``model.visual.``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("PIL")
torch = pytest.importorskip("torch")
from PIL import Image  # noqa: E402

from infer.image_processors.qwen2_vl import Qwen2VLImageProcessor, smart_resize  # noqa: E402

BACKENDS = ("numpy", "torch:cpu", "mlx:cpu")

#: Small vision sizes: 4-pixel patches keep the images (and the test) tiny.
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=24,
                   num_position_embeddings=16, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
#: The processor settings that go with it: 8-pixel merge blocks, at most 32 x 32 pixels.
TINY_PROCESSOR = dict(patch_size=4, merge_size=2, temporal_patch_size=2,
                      size={"shortest_edge": 8 * 8, "longest_edge": 32 * 32})


def images(seed: int = 0) -> list[Any]:
    """Synthetic PIL images of every mode and shape the processor treats apart."""
    rng = np.random.default_rng(seed)

    def pixels(*shape: int) -> np.ndarray:
        return rng.integers(0, 256, shape, dtype=np.uint8)

    palette = Image.fromarray(pixels(12, 17), "L").convert("P")
    palette.info["transparency"] = 3  # a palette colour marked transparent: composited on white
    return [Image.fromarray(pixels(37, 53, 3)),            # RGB, sides not multiples of anything
            Image.fromarray(pixels(40, 21, 4), "RGBA"),    # alpha on white
            Image.fromarray(pixels(30, 90), "L"),          # greyscale, 3:1
            palette,
            Image.fromarray(pixels(5, 7, 3)),              # tiny: grown to min_pixels
            Image.fromarray(pixels(2, 300, 3)),            # 150:1
            Image.fromarray(pixels(300, 500, 3))]          # shrunk to max_pixels


@pytest.mark.parametrize("settings", [{}, TINY_PROCESSOR,
                                      dict(patch_size=16, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                           size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64 * 4})],
                         ids=["defaults", "tiny", "qwen3_5"])
def test_pixel_values_equal_transformers_pil_processor(settings: dict[str, Any]) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf = Qwen2VLImageProcessorPil(**settings)
    ours = Qwen2VLImageProcessor.from_config(hf.to_dict())
    for i, image in enumerate(images()):
        want = hf(images=[image], return_tensors="np")
        got, grid = ours(image)
        assert grid == tuple(want["image_grid_thw"][0]), f"image {i}"
        assert got.dtype == np.float32 and got.shape == want["pixel_values"].shape, f"image {i}"
        np.testing.assert_allclose(got, want["pixel_values"], rtol=0, atol=1e-6, err_msg=f"image {i}")
        assert ours.num_tokens(image.height, image.width) == want["image_grid_thw"][0].prod() // 4


def test_smart_resize_bounds_and_aspect_limit() -> None:
    from infer.errors import ImageError

    assert smart_resize(5, 7, 28, 56 * 56, 28 * 28 * 1280) == (56, 84)  # grown by one factor, then rounded up
    h, w = smart_resize(3000, 4000, 28, 56 * 56, 28 * 28 * 1280)
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 28 * 28 * 1280
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_resize(1, 201, 28, 56 * 56, 28 * 28 * 1280)


def tiny_vision_tower(seed: int = 0) -> tuple[Any, dict[str, np.ndarray], dict[str, Any]]:
    """transformers' ``Qwen3_5VisionModel`` of :data:`TINY_VISION`, re-randomized;
    its weights under ``model.visual.`` and the ``qwen3_5`` config dict."""
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    torch.manual_seed(seed)
    config = Qwen3_5Config(vision_config=TINY_VISION)
    tower = Qwen3_5VisionModel._from_config(config.vision_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    weights = {"model.visual." + k: v.numpy() for k, v in tower.state_dict().items()}
    return tower, weights, config.to_dict()


def test_vision_tower_equals_transformers(backend: str) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from infer.architecture import WeightLoader
    from infer.architectures.qwen3_5_vision import Qwen3_5VisionModel, vision_config
    from infer.plugins.selection import select_backend
    from infer.testing.tiny_model import ArrayTensorSource

    tower, weights, config = tiny_vision_tower()
    hf_processor = Qwen2VLImageProcessorPil(**TINY_PROCESSOR)
    pictures = [images()[0], images()[2]]  # grids 1x6x8 and 1x4x12 (within the 32x32 bound)
    inputs = hf_processor(images=pictures, return_tensors="pt")
    with torch.no_grad():
        want = tower(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output.numpy()

    ops = select_backend(backend, "float32")
    model = Qwen3_5VisionModel(vision_config(config), WeightLoader(ArrayTensorSource(weights), ops), ops)
    pixel_values, grids = Qwen2VLImageProcessor.from_config(hf_processor.to_dict()).batch(pictures)
    assert grids == [(1, 6, 8), (1, 4, 12)] and [model.num_tokens(g) for g in grids] == [12, 12]
    got = ops.to_numpy(model(ops.from_numpy(pixel_values), grids))
    # Two blocks of width 32 and a merger of width 128 over values of order 1: a few float32 roundings
    # per product (and the backends' own reduction orders) stay below 1e-5 of the output's scale.
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


# -- M-RoPE ------------------------------------------------------------------------------------------


def hf_rope_index(ids: list[int], image_token: int, grids: list[tuple[int, int, int]], merge: int) -> tuple[Any, int]:
    """transformers' ``Qwen3_5Model.get_rope_index`` for one prompt (it reads only the merge size of ``self``)."""
    import functools
    import types

    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    owner = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=merge)),
        get_vision_position_ids=functools.partial(Qwen3_5Model.get_vision_position_ids, None))
    input_ids = torch.tensor([ids])
    positions, delta = Qwen3_5Model.get_rope_index(owner, input_ids, (input_ids == image_token).int(),
                                                   image_grid_thw=torch.tensor(grids))
    return positions[:, 0].numpy(), int(delta)


@pytest.mark.parametrize("layout", [
    [(3, (1, 4, 6))],                       # one image between text
    [(0, (1, 2, 2))],                       # an image first
    [(2, (1, 6, 2)), (11, (1, 2, 8))],      # two images, tall then wide
    [(5, (1, 4, 4))],                       # an image last: no text after it
], ids=["one", "first", "two", "last"])
def test_mrope_positions_equal_get_rope_index(layout: list[tuple[int, tuple[int, int, int]]]) -> None:
    from infer.architectures.mrope import mrope_positions

    image, text, merge = 9, 1, 2
    ids: list[int] = []
    for start, (t, h, w) in layout:
        ids += [text] * (start - len(ids)) + [image] * (t * h * w // merge ** 2)
    ids += [text] * (3 if layout[-1][0] != 5 else 0)
    want, want_delta = hf_rope_index(ids, image, [g for _, g in layout], merge)
    got, delta = mrope_positions(len(ids), layout, merge)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert delta == want_delta


def test_mrope_tables_equal_transformers(backend: str) -> None:
    import types

    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from infer.architectures.mrope import MRotaryEmbedding
    from infer.plugins.selection import select_backend

    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
              "mrope_section": [3, 3, 2], "mrope_interleaved": True}
    config = Qwen3_5TextConfig(head_dim=32, rope_parameters=params)
    streams = np.random.default_rng(0).integers(0, 500, (3, 7)).astype(np.int32)
    cos, sin = Qwen3_5TextRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32),
                                                  torch.from_numpy(streams).long()[:, None])
    ops = select_backend(backend, "float32")
    rope = MRotaryEmbedding(ops, 32, params, 4096)
    ctx = types.SimpleNamespace(position_ids=ops.from_numpy(streams), positions=None)
    got_cos, got_sin = (ops.to_numpy(a) for a in rope(ctx))
    # transformers' tables repeat the rot/2 angles twice (half-split pairs); infer keeps one half.
    np.testing.assert_allclose(got_cos, cos[0, :, :8].numpy(), rtol=0, atol=2e-6)
    np.testing.assert_allclose(got_sin, sin[0, :, :8].numpy(), rtol=0, atol=2e-6)
