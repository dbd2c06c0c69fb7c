"""A pull's completion counts only from the NIXL agent its source endpoint named.

kvcr 0.1.1 takes a ``write_done`` notice for any in-flight pull from any NIXL
agent; a success marks the pull's keys resident, so whoever holds a worker's
NIXL metadata could make slots nobody wrote (another tenant's bytes) a hit. The
worker (real kvcr + NIXL on loopback) pulls from a hinted source that accepts
the ``start_write`` and never writes (``Hole``); real NIXL agents send it
notices. Only the agent the source named in its ``target_metadata_ack`` is
believed, and a notice that arrives before that ack (or before a restarted
source's new one) waits for it.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from cpu_harness.kvcr_pages import (
    PAGE_BYTES,
    fetch_hint,
    hashes_for,
    kv_transfer,
    make_linker,
    make_pool,
    wait_until,
)
from cpu_harness.kvcr_stray_peers import Hole, NixlSender, settle, write_done
from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_session
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import completion_senders
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)

pytestmark = pytest.mark.kvcr

# Time enough to send notices while the pull waits; it then fails at the deadline.
CONFIG = {
    "local_dram_bytes_per_worker": 16 * PAGE_BYTES,
    "operation_timeout_ms": 3000,
    "abandon_timeout_ms": 6000,
    "preparation_timeout_ms": 5000,
}


@pytest.fixture
def target():
    """A worker and a hole, the hinted source of its pages."""
    lk, hole = make_linker(make_pool("cpu"), **CONFIG), Hole()
    yield lk, hole
    hole.close()
    lk.close()


def _dropped(lk) -> int:
    return lk.stats_snapshot()["dropped_notices"]


def _pull(lk, hole, rid):
    hashes = hashes_for(2, rid)
    ctx = LinkerRequestContext(rid, 0, fetch_hint(hole.endpoint, hashes))
    handle = lk.prepare_request(ctx, kv_transfer(hashes))
    return hashes, handle


def test_a_completion_from_an_agent_the_pull_was_not_sent_to_is_dropped(target):
    lk, hole = target
    hashes, handle = _pull(lk, hole, "stranger")
    metadata = hole.wait("target_metadata")["target_agent_metadata"]
    hole.ack(lk.endpoint, "source-agent")  # the hinted source names its agent
    start = hole.wait("start_write")
    stranger = NixlSender("stranger", metadata)
    stranger.send(write_done(start))
    settle(
        lambda: _dropped(lk) or lk.preparation_ready(handle),
        [stranger],
        timeout=2.5,
        what="the stranger's notice judged",
    )
    assert _dropped(lk) == 1
    assert not lk.preparation_ready(handle)  # still waiting for its source
    wait_until(lambda: lk.preparation_ready(handle), timeout=10, what="deadline")
    assert lk.lookup("stranger", kv_transfer(hashes)) == []  # a miss, never a hit
    lk.release_request("stranger")


def test_a_sources_notice_waits_for_its_ack_and_a_strangers_is_dropped(target):
    lk, hole = target
    hashes, handle = _pull(lk, hole, "early")
    metadata = hole.wait("target_metadata")["target_agent_metadata"]
    start = hole.wait("start_write")
    source = NixlSender("source", metadata)
    stranger = NixlSender("stranger", metadata)
    source.send(write_done(start))  # before the source's ack: UCX beat ZMQ
    stranger.send(write_done(start))
    with pytest.raises(AssertionError):  # neither is believed yet
        settle(lambda: lk.preparation_ready(handle), [source, stranger], 0.5, "hold")
    assert _dropped(lk) == 0
    hole.ack(lk.endpoint, source.name)
    settle(
        lambda: lk.preparation_ready(handle),
        [source, stranger],
        timeout=2.5,
        what="the held notice accepted once its source named itself",
    )
    assert lk.lookup("early", kv_transfer(hashes)) == [1, 2]
    assert _dropped(lk) == 1  # the stranger's
    lk.release_request("early")


def test_a_source_restarted_on_its_endpoint_is_believed_once_it_names_itself(target):
    """After kvcr gave an endpoint up (a timeout), a new agent there (a restarted
    source) may send its notice before its ack: it waits instead of being
    dropped as a stranger's."""
    lk, hole = target
    _, handle = _pull(lk, hole, "old")
    metadata = hole.wait("target_metadata")["target_agent_metadata"]
    hole.ack(lk.endpoint, "old-source-agent")
    old = hole.wait("start_write")
    wait_until(lambda: lk.preparation_ready(handle), timeout=10, what="timed out")
    lk.release_request("old")
    hole.seen.clear()
    hashes, handle = _pull(lk, hole, "new")
    start = hole.wait("start_write")
    assert start["op_handle"] != old["op_handle"]
    restarted = NixlSender("restarted", metadata)
    restarted.send(write_done(start))
    with pytest.raises(AssertionError):  # not believed before it names itself
        settle(lambda: lk.preparation_ready(handle), [restarted], 0.5, "hold")
    assert _dropped(lk) == 0
    hole.ack(lk.endpoint, restarted.name)
    settle(
        lambda: lk.preparation_ready(handle),
        [restarted],
        timeout=2.5,
        what="the restarted source's notice accepted",
    )
    assert lk.lookup("new", kv_transfer(hashes)) == [1, 2]
    lk.release_request("new")


def test_a_stranger_cannot_name_itself_after_a_source_it_can_guess(target):
    """NIXL 1.5.0's UCX backend reads a notice's sender name from the message
    body: the sender check holds only while a source's agent name cannot be
    guessed. A stranger holding the worker's metadata builds the name a worker
    (``src``, whose control channel the hole stands for) would have from what
    it can know or try (host, pid, rank label, a small incarnation number)."""
    lk, hole = target
    src = make_linker(make_pool("cpu"), **CONFIG)
    try:
        incarnation = int(repr(kvcr_session._INCARNATIONS)[len("count(") : -1]) - 1
        guess = f"kvcr-{socket.gethostname()}-{os.getpid()}-r0-{incarnation}"
        hashes, handle = _pull(lk, hole, "guessed")
        metadata = hole.wait("target_metadata")["target_agent_metadata"]
        hole.ack(lk.endpoint, src.session.agent)  # the source names its agent
        start = hole.wait("start_write")
        stranger = NixlSender("stranger", metadata, name=guess)
        stranger.send(write_done(start))
        settle(
            lambda: _dropped(lk) or lk.preparation_ready(handle),
            [stranger],
            timeout=2.5,
            what="the guessing stranger's notice judged",
        )
        assert _dropped(lk) == 1
        wait_until(lambda: lk.preparation_ready(handle), timeout=10, what="deadline")
        assert lk.lookup("guessed", kv_transfer(hashes)) == []  # never a hit
        lk.release_request("guessed")
    finally:
        src.close()


FLOOD = completion_senders.MAX_HELD + 8  # more than the whole hold


def _flood(lk, stranger, start, expect_dropped, timeout=5.0):
    for _ in range(FLOOD):
        stranger.send(write_done(start))
    settle(
        lambda: _dropped(lk) >= expect_dropped,
        [stranger],
        timeout=timeout,
        what="the flood judged",
    )


def _early_notice_accepted(lk, hole, rid, metadata):
    """A pull whose source's notice beats its ack is still believed."""
    hole.seen.clear()
    hashes, handle = _pull(lk, hole, rid)
    start = hole.wait("start_write")
    source = NixlSender("source", metadata)
    source.send(write_done(start))
    sent = time.monotonic()
    settle(lambda: time.monotonic() - sent > 0.3, [source], 1, "sent before the ack")
    hole.ack(lk.endpoint, source.name)
    settle(
        lambda: lk.preparation_ready(handle),
        [source],
        timeout=2.5,
        what="the early notice accepted once its source named itself",
    )
    assert lk.lookup(rid, kv_transfer(hashes)) == [1, 2]
    lk.release_request(rid)


def test_notices_for_a_pull_kvcr_gave_up_on_are_not_held(target):
    """A pull past its deadline (probed, then quarantined for good when its
    source never answers) no longer waits for a notice: a stranger's flood for
    it is dropped at once instead of filling the hold for as long as the pull
    lasts, and a later source's notice that beats its ack is still held."""
    lk, hole = target
    _, handle = _pull(lk, hole, "given-up")
    metadata = hole.wait("target_metadata")["target_agent_metadata"]
    hole.ack(lk.endpoint, "old-source-agent")
    start = hole.wait("start_write")
    wait_until(lambda: lk.preparation_ready(handle), timeout=10, what="timed out")
    lk.release_request("given-up")
    stranger = NixlSender("stranger", metadata)
    # Dropped well before the operation timeout (3 s), after which a held
    # notice would be dropped anyway.
    started = time.monotonic()
    _flood(lk, stranger, start, FLOOD, timeout=2.0)
    assert _dropped(lk) == FLOOD  # none held
    assert time.monotonic() - started < 2.0
    _early_notice_accepted(lk, hole, "after-flood", metadata)


def test_notices_held_for_one_pull_are_capped(target):
    """A stranger's flood for a pull whose source has not named itself yet
    holds only a few notices, so another pull's early notice still fits."""
    lk, hole = target
    _pull(lk, hole, "flooded")
    metadata = hole.wait("target_metadata")["target_agent_metadata"]
    start = hole.wait("start_write")
    stranger = NixlSender("stranger", metadata)
    _flood(lk, stranger, start, FLOOD - completion_senders.MAX_HELD)
    other = Hole()
    try:
        _early_notice_accepted(lk, other, "other", metadata)
    finally:
        other.close()
    assert _dropped(lk) == FLOOD - completion_senders.MAX_HELD_PER_PULL
    lk.release_request("flooded")
