"""Gemma 3 specifics, beyond the shared parity runner.

test_parity.py runs every tiny variant, these included, through the
prefill/decode-logit, greedy and cached-vs-full checks, at one tolerance (reference.LOGIT_RTOL * max|logit|, 2.0e-5; measured ~7e-7 relative, while a window off by
one, the head_dim scale instead of query_pre_attn_scalar or the two rope bases
swapped all move the logits by 15-70%). The variants (tests/reference.py):

* ``gemma3``: 5 sliding layers (window 4, against a 23-token prompt) : 1 global,
  tied head, query_pre_attn_scalar 24 with head_dim 16;
* ``gemma3_softcap``: final logit soft-cap 20, and ``attn_logit_softcapping`` 1.0,
  which transformers' Gemma 3 ignores and so does infer (applying it would move
  the logits by ~40%; leaving out the final cap, by ~25%);
* ``gemma3_legacy``: config.json in the 4.x form, linear rope scaling on the
  global layers, every 3rd layer global, biases, untied head.
"""

from __future__ import annotations

import json

import infer
import pytest
from reference import TINY_VARIANTS, encode, tiny_model_dir
from test_parity import DECODE_TEXT, PROMPT, assert_logits_close

VARIANTS = tuple(v for v in TINY_VARIANTS if v.startswith("gemma3"))


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> tuple[str, infer.Model]:
    return request.param, infer.load(tiny_model_dir(request.param), backend="numpy")


def test_chunked_forward_equals_full_forward(variant: tuple[str, infer.Model]) -> None:
    # Chunks shorter and longer than the window of 4: sliding layers then see cached keys
    # partly outside the window, all inside it, or none.
    name, model = variant
    path = tiny_model_dir(name)
    ids = encode(path, PROMPT + DECODE_TEXT)
    assert len(ids) > 4 * model.config["sliding_window"]
    engine, ops = model.engine, model.backend
    full = ops.to_numpy(engine.forward(engine.new_sequence(), ids, all_logits=True))
    seq, start, sizes = engine.new_sequence(), 0, iter([3, 1, 6, 2, 5, 1, 1, 4, 7] + [1] * len(ids))
    while start < len(ids):
        chunk = ids[start : start + next(sizes)]
        got = ops.to_numpy(engine.forward(seq, chunk, all_logits=True))
        assert_logits_close(got, full[start : start + len(chunk)], f"{name} chunk at {start}")
        start += len(chunk)


def test_legacy_config_is_read_as_transformers_reads_it() -> None:
    from transformers import AutoConfig

    path = tiny_model_dir("gemma3_legacy")
    raw = json.loads((path / "config.json").read_text())
    assert "layer_types" not in raw and "rope_parameters" not in raw
    assert raw["sliding_window_pattern"] == 3 and raw["rope_scaling"]["rope_type"] == "linear"
    want = AutoConfig.from_pretrained(path)
    network = infer.load(path, backend="numpy").network
    assert want.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    assert [layer.rope for layer in network.layers] == want.layer_types
    got = {kind: (r.rope_type, r.base, r.params.get("factor")) for kind, r in network.rope.items()}
    rope = want.rope_parameters
    assert got == {kind: (p["rope_type"], p["rope_theta"], p.get("factor")) for kind, p in rope.items()}
    assert got["full_attention"] == ("linear", 1e6, 2.0) and got["sliding_attention"] == ("default", 1e4, None)
