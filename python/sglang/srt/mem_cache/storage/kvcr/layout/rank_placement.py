"""Where one attention rank sits in a server: its shard, its port, its DRAM share.

A server runs ``dp_size`` replicas; without DP attention each replica is its own
TP group of ``tp_size`` ranks, with DP attention one TP group holds all replicas and
each replica is an attention-TP group of ``tp_size / dp_size`` ranks. Every
attention rank has one KVCR, so each needs a port of its own and a slice of the
worker's host DRAM. ``RankPlacement`` numbers the ranks globally (replica ``d``'s
attention rank ``r`` is ``d * attn_tp_size + r``), binds ``control_port + global``,
divides ``local_dram_bytes_per_worker`` by the ranks one node runs, and keeps the
shard (attention-TP rank and size) separate: it is what a page's bytes depend on,
so replicas with equal shards share pages. A router names replica ``d`` of a worker
by its first rank's endpoint, ``control_port + d * attn_tp_size``; each rank adds
its shard rank to fetch from the same shard.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRConfigError


@dataclasses.dataclass(frozen=True, slots=True)
class RankPlacement:
    """One attention rank of a server (see the module docstring)."""

    shard_rank: int  # attention-TP rank: which heads a page of this rank holds
    shard_size: int  # attention-TP size
    replica: int  # DP replica (attention-DP rank, or the DP controller's rank)
    ranks_on_node: int  # attention ranks (one KVCR each) this node runs
    multi_node: bool = False  # the server's ranks span nodes (--nnodes > 1)

    @property
    def global_rank(self) -> int:
        return self.replica * self.shard_size + self.shard_rank

    def control_port(self, base: int) -> int:
        """The port this rank's KVCR binds (0, ephemeral, stays 0)."""
        return base + self.global_rank if base else 0

    def replica_port(self, base: int) -> int:
        """The port a router names for this rank's replica (its first rank's)."""
        return base + self.replica * self.shard_size if base else 0

    def label(self) -> str:
        return f"r{self.global_rank}"

    def describe(self) -> str:
        return (
            f"DP replica {self.replica}, attention rank {self.shard_rank} "
            f"of {self.shard_size}"
        )


def placement_of(
    server_args: Any, shard_rank: int, shard_size: int, replica: int, replicas: int
) -> RankPlacement:
    """This rank's placement: its attention-TP rank and size, and its replica
    (attention-DP rank with DP attention, else the DP controller's rank) of
    ``replicas``. Every replica has ``shard_size`` attention ranks."""
    nnodes = int(getattr(server_args, "nnodes", 1) or 1)
    if not 0 <= shard_rank < shard_size:
        raise KVCRConfigError(
            f"attention-TP rank {shard_rank} is not in [0, {shard_size})"
        )
    if not 0 <= replica < replicas:
        raise KVCRConfigError(
            f"DP replica {replica} is not in [0, {replicas}) (--dp-size)"
        )
    ranks_total = replicas * shard_size
    if ranks_total % nnodes:
        raise KVCRConfigError(
            f"{ranks_total} attention ranks do not split evenly over --nnodes {nnodes}"
        )
    return RankPlacement(
        shard_rank, shard_size, replica, ranks_total // nnodes, nnodes > 1
    )


def attention_replica(server_args: Any) -> tuple[int, int]:
    """(replica, replicas) of this scheduler process across the server: the DP
    controller's replica ``d`` of ``--dp-size`` times its attention-DP rank ``a``
    of ``--attn-dp-size`` (``--dp-size N --enable-dp-attention`` is resolved
    into the latter), ``d * attn_dp_size + a``. Refuses when DP is on and
    SGLang did not publish the rank."""
    dp_size = int(getattr(server_args, "dp_size", 1) or 1)
    attn_dp = int(getattr(server_args, "attn_dp_size", 1) or 1)
    if getattr(server_args, "enable_dp_attention", False):
        attn_dp = max(attn_dp, dp_size)  # the deprecated spelling, unresolved
        dp_size = 1
    if dp_size == 1 and attn_dp == 1:
        return 0, 1
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    try:
        attn_rank = int(parallel.attn_dp_rank) if attn_dp > 1 else 0
        dp_rank = parallel.dp_rank if dp_size > 1 else 0
    except (AttributeError, RuntimeError, ValueError) as exc:
        raise KVCRConfigError(
            f"--dp-size {dp_size} / --attn-dp-size {attn_dp}: SGLang did not "
            f"publish this process's DP rank ({exc}); run the KVCR linker with "
            "--dp-size 1 and --attn-dp-size 1"
        ) from exc
    if dp_rank is None:
        dp_rank = os.environ.get("SGLANG_DP_RANK")
    if dp_rank is None:
        raise KVCRConfigError(
            f"--dp-size {dp_size}: this process's DP rank is unknown; run the "
            "KVCR linker with --dp-size 1"
        )
    return int(dp_rank) * attn_dp + attn_rank, dp_size * attn_dp
