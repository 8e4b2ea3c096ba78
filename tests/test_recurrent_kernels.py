"""The recurrent layers' C kernels (backends/cpu/recurrent.c) against the op references.

Each op runs on a ragged batch with an empty sequence, a one-row (decode)
sequence and longer runs, checkpoint rows out of order and repeated, on
every code path this CPU has (the paths compute the same float32 sums in
the same order, so they must agree to the bit). Tolerances: the kernels sum
in a different order from numpy's einsum (16 partial sums), so they differ
from the float32 references by float32 rounding grown over the rows (below
1e-6 of the outputs' largest magnitude, measured at these sizes), bounded
here by 2e-5; ``ssd``'s reference is float64, the same bound holds.
"""

from __future__ import annotations

import numpy as np
import pytest

from infer import oplib
from infer.backends.cpu import kernels
from infer.backends.numpy import NumpyBackend

pytestmark = pytest.mark.skipif(not kernels.has_recurrent(), reason="the C kernels are not built")

TOL = 2e-5
QS = np.array([0, 1, 1, 40, 90], np.int32)  # a decode row, an empty sequence, two runs
ROWS = np.array([70, 0, 39, 89, 70, 5], np.int32)  # out of order, one repeated, one mid-run


@pytest.fixture(params=["portable", "avx2+fma", "avx512"])
def path(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Each code path this CPU runs, the one in use restored after."""
    native = kernels.native
    if request.param not in native.paths():
        pytest.skip(f"this CPU has no {request.param}")
    before = native.simd()
    native.use_simd(request.param)
    yield request.param
    native.use_simd(before)


def close(got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...]) -> None:
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert g.size == 0 or np.abs(g - w).max() <= TOL * max(1.0, float(np.abs(w).max()))


def conv_args(rng: np.random.Generator, k: int = 4) -> tuple[np.ndarray, ...]:
    c = 70  # more than one span of 64 channels, and not a multiple of it
    return (rng.standard_normal((90, c)).astype(np.float32), rng.standard_normal((4, k - 1, c)).astype(np.float32),
            rng.standard_normal((c, k)).astype(np.float32), rng.standard_normal(c).astype(np.float32))


def gdr_args(rng: np.random.Generator, dk: int = 32, dv: int = 40) -> tuple[np.ndarray, ...]:
    t, hk, h = 90, 2, 4
    return (rng.standard_normal((t, hk, dk)).astype(np.float32), rng.standard_normal((t, hk, dk)).astype(np.float32),
            rng.standard_normal((t, h, dv)).astype(np.float32), -rng.random((t, h)).astype(np.float32),
            rng.random((t, h)).astype(np.float32), rng.standard_normal((4, h, dk, dv)).astype(np.float32))


def ssd_args(rng: np.random.Generator, n: int = 24) -> tuple[np.ndarray, ...]:
    t, h, p, g = 90, 4, 20, 2
    return (rng.standard_normal((t, h, p)).astype(np.float32), rng.standard_normal((t, h)).astype(np.float32),
            -rng.random(h).astype(np.float32), rng.standard_normal((t, g, n)).astype(np.float32),
            rng.standard_normal((t, g, n)).astype(np.float32), rng.standard_normal(h).astype(np.float32),
            rng.standard_normal(h).astype(np.float32), rng.standard_normal((4, h, p, n)).astype(np.float32))


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("k", [1, 4])
def test_causal_conv1d(path: str, silu: bool, k: int) -> None:
    x, window, weight, bias = conv_args(np.random.default_rng(0), k)
    want = oplib.conv1d_reference(x, window, weight, bias, QS, ROWS, "silu" if silu else None)
    close(kernels.causal_conv1d(x, window, weight, bias, QS, ROWS, silu), want)
    close(kernels.causal_conv1d(x, window, weight, None, QS, None, silu),
          oplib.conv1d_reference(x, window, weight, None, QS, None, "silu" if silu else None))


@pytest.mark.parametrize("chunked", [0, 16])
def test_gated_delta_rule(path: str, chunked: int) -> None:
    # chunked=16: the 39- and 50-row runs take the chunked form, in chunks cut at checkpoint rows.
    q, k, v, g, beta, state = gdr_args(np.random.default_rng(1))
    for l2norm, scale in ((True, None), (False, 0.3)):
        want = oplib.gated_delta_rule_reference(q, k, v, g, beta, state, QS, ROWS, scale=scale, l2norm_qk=l2norm)
        got = kernels.gated_delta_rule(q, k, v, g, beta, state, QS, ROWS, 32 ** -0.5 if scale is None else scale,
                                       l2norm, chunked)
        close(got, want)


def test_gated_delta_rule_qwen_heads_chunked() -> None:
    # 128-wide heads take the chunked form's fixed-size loops; one 200-row run, 64-row chunks.
    rng = np.random.default_rng(2)
    q, k, v, g, beta, _ = gdr_args(rng, 128, 128)
    state = np.zeros((1, 4, 128, 128), np.float32)
    qs, rows = np.array([0, 90], np.int32), np.array([63, 89], np.int32)
    want = oplib.gated_delta_rule_reference(q, k, v, g, beta, state, qs, rows)
    close(kernels.gated_delta_rule(q, k, v, g, beta, state, qs, rows, 128 ** -0.5, True, 64), want)
    close(kernels.gated_delta_rule(q, k, v, g, beta, state, qs, rows, 128 ** -0.5, True, 0), want)


@pytest.mark.parametrize("n", [24, 128])
def test_ssd(path: str, n: int) -> None:
    x, dt, A, B, C, D, dt_bias, state = ssd_args(np.random.default_rng(3), n)
    want = oplib.ssd_reference(x, dt, A, B, C, D, dt_bias, state, QS, ROWS, dt_softplus=True, dt_min=0.001,
                               dt_max=2.0)
    close(kernels.ssd(x, dt, A, B, C, D, dt_bias, state, QS, ROWS, True, 0.001, 2.0), want)
    want = oplib.ssd_reference(x, dt, A, B, C, None, None, state, QS, None, dt_softplus=False)
    close(kernels.ssd(x, dt, A, B, C, None, None, state, QS, None, False, 0.0, float("inf")), want)


def test_paths_agree_to_the_bit() -> None:
    native, before = kernels.native, kernels.native.simd()
    rng = np.random.default_rng(4)
    conv, gdr, ssd = conv_args(rng), gdr_args(rng), ssd_args(rng, 128)
    results = []
    try:
        for name in native.paths():
            native.use_simd(name)
            results.append([*kernels.causal_conv1d(*conv, QS, ROWS, True),
                            *kernels.gated_delta_rule(*gdr, QS, ROWS, 0.2, True, 0),
                            *kernels.gated_delta_rule(*gdr, QS, ROWS, 0.2, True, 16),
                            *kernels.ssd(*ssd, QS, ROWS, True, 0.0, float("inf"))])
    finally:
        native.use_simd(before)
    for other in results[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(results[0], other))


def test_a_bad_batch_is_refused_not_read_past() -> None:
    x, window, weight, bias = conv_args(np.random.default_rng(5))
    for qs, rows in ((np.array([0, 1, 1, 40, 91], np.int32), None),  # past the rows
                     (np.array([0, 5, 1, 40, 90], np.int32), None),  # falling
                     (QS, np.array([90], np.int32))):  # a checkpoint past the rows
        with pytest.raises(ValueError):
            kernels.causal_conv1d(x, window, weight, bias, qs, rows, False)
    q, k, v, g, beta, state = gdr_args(np.random.default_rng(5), dk=300)  # wider than the kernel's state block
    with pytest.raises(ValueError, match="K=300"):
        kernels.gated_delta_rule(q, k, v, g, beta, state[:, :, :300], QS, None, 0.1, True)


def test_numpy_backend_uses_them_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    ops, rng = NumpyBackend(), np.random.default_rng(6)
    gdr = gdr_args(rng)
    got = ops.gated_delta_rule(*gdr, QS, ROWS)
    assert all(np.array_equal(a, b) for a, b in zip(got, kernels.gated_delta_rule(*gdr, QS, ROWS, 32 ** -0.5, True)))
    # Without the kernels (not built): the references, and the numpy chunked scan for ssd.
    monkeypatch.setattr(kernels, "has_recurrent", lambda: False)
    close(ops.gated_delta_rule(*gdr, QS, ROWS), oplib.gated_delta_rule_reference(*gdr, QS, ROWS))
    conv = conv_args(rng)
    close(ops.causal_conv1d(*conv, QS, ROWS, activation="silu"), oplib.conv1d_reference(*conv, QS, ROWS, "silu"))
    s = ssd_args(rng)
    close(ops.ssd(*s, QS, ROWS), oplib.ssd_reference(*s, QS, ROWS))


def test_a_prompts_ops_use_the_threads_unless_blas_ran_the_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's recurrent ops (90 rows here) run on the kernels' threads after
    a product on them (tiled or q8), on one thread after a BLAS product (whose
    threads spin on the cores); decode rows always on the threads. The threads
    split heads and column blocks, each its own arithmetic: the same bits."""
    ops, rng = NumpyBackend(), np.random.default_rng(7)
    gdr, conv, s = gdr_args(rng), conv_args(rng), ssd_args(rng)
    seen: list[bool] = []
    for name in ("gated_delta_rule", "causal_conv1d", "ssd"):
        real = getattr(kernels.native, name)
        monkeypatch.setattr(kernels.native, name, lambda *a, real=real: seen.append(a[-1]) or real(*a))
    results = {}
    for after_blas in (False, True):
        ops._after_blas = after_blas
        seen.clear()
        results[after_blas] = (ops.gated_delta_rule(*gdr, QS, ROWS), ops.causal_conv1d(*conv, QS, ROWS),
                               ops.ssd(*s, QS, ROWS))
        assert seen == [not after_blas] * 3
    for a, b in zip(results[False], results[True]):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    ops._after_blas = True
    seen.clear()
    one = np.array([0, 1], np.int32)  # a decode step's row
    ops.gated_delta_rule(*(a[:1] for a in gdr[:5]), gdr[5][:1], one)
    assert seen == [True]


def test_torch_cpu_runs_the_same_kernels() -> None:
    torch = pytest.importorskip("torch")
    from infer.backends.torch import TorchBackend

    ops, rng = TorchBackend("cpu", "float32"), np.random.default_rng(7)
    for name, args in (("causal_conv1d", conv_args(rng)), ("gated_delta_rule", gdr_args(rng)),
                       ("ssd", ssd_args(rng))):
        mine = getattr(NumpyBackend(), name)(*args, QS, ROWS)
        theirs = getattr(ops, name)(*(torch.from_numpy(a) for a in args), torch.from_numpy(QS),
                                    torch.from_numpy(ROWS))
        assert all(np.array_equal(a, b.numpy()) for a, b in zip(mine, theirs)), name


def test_a_recorded_step_reads_the_batch_from_its_inputs() -> None:
    # The ops recorded once serve another batch of the same shapes (other run lengths, other
    # checkpoint rows): the program reads query_start and the rows at each run, not the trace's.
    ops, rng = NumpyBackend(), np.random.default_rng(8)
    conv, gdr, s = conv_args(rng), gdr_args(rng, 32, 32), ssd_args(rng)
    window, state, ssm = conv[1], gdr[5], s[7]

    def step(x, win, q, k, v, g, beta, st, xs, dt, B, C, sst, qs, rows):  # type: ignore[no-untyped-def]
        y, w1, w2 = ops.causal_conv1d(x, win, conv[2], conv[3], qs, rows, activation="silu")
        o, s1, s2 = ops.gated_delta_rule(q, k, v, g, beta, st, qs, rows)
        z, t1, t2 = ops.ssd(xs, dt, s[2], B, C, s[5], s[6], sst, qs, rows, dt_min=0.001, dt_max=5.0)
        return y, w1, w2, o, s1, s2, z, t1, t2

    planned = ops.compile(step, static=True)
    other_qs, other_rows = np.array([0, 30, 31, 31, 90], np.int32), np.array([89, 30, 0, 45, 12, 12], np.int32)
    for qs, rows in ((QS, ROWS), (other_qs, other_rows)):
        args = (conv[0], window, *gdr[:5], state, s[0], s[1], s[3], s[4], ssm, qs, rows)
        got = planned(*(a.copy() for a in args))
        want = step(*args)
        close(tuple(got), tuple(want))
    assert planned.graphs() == 1
    with pytest.raises(IndexError, match="query_start"):
        planned(*(a.copy() for a in (conv[0], window, *gdr[:5], state, s[0], s[1], s[3], s[4], ssm)),
                np.array([0, 30, 20, 31, 90], np.int32), other_rows)



def _pooled_step(ops: NumpyBackend, s: tuple[np.ndarray, ...], read_copy: bool):  # type: ignore[no-untyped-def]
    """A step as a hybrid layer writes it: each sequence's state gathered from its pool row
    (``ctx.state``), the op, the new state scattered back (``ctx.set_state``); with
    ``read_copy`` the gathered copy is read once more, by another op."""

    def step(q, k, v, g, beta, xs, dt, B, C, pool, spool, slots, qs, rows):  # type: ignore[no-untyped-def]
        state = ops.take(pool, slots, axis=0)
        o, last, ckpt = ops.gated_delta_rule(q, k, v, g, beta, state, qs, rows)
        y, slast, sckpt = ops.ssd(xs, dt, s[2], B, C, s[5], s[6], ops.take(spool, slots, axis=0), qs, rows,
                                  dt_min=0.001, dt_max=5.0)
        ops.scatter_rows(pool, slots, last)
        ops.scatter_rows(spool, slots, slast)
        return (o, ckpt, y, sckpt, ops.mul(state, state)) if read_copy else (o, ckpt, y, sckpt)

    return step


@pytest.mark.parametrize("read_copy", [False, True])
def test_a_recorded_step_updates_the_pools_state_rows_in_place(read_copy: bool) -> None:
    # The program reads and writes each sequence's pool row in place of the gather and the scatter
    # (at Qwen3.5's shape two 1 MiB copies per DeltaNet layer and token): the same arithmetic, so the
    # same bits as the eager ops, step after step; where the gathered copy is read by another op, the
    # copies stay. A slot past the pool is a typed error that writes nothing.
    from infer.backends.cpu import record

    ops, rng = NumpyBackend(), np.random.default_rng(9)
    q, k, v, g, beta, _ = gdr_args(rng, 32, 32)
    s = ssd_args(rng)
    pool = rng.standard_normal((6, 4, 32, 32)).astype(np.float32)
    spool = rng.standard_normal((6, 4, 20, 24)).astype(np.float32)
    slots = np.array([5, 0, 3, 2], np.int32)  # one per sequence of QS
    step = _pooled_step(ops, s, read_copy)
    planned = ops.compile(step, static=True)
    pools, planned_pools = (pool.copy(), spool.copy()), (pool.copy(), spool.copy())
    for _ in range(3):
        want = step(q, k, v, g, beta, s[0], s[1], s[3], s[4], *pools, slots, QS, ROWS)
        got = planned(q, k, v, g, beta, s[0], s[1], s[3], s[4], *planned_pools, slots, QS, ROWS)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
        assert all(np.array_equal(a, b) for a, b in zip(planned_pools, pools))
    assert not np.array_equal(pools[0], pool)  # the states moved
    assert planned.graphs() == 1
    plan = next(iter(planned._plans.values()))
    steps = [op for _, _, op in plan.marks]
    # Kept copies: the gather the other op reads (and, so that it reads the state before the update, its
    # scatter); the SSD's state (read by nobody else) in place either way.
    assert steps.count(record.GATHER) == steps.count(record.SCATTER_ROWS) == (1 if read_copy else 0)
    # The copies the program no longer touches are let go: the recording wrote them, so each held
    # its pages, a state's size, for as long as the program lived (72 MB at Qwen3.5's shape).
    held = {a.shape for a in plan.keep if type(a) is np.ndarray}
    assert (len(slots), *spool.shape[1:]) not in held
    assert ((len(slots), *pool.shape[1:]) in held) == read_copy
    before = tuple(p.copy() for p in planned_pools)
    # (the kept gather checks its indices first, with its own message)
    refused = r"row index 6 out of range \[0, 6\)" if read_copy else "state slot 6 of a pool of 6"
    with pytest.raises(IndexError, match=refused):
        planned(q, k, v, g, beta, s[0], s[1], s[3], s[4], *planned_pools, np.array([5, 0, 6, 2], np.int32), QS, ROWS)
    assert all(np.array_equal(a, b) for a, b in zip(planned_pools, before))