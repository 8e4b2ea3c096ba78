"""Load settings (``infer.ops.LoadSettings``): what ``infer.load`` was asked
for reaches the backend as one object passed in (``Backend.configure``), never
as attributes written onto a backend instance that other models may share.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from reference import tiny_model_dir

import infer
from infer.backends.numpy import NumpyBackend
from infer.errors import CacheConfigError, InvalidQuantizationError
from infer.ops import LoadSettings

IDS = list(range(3, 40))


def _logits(model: infer.Model) -> np.ndarray:
    engine = model.engine
    seq = engine.new_sequence()
    rows = model.backend.to_numpy(engine.forward(seq, IDS, all_logits=True))
    engine.release(seq)
    return rows


def _tokens(model: infer.Model) -> list[int]:
    """Greedy tokens: the decode steps run the recorded program where the backend records one."""
    return list(model.generate_tokens(IDS, max_tokens=8, ignore_eos=True))


def _attributes(ops: NumpyBackend) -> dict[str, int]:
    return {name: id(value) for name, value in vars(ops).items()}


@pytest.mark.skipif(not NumpyBackend.activation_schemes, reason="the C kernels are not built here")
def test_two_models_on_one_backend_keep_their_own_activations() -> None:
    ops = NumpyBackend()
    exact = infer.load(tiny_model_dir("llama3"), backend=ops, quantize="q8")
    logits, tokens = _logits(exact), _tokens(exact)
    q8 = infer.load(tiny_model_dir("llama3"), backend=ops, quantize="q8", activations="q8")
    # The first model still computes exactly, eagerly and in its recorded step, ...
    np.testing.assert_array_equal(_logits(exact), logits)
    assert _tokens(exact) == tokens
    # ... and the second on quantized activations (which move the logits).
    assert exact.backend.settings.activations is None and q8.backend.settings.activations == "q8"
    assert not np.array_equal(_logits(q8), logits)
    assert ops.settings == LoadSettings()


def test_two_models_on_one_backend_keep_their_own_quantization() -> None:
    ops = NumpyBackend()
    floats = infer.load(tiny_model_dir("llama3"), backend=ops, compile=False)
    logits = _logits(floats)
    q4 = infer.load(tiny_model_dir("llama3"), backend=ops, quantize="q4", compile=False)
    np.testing.assert_array_equal(_logits(floats), logits)
    assert floats.backend.settings.quantize is None and q4.backend.settings.quantize == "q4"
    assert not np.array_equal(_logits(q4), logits)  # q4 weights: other logits


def test_loading_leaves_the_backend_instance_untouched() -> None:
    ops = NumpyBackend()
    before = _attributes(ops)
    kv = next(iter(ops.kv_dtypes))
    model = infer.load(tiny_model_dir("llama3"), backend=ops, quantize="q8", compile=True, kv_dtype=kv,
                       activations="q8" if ops.activation_schemes else None)
    assert _attributes(ops) == before  # nothing written onto it, nothing rebound
    assert ops.settings == LoadSettings() and ops.quantize is None and not ops.graph_capture
    assert model.backend is not ops and type(model.backend) is type(ops)
    assert model.backend.settings.quantize == "q8" and model.backend.settings.kv_dtype == kv
    assert model.backend.graph_capture and model.engine.backend is model.backend
    # Settings equal to the instance's own: the instance itself, unchanged.
    assert infer.load(tiny_model_dir("llama3"), backend=ops).backend is ops


def test_settings_are_checked_in_one_place() -> None:
    with pytest.raises(InvalidQuantizationError, match="expected None, 'off' or one of 'q8', 'q4'"):
        LoadSettings(quantize="q3")
    with pytest.raises(InvalidQuantizationError, match="expected None"):
        LoadSettings(activations="q4")
    ops = NumpyBackend()

    class Plain(NumpyBackend):  # a backend that lists no schemes
        quantize_schemes = frozenset()
        activation_schemes = frozenset()

    plain = Plain()
    with pytest.raises(InvalidQuantizationError, match="has no on-load quantization 'q8'"):
        plain.configure(LoadSettings(quantize="q8"))
    with pytest.raises(InvalidQuantizationError, match="has no activation quantization 'q8'"):
        plain.configure(LoadSettings(activations="q8"))
    with pytest.raises(CacheConfigError, match="kv_dtype='int8'"):
        ops.configure(LoadSettings(kv_dtype="int8"))
    # The engine's own check is the same one.
    from infer.engine.runner import check_kv_dtype

    assert check_kv_dtype(ops, ops.compute_dtype) is None
    with pytest.raises(CacheConfigError, match="kv_dtype='int8'"):
        check_kv_dtype(ops, "int8")
    assert plain.configure(LoadSettings(quantize="off")).settings.quantize == "off"  # needs no scheme


def test_assigning_the_old_attributes_warns_and_changes_only_that_instance() -> None:
    ops = NumpyBackend()
    with pytest.warns(DeprecationWarning, match="backend.quantize is deprecated"):
        ops.quantize = "q4"
    assert ops.settings.quantize == "q4" and ops.quantize == "q4"
    assert NumpyBackend().quantize is None and NumpyBackend.settings == LoadSettings()
    with pytest.warns(DeprecationWarning, match="backend.graph_capture"):
        ops.graph_capture = True
    assert ops.settings.compile is True


def test_old_helper_imports_from_the_contract_still_work() -> None:
    from infer import oplib, ops

    for name in ("row_run", "attention_mask", "ragged_rows", "rows_within", "conv1d_reference",
                 "ssd_reference", "gated_delta_rule_reference"):
        with pytest.warns(DeprecationWarning, match=f"infer.ops.{name} moved to infer.oplib.{name}"):
            assert getattr(ops, name) is getattr(oplib, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from infer.ops import AttentionBatch, Backend  # noqa: F401  (the contract's own names: no warning)
    with pytest.raises(AttributeError):
        ops.no_such_name  # noqa: B018


def test_the_ranks_configure_their_backend_with_rank_0s_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 0 hands its settings to the ranks it starts; a rank configures its backend with
    # them before it prepares a weight. (Both sides run here, without starting processes.)
    import infer.distributed as distributed
    from infer.distributed import worker

    started: list[dict] = []

    class Recorded:
        pid = 0

        def __init__(self, cmd: list[str], **_: object) -> None:
            started.append(json.loads(cmd[-1]))

    monkeypatch.setattr(distributed.subprocess, "Popen", Recorded)
    settings = LoadSettings(quantize="q8", kv_dtype=next(iter(NumpyBackend.kv_dtypes)))
    distributed.start(Path(tiny_model_dir("llama3")), "huggingface", "numpy", None, settings, 2)
    (spec,) = started
    served = []
    monkeypatch.setattr(distributed, "serve", lambda package, arch, ops, ranks: served.append(ops))
    worker.run(dict(spec, rank=0, ranks=1))  # a group of one: numpy has no collectives
    (ops,) = served
    assert ops.settings == settings and ops.quantize == "q8"


def test_configured_copies_keep_their_dequantization_caches_apart() -> None:
    # Each copy counts the bytes it caches against cache_bytes; a dict shared
    # between copies would hold that bound once per copy.
    ops = NumpyBackend()
    a, b = ops.configure(LoadSettings(quantize="q8")), ops.configure(LoadSettings(quantize="q4"))
    assert a._cache is not b._cache and a._cache is not ops._cache
    assert a._cached_bytes == b._cached_bytes == 0
    assert ops.configure(LoadSettings()) is ops  # the same settings: the instance itself, cache and all
