"""Run one function in N spawned processes that form a gloo group on loopback.

The multi-rank tests (TP=2 readiness and offloads, rank-replicated pools) spawn
their ranks here: ``run_ranks(body, world)`` starts ``world`` processes, each
calling ``body(rank, port, *args)`` (a module-level function, so spawn can import
it), collects one report per rank with a deadline, and fails the test with every
rank's traceback when one raised, died or stayed silent. A rank that fails first
ends the wait: its peer may be stuck in a collective until gloo's own timeout.
``init_gloo`` joins the group from inside a rank.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue as queue_module
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest

from cpu_harness.server import free_port

EXIT_TIMEOUT_S = 20.0


def init_gloo(rank: int, port: int, world: int, timeout_s: float) -> None:
    """Join the loopback gloo group of ``world`` ranks (collectives time out)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _rank_main(
    rank: int,
    port: int,
    results: Any,
    body: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    """Entry point of one spawned rank; reports (rank, status, payload)."""
    try:
        report = (rank, "ok", body(rank, port, *args))
        code = 0
    except BaseException:
        report = (rank, "error", traceback.format_exc())
        code = 1
    results.put(report)
    results.close()
    results.join_thread()  # the report is in the pipe
    sys.stdout.flush()
    sys.stderr.flush()
    # The body closed its linker and process group; skip the interpreter's
    # native teardown (torch, gloo, UCX), which takes seconds on a busy host.
    os._exit(code)


def run_ranks(
    body: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float,
    name: str = "kvcr-rank",
) -> dict[int, Any]:
    """``{rank: body(rank, port, *args)}`` from ``world`` spawned ranks."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, port, results, body, args),
            name=f"{name}{rank}",
            daemon=True,
        )
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    reports: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(reports) < world and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=1.0)
            except queue_module.Empty:
                dead = [
                    i
                    for i, p in enumerate(procs)
                    if i not in reports and not p.is_alive() and p.exitcode != 0
                ]
                if not dead:
                    continue
                try:  # a report may still be in flight from a dead rank
                    rank, status, payload = results.get(timeout=2.0)
                except queue_module.Empty:
                    for i in dead:
                        reports[i] = (
                            "error",
                            f"rank {i} exited with code {procs[i].exitcode} "
                            "without a report",
                        )
                    break
            reports[rank] = (status, payload)
            if status == "error":
                break  # the other rank may be stuck in a collective
        clean = len(reports) == world and all(s == "ok" for s, _ in reports.values())
        for proc in procs:
            proc.join(timeout=EXIT_TIMEOUT_S if clean else 2.0)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
    errors = [f"rank {r}:\n{p}" for r, (s, p) in sorted(reports.items()) if s != "ok"]
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    if len(reports) < world:
        missing = sorted(set(range(world)) - set(reports))
        pytest.fail(
            f"ranks {missing} reported nothing within {timeout_s:.0f} s",
            pytrace=False,
        )
    for rank, proc in enumerate(procs):
        assert proc.exitcode == 0, f"rank {rank} exit code {proc.exitcode}"
    return {rank: payload for rank, (_, payload) in reports.items()}
