"""Rank-replicated (MLA) pools stored once: two attention ranks over gloo on CPU.

Two spawned processes each build a real ``UnifiedRadixCache`` (Python tree core)
over a real CPU ``MLATokenToKVPool`` whose cache groups are a two-rank gloo group,
and get their linker from the plugin's ``kvcr`` backend: rank 0 (the owner) a
``KVCRDirectLinker`` with a ``ReplicaBroadcast``, rank 1 a ``ReplicaFollower``
with no KVCR. In lockstep both ranks fill the same bytes into their own (different)
slots, insert (write-through offload), evict from the device, zero the pool, then
prepare (readiness MIN-reduced through the prefill gate's reduction, the owner
held back on the first pass), match (lookup MIN-reduced), load, start and finish
one request. Then rank 0 restores the same pages into a separate TP=1 MLA linker
of the same identity from a ``kv.fetch`` hint naming the owner's endpoint, and
then a second sequence with the owner's broadcast gather failing once, and finally a third
with the owner's copy failing once.

The two processes run once per module; each test checks one part of what they
returned.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from cpu_harness import gloo_ranks

pytestmark = pytest.mark.kvcr

WORLD = 2
PAGE = 4
LAYERS = 2
LORA, ROPE = 16, 8
SEQS = 3  # sequences the ranks round-trip (ok, gather failure, copy failure)
PAGES = 3  # pages per sequence
POOL_TOKENS = 64 * PAGE
PAGE_OBJECT_BYTES = LAYERS * PAGE * (LORA + ROPE) * 2  # one page, every layer, bf16
DRAM = 4 << 20
CONFIG = {
    "local_dram_bytes_per_worker": DRAM,
    "operation_timeout_ms": 5000,
    "abandon_timeout_ms": 10000,
    "preparation_timeout_ms": 5000,
}
JOB_TIMEOUT_S = 150.0
GLOO_TIMEOUT_S = 60
MAX_ROUNDS = 4000  # a round bound, not a time bound: identical on both ranks
OWNER, FOLLOWER = 0, 1


# ---- child process -----------------------------------------------------------------


def _run_rank(rank: int, port: int) -> dict[str, Any]:
    import torch.distributed as dist
    from sglang.srt.plugins import load_plugins

    load_plugins()
    gloo_ranks.init_gloo(rank, port, WORLD, GLOO_TIMEOUT_S)
    stack = None
    try:
        stack = _build(dist.group.WORLD)
        linker = stack["cache"].linker.cache_linker
        out: dict[str, Any] = {
            "linker": type(linker).__name__,
            "digest": linker.layout.compatibility_digest,
            "has_kvcr": hasattr(linker, "session"),
            "dram_bytes": linker.stats_snapshot()["dram_bytes"],
        }
        if rank == OWNER:
            out["dram_expected"] = _dram_share(linker.layout, 1)
            out["dram_every_rank"] = _dram_share(linker.layout, 2)
        out["restore"] = _round_trip(rank, stack, seq=0)
        dist.barrier()
        if rank == OWNER:
            out["peer"] = _peer_restore(stack, out["restore"])
        dist.barrier()
        # The owner's gather raises half way: every broadcast still runs (the
        # follower does not wait alone), and the request aborts on both ranks.
        out["gather_failure"] = _round_trip(
            rank, stack, seq=1, fail_gather=rank == OWNER
        )
        dist.barrier()
        # Last: a failed copy pauses the owner's restores for a while.
        out["failure"] = _round_trip(rank, stack, seq=2, fail_copy=rank == OWNER)
        dist.barrier()
        out["stats"] = linker.stats_snapshot()
        out["stats_line"] = linker.stats_line()
        if rank == OWNER:
            out["adapter_deposits"] = linker._adapter.stats().deposits
        return out
    finally:
        if stack is not None:
            stack["cache"].linker.close()
        dist.destroy_process_group()


def _build(group: Any) -> dict[str, Any]:
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from cpu_harness import kvcr_families, kvcr_stack

    server_args = kvcr_families.publish_server_args(PAGE)
    kvcache = MLATokenToKVPool(
        POOL_TOKENS, PAGE, torch.bfloat16, LORA, ROPE, LAYERS, "cpu", False
    )
    allocator = PagedTokenToKVPoolAllocator(
        POOL_TOKENS, PAGE, torch.bfloat16, "cpu", kvcache, False
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(8, 512, "cpu", False),
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE,
        tp_cache_group=group,
        attn_tp_cache_group=group,
        tree_components=(ComponentType.FULL,),
        tree_core_backend="python",
    )
    cache = UnifiedRadixCache(params)
    stack = kvcr_stack.KVCRStack(
        cache, kvcache, allocator, server_args, params, dict(CONFIG)
    )
    kvcr_stack.attach(stack, kvcr_stack.create_linker(stack))
    return {
        "cache": cache,
        "kvcache": kvcache,
        "allocator": allocator,
        "args": server_args,
    }


def _dram_share(layout: Any, ranks: int) -> int:
    from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import plan_capacity

    plan = plan_capacity(layout, DRAM, ranks)
    return sum(p.bytes for p in plan.pools)


def _rows(kvcache: Any, slots: Any) -> list[bytes]:
    """Each layer's bytes at ``slots``."""
    import torch

    return [buf[slots].view(torch.uint8).numpy().tobytes() for buf in kvcache.kv_buffer]


