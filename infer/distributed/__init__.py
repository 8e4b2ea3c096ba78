"""Tensor parallelism: one model over ``N`` ranks of a process group.

``infer.load(ref, backend="torch:cpu", tensor_parallel=N)`` (or
``"torch:cuda"``) shards the model over ``N`` ranks (how: :mod:`.sharding`)
and returns an ordinary :class:`~infer.model.Model` on rank 0, which drives
generation (how the ranks stay in step: :mod:`.group`). Two ways to launch:

* **infer starts the workers** (one machine): the calling process is rank 0
  and starts ranks ``1 .. N-1`` itself, each a fresh interpreter
  (``python -m infer.distributed.worker``: the spawn start method's clean
  process, without re-running the caller's main module, and no fork of a
  process holding torch threads). They rendezvous over TCP on 127.0.0.1 and
  exit when the model is closed (``model.close()``, a ``with`` block, or at
  exit), or when the driver dies (each watches a pipe from it).
* **torchrun starts every rank** (one machine or several): every process
  runs the same script; ``infer.load`` sees ``RANK`` and ``WORLD_SIZE`` in
  the environment and joins the group ``torchrun``'s rendezvous describes
  (``MASTER_ADDR``, ``MASTER_PORT``). On rank 0 it returns the model; on
  the others it serves rank 0 and never returns: the process exits (status
  0) when rank 0 closes the model.

A collective that waits longer than ``INFER_TP_TIMEOUT`` seconds (default
60) raises, so a dead or stuck rank is a :class:`~infer.errors.WorkerError`
in the driver, not a hang. docs/distributed.md has the whole story.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

from infer.architecture import CausalLM
from infer.distributed.group import DriverGroup, TensorParallelLM, Worker
from infer.distributed.sharding import ShardedWeightLoader, plan
from infer.errors import ConfigError, TensorParallelConfigError, WorkerError
from infer.ops import Backend, LoadSettings
from infer.package import ModelPackage

log = logging.getLogger(__name__)

#: Seconds a collective may wait for a peer before it raises.
DEFAULT_TIMEOUT = 60.0


def timeout() -> float:
    """The collectives' timeout: ``$INFER_TP_TIMEOUT`` seconds, default 60."""
    text = os.environ.get("INFER_TP_TIMEOUT")
    if not text:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        raise TensorParallelConfigError(f"INFER_TP_TIMEOUT={text!r} is not a number of seconds") from None
    if value <= 0:
        raise TensorParallelConfigError(f"INFER_TP_TIMEOUT={text!r} must be positive")
    return value


def launched_by_torchrun() -> bool:
    """True when ``torchrun`` (``torch.distributed.run``) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check(ops: Backend, package: ModelPackage, ranks: int, *, compile: bool = False) -> None:
    """Refuse what cannot run tensor-parallel, before anything starts.

    Raises:
        TensorParallelConfigError: ``ranks`` below 1, a backend without
            collectives, ``compile=True``, or a model ``ranks`` cannot split.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise TensorParallelConfigError(f"tensor_parallel must be an integer of at least 1, got {ranks!r}")
    if not ops.supports("all_reduce"):
        raise TensorParallelConfigError(
            f"tensor_parallel={ranks}: backend {ops.name}/{ops.device} has no native all_reduce (collectives); "
            "use torch:cpu (gloo) or torch:cuda (NCCL)")
    if compile:
        raise TensorParallelConfigError(f"tensor_parallel={ranks} does not combine with compile=True yet: a "
                                        "captured decode step runs without the other ranks")
    plan(package.config, package.model_type, package.tensors, ranks)


