"""The batch engine counts the vision tower's memory (infer.engine.budget.EncoderBudget).

* Each family's estimate of what its tower holds at once while it encodes an
  image (``image_activation_bytes``, from the shapes) bounds what numpy really
  allocates then (tracemalloc sees numpy's buffers), and is not wildly above.
* A request whose images do not fit beside the running requests' waits, and
  runs to the same tokens once they have finished; images that could never
  fit are an :class:`~infer.errors.EncoderMemoryError` at submission, naming
  the image and the limit.
* The tower runs when a forward first needs the image rows (after
  admission): a prompt found in the prefix cache past its image never runs it.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest

import infer
from infer.engine.batch import BatchEngine
from infer.engine.generate import StopConditions
from infer.engine.sampling import SamplingParams
from infer.errors import EncoderMemoryError

pytest.importorskip("PIL")
pytest.importorskip("transformers")

import vision_models  # noqa: E402
import vision_models_b  # noqa: E402

#: Per family: its folder and a prompt with two images.
FAMILIES = {
    "gemma3": (vision_models, "A {0} and {0} then"),
    "llava_clip": (vision_models, "A <image> and <image> then"),
    "qwen3_5": (vision_models_b, "A <|vision_start|><|image_pad|><|vision_end|> and "
                                 "<|vision_start|><|image_pad|><|vision_end|> then"),
    "idefics3": (vision_models_b, "A <image> and <image> then"),
}

_MODELS: dict[str, infer.Model] = {}


def load(name: str) -> infer.Model:
    if name not in _MODELS:
        _MODELS[name] = infer.load(FAMILIES[name][0].vlm_dir(name), backend="numpy", dtype="float32")
    return _MODELS[name]


def pictures() -> list[Any]:
    return [vision_models.synthetic_image(27, 20, seed=3), vision_models.synthetic_image(12, 30, "RGBA", seed=4)]


def prompt(name: str) -> str:
    return FAMILIES[name][1].format("<start_of_image>")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_activation_estimate_bounds_what_numpy_allocates(name: str) -> None:
    model = load(name)
    _, media = model.image_prompt(prompt(name), pictures())
    for image in media.images:
        assert image.activation_bytes > 0, image.name
    media.embeddings  # noqa: B018 - a first run lays out weights once for the model's lifetime: not counted
    media.release()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        embeddings = media.embeddings  # the tower runs here, one image at a time
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    rows, width = model.backend.shape(embeddings)
    assert media.embedding_bytes == rows * width * 4
    estimate = media.activation_bytes + media.embedding_bytes
    # Upper estimate (what admission reserves), within a small factor of the truth.
    assert peak <= estimate <= 8 * peak, f"{name}: measured {peak:,} bytes, estimated {estimate:,}"


def _submit(batch: Any, model: infer.Model, name: str, tokens: int = 5) -> Any:
    ids, media = model.image_prompt(prompt(name), pictures())
    return batch.submit(ids, SamplingParams(temperature=0.0), StopConditions(max_tokens=tokens), media=media)


def test_a_request_waits_until_its_images_fit_beside_the_running_ones() -> None:
    name = "gemma3"
    model = load(name)
    want = model.complete(prompt(name), images=pictures(), max_tokens=5, temperature=0).token_ids
    _, media = model.image_prompt(prompt(name), pictures())
    embeddings = media.embedding_bytes
    need = embeddings + media.activation_bytes
    # Room for one request being encoded and another's embeddings, less a byte: the second waits
    # until the first has finished (its embeddings held until then).
    batch = BatchEngine(model.engine, encoder_memory=need + embeddings - 1)
    first, second = _submit(batch, model, name), _submit(batch, model, name)
    batch.step()
    assert batch.running == [first] and list(batch.waiting) == [second]
    assert first.media.encoded  # the tower ran after admission, in the first forward
    assert batch.encoder_held() == embeddings  # the activations' share is free again once encoded
    while not first.finished:
        assert list(batch.waiting) == [second], "admitted beside the first request's images"
        batch.step()
    batch.run_until_done()
    assert first.tokens == want and second.tokens == want
    assert batch.encoder_held() == 0 and not second.media.encoded  # the encoder cache let them go

    # One byte more: the second is admitted as soon as the first's images are encoded.
    batch = BatchEngine(model.engine, encoder_memory=need + embeddings)
    first, second = _submit(batch, model, name), _submit(batch, model, name)
    batch.step()
    assert batch.running == [first]
    batch.step()
    assert batch.running == [first, second]
    batch.run_until_done()
    assert second.tokens == want

    roomy = BatchEngine(model.engine, encoder_memory=2 * need)
    both = [_submit(roomy, model, name), _submit(roomy, model, name)]
    roomy.step()
    assert roomy.running == both  # room for two being encoded: they start together
    roomy.run_until_done()


def test_images_that_can_never_fit_are_a_typed_error_naming_the_image_and_the_limit() -> None:
    name = "qwen3_5"
    model = load(name)
    ids, media = model.image_prompt(prompt(name), pictures())
    need = media.embedding_bytes + media.activation_bytes
    batch = BatchEngine(model.engine, encoder_memory=need - 1)
    largest = max(media.images, key=lambda i: i.activation_bytes).name
    with pytest.raises(EncoderMemoryError, match=rf"{largest.replace('[', '.').replace(']', '.')} .*"
                                                 rf"encoder_memory is {need - 1:,} bytes") as err:
        batch.submit(ids, SamplingParams(temperature=0.0), StopConditions(max_tokens=3), media=media)
    assert err.value.bytes_available == need - 1  # type: ignore[attr-defined]
    assert not batch.has_work() and not media.encoded  # refused before the tower ran


def test_a_prefix_hit_past_the_image_never_runs_the_tower() -> None:
    name = "gemma3"
    model = load(name)
    text = prompt(name) + " " + "and more words after the pictures " * 4
    network = model.engine.model
    calls = []
    original = network.embed_image

    def counted(pixel_values: Any, meta: Any) -> Any:
        calls.append(1)
        return original(pixel_values, meta)

    network.embed_image = counted
    try:
        batch = BatchEngine(model.engine, kv_layout="paged", block_size=4)
        runs = []
        for _ in range(2):
            ids, media = model.image_prompt(text, pictures())
            handle = batch.submit(ids, SamplingParams(temperature=0.0), StopConditions(max_tokens=4), media=media)
            batch.run_until_done()
            runs.append((handle.cached_tokens, handle.tokens, len(calls)))
    finally:
        del network.embed_image
    assert runs[0][2] == 2, "the first request encodes its two images"
    assert runs[1][0] > int(media.rows[-1]), "the second request's prefix hit ends before its last image"
    assert runs[1][2] == 2 and runs[1][1] == runs[0][1], "the second request ran the tower again"
