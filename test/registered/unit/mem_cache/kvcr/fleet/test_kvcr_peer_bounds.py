"""What peers can make a worker hold is bounded (real kvcr + NIXL on loopback).

A hinted source that accepts ``start_write`` and never completes (``Hole``)
leaves kvcr holding the failed fetch's slots: they are counted
(``unresolved_fill_bytes``) and past a quarter of the DRAM share (or
``max_abandoned_bytes``, if larger) hints are ignored until the writes resolve. The control channel keeps at most ``MAX_OUTGOING``
outgoing sockets, least recently used closed first. A source keeps at most
``MAX_FENCES`` write-probe fences, and a ``start_write`` for an evicted fence's
operation, delayed past its probe, is still refused.
"""

from __future__ import annotations

import functools

import pytest
import torch
import zmq

from cpu_harness.kvcr_pages import (
    PAGE_BYTES,
    fetch_hint,
    fill_random,
    hashes_for,
    kv_transfer,
    make_linker,
    make_pool,
    offload_and_commit,
    wait_until,
)
from cpu_harness.kvcr_stray_peers import Hole, NixlSender, settle, write_done
from sglang.srt.mem_cache.storage.kvcr.config.linker_config import KVCRLinkerConfig
from sglang.srt.mem_cache.storage.kvcr.fleet.control_auth import InboundGuard
from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_factory, kvcr_patches
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import (
    outgoing_sockets,
    probe_fences,
)
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)

pytestmark = pytest.mark.kvcr

FAST = {
    "local_dram_bytes_per_worker": 16 * PAGE_BYTES,
    "operation_timeout_ms": 500,
    "abandon_timeout_ms": 1000,
    "preparation_timeout_ms": 1000,
}


def _hinted(lk, rid, endpoint, hashes):
    ctx = LinkerRequestContext(rid, 0, fetch_hint(endpoint, hashes))
    handle = lk.prepare_request(ctx, kv_transfer(hashes))
    wait_until(lambda: lk.preparation_ready(handle), what=f"{rid} prepared")
    return lk.lookup(rid, kv_transfer(hashes))


def test_a_dead_peers_held_fetch_below_a_quarter_of_dram_keeps_hints_on():
    """A source that died mid-fetch never resolves its write: its bytes stay
    held until a flush. Up to a quarter of the DRAM share (here 4 of 16 pages,
    above ``max_abandoned_bytes``) that does not turn hints off."""
    lk, hole = (
        make_linker(make_pool("cpu"), **FAST, max_abandoned_bytes=PAGE_BYTES),
        Hole(),
    )
    try:
        assert _hinted(lk, "a", hole.endpoint, hashes_for(2, "a")) == []
        wait_until(
            lambda: lk.stats_snapshot()["unresolved_fill_bytes"] == 2 * PAGE_BYTES,
            what="the failed fetch's slots counted",
        )
        assert _hinted(lk, "b", hole.endpoint, hashes_for(2, "b")) == []
        assert lk.stats_snapshot()["hints_unresolved_off"] == 0
        assert hole.count("start_write", 2) == 2  # the hint was taken
        for rid in "ab":
            lk.release_request(rid)
    finally:
        hole.close()
        lk.close()


def test_failed_fetches_still_holding_dram_stop_hints_until_they_resolve():
    lk, hole = (
        make_linker(make_pool("cpu"), **FAST, max_abandoned_bytes=PAGE_BYTES),
        Hole(),
    )
    try:
        # Five pages: over a quarter of the 16-page share.
        assert _hinted(lk, "a", hole.endpoint, hashes_for(5, "a")) == []
        # The fetch failed at its deadline; kvcr still holds its five pages.
        wait_until(
            lambda: lk.stats_snapshot()["unresolved_fill_bytes"] == 5 * PAGE_BYTES,
            what="the failed fetch's slots counted",
        )
        start = hole.wait("start_write")
        assert _hinted(lk, "b", hole.endpoint, hashes_for(2, "b")) == []
        snap = lk.stats_snapshot()
        assert snap["hints_unresolved_off"] == 1  # not fetched: nothing more held
        assert snap["unresolved_fill_bytes"] == 5 * PAGE_BYTES
        assert hole.count("start_write", 2, timeout=0.5) == 1
        # The source names itself and reports its write failed: the slots go.
        source = NixlSender("source", start["target_agent_metadata"])
        hole.ack(lk.endpoint, source.name)
        source.send(write_done(start, success=False))
        settle(
            lambda: lk.stats_snapshot()["unresolved_fill_bytes"] == 0,
            [source],
            timeout=5,
            what="the resolved write's slots released",
        )
        assert _hinted(lk, "c", hole.endpoint, hashes_for(2, "c")) == []
        assert lk.stats_snapshot()["hints_unresolved_off"] == 1  # taken again
        assert hole.count("start_write", 2) == 2
        for rid in "abc":
            lk.release_request(rid)
    finally:
        hole.close()
        lk.close()


