"""The conformance kit (infer.testing): run on every installed backend, and checked itself.

``test_op`` and ``test_end_to_end`` are the kit's own tests, imported so that
they run here on every available backend except the reference they are
compared with (numpy/cpu, torch/cpu, mlx/cpu, ...), in each float dtype the
backend declares, through the kit's pytest plugin (``--infer-backend``
narrows them). The rest checks the kit: numpy passes it, deliberately broken
backends are reported wrong on exactly the op they break, "unsupported" is a skip and not a failure, and the
one-command form a third party uses works from outside this checkout.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from infer.backends.numpy import NumpyBackend, reference_attention
from infer.oplib import attention_mask
from infer.ops import AttentionBatch

from infer.errors import InferError, MissingDependencyError, UnsupportedOpError
from infer.ops import OPTIONAL_OPS, REQUIRED_OPS
from infer.testing.cases import CASES, case_named
from infer.testing.conformance import TOLERANCES, check_backend, check_case
from infer.testing.test_conformance import test_end_to_end, test_op  # noqa: F401  (run here)
from infer.testing.tiny_model import check_end_to_end


def test_every_op_of_the_contract_has_a_case() -> None:
    covered = {c.op for c in CASES}
    assert set(REQUIRED_OPS) | set(OPTIONAL_OPS) <= covered
    assert len({c.name for c in CASES}) == len(CASES)


def test_numpy_passes_the_kit() -> None:
    results = check_backend(NumpyBackend(), max_examples=5)
    # numpy has no bfloat16 arrays: a cast to it is unsupported, not wrong.
    assert [(r.case, r.status) for r in results if r.status != "ok"] == [("astype-bfloat16", "unsupported")]
    # An approximate mode's cases (int8 activations) are judged by their own bound; their NMSE is only reported.
    exact = {c.name for c in CASES if c.bound is None}
    assert max(r.worst_nmse for r in results if r.case in exact) <= TOLERANCES["float32"]
    assert all(r.passed for r in check_end_to_end(NumpyBackend()))
    # Against itself, the same code on both sides: not a rounding apart.
    same = check_backend(NumpyBackend(), max_examples=5, reference=NumpyBackend())
    assert max(r.worst_nmse for r in same if r.case in exact) == 0.0


def test_tiny_models_have_clear_greedy_margins() -> None:
    # float32 backends must reproduce the reference's tokens exactly: that is fair only
    # if no step's best two logits are within rounding of each other. Two correct
    # float32 backends differ by up to 4 u sqrt(K) (L + 1) max|logit| per logit
    # (reference.LOGIT_RTOL's argument; K = 128, L = 2, logits below ~20 for the
    # kit's models: 1.6e-4), so a tie needs a gap under twice that, 3.3e-4:
    # 5e-3 is 15x above it.
    for result in check_end_to_end(NumpyBackend()):
        assert result.reference_margin > 5e-3, result.describe()


# -- broken backends, each wrong in one way --------------------------------------------------


class TopLeftCausal(NumpyBackend):
    """Aligns each sequence's queries with its first keys (torch's is_causal=True)
    instead of its last: query i sees keys 0..i."""

    def attention(self, q, k_pool, v_pool, batch, *, scale, causal=True, window=None, softcap=None, sinks=None):
        host = batch.on_host(self)
        counts = np.diff(host.query_start)
        lengths = np.where(counts > 0, np.minimum(host.seq_lens, np.maximum(counts, 1)), host.seq_lens)
        moved = AttentionBatch(host.query_start, lengths.astype(np.int32), host.block_tables, host.block_size,
                               host.max_query)
        return super().attention(q, k_pool, v_pool, moved, scale=scale, causal=causal, window=window,
                                 softcap=softcap, sinks=sinks)


class IgnoresSinks(NumpyBackend):
    def attention(self, q, k_pool, v_pool, batch, *, scale, causal=True, window=None, softcap=None, sinks=None):
        return super().attention(q, k_pool, v_pool, batch, scale=scale, causal=causal, window=window, softcap=softcap)


class FirstSequenceOnly(NumpyBackend):
    """Reads every sequence's keys through the first sequence's block table."""

    def attention(self, q, k_pool, v_pool, batch, *, scale, causal=True, window=None, softcap=None, sinks=None):
        host = batch.on_host(self)
        tables = np.repeat(host.block_tables[:1], host.num_seqs, axis=0)
        moved = AttentionBatch(host.query_start, host.seq_lens, tables, host.block_size, host.max_query)
        return super().attention(q, k_pool, v_pool, moved, scale=scale, causal=causal, window=window,
                                 softcap=softcap, sinks=sinks)


class IgnoresInterleaved(NumpyBackend):
    def rope(self, x, cos, sin, interleaved=False):
        return super().rope(x, cos, sin, interleaved=False)


class SoftmaxZeroForMaskedRows(NumpyBackend):
    def softmax(self, x, axis=-1):
        return np.nan_to_num(super().softmax(x, axis), nan=0.0)


class LastArgmax(NumpyBackend):
    def argmax(self, x, axis=-1):
        flipped = np.flip(x, axis=axis)
        return x.shape[axis] - 1 - np.argmax(flipped, axis=axis)


class InPlaceExp(NumpyBackend):
    def exp(self, x):
        return np.exp(x, out=x)


class AliasingToNumpy(NumpyBackend):
    def to_numpy(self, x):
        return x


class RmsNormWithoutEps(NumpyBackend):
    def rms_norm(self, x, weight, eps):
        return super().rms_norm(x, weight, 0.0)


class MeanInFloat64(NumpyBackend):
    def mean(self, x, axis=-1, keepdims=False):
        return np.mean(x.astype(np.float64), axis=axis, keepdims=keepdims)


class WrappingEmbedding(NumpyBackend):
    def embedding(self, table, ids):
        return np.take(table, ids, axis=0, mode="wrap")


class DropsBias(NumpyBackend):
    def linear(self, x, weight, bias=None):
        return super().linear(x, weight, None)


class SlidingWindowOffByOne(NumpyBackend):
    def attention(self, q, k_pool, v_pool, batch, *, scale, causal=True, window=None, softcap=None, sinks=None):
        return super().attention(q, k_pool, v_pool, batch, scale=scale, causal=causal,
                                 window=None if window is None else window + 1, softcap=softcap, sinks=sinks)


@pytest.mark.parametrize("backend, wrong, right, says", [
    (TopLeftCausal, "attention-decode", "attention-causal", "NMSE"),
    (IgnoresSinks, "attention-sinks", "attention-window", "NMSE"),
    (FirstSequenceOnly, "attention-ragged", "attention-causal", "NMSE"),
    (IgnoresInterleaved, "rope", "rms_norm", "NMSE"),
    (SoftmaxZeroForMaskedRows, "softmax-masked-row", "softmax", "NaN"),
    (LastArgmax, "argmax", "max", "integer results differ"),
    (InPlaceExp, "exp", "tanh", "modified its input"),
    (AliasingToNumpy, "to_numpy", "shape", "modified its input"),
    (RmsNormWithoutEps, "rms_norm", "layer_norm", "NMSE"),
    (MeanInFloat64, "mean", "sum", "reading back the result"),
    (WrappingEmbedding, "embedding-out-of-range", "embedding", "instead of raising"),
    (DropsBias, "linear-bias", "linear", "NMSE"),
    (SlidingWindowOffByOne, "attention-window", "attention-gqa", "NMSE"),
])
def test_a_wrong_op_is_reported_wrong(backend, wrong, right, says) -> None:
    broken = backend()
    result = check_case(case_named(wrong), broken)
    assert result.status == "wrong" and says in result.detail, result
    assert re.search("Falsifying example|Failing test case", result.detail)  # hypothesis' smallest failing call
    assert check_case(case_named(right), broken).status == "ok"


class NoSmallWindows(NumpyBackend):
    def attention(self, q, k_pool, v_pool, batch, *, scale, causal=True, window=None, softcap=None, sinks=None):
        if window is not None and window < 3:
            raise UnsupportedOpError("windows under 3 are not supported")
        return super().attention(q, k_pool, v_pool, batch, scale=scale, causal=causal, window=window,
                                 softcap=softcap, sinks=sinks)


class NoTopk(NumpyBackend):
    def topk(self, x, k):
        raise UnsupportedOpError("no top-k on this backend")


def test_unsupported_is_reported_apart_from_wrong() -> None:
    result = check_case(case_named("topk-values"), NoTopk())
    assert result.status == "unsupported" and "no top-k" in result.detail
    partial = check_case(case_named("attention-window"), NoSmallWindows())
    assert partial.status == "ok" and partial.examples > 0 and partial.unsupported_examples > 0
    assert "windows under 3" in partial.detail


# -- the command a third party runs ---------------------------------------------------------------

BROKEN_PLUGIN = '''
"""A third-party backend, registered when pytest loads this module with -p."""
import numpy as np
from infer.backends.numpy import NumpyBackend
from infer.errors import UnsupportedOpError
from infer.plugins.hookspecs import hookimpl
from infer.plugins import register_plugin
from infer.plugins.registry import BackendSpec, Probe


class Broken(NumpyBackend):
    name = "brokenbk"

    def softmax(self, x, axis=-1):
        return np.nan_to_num(super().softmax(x, axis), nan=0.0)

    def topk(self, *args, **kwargs):
        raise UnsupportedOpError("brokenbk has no top-k")


@hookimpl
def infer_register_backends(register):
    register(BackendSpec("brokenbk", "cpu", factory=lambda dtype: Broken(dtype), probe=lambda: Probe(5)))


register_plugin(__import__(__name__), name="brokenbk")
'''


def run_pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(cwd))
    env.pop("INFER_CONFORMANCE_BACKENDS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def outcome(stdout: str) -> dict[str, int]:
    tail = stdout.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}


def test_pyargs_reports_wrong_as_failed_and_unsupported_as_skipped(tmp_path: Path) -> None:
    (tmp_path / "brokenbk_plugin.py").write_text(textwrap.dedent(BROKEN_PLUGIN))
    proc = run_pytest(tmp_path, "-p", "brokenbk_plugin", "--pyargs", "infer.testing", "--infer-backend", "brokenbk",
                      "--infer-examples", "5", "-k", "softmax or topk or (exp and not expert)", "-q", "-rs")
    # the two top-k cases skip.
    assert outcome(proc.stdout) == {"failed": 1, "passed": 2, "skipped": 2}, proc.stdout + proc.stderr
    assert "brokenbk/cpu-float32-softmax-masked-row" in proc.stdout and "NaN" in proc.stdout
    assert "brokenbk has no top-k" in proc.stdout


def test_pyargs_runs_the_kit_on_torch(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    proc = run_pytest(tmp_path, "--pyargs", "infer.testing", "--infer-backend", "torch:cpu",
                      "--infer-dtype", "float32", "--infer-examples", "3", "-q")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # torch/cpu runs int8 activations on the C kernels (activation_schemes), but lists no q8_0 pools
    # (kv_dtypes): those cases skip as unsupported, nothing else.
    q8_pools = sum("q8_0" in c.name for c in CASES)
    assert outcome(proc.stdout) == {"passed": len(CASES) + 2 - q8_pools, "skipped": q8_pools}


def test_family_name_checks_the_usable_devices_and_device_names_are_strict(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    proc = run_pytest(tmp_path, "--pyargs", "infer.testing", "--infer-backend", "torch", "--infer-dtype", "float32",
                      "--infer-examples", "3", "-k", "exp", "-q")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert outcome(proc.stdout).get("passed", 0) >= 1 and "failed" not in outcome(proc.stdout)
    proc = run_pytest(tmp_path, "--pyargs", "infer.testing", "--infer-backend", "torch:cuda")
    assert proc.returncode == 4 and "torch/cuda: not available here" in proc.stderr


def test_unknown_backend_is_a_usage_error(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path, "--pyargs", "infer.testing", "--infer-backend", "nosuchbackend")
    assert proc.returncode == 4  # pytest's usage error
    assert "nosuchbackend: no such backend is registered" in proc.stderr


# -- without hypothesis ---------------------------------------------------------------------------

INSTALL_ADVICE = "pip install 'infer-engine[conformance]'"


def test_without_hypothesis_the_kit_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry is what `import hypothesis` meets when it is not installed:
    # ModuleNotFoundError (name="hypothesis"). The kit's modules are imported afresh.
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    for name in ("infer.testing.cases", "infer.testing.strategies"):
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(MissingDependencyError) as caught:
        check_backend(NumpyBackend(), max_examples=1)
    message = str(caught.value)
    assert "hypothesis, which is not installed here" in message and INSTALL_ADVICE in message
    assert isinstance(caught.value, InferError) and isinstance(caught.value, ImportError)


#: A hypothesis that is "not installed": it shadows the real one on PYTHONPATH.
NO_HYPOTHESIS = '''raise ModuleNotFoundError("No module named 'hypothesis'", name="hypothesis")\n'''


def test_the_pytest_command_without_hypothesis_says_what_to_install(tmp_path: Path) -> None:
    (tmp_path / "hypothesis").mkdir()
    (tmp_path / "hypothesis" / "__init__.py").write_text(NO_HYPOTHESIS)
    # hypothesis' own pytest plugin is not there either when hypothesis is not installed.
    named = run_pytest(tmp_path, "-p", "no:hypothesispytest", "--pyargs", "infer.testing", "--infer-backend", "numpy")
    assert named.returncode == 4, named.stdout[-2000:] + named.stderr[-2000:]  # pytest's usage error
    assert "ERROR: infer's conformance kit draws its op calls with hypothesis" in named.stderr
    assert INSTALL_ADVICE in named.stderr
    assert "Traceback" not in named.stderr
    unnamed = run_pytest(tmp_path, "-p", "no:hypothesispytest", "--pyargs", "infer.testing")
    assert unnamed.returncode == 2  # an error while collecting the kit's module
    assert "MissingDependencyError" in unnamed.stdout and INSTALL_ADVICE in unnamed.stdout


def test_the_kit_needs_neither_transformers_nor_a_framework() -> None:
    code = ("import sys, infer.testing.conformance, infer.testing.cases, infer.testing.tiny_model, "
            "infer.testing.pytest_plugin; bad = {'transformers', 'torch', 'mlx', 'reference'} & set(sys.modules); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_attention_mask_is_bottom_right() -> None:
    # The contract's mask, which the kit's reference (the contract's default attention) trusts: queries at positions 3 and 4
    # (the last of 5) see keys up to themselves; the last sees every key.
    mask = attention_mask(3, 2, 0, 5, True, None)
    assert (mask == 0).tolist() == [[True, True, True, True, False], [True] * 5]
    assert attention_mask(4, 1, 0, 5, True, None) is None  # decoding: every key seen
    assert (attention_mask(2, 1, 0, 5, False, 2) == 0).tolist() == [[False, True, True, True, False]]


def test_numpy_attention_equals_the_plain_definition() -> None:
    """numpy's attention (its fast paths: the C kernel, the chunked GEMMs) against
    :func:`reference_attention`, the contract's definition written out in float64."""
    from hypothesis import given, settings

    case = case_named("attention-all")
    ops = NumpyBackend()

    @settings(max_examples=60, deadline=None, derandomize=True, database=None)
    @given(case.inputs)
    def check(call) -> None:
        q, k, v, qs, lens, tables = (a.value if hasattr(a, "value") else a for a in call.args)
        kwargs = {key: (val.value if hasattr(val, "value") else val) for key, val in call.kwargs.items()}
        batch = AttentionBatch(qs, lens, tables, call.info["block_size"], call.info["max_query"])
        got = ops.attention(q, k, v, batch, **kwargs)
        want = reference_attention(q, k, v, batch, **kwargs)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)  # float32 sums against float64

    check()


