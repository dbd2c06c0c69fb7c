"""Data parallelism: every attention rank of a server gets its own port and a slice
of the worker's DRAM, and a hint naming a replica reaches the same shard.

SGLang's CPU server runs one replica, so the arithmetic and the rank mapping are
tested directly: over every DP / DP-attention / TP / node layout up to 8 ranks,
ports are unique and the DRAM shares sum to at most the worker's budget; a hint
naming replica d's endpoint resolves, on each of B's ranks, to the endpoint of the
rank of A holding the same shard; ``attention_replica`` reads SGLang's published
ranks (and refuses, naming ``--dp-size``, when it cannot); and a real linker built
as replica 1 of 2 binds the second port with half the DRAM.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from cpu_harness import kvcr_stack
from cpu_harness import server as harness
from cpu_harness.kvcr_pages import PAGE, fetch_hint, make_pool
from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRConfigError
from sglang.srt.mem_cache.storage.kvcr.fleet.router_hint import (
    EndpointAllowlist,
    RouterHintParser,
)
from sglang.srt.mem_cache.storage.kvcr.layout import page_layout, rank_placement
from sglang.srt.mem_cache.storage.kvcr.layout.rank_placement import placement_of

BASE = 41000


def _server(nnodes=1):
    return SimpleNamespace(nnodes=nnodes)


def _layouts():
    """(replicas, shard size, nodes) of every layout with at most 8 ranks."""
    for replicas, shard, nodes in itertools.product((1, 2, 4), (1, 2, 4), (1, 2)):
        if replicas * shard <= 8 and (replicas * shard) % nodes == 0:
            yield replicas, shard, nodes


def _ranks(replicas, shard, nodes):
    return [
        placement_of(_server(nodes), r, shard, d, replicas)
        for d in range(replicas)
        for r in range(shard)
    ]


def test_every_rank_of_every_layout_has_its_own_port_and_a_fair_dram_share():
    layouts = list(_layouts())
    assert len(layouts) >= 12
    for replicas, shard, nodes in layouts:
        ranks = _ranks(replicas, shard, nodes)
        ports = [p.control_port(BASE) for p in ranks]
        assert len(set(ports)) == len(ranks) == replicas * shard
        assert sorted(ports) == list(range(BASE, BASE + len(ranks)))
        per_node = {p.ranks_on_node for p in ranks}
        assert per_node == {replicas * shard // nodes}
        # One node's ranks together never take more than the worker's budget.
        budget = 1 << 30
        shares = [budget // p.ranks_on_node for p in ranks[: replicas * shard // nodes]]
        assert sum(shares) <= budget
        assert min(shares) >= budget // (replicas * shard)  # and nothing idle
        assert all(p.control_port(0) == 0 for p in ranks)  # ephemeral stays so


def test_a_hint_naming_a_replica_reaches_the_rank_with_the_same_shard():
    checked = 0
    for replicas, shard, _ in _layouts():
        peer = _ranks(replicas, shard, 1)
        endpoint_of = {
            (p.replica, p.shard_rank): f"tcp://127.0.0.1:{p.control_port(BASE)}"
            for p in peer
        }
        for d in range(replicas):
            named = peer[d * shard].replica_port(BASE)
            hint = fetch_hint(f"tcp://127.0.0.1:{named}", ["ab" * 32])
            for r in range(shard):
                parser = RouterHintParser(
                    EndpointAllowlist((), "127.0.0.1"), rank_offset=r
                )
                parsed = parser.parse(hint)
                assert parsed is not None, parser.stats.as_dict()
                assert parsed.source_endpoint == endpoint_of[(d, r)]
                checked += 1
    assert checked >= 40


def test_out_of_range_ranks_and_uneven_nodes_are_refused():
    with pytest.raises(KVCRConfigError, match="--dp-size"):
        placement_of(_server(), 0, 2, 2, 2)
    with pytest.raises(KVCRConfigError, match="attention-TP rank"):
        placement_of(_server(), 2, 2, 0, 1)
    with pytest.raises(KVCRConfigError, match="--nnodes 4"):
        placement_of(_server(4), 0, 2, 0, 1)


def _published_parallel(monkeypatch, **ranks):
    import sglang.srt.runtime_context as rc

    monkeypatch.setattr(rc, "get_parallel", lambda: SimpleNamespace(**ranks))


def test_attention_replica_reads_the_rank_sglang_published(monkeypatch):
    assert rank_placement.attention_replica(SimpleNamespace(dp_size=1)) == (0, 1)
    _published_parallel(monkeypatch, dp_rank=3, attn_dp_rank=0, attn_dp_size=1)
    assert rank_placement.attention_replica(SimpleNamespace(dp_size=4)) == (3, 4)
    _published_parallel(monkeypatch, dp_rank=None, attn_dp_rank=1, attn_dp_size=2)
    deprecated = SimpleNamespace(dp_size=2, enable_dp_attention=True)
    assert rank_placement.attention_replica(deprecated) == (1, 2)
    # What 0.5.23 resolves --dp-size 2 --enable-dp-attention (or --attn-dp-size
    # 2) into: dp_size 1, attn_dp_size 2.
    resolved = SimpleNamespace(dp_size=1, attn_dp_size=2)
    assert rank_placement.attention_replica(resolved) == (1, 2)
    # DP replicas of attention-DP groups: replica 3 * 2 + 1 of 8.
    _published_parallel(monkeypatch, dp_rank=3, attn_dp_rank=1, attn_dp_size=2)
    both = SimpleNamespace(dp_size=4, attn_dp_size=2)
    assert rank_placement.attention_replica(both) == (7, 8)


def test_an_unknown_dp_rank_is_refused_naming_the_flag(monkeypatch):
    monkeypatch.delenv("SGLANG_DP_RANK", raising=False)
    _published_parallel(monkeypatch, dp_rank=None)
    with pytest.raises(KVCRConfigError, match="--dp-size 1"):
        rank_placement.attention_replica(SimpleNamespace(dp_size=2))
    monkeypatch.setenv("SGLANG_DP_RANK", "1")
    assert rank_placement.attention_replica(SimpleNamespace(dp_size=2)) == (1, 2)


def _storage_bytes(lk):
    return sum(t.numel() * t.element_size() for t in lk.dram.storage.values())


def test_a_linker_of_the_second_replica_binds_its_own_port_and_half_the_dram(
    monkeypatch,
):
    _published_parallel(monkeypatch, dp_rank=1)
    pool = make_pool("cpu")
    budget = 64 << 20
    linkers = []
    try:
        ports = []
        for dp_size in (1, 2):
            ports.append(harness.free_port())
            # Replica 1 binds base + 1: give it base = the free port - 1.
            base = ports[-1] - (dp_size - 1)
            config = {"local_dram_bytes_per_worker": budget, "control_port": base}
            linkers.append(
                kvcr_stack.bare_linker(
                    pool, PAGE, config, server_args={"dp_size": dp_size}
                )
            )
        single, second = linkers
        assert (single.placement.replica, second.placement.replica) == (0, 1)
        assert single.endpoint.rsplit(":", 1)[1] == str(ports[0])
        assert second.endpoint.rsplit(":", 1)[1] == str(ports[1])
        pages = [
            page_layout.plan_capacity(single.layout, budget, ranks).pages
            for ranks in (1, 2)
        ]
        assert pages[1] < pages[0]
        assert _storage_bytes(single) == pages[0] * sum(
            p.page_bytes * len(p.spans) for p in single.layout.pools
        )
        assert _storage_bytes(second) == pages[1] * sum(
            p.page_bytes * len(p.spans) for p in second.layout.pools
        )
    finally:
        for lk in linkers:
            lk.close()
