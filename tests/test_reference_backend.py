"""The reference backend (backends/reference.py): what the kit and ``infer diff`` compare with.

Run against itself the kit passes trivially, so these tests check it against an
independent implementation, the numpy backend (its C kernels, chunked scans and
fused paths): op by op through the kit with the roles swapped, and model by model,
logits and greedy tokens, within the float32 bound of ``tests/reference.py``. And
the registry offers it by name only.
"""

from __future__ import annotations

import numpy as np
import pytest
from infer.backends.numpy import NumpyBackend
from infer.backends.reference import ReferenceBackend
from reference import assert_greedy_equal, assert_logits_close, encode, float32_rtol, tiny_model_dir

import infer
from infer.ops import OPTIONAL_OPS, Backend
from infer.plugins.selection import select_backend
from infer.testing.conformance import REFERENCE, TOLERANCES, check_backend, reference_backend
from infer.testing.tiny_model import check_end_to_end

PROMPT = "The capital of France is Paris. Once upon a time"


def test_registered_under_its_own_name_and_never_chosen_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFER_BACKEND", raising=False)
    infos = {b.key: b for b in infer.list_backends()}
    ref = infos["reference/cpu"]
    assert ref.available and ref.native_ops == () and ref.plugin == "reference"
    assert all(ref.score < b.score for key, b in infos.items() if b.available and key != "reference/cpu")
    assert select_backend().name == "numpy"  # the fast CPU default stays the default
    assert isinstance(select_backend("reference"), ReferenceBackend)
    assert REFERENCE == "reference/cpu" and isinstance(reference_backend(), ReferenceBackend)


def test_every_optional_op_is_the_contracts_default() -> None:
    # The plainest implementation: nothing re-implemented that the contract defines.
    assert ReferenceBackend.native_ops == frozenset()
    own = [op for op in OPTIONAL_OPS if getattr(ReferenceBackend, op) is not getattr(Backend, op)]
    assert own == []


def test_its_ops_match_numpy() -> None:
    """The kit with the roles swapped: the reference as the candidate, numpy as the judge."""
    results = check_backend(ReferenceBackend(), max_examples=10, reference=NumpyBackend())
    # numpy has no bfloat16: the reference declines the cast (the kit rounds on the host); and it
    # has no int8 activations (an approximate mode, not part of the plain reference).
    q8 = [(r.case, "unsupported") for r in results if r.case.startswith("quantized_linear-q8act-")]
    assert len(q8) == 8
    assert [(r.case, r.status) for r in results if r.status != "ok"] == [("astype-bfloat16", "unsupported"), *q8]
    assert max(r.worst_nmse for r in results) <= TOLERANCES["float32"]
    for result in check_end_to_end(ReferenceBackend(), reference=NumpyBackend()):
        assert result.passed, result.describe()


def _teacher_forced_logits(model: infer.Model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The logits that chose each of ``tokens``: after the prompt, then after each token fed."""
    engine, ops = model.engine, model.backend
    seq = engine.new_sequence(len(prompt) + len(tokens))
    rows = [ops.to_numpy(engine.forward(seq, prompt)[-1])]
    for token in tokens[:-1]:
        rows.append(ops.to_numpy(engine.forward(seq, [token])[-1]))
    return np.stack(rows).astype(np.float32)


# Dense, windowed, soft-capped, sinks and clipped SwiGLU (gpt_oss), mixture of experts,
# and the three recurrent ops (mamba2: causal_conv1d + ssd; qwen3_5: gated_delta_rule).
@pytest.mark.parametrize("variant", ["llama3", "mistral", "qwen2", "gemma3_softcap", "gpt_oss", "deepseek_v3",
                                     "mamba2", "qwen3_5"])
def test_tiny_model_gives_numpys_logits_and_tokens(variant: str) -> None:
    path = tiny_model_dir(variant)
    prompt = encode(path, PROMPT)
    fast, plain = infer.load(path, backend="numpy"), infer.load(path, backend="reference")
    assert isinstance(plain.backend, ReferenceBackend)
    want = list(fast.generate_tokens(prompt, max_tokens=8, ignore_eos=True))
    got = list(plain.generate_tokens(prompt, max_tokens=8, ignore_eos=True))
    rtol = float32_rtol(path)
    want_logits = _teacher_forced_logits(fast, prompt, want)
    assert_logits_close(_teacher_forced_logits(plain, prompt, want), want_logits, f"{variant} on reference", rtol=rtol)
    assert_greedy_equal(got, want, want_logits, rtol, f"{variant} greedy on reference")


def test_float16_kv_pools_decode_as_numpys() -> None:
    path = tiny_model_dir("llama3")
    prompt = encode(path, PROMPT)
    want = list(infer.load(path, backend="numpy", kv_dtype="float16").generate_tokens(prompt, max_tokens=8,
                                                                                       ignore_eos=True))
    plain = infer.load(path, backend="reference", kv_dtype="float16")
    assert list(plain.generate_tokens(prompt, max_tokens=8, ignore_eos=True)) == want


def test_no_bfloat16() -> None:
    from infer.errors import UnsupportedOpError

    with pytest.raises(UnsupportedOpError, match="bfloat16"):
        ReferenceBackend("bfloat16")
    ops = ReferenceBackend()
    with pytest.raises(UnsupportedOpError, match="bfloat16"):
        ops.astype(ops.zeros((2,)), "bfloat16")