def test_end_to_end_reports_nan_and_wrong_shape_backends_with_their_reason() -> None:
    class NaNLinear(NumpyBackend):
        def linear(self, x, w, *args, **kwargs):  # type: ignore[no-untyped-def]
            return super().linear(x, w, *args, **kwargs) * np.float32("nan")

    class ShortNorm(NumpyBackend):
        def rms_norm(self, x, w, eps):  # type: ignore[no-untyped-def]
            return super().rms_norm(x, w, eps)[..., :3]

    for backend, says in ((NaNLinear("float32"), "NaN"), (ShortNorm("float32"), "ValueError")):
        (result,) = check_end_to_end(backend, variants=["llama"])
        assert not result.passed and says in result.error
        assert result.describe().startswith("llama in float32: the candidate failed to decode")


def test_int8_activation_cases_are_a_separate_mode_with_their_own_bound() -> None:
    q8_cases = [c for c in CASES if c.name.startswith("quantized_linear-q8act-")]
    assert len(q8_cases) == 8 and all(c.bound is not None for c in q8_cases)
    numpy_q8 = "q8" in NumpyBackend().activation_schemes
    for result in check_backend(NumpyBackend(), q8_cases, max_examples=8):
        assert result.status == ("ok" if numpy_q8 else "unsupported"), (result.case, result.detail)

    class NoQ8(NumpyBackend):
        activation_schemes = frozenset()

    assert {r.status for r in check_backend(NoQ8(), q8_cases[:1], max_examples=3)} == {"unsupported"}

    class WrongScale(NumpyBackend):
        """int8 activations with a scale half again too large (one dx per row instead of per group, say)."""

        def configure(self, settings):  # type: ignore[no-untyped-def]
            configured = super().configure(settings)
            if settings.activations is None:
                return configured
            inner_linear = configured.linear
            configured.linear = lambda x, w, b=None: inner_linear(x, w, b) * np.float32(1.5)
            return configured

    if numpy_q8:
        wrong = check_backend(WrongScale(), [case_named("quantized_linear-q8act-Q4_K")], max_examples=5)
        assert wrong[0].status == "wrong" and "beyond the mode's bound" in wrong[0].detail