def _drain(cache: Any) -> int:
    """check_hicache_events in lockstep until every pending offload committed
    (both ranks pop the same MIN-reduced count each round)."""
    rounds = 0
    while cache.linker.pending_offloads and rounds < MAX_ROUNDS:
        cache.check_hicache_events()
        rounds += 1
        time.sleep(0.005)
    return rounds


def _round_trip(
    rank: int,
    stack: dict[str, Any],
    seq: int,
    fail_copy: bool = False,
    fail_gather: bool = False,
) -> dict[str, Any]:
    from array import array
    from unittest import mock

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InitLoadBackParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams

    from cpu_harness.kvcr_pages import fill_random
    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration

    cache, kvcache, allocator = stack["cache"], stack["kvcache"], stack["allocator"]
    linker = cache.linker.cache_linker
    out: dict[str, Any] = {}
    n = PAGES * PAGE
    tokens = list(range(1000 * (seq + 1), 1000 * (seq + 1) + n))
    if rank == FOLLOWER:
        allocator.alloc(PAGE * (seq + 2))  # the ranks' physical slots differ
    slots = allocator.alloc(n)
    out["first_slot"] = int(slots[0])
    fill_random(kvcache, slots, 77 + seq, page=1)  # the same bytes on both ranks
    written = _rows(kvcache, slots)
    cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))
    out["commit_rounds"] = _drain(cache)
    probe = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
    node = cache.tree_core.node_by_id(probe.last_device_node)
    out["stored"] = bool(node.external_cache_stored)
    out["hashes"] = list(node.hash_value or ())
    cache.evict(EvictParams(num_tokens=n))
    probe = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
    out["device_after_evict"] = int(probe.device_prefix_len)
    for buf in kvcache.kv_buffer:
        buf.zero_()

    rid = f"seq{seq}"
    req = Req(rid, "", array("q", [*tokens, 1, 2]), SamplingParams(max_new_tokens=1))
    integration.wrapper_prepare_request(cache.linker, req)
    real_ready = linker.preparation_ready
    local: list[bool] = []

    def ready(handle: Any) -> bool:
        value = bool(real_ready(handle))
        if rank == OWNER and not local:
            value = False  # the owner holds the first pass back
        local.append(value)
        return value

    reduced: list[bool] = []
    with mock.patch.object(linker, "preparation_ready", side_effect=ready):
        while len(reduced) < MAX_ROUNDS:
            reduced.append(integration.wrapper_sync_preparation(cache.linker, [req])[0])
            if reduced[-1]:
                break
            time.sleep(0.005)
    out["ready_local"], out["ready_reduced"] = local, reduced

    req.init_next_round_input(cache)  # match: the lookup is MIN-reduced
    out["hit"] = int(req.host_hit_length)
    out["failed"], out["landed"] = None, None
    if out["hit"]:
        loaded, _ = cache.init_load_back(
            InitLoadBackParams(
                best_match_node=req.best_match_node,
                host_hit_length=req.host_hit_length,
                req=req,
            )
        )
        out["loaded"] = int(loaded)
        private = cache.linker.private_load_indices[rid].clone()
        real_copy = linker.restorer.copy_batch if fail_copy else None

        def broken_copy(*args: Any) -> None:
            linker.restorer.copy_batch = real_copy  # once
            raise RuntimeError("injected restore copy failure")

        if fail_copy:
            linker.restorer.copy_batch = broken_copy
        if fail_gather:

            def broken_gather(moves: Any) -> None:
                del linker.replicas.gather  # once: the class's gather again
                raise RuntimeError("injected broadcast gather failure")

            linker.replicas.gather = broken_gather
        out["counter_index"] = cache.ready_to_load_host_cache()
        out["failed"] = [r.rid for r in cache.finish_external_linker_loads([req])]
        out["landed"] = _rows(kvcache, private)
    out["written"] = written
    linker.finish_request(rid)
    return out


