"""The replica broadcast group is warmed when it is built, on every rank at once.

Two spawned gloo ranks run, in order: ``broadcast_group`` over a real CPU MLA
layout (the build path: the probe broadcast runs inside it on both ranks), then
``warm_group`` over a separate short-timeout gloo group standing in for the NCCL
group of CUDA pools (its failures are agreed over the world group, as the NCCL
group's are over the attention group's gloo group). An NCCL communicator that
fails to come up on one rank cannot be produced on CPU, so that rank's probe
broadcast is replaced by one that raises before taking part (the other rank's
half then times out as well), or, standing in for a probe that stalls on the
device, by one that raises after a broadcast that went through (only the
agreement tells the other rank). In every case both ranks raise
``ReplicaGroupError`` at build time, instead of one rank queueing a broadcast no
peer will ever match while serving.
The ranks run once per module; each test checks one part of what they returned.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from cpu_harness import gloo_ranks

pytestmark = pytest.mark.kvcr

WORLD = 2
GLOO_TIMEOUT_S = 60
PROBE_GROUP_TIMEOUT_S = 2  # how long a follower waits for an owner that never sends
JOB_TIMEOUT_S = 150.0
PAGE = 4
# (case, the rank whose probe fails, whether it fails before or after taking part)
CASES = (
    ("follower_before", 1, "before"),
    ("follower_after", 1, "after"),
    ("owner_before", 0, "before"),  # last: the follower waits out the timeout
)


def _layout() -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import PageLayout
    from sglang.srt.mem_cache.storage.kvcr.layout.pool_layout import ModelIdentity

    pool = MLATokenToKVPool(16 * PAGE, PAGE, torch.bfloat16, 16, 8, 2, "cpu", False)
    return PageLayout.from_kv_pool(
        pool, PAGE, identity=ModelIdentity("w", "", "", 0, 1)
    )


def _warm_rank(rank: int, port: int) -> dict[str, Any]:
    import types

    import torch.distributed as dist

    from sglang.srt.mem_cache.storage.kvcr.datapath import replica_broadcast as rb
    from sglang.srt.mem_cache.storage.kvcr.device.device_streams import DeviceBinding

    gloo_ranks.init_gloo(rank, port, WORLD, GLOO_TIMEOUT_S)
    real_broadcast = dist.broadcast
    seen: list[int] = []  # probe bytes this rank holds after each broadcast

    def spy(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        out = real_broadcast(tensor, *args, **kwargs)
        seen.append(int(tensor[0]))
        return out

    def fails_before(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("NCCL error: unhandled system error (injected)")

    def fails_after(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        real_broadcast(tensor, *args, **kwargs)
        raise RuntimeError("a KVCR copy did not complete within 120 s (injected)")

    def attempt(fn: Any) -> str:
        try:
            fn()
        except rb.ReplicaGroupError as exc:
            return f"ReplicaGroupError: {exc}"
        return "ok"

    out: dict[str, Any] = {}
    try:
        dist.broadcast = spy
        params = types.SimpleNamespace(
            attn_tp_cache_group=dist.group.WORLD, tp_cache_group=None
        )
        group, owner = rb.broadcast_group(params, _layout())
        out["build"] = {"owner": owner, "world": group is dist.group.WORLD}
        out["build_probes"] = list(seen)
        cpu = DeviceBinding.of("cpu")
        for case, failing_rank, fake in CASES:
            probe_group = dist.new_group(
                [0, 1],
                backend="gloo",
                timeout=datetime.timedelta(seconds=PROBE_GROUP_TIMEOUT_S),
            )
            fail = fails_before if fake == "before" else fails_after
            dist.broadcast = fail if rank == failing_rank else spy
            out[case] = attempt(
                lambda g=probe_group: rb.warm_group(
                    g, 0, cpu, agree_over=dist.group.WORLD
                )
            )
            dist.broadcast = spy
        dist.barrier()
        return out
    finally:
        dist.broadcast = real_broadcast
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks() -> dict[int, dict[str, Any]]:
    return gloo_ranks.run_ranks(
        _warm_rank, WORLD, timeout_s=JOB_TIMEOUT_S, name="kvcr-warm"
    )


def test_the_group_is_probed_while_it_is_built(ranks):
    """``broadcast_group`` returns the owner and the group after one probe
    broadcast on each rank, the follower holding the owner's byte."""
    from sglang.srt.mem_cache.storage.kvcr.datapath.replica_broadcast import PROBE_BYTE

    for rank in range(WORLD):
        assert ranks[rank]["build"] == {"owner": 0, "world": True}
        assert ranks[rank]["build_probes"] == [PROBE_BYTE], f"rank {rank}"


@pytest.mark.parametrize("case, failing, _", CASES, ids=[c[0] for c in CASES])
def test_a_probe_failing_on_one_rank_fails_the_build_on_every_rank(
    ranks, case, failing, _
):
    """The rank whose probe failed and the other rank both raise
    ``ReplicaGroupError`` at build time (nothing is left to hang while serving),
    also when the other rank's own half went through (``follower_after``)."""
    for rank in range(WORLD):
        verdict = ranks[rank][case]
        assert verdict.startswith("ReplicaGroupError"), f"rank {rank}: {verdict}"
    assert "this rank" in ranks[failing][case]
    if case == "follower_after":  # the owner learns it from the agreement alone
        assert "another rank" in ranks[1 - failing][case]
