"""Qwen3.5 (dense and MoE) and Idefics3 / SmolVLM with images, end to end, against transformers float32.

The tiny folders are tests/vision_models_b.py's (model, image processor and
tokenizer saved by transformers, every weight re-randomized); ``infer.load``
reads them as downloaded checkpoints. For each family and backend: the prompt's
token ids equal the transformers processor's, the logits of every prompt
position are within the tolerance, and greedy decoding gives transformers'
``generate`` tokens, for one image, two images, and an image between chat
turns. For Qwen3.5 (M-RoPE positions and DeltaNet state across forwards):
chunked prefill over the images equals one forward, the prefix cache hits for
the same image only, and speculative decoding keeps the positions after a
rejected draft.

Tolerance: logits within ``rounding_rtol(2 + 2 + 1, 256)`` of max|logit|
(tests/reference.py's float32 rounding bound over the language model's two
layers, the tower's two and its merger or connector); measured 8e-7..2.2e-6
of max|logit| on numpy and torch. Positions by token index instead of M-RoPE's
move Qwen3.5's logits by 0.12 of max|logit|.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from reference import assert_greedy_equal, assert_logits_close, backend_params, rounding_rtol
from vision_models import synthetic_image
from vision_models_b import reference_inputs, reference_model, vlm_dir

import infer

pytest.importorskip("PIL")
torch = pytest.importorskip("torch")

FAMILIES = ("qwen3_5", "qwen3_5_moe", "idefics3", "smolvlm")
#: What stands for an image in a prompt, as the families' chat templates render an image part.
PLACEHOLDER = {"qwen3_5": "<|vision_start|><|image_pad|><|vision_end|>",
               "qwen3_5_moe": "<|vision_start|><|image_pad|><|vision_end|>", "idefics3": "<image>",
               "smolvlm": "<image>"}
RTOL = rounding_rtol(2 + 2 + 1, 256)

_MODELS: dict[tuple[str, str], infer.Model] = {}
_REFS: dict[str, Any] = {}


def load(name: str, backend: str = "numpy") -> infer.Model:
    if (name, backend) not in _MODELS:
        _MODELS[(name, backend)] = infer.load(vlm_dir(name), backend=backend)
    return _MODELS[(name, backend)]


def hf(name: str) -> Any:
    if name not in _REFS:
        _REFS[name] = reference_model(vlm_dir(name))
    return _REFS[name]


def images() -> list[Any]:
    """A wide RGB picture and a tall RGBA one (Qwen: grids 1x4x6 and 1x8x2; Idefics3: 3x3 and 3x2 tiles)."""
    return [synthetic_image(27, 20, seed=3), synthetic_image(12, 30, "RGBA", seed=4)]


def prompts(name: str) -> dict[str, tuple[str, list[Any]]]:
    ph = PLACEHOLDER[name]
    one, two = images()
    return {"one": (f"Look: {ph} The capital of France is", [one]),
            "two": (f"The capital {ph} of France is {ph} Paris, and", [one, two])}


def greedy_reference(name: str, inputs: dict[str, Any], steps: int) -> tuple[list[int], np.ndarray]:
    with torch.no_grad():
        out = hf(name).generate(**inputs, max_new_tokens=steps, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), torch.cat(out.logits).numpy()


@pytest.mark.parametrize("backend", backend_params("numpy", "torch:cpu", "mlx:cpu"))
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_and_greedy_equal_transformers(name: str, backend: str) -> None:
    model, folder = load(name, backend), vlm_dir(name)
    for what, (text, pics) in prompts(name).items():
        ref = reference_inputs(folder, text, pics)
        ids, media = model.image_prompt(text, pics)
        assert ids == ref["input_ids"][0].tolist(), f"{name} {what}: token ids"
        with torch.no_grad():
            want = hf(name)(**ref).logits[0].numpy()
        seq = model.engine.new_sequence()
        seq.media = media
        got = model.backend.to_numpy(model.engine.forward(seq, ids, all_logits=True))
        model.engine.release(seq)
        assert_logits_close(got, want, f"{name} {what} on {backend}", rtol=RTOL)
        want_tokens, logits = greedy_reference(name, ref, 6)
        got_tokens = model.complete(text, images=pics, max_tokens=6, temperature=0).token_ids
        assert_greedy_equal(got_tokens[:len(want_tokens)], want_tokens, logits, RTOL, f"{name} {what} greedy")


@pytest.mark.parametrize("name", FAMILIES)
def test_chat_with_an_image_between_text_turns(name: str) -> None:
    from transformers import AutoTokenizer

    model, folder = load(name), vlm_dir(name)
    one, two = images()
    messages = [
        {"role": "user", "content": [{"type": "image", "image": one}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A picture of Paris."}]},
        {"role": "user", "content": [{"type": "image", "image": two}, {"type": "text", "text": "And this one?"}]},
    ]
    plain = [{**m, "content": [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]}
             for m in messages]
    text = AutoTokenizer.from_pretrained(folder).apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    ref = reference_inputs(folder, text, [one, two])
    plan = model.plan_chat(messages, infer.GenerationRequest(max_tokens=5, temperature=0))
    assert plan.prompt_ids == ref["input_ids"][0].tolist()
    want, logits = greedy_reference(name, ref, 5)
    got = model.complete(plan.prompt_text, images=[one, two], max_tokens=5, temperature=0,
                         add_special_tokens=False).token_ids
    assert_greedy_equal(got[:len(want)], want, logits, RTOL, f"{name} chat")


def test_mrope_positions_move_the_logits() -> None:
    # The check above can fail: with the image's positions as token indices the logits move far
    # beyond the tolerance (the same prompt, its media without the three streams).
    model = load("qwen3_5")
    text, pics = prompts("qwen3_5")["two"]
    ids, media = model.image_prompt(text, pics)
    assert media.positions is not None and media.position_delta < 0  # two 4x6 / 8x2 grids: fewer positions than tokens
    runs = []
    for streams in (media.positions, None):
        media.positions = streams
        seq = model.engine.new_sequence()
        seq.media = media
        runs.append(model.backend.to_numpy(model.engine.forward(seq, ids, all_logits=True)))
        model.engine.release(seq)
    assert np.abs(runs[0] - runs[1]).max() > 100 * RTOL * np.abs(runs[0]).max()


def _batch_tokens(model: infer.Model, ids: list[int], media: Any, steps: int, speculation: Any = None,
                  **engine: Any) -> tuple[list[int], Any]:
    from infer.engine.batch import BatchEngine
    from infer.engine.generate import StopConditions
    from infer.engine.sampling import SamplingParams

    batch = BatchEngine(model.engine, **engine)
    handle = batch.submit(ids, SamplingParams(temperature=0.0), StopConditions(max_tokens=steps), speculation,
                          media=media)
    batch.run_until_done()
    return handle.tokens, handle


def test_qwen_chunked_prefill_over_the_images_equals_one_forward() -> None:
    # Each chunk takes its slice of the three position streams and the DeltaNet state of the one before.
    model = load("qwen3_5")
    text, pics = prompts("qwen3_5")["two"]
    ids, media = model.image_prompt(text, pics)
    whole = model.complete(text, images=pics, max_tokens=6, temperature=0).token_ids
    first = int(media.rows[0])
    for chunk in (5, first + 3, 17):  # boundaries inside the first image, inside the second
        tokens, _ = _batch_tokens(model, ids, media, 6, max_batch_tokens=chunk)
        assert tokens == whole, f"chunks of {chunk}"


def test_qwen_prefix_cache_hits_for_the_same_image_only() -> None:
    model = load("qwen3_5")
    one, two = images()
    text = f"{PLACEHOLDER['qwen3_5']} Describe the picture in one word please, and the capital of France is"
    ids, same = model.image_prompt(text, [one])
    _, again = model.image_prompt(text, [one.copy()])
    _, other = model.image_prompt(text, [two.convert("RGB").resize((27, 20))])  # another picture, same grid
    assert len(ids) == len(model.image_prompt(text, [two.convert("RGB").resize((27, 20))])[0])
    from infer.engine.batch import BatchEngine
    from infer.engine.generate import StopConditions
    from infer.engine.sampling import SamplingParams

    batch = BatchEngine(model.engine, block_size=8)
    results = []
    for media in (same, again, other):
        handle = batch.submit(ids, SamplingParams(temperature=0.0), StopConditions(max_tokens=4), media=media)
        batch.run_until_done()
        results.append((handle.cached_tokens, handle.tokens))
    assert results[0][0] == 0
    assert results[1][0] >= 8 * ((len(ids) - 1) // 8) > 0 and results[1][1] == results[0][1]
    assert results[2][0] == 0, "another image with the same text hit the cache"
    assert results[0][1] == model.complete(text, images=[one], max_tokens=4, temperature=0).token_ids


def test_qwen_speculative_decoding_keeps_the_positions_after_a_rejection() -> None:
    # An n-gram draft proposes tokens the target mostly rejects; the tokens after each rollback sit at
    # index + delta, so the output equals plain greedy decoding.
    from infer.engine.speculative import NGramDraft, Speculation

    model = load("qwen3_5")
    text, pics = prompts("qwen3_5")["one"]
    ids, media = model.image_prompt(text, pics)
    want = model.complete(text, images=pics, max_tokens=12, temperature=0).token_ids
    tokens, handle = _batch_tokens(model, ids, media, 12, Speculation(NGramDraft(), 3))
    assert tokens == want
    stats = handle.stats
    assert stats.drafted > stats.accepted, "no draft was rejected: the rollback went untested"


def test_qwen_through_the_server_gives_model_chat_tokens() -> None:
    # The server's image forms reach Qwen3.5's M-RoPE positions as Model.chat's do (tests/test_serve_vision.py
    # checks every form on LLaVA; one form and the Anthropic block suffice here).
    import base64
    import io

    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    from test_serve import KEY, NAME, running

    from infer.serve import create_app

    picture = images()[0]
    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image", "image": picture},
                                             {"type": "text", "text": "What is it?"}]}]
    want = str(load("qwen3_5").chat(messages, max_tokens=6, temperature=0))
    with running(create_app(infer.load(vlm_dir("qwen3_5"), backend="numpy"), model_name=NAME, api_key=KEY)) as url:
        oa = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        reply = oa.chat.completions.create(model=NAME, max_tokens=6, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}},
                                         {"type": "text", "text": "What is it?"}]}])
        assert reply.choices[0].message.content == want
        an = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
        message = an.messages.create(model=NAME, max_tokens=6, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": data}},
                                         {"type": "text", "text": "What is it?"}]}])
        assert message.content[0].text == want