def _peer_restore(stack: dict[str, Any], first: dict[str, Any]) -> dict[str, Any]:
    """A TP=1 MLA linker of the same identity restores the owner's pages from a
    kv.fetch hint naming the owner's endpoint."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from cpu_harness.kvcr_pages import fetch_hint, kv_transfer, wait_until
    from cpu_harness.kvcr_stack import PoolAllocator
    from sglang.srt.mem_cache.storage.kvcr.builder import build_linker
    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
        LinkerRequestContext,
    )

    owner = stack["cache"].linker.cache_linker
    pool = MLATokenToKVPool(
        POOL_TOKENS, PAGE, torch.bfloat16, LORA, ROPE, LAYERS, "cpu", False
    )
    params = SimpleNamespace(
        token_to_kv_pool_allocator=PoolAllocator(pool),
        page_size=PAGE,
        attn_tp_cache_group=None,
        tp_cache_group=None,
    )
    peer = build_linker(
        stack["args"], params, components={ComponentType.FULL}, extra_config=CONFIG
    )
    try:
        hashes = first["hashes"]
        hint = fetch_hint(owner.endpoint, hashes)
        handle = peer.prepare_request(
            LinkerRequestContext("peer", 0, hint), kv_transfer(hashes)
        )
        wait_until(lambda: peer.preparation_ready(handle), timeout=20, what="peer")
        dest = [40, 41, 42]
        out = {
            "digest": peer.layout.compatibility_digest,
            "shard_size": peer.placement.shard_size,
            "lookup": peer.lookup("peer", kv_transfer(hashes)),
            "load": peer.load("peer", kv_transfer(hashes, dest)),
        }
        index = peer.start_layer_wise_loading()
        out["landed_ok"] = peer.finish_layer_wise_loading(index)
        slots = torch.tensor([p * PAGE + t for p in dest for t in range(PAGE)])
        out["landed"] = _rows(pool, slots)
        out["fetches"] = peer._adapter.stats().fetches
        return out
    finally:
        peer.close()


# ---- parent ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks() -> dict[int, dict[str, Any]]:
    return gloo_ranks.run_ranks(
        _run_rank, WORLD, timeout_s=JOB_TIMEOUT_S, name="kvcr-replica"
    )


# ---- tests -------------------------------------------------------------------------


def test_only_the_owner_runs_kvcr_and_deposits_each_page_once(ranks):
    """Rank 0 deposits every page once; rank 1 has no KVCR and deposits none."""
    owner, follower = ranks[OWNER], ranks[FOLLOWER]
    for rank in (OWNER, FOLLOWER):
        print(f"rank {rank}: {ranks[rank]['stats_line']}")
    assert owner["linker"] == "KVCRDirectLinker" and owner["has_kvcr"]
    assert follower["linker"] == "ReplicaFollower" and not follower["has_kvcr"]
    assert owner["digest"] == follower["digest"]
    s0, s1 = owner["stats"], follower["stats"]
    # Two sequences of PAGES pages: one offload each, one KVCR key per page.
    assert s0["offloads"] == SEQS and owner["adapter_deposits"] == SEQS
    assert s0["offload_pages"] == SEQS * PAGES and s0["offload_failures"] == 0
    assert s0["resident_keys"] == SEQS * PAGES
    assert s0["replica_role"] == "owner" and s1["replica_role"] == "follower"
    assert s0["offloaded_bytes"] == SEQS * PAGES * PAGE_OBJECT_BYTES
    assert s1["offload_pages"] == s1["offloaded_bytes"] == 0
    assert s1["resident_keys"] == s1["dram_bytes"] == 0
    assert s1["offloads_acknowledged"] == SEQS
    # Each offload committed as stored on both ranks, in the same rounds.
    for seq in ("restore", "failure"):
        assert owner[seq]["stored"] and follower[seq]["stored"]
        assert owner[seq]["commit_rounds"] == follower[seq]["commit_rounds"]
        assert owner[seq]["hashes"] == follower[seq]["hashes"]
        assert len(owner[seq]["hashes"]) == PAGES


def test_the_owner_gets_the_nodes_dram_share_of_both_ranks(ranks):
    """Followers hold no DRAM, so the owner's share is the node's, not half."""
    owner = ranks[OWNER]
    assert owner["dram_bytes"] == owner["dram_expected"]
    assert owner["dram_bytes"] > owner["dram_every_rank"]


def test_both_ranks_restore_byte_exact_into_their_own_slots(ranks):
    """The owner restores from KVCR, the follower receives by broadcast: both
    ranks' private slots hold exactly the bytes written, though the slots differ."""
    r0, r1 = ranks[OWNER]["restore"], ranks[FOLLOWER]["restore"]
    assert r0["first_slot"] != r1["first_slot"]
    assert r0["device_after_evict"] == r1["device_after_evict"] == 0
    assert r0["written"] == r1["written"]  # the same (replicated) bytes
    assert r0["hit"] == r1["hit"] == PAGES * PAGE
    assert r0["loaded"] == r1["loaded"] == PAGES * PAGE
    assert r0["failed"] == r1["failed"] == []
    assert r0["landed"] == r0["written"]
    assert r1["landed"] == r1["written"]
    stats = ranks[FOLLOWER]["stats"]
    # Every batch reached the follower; the owner counts the ones it sent whole
    # (not the one whose gather failed).
    assert stats["replica_pages_received"] == SEQS * PAGES
    assert stats["replica_bytes_received"] == SEQS * PAGES * PAGE_OBJECT_BYTES
    assert ranks[OWNER]["stats"]["replica_pages_sent"] == (SEQS - 1) * PAGES


