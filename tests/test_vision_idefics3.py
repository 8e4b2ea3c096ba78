"""Idefics3 / SmolVLM image input against transformers, part by part.

* Preprocessing: :class:`infer.image_processors.idefics3.Idefics3ImageProcessor`
  gives the same tiles (``pixel_values``), rows and columns as transformers'
  ``Idefics3ImageProcessorPil`` and ``SmolVLMImageProcessorPil`` on RGB, RGBA,
  greyscale, odd-aspect and tiny images, split and unsplit.
* The prompt: an image's text (tiles with ``<row_r_col_c>``, the global image)
  equals transformers' ``get_image_prompt_string``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("PIL")
pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from infer.image_processors.idefics3 import Idefics3ImageProcessor  # noqa: E402

#: Tiles of 16 pixels, images scaled to a longest edge of 48: up to 3 x 3 tiles plus the global image.
TINY = dict(size={"longest_edge": 48}, max_image_size={"longest_edge": 16})


def images(seed: int = 0) -> list[Any]:
    rng = np.random.default_rng(seed)

    def pixels(*shape: int) -> np.ndarray:
        return rng.integers(0, 256, shape, dtype=np.uint8)

    return [Image.fromarray(pixels(37, 53, 3)), Image.fromarray(pixels(40, 21, 4), "RGBA"),
            Image.fromarray(pixels(30, 90), "L"), Image.fromarray(pixels(5, 7, 3)),
            Image.fromarray(pixels(3, 100, 3)), Image.fromarray(pixels(64, 64, 3))]


@pytest.mark.parametrize("settings", [TINY, dict(TINY, do_image_splitting=False), {}],
                         ids=["tiny", "unsplit", "defaults"])
@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_tiles_equal_transformers_pil_processor(family: str, settings: dict[str, Any]) -> None:
    if family == "idefics3":
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil as HF
    else:
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as HF
    hf = HF(**settings)
    ours = Idefics3ImageProcessor.from_config(hf.to_dict())
    pictures = images() if settings else images()[:2]  # the defaults' 364-pixel tiles: two images suffice
    for i, image in enumerate(pictures):
        want = hf(images=[image], return_tensors="np", return_row_col_info=True)
        got, rows, cols = ours(image)
        assert (rows, cols) == (want["rows"][0][0], want["cols"][0][0]), f"image {i}"
        assert got.dtype == np.float32 and got.shape == want["pixel_values"][0].shape, f"image {i}"
        np.testing.assert_allclose(got, want["pixel_values"][0], rtol=0, atol=1e-6, err_msg=f"image {i}")


@pytest.mark.parametrize(("rows", "cols"), [(0, 0), (1, 3), (2, 2)])
def test_prompt_equals_transformers(rows: int, cols: int) -> None:
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    want = get_image_prompt_string(rows, cols, 4, fake_token_around_image="<fake_token_around_image>",
                                   image_token="<image>", global_image_token="<global-img>")
    assert Idefics3ImageProcessor().prompt(rows, cols, 4) == want


# -- the tile encoder and connector --------------------------------------------------------------

BACKENDS = ("numpy", "torch:cpu", "mlx:cpu")

#: Tiny sizes: 16-pixel tiles of 4-pixel patches, shuffled by 2: 4 image tokens per tile.
TINY_VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                   patch_size=4)
TINY_TEXT = dict(model_type="llama", hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 vocab_size=64)


def test_tile_encoder_and_connector_equal_transformers(backend: str) -> None:
    torch = pytest.importorskip("torch")
    from transformers import Idefics3Config
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

    from infer.architecture import WeightLoader
    from infer.architectures.idefics3 import Idefics3VisionModel, tile_encoder_config
    from infer.plugins.selection import select_backend
    from infer.testing.tiny_model import ArrayTensorSource

    torch.manual_seed(0)
    config = Idefics3Config(vision_config=TINY_VISION, text_config=TINY_TEXT, scale_factor=2)
    encoder = Idefics3VisionTransformer._from_config(config.vision_config, dtype=torch.float32).eval()
    connector = Idefics3Connector(config).eval()
    with torch.no_grad():  # every weight re-randomized
        for p in [*encoder.parameters(), *connector.parameters()]:
            p.copy_(torch.randn_like(p) * 0.2)
    weights = {"model.vision_model." + k: v.numpy() for k, v in encoder.state_dict().items()}
    weights.update({"model.connector." + k: v.numpy() for k, v in connector.state_dict().items()})
    tiles = Idefics3ImageProcessorPil(**TINY)(images=[images()[0]], return_tensors="pt")["pixel_values"][0]
    with torch.no_grad():
        want = connector(encoder(tiles).last_hidden_state).reshape(-1, TINY_TEXT["hidden_size"]).numpy()

    ops = select_backend(backend, "float32")
    model = Idefics3VisionModel(tile_encoder_config(config.to_dict()), 2, TINY_TEXT["hidden_size"],
                                WeightLoader(ArrayTensorSource(weights), ops), ops)
    assert model.tokens_per_tile == 4 and tiles.shape[0] == 10  # 3 x 3 tiles and the global image
    got = ops.to_numpy(model(ops.from_numpy(tiles.numpy())))
    # Two blocks of width 32 and a projection from 128 over values of order 1 (see test_vision_qwen.py).
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