def build_shard(package: ModelPackage, arch: Any, ops: Backend, ranks: int,
                progress: Any = None) -> tuple[CausalLM, ShardedWeightLoader]:
    """This rank's (``ops.rank``) shard of the network: the architecture
    built from the rank-local config through a :class:`ShardedWeightLoader`,
    with the output head split by vocabulary."""
    shard, config = plan(package.config, package.model_type, package.tensors, ranks)
    shard = type(shard)(ops.rank, ranks, shard.heads, shard.kv_heads, shard.head_dim)
    loader = ShardedWeightLoader(package.tensors, ops, shard, progress=progress)
    try:
        network = arch.build(config, loader, ops)
    except ConfigError as exc:
        raise ConfigError(f"{package.path}: {exc}") from exc
    loader.shard_head(network)
    log.info("rank %d of %d: weights %s", ops.rank, ranks, dict(loader.bytes_by_role))
    return network, loader


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(path: Path, format: str, backend: str, dtype: str | None, settings: LoadSettings,
          ranks: int) -> tuple[list[subprocess.Popen[bytes]], str]:
    """Start ranks ``1 .. ranks-1`` as fresh interpreters, each to configure
    its backend with rank 0's ``settings``; returns them and the rendezvous
    address rank 0 joins too."""
    init = f"tcp://127.0.0.1:{_free_port()}"
    spec = {"path": str(path), "format": format, "backend": backend, "dtype": dtype,
            "settings": dataclasses.asdict(settings), "ranks": ranks, "init_method": init, "timeout": timeout(),
            "parent": os.getpid()}
    env = dict(os.environ)
    threads = max(1, (os.cpu_count() or 1) // ranks)
    env.setdefault("OMP_NUM_THREADS", str(threads))  # the ranks share the cores
    processes = []
    for rank in range(1, ranks):
        cmd = [sys.executable, "-m", "infer.distributed.worker", json.dumps(dict(spec, rank=rank))]
        processes.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env))
    log.info("tensor parallel: started ranks 1..%d (pids %s), rendezvous %s", ranks - 1,
             ", ".join(str(p.pid) for p in processes), init)
    return processes, init


def driver(package: ModelPackage, arch: Any, ops: Backend, ranks: int, *, format: str, backend: str,
           dtype: str | None, settings: LoadSettings, progress: Any = None) -> TensorParallelLM:
    """Rank 0's network over ``ranks`` ranks: joins (or first starts) the
    group, builds its shard and wraps it in a :class:`TensorParallelLM`.
    ``ops`` is already configured with ``settings``; the ranks this starts
    configure theirs with the same."""
    limit = timeout()
    processes: list[subprocess.Popen[bytes]] = []
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != ranks:
            raise TensorParallelConfigError(
                f"tensor_parallel={ranks}, but torchrun started {world} processes (WORLD_SIZE); they must agree")
        ops.join_group(int(os.environ["RANK"]), ranks, init_method=None, timeout=limit)
    else:
        assert package.path is not None
        processes, init = start(package.path, format, backend, dtype, settings, ranks)
        try:
            ops.join_group(0, ranks, init_method=init, timeout=limit)
        except Exception as exc:
            for p in processes:
                p.kill()
                p.wait()
            raise WorkerError(f"tensor parallelism: the {ranks} ranks did not meet within {limit:g} s: "
                              f"{type(exc).__name__}: {exc}") from exc
    if ops.rank != 0:  # torchrun started this process as a worker: it serves until rank 0 closes the model
        serve(package, arch, ops, ranks)
        raise SystemExit(0)
    group = DriverGroup(ops, timeout=limit, processes=processes)
    try:
        network, loader = build_shard(package, arch, ops, ranks, progress)
    except BaseException as exc:
        group.broken = f"rank 0 failed to load: {type(exc).__name__}: {exc}"
        group.close()
        raise
    model = TensorParallelLM(network, group, loader)
    model.wait_ready()  # a worker that failed to load is an error now, not at the first request
    atexit.register(_close_at_exit, weakref.ref(group))
    return model


def serve(package: ModelPackage, arch: Any, ops: Backend, ranks: int) -> None:
    """A worker's life after joining the group: build its shard, repeat rank
    0's calls until it closes the model, leave the group."""
    network, loader = build_shard(package, arch, ops, ranks)
    try:
        Worker(network, ops, loader).serve()
    finally:
        ops.leave_group()


def _close_at_exit(ref: weakref.ref[DriverGroup]) -> None:
    group = ref()
    if group is not None:
        group.close()


__all__ = ["DEFAULT_TIMEOUT", "TensorParallelLM", "build_shard", "check", "driver", "launched_by_torchrun",
           "serve", "timeout"]