def test_readiness_is_min_reduced_to_the_owners_answer(ranks):
    """The owner holds the first gate pass back; neither rank admits it then."""
    r0, r1 = ranks[OWNER]["restore"], ranks[FOLLOWER]["restore"]
    assert r0["ready_local"][0] is False
    assert all(r1["ready_local"])  # the follower is always ready
    assert r0["ready_reduced"] == r1["ready_reduced"]
    assert r0["ready_reduced"][0] is False and r0["ready_reduced"][-1] is True
    assert len(r0["ready_reduced"]) == len(r0["ready_local"]) == len(r1["ready_local"])
    assert r0["ready_reduced"] == [
        a and b for a, b in zip(r0["ready_local"], r1["ready_local"], strict=True)
    ]


def test_a_peer_hint_naming_the_owner_restores_its_pages_byte_exact(ranks):
    """A TP=1 MLA worker of the same model shares the pages' digest and fetches
    them from the owner's KVCR (the only one holding them)."""
    owner = ranks[OWNER]
    peer = owner["peer"]
    assert peer["shard_size"] == 1 and peer["digest"] == owner["digest"]
    assert peer["lookup"] == list(range(1, PAGES + 1))
    assert peer["load"] is True and peer["landed_ok"] is True
    assert peer["fetches"] >= 1
    assert peer["landed"] == owner["restore"]["written"]


