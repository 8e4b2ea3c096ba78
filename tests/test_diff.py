"""The divergence tracer finds where a backend goes wrong, and says nothing when none does."""

from __future__ import annotations

import pytest
from infer.backends.numpy import NumpyBackend
from reference import LOGIT_RTOL, encode, tiny_model_dir

from infer.plugins import register_plugin, unregister_plugin
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import BackendSpec, Probe
from infer.tools.cli import main
from infer.tools.diff import diff


class SlightlyWrongSilu(NumpyBackend):
    """numpy, except that silu is 1% too large: a bug a backend author could ship."""

    name = "wrongsilu"

    def silu(self, x):  # type: ignore[no-untyped-def]
        return super().silu(x) * 1.01

    def swiglu(self, gate, up):  # type: ignore[no-untyped-def]
        return self.silu(gate) * up


class Plugin:
    @hookimpl
    def infer_register_backends(self, register):  # type: ignore[no-untyped-def]
        register(BackendSpec(name="wrongsilu", device="cpu", factory=lambda dtype: SlightlyWrongSilu(dtype),
                             probe=lambda: Probe(1)))


@pytest.fixture()
def wrong_backend():  # type: ignore[no-untyped-def]
    name = register_plugin(Plugin(), name="wrongsilu-plugin")
    yield "wrongsilu"
    unregister_plugin(name)


@pytest.fixture(scope="module")
def model_and_ids():  # type: ignore[no-untyped-def]
    path = tiny_model_dir("llama3")
    return path, encode(path, "The capital of France is Paris")


def test_identical_backends_show_no_divergence(model_and_ids) -> None:  # type: ignore[no-untyped-def]
    path, ids = model_and_ids
    report = diff(path, ["numpy", "numpy"], ids, steps=3)
    assert report.first is None
    assert max(max(row) for row in report.per_layer) == 0.0
    assert len(report.per_layer) == 3 and len(report.per_layer[0]) == len(ids) + 3
    assert report.tokens_a == report.tokens_b


def test_one_backend_is_compared_with_the_reference(model_and_ids) -> None:  # type: ignore[no-untyped-def]
    path, ids = model_and_ids
    report = diff(path, ["numpy"], ids, steps=3)
    assert (report.a, report.b) == ("reference/cpu", "numpy/cpu")
    assert report.first is None and report.tokens_a == report.tokens_b
    # Two codes, float32 rounding apart: within LOGIT_RTOL of the largest logit (about 15 here).
    assert 0.0 < max(report.logits) < LOGIT_RTOL * 15


def test_first_divergence_names_the_op_and_layer(model_and_ids, wrong_backend: str) -> None:  # type: ignore[no-untyped-def]
    path, ids = model_and_ids
    report = diff(path, [wrong_backend], ids, steps=2, tolerance=1e-4)
    assert report.a == "reference/cpu"
    assert report.first is not None
    index, op, layer, err = report.first
    # The MLP of layer 0 runs after layer 0's attention.
    assert op == "swiglu" and layer == 1 and err > 1e-4
    assert "first divergence: op" in report.format() and "swiglu after layer 0's attention" in report.format()


def test_against_transformers_per_layer(model_and_ids) -> None:  # type: ignore[no-untyped-def]
    path, ids = model_and_ids
    report = diff(path, ["numpy", "transformers"], ids, steps=3)
    assert len(report.per_layer) == 2  # hidden states after layers 0 and 1 of 3 (the last is normed)
    assert report.first is None and report.tokens_a == report.tokens_b
    assert max(report.logits) < LOGIT_RTOL  # relative to max|logit|: float32 rounding only (reference.py)


def test_cli_diff(model_and_ids, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    path, _ = model_and_ids
    assert main(["-q", "diff", str(path), "--backends", "numpy,numpy", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "no op output exceeds the tolerance" in out and "greedy tokens identical" in out
    assert main(["-q", "diff", str(path), "--backends", "numpy", "--steps", "1"]) == 0
    assert capsys.readouterr().out.startswith("reference/cpu vs numpy/cpu")
    assert main(["diff", str(path), "--backends", "numpy,numpy,numpy"]) == 1


def test_int8_activations_are_labelled_approximate_and_held_to_their_bound(model_and_ids) -> None:  # type: ignore[no-untyped-def]
    if "q8" not in NumpyBackend().activation_schemes:
        pytest.skip("the numpy backend's C kernels are not built: no activations='q8'")
    path, ids = model_and_ids
    report = diff(path, ["numpy", "numpy"], ids, steps=2, quantize="q8", activations="q8")
    assert report.activations == "q8" and report.b.endswith("activations=q8")
    # A prompt's products on quantized weights (two or more rows) took the int8 path and stayed in bound.
    assert len(report.bound_checks) > 0 and report.within_bound
    assert max(r for _, _, r in report.bound_checks) > 0  # int8 rounding moved them
    text = report.format()
    assert "approximate: " in text and "beyond it" in text