def _channel(ctx):
    cfg = KVCRLinkerConfig.from_dict(
        {"local_dram_bytes_per_worker": 1 << 26, "control_bind_host": "127.0.0.1"}
    )
    guarded = functools.partial(
        kvcr_patches.guarded_channel_class(), guard=InboundGuard.from_config(cfg)
    )
    channel = kvcr_factory._channel_on_own_port(guarded, "127.0.0.1", "127.0.0.1")
    channel.initialize()
    return channel


def test_the_control_channel_closes_its_least_recently_used_sockets(monkeypatch):
    monkeypatch.setattr(outgoing_sockets, "MAX_OUTGOING", 2)
    ctx = zmq.Context()
    sinks, names = [], []
    for _ in range(3):
        sink = ctx.socket(zmq.PULL)
        sink.linger = 0
        names.append(f"tcp://127.0.0.1:{sink.bind_to_random_port('tcp://127.0.0.1')}")
        sinks.append(sink)
    channel = _channel(ctx)
    try:
        for i in (0, 1, 0, 2):  # 1 is the least recently used when 2 is dialed
            assert channel.send(names[i], f"to {i}".encode())
        assert list(channel._outgoing) == [names[0], names[2]]
        assert _received(sinks[0], 2) == [b"to 0", b"to 0"]
        assert _received(sinks[2], 1) == [b"to 2"]
        assert channel.send(names[1], b"again")  # dialed anew; 0 is closed now
        assert list(channel._outgoing) == [names[2], names[1]]
        assert _received(sinks[1], 1)[-1] == b"again"
    finally:
        channel.close()
        for sink in sinks:
            sink.close()
        ctx.destroy(linger=0)


def _received(sink, n):
    """At least ``n`` messages from ``sink`` (and any that follow at once)."""
    got = []
    while sink.poll(5000 if len(got) < n else 200):
        got.append(sink.recv())
    return got


def _slot_bytes(lk, start):
    """The target's DRAM bytes under ``start``'s destination slots."""
    sizes = dict(lk.layout.kvcr_pool_layouts())
    out = []
    for refs in start["dst_descriptors"]:
        for ref in refs:
            pool = ref["label"].partition(":")[0]
            raw = lk.dram.storage[pool].view(torch.uint8)
            at = ref["element_index"] * sizes[pool]
            out.append(raw[at : at + sizes[pool]].clone())
    return torch.cat(out)


def test_probe_fences_are_bounded_and_an_evicted_ones_write_stays_refused(
    monkeypatch,
):
    monkeypatch.setattr(probe_fences, "MAX_FENCES", 8)
    slow = {**FAST, "operation_timeout_ms": 3000, "abandon_timeout_ms": 6000}
    source_pool = make_pool("cpu")
    source = make_linker(source_pool, **slow)
    target, hole = make_linker(make_pool("cpu"), **slow), Hole()
    try:
        fill_random(source_pool, [1, 2], seed=11)
        hashes = hashes_for(2, "fenced")
        assert offload_and_commit(source, hashes, [1, 2]) is True
        # The target's start_write for the source's pages is held back (it goes
        # to the hole), as a reconnect can delay it past the target's probe.
        ctx = LinkerRequestContext("late", 0, fetch_hint(hole.endpoint, hashes))
        target.prepare_request(ctx, kv_transfer(hashes))
        start = hole.wait("start_write")
        before = _slot_bytes(target, start)
        handle = start["op_handle"]
        step = -1 if handle < 0 else 1  # later operations: larger magnitude
        for k in range(3 * probe_fences.MAX_FENCES):  # its probe, then made-up ones
            hole.say(
                source.endpoint,
                {
                    "type": "write_probe",
                    "target_agent": start["target_agent"],
                    "op_handle": handle + step * k,
                    "sender_control_endpoint": hole.endpoint,
                    "source_control_endpoint": source.endpoint,
                    "source_incarnation": None,
                },
            )
        probes = 3 * probe_fences.MAX_FENCES
        assert hole.count("write_probe_ack", probes) == probes  # all answered
        kv = source._adapter._executor.kvcr
        assert probe_fences.fences(kv) == probe_fences.MAX_FENCES
        hole.say(source.endpoint, start)  # the delayed start_write arrives now
        with pytest.raises(AssertionError):
            wait_until(
                lambda: not torch.equal(_slot_bytes(target, start), before),
                timeout=1.5,
                what="the source wrote",
            )
        target.release_request("late")
    finally:
        hole.close()
        target.close()
        source.close()