def test_a_failed_owner_copy_aborts_the_request_on_both_ranks(ranks):
    """The owner's copy raises once: it still broadcasts (the follower does not
    hang), and the MIN-reduced verdict aborts the request on both ranks."""
    r0, r1 = ranks[OWNER]["failure"], ranks[FOLLOWER]["failure"]
    assert r0["hit"] == r1["hit"] == PAGES * PAGE
    assert r0["failed"] == r1["failed"] == ["seq2"]
    assert r0["counter_index"] == r1["counter_index"] >= 0
    # Nothing was restored: what the follower received is not the written KV.
    assert r1["landed"] != r1["written"]
    assert ranks[OWNER]["stats"]["restore_copy_failures"] == 1


def test_a_failed_owner_gather_still_broadcasts_and_aborts_on_both_ranks(ranks):
    """The owner's gather raises: it still makes every broadcast (else the
    follower would wait in one alone and the group's next collective would
    pair with the wrong call), then fails the batch; both ranks abort it."""
    r0, r1 = ranks[OWNER]["gather_failure"], ranks[FOLLOWER]["gather_failure"]
    assert r0["hit"] == r1["hit"] == PAGES * PAGE
    assert r0["failed"] == r1["failed"] == ["seq1"]
    assert r1["landed"] != r1["written"]
    assert ranks[OWNER]["stats"]["replica_failures"] == 1
    # Every batch was received, the failed ones too (the sequence held).
    assert ranks[FOLLOWER]["stats"]["replica_batches"] == 3


# ---- in-process pieces ---------------------------------------------------------------


def _mla_layout(device: str = "cpu") -> tuple[Any, Any]:
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import PageLayout
    from sglang.srt.mem_cache.storage.kvcr.layout.pool_layout import ModelIdentity

    pool = MLATokenToKVPool(
        POOL_TOKENS, PAGE, torch.bfloat16, LORA, ROPE, LAYERS, device, False
    )
    identity = ModelIdentity("replica-test", "", "", 0, 1)
    return pool, PageLayout.from_kv_pool(pool, PAGE, identity=identity)


def test_stores_once_only_for_replicated_groups_of_all_page_pools():
    """MLA with TP > 1 stores once; TP 1, MHA and a trailing pool do not."""
    import dataclasses

    from cpu_harness import kvcr_families
    from sglang.srt.mem_cache.storage.kvcr.datapath.replica_broadcast import stores_once
    from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import PageLayout
    from sglang.srt.mem_cache.storage.kvcr.layout.pool_layout import ModelIdentity

    _, mla = _mla_layout()
    assert mla.rank_replicated
    assert stores_once(mla, 2) and stores_once(mla, 8)
    assert not stores_once(mla, 1)
    identity = ModelIdentity("replica-test", "", "", 0, 2)
    mha = PageLayout.from_kv_pool(
        kvcr_families.mha_pool(64, PAGE, 2), PAGE, identity=identity
    )
    assert not stores_once(mha, 2)
    swa_pool, _ = kvcr_families._swa(64, PAGE, [0, 2], [1, 3])
    swa = PageLayout.from_kv_pool(swa_pool, PAGE, identity=identity)
    assert not stores_once(dataclasses.replace(swa, rank_replicated=True), 2)
    # An MHA draft beside an MLA target holds this rank's heads only: nothing
    # is replicated (else a follower would get rank 0's draft KV); an MLA
    # draft keeps the group replicated.
    drafted = dataclasses.replace(identity, draft="draft-test")
    mla_pool, _ = _mla_layout()
    with_mha = PageLayout.from_kv_pool(
        mla_pool, PAGE, identity=drafted, draft_pool=kvcr_families.mha_pool(64, PAGE, 2)
    )
    assert not with_mha.rank_replicated and not stores_once(with_mha, 2)
    with_mla = PageLayout.from_kv_pool(
        mla_pool, PAGE, identity=drafted, draft_pool=_mla_layout()[0]
    )
    assert with_mla.rank_replicated and stores_once(with_mla, 2)


def test_broadcast_queue_refuses_exactly_what_plan_transfers_refuses():
    """Every rank queues a load exactly when it has KV keys and a device index for
    every slot of their pages, with the first page of each key's slots as its
    destination; the owner's restorer plans (or refuses) the same loads."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer

    from cpu_harness.kvcr_pages import hashes_for, kv_transfer
    from sglang.srt.mem_cache.storage.kvcr.datapath.replica_broadcast import (
        ReplicaBroadcast,
        dest_rows_of,
    )
    from sglang.srt.mem_cache.storage.kvcr.datapath.restore import plan_transfers

    _, layout = _mla_layout()
    hashes = hashes_for(3, "queue")
    one_slot_short = [
        PoolTransfer(
            name=t.name,
            keys=t.keys,
            device_indices=t.device_indices[:-1],
            hit_policy=t.hit_policy,
        )
        for t in kv_transfer(hashes, [5, 3, 9])
    ]
    # name: (transfers, the destination pages queued; None: refused)
    cases = {
        "good": (kv_transfer(hashes, [5, 3, 9]), [5, 3, 9]),
        "more slots than keys": (kv_transfer(hashes[:2], [5, 3, 9]), [5, 3]),
        "no keys": (kv_transfer([], [5]), None),
        "no kv transfer": ([], None),
        "no indices": (kv_transfer(hashes), None),
        "a page short": (kv_transfer(hashes, [5, 3]), None),
        "one slot short": (one_slot_short, None),
    }
    for name, (transfers, want) in cases.items():
        broadcast = ReplicaBroadcast(
            layout, dest_rows_of(layout, PAGE), None, 0, True, PAGE
        )
        assert broadcast.queue("r", transfers) is (want is not None), name
        planned = plan_transfers("r", None, transfers, layout, PAGE)
        assert (planned is not None) is (want is not None), name
        batch = broadcast.take()
        if want is None:
            assert batch is None, name
        else:
            assert batch.rids == ("r",) and batch.count == len(want), name
            assert batch.pages["kv"].tolist() == want, name
    broadcast = ReplicaBroadcast(
        layout, dest_rows_of(layout, PAGE), None, 0, True, PAGE
    )
    assert broadcast.queue("a", kv_transfer(hashes[:1], [1]))
    assert broadcast.queue("b", kv_transfer(hashes[:2], [2, 4]))
    assert broadcast.queue("a", kv_transfer(hashes[:1], [6]))  # replaces, goes last
    assert broadcast.cancel("b") and not broadcast.cancel("b")
    batch = broadcast.take()
    assert batch.rids == ("a",) and torch.equal(batch.pages["kv"], torch.tensor([6]))
    assert broadcast.take() is None


def test_both_kvcr_routes_are_built_by_the_plugin_and_others_pass_through():
    """The kvcr alias and the dynamic route naming KVCRDirectLinker get the KVCR
    config; any other linker goes to SGLang's factory untouched."""
    from sglang.srt.mem_cache.storage.kvcr import plugin
    from sglang.srt.mem_cache.storage.kvcr.config.linker_config import (
        LINKER_CLASS_NAME,
        LINKER_MODULE_PATH,
    )

    extra = {"local_dram_bytes_per_worker": DRAM}
    dynamic = {
        "linker": LINKER_CLASS_NAME,
        "linker_module_path": LINKER_MODULE_PATH,
        "linker_extra_config": extra,
    }
    assert plugin._kvcr_extra_config("kvcr", extra) == extra
    assert plugin._kvcr_extra_config("dynamic", dynamic) == extra
    assert plugin._kvcr_extra_config("dynamic", {**dynamic, "linker": "Other"}) is None
    assert plugin._kvcr_extra_config("mooncake", extra) is None
    with pytest.raises(ValueError, match="unknown fields"):
        plugin._kvcr_extra_config("dynamic", {**dynamic, "typo": 1})


# ---- the broadcast alone, CPU and CUDA pools ---------------------------------------


def _broadcast_rank(rank: int, port: int, device: str) -> dict[str, Any]:
    """The owner's rows at its pages reach the follower's other pages. Both ranks
    use gloo: with CUDA pools both share the one GPU (NCCL needs one per rank)."""
    import torch
    import torch.distributed as dist
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
        LayerWiseLoadCounter,
    )

    from cpu_harness.kvcr_pages import hashes_for, kv_transfer
    from sglang.srt.mem_cache.storage.kvcr.datapath.replica_broadcast import (
        ReplicaBroadcast,
        dest_rows_of,
    )

    gloo_ranks.init_gloo(rank, port, WORLD, GLOO_TIMEOUT_S)
    cuda = device == "cuda"
    try:
        if cuda:
            torch.cuda.set_device(0)
        pool, layout = _mla_layout(device)
        pages = [1, 2, 3] if rank == OWNER else [7, 5, 9]
        mine = [p * PAGE + t for p in pages for t in range(PAGE)]
        gen = torch.Generator().manual_seed(5)
        want = []
        for buf in pool.kv_buffer:
            raw = buf.view(torch.uint8).reshape(buf.shape[0], -1)
            data = torch.randint(
                0, 256, (len(mine), raw.shape[1]), dtype=torch.uint8, generator=gen
            )
            want.append(data)
            if rank == OWNER:
                raw[mine] = data.to(device)
        broadcast = ReplicaBroadcast(
            layout,
            dest_rows_of(layout, PAGE),
            dist.group.WORLD,
            0,
            rank == OWNER,
            PAGE,
            forward_stream=torch.cuda.Stream() if cuda else None,
        )
        counter = LayerWiseLoadCounter(layout.num_layers)
        transfers = kv_transfer(hashes_for(3, "bcast"), pages, device=device)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # queueing must not sync
        queued = broadcast.queue("g", transfers)
        queued_on = broadcast._queued["g"][0]["kv"].device.type
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
        if rank == OWNER:
            index = counter.update_producer()
            for layer in range(layout.num_layers):
                counter.complete(index, layer)
            broadcast.send(counter, index, 10.0)
        else:
            index, _ = broadcast.receive(counter)
        landed = counter.finish(index)
        if cuda:
            torch.cuda.synchronize()
        exact = [
            torch.equal(
                buf.view(torch.uint8).reshape(buf.shape[0], -1)[mine].cpu(), data
            )
            for buf, data in zip(pool.kv_buffer, want, strict=True)
        ]
        return {
            "queued": queued,
            "queued_on": queued_on,
            "landed": landed,
            "exact": exact,
            "stats": broadcast.stats_snapshot(),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_broadcast_moves_the_owners_rows_into_the_followers_pages(device):
    """Each layer's rows at the owner's pages land byte-exact at the follower's
    (different) pages; CUDA pages are queued without a host sync."""
    out = gloo_ranks.run_ranks(
        _broadcast_rank, WORLD, device, timeout_s=JOB_TIMEOUT_S, name="kvcr-replica"
    )
    for rank in (OWNER, FOLLOWER):
        assert out[rank]["queued"] and out[rank]["queued_on"] == device
        assert out[rank]["landed"] is True
        assert out[rank]["exact"] == [True] * LAYERS, f"rank {rank}"
        assert out[rank]["stats"]["replica_failures"] == 0
    assert out[OWNER]["stats"]["replica_pages_sent"] == 3
    assert out[FOLLOWER]["stats"]["replica_bytes_received"] == 3 * PAGE_OBJECT_BYTES
