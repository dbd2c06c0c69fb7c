"""The peer scenarios: one peer A (a child process) serving B (this process).

A frozen with SIGSTOP shorter and longer than B's operation timeout, then
resumed; A killed with fetches in flight from B and from a fresh B2; a new peer
A2 on A's endpoint; a flush of B while it may still hold the dead peer's
quarantined operation; and, in a child, a peer that never answers.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import traceback
from typing import Any

from cpu_harness.kvcr_pages import fetch_hint, hashes_for, kv_transfer, wait_until
from cpu_harness.server import free_port
from kvcr_drivers.faults.common import (
    BASE_CONFIG,
    WAIT_S,
    Harness,
    LogCapture,
    Scenario,
    ctx,
    local_round_trip,
    page_data,
    prepare,
    restore,
    retained_count,
    settle,
    unresolved_operations,
)
from kvcr_drivers.faults.peers import (
    PeerChildren,
    scenario_unreachable_peer_close_retained,
)

# How long B2's operation to the dead peer may take to resolve through A2
# (kvcr's abandon timeout, then a probe's round trip).
PROBE_WAIT_S = 2 * BASE_CONFIG["abandon_timeout_ms"] / 1000.0


def run_peer_scenarios(children: PeerChildren) -> list[Scenario]:
    """frozen/resumed, killed mid-fetch, restarted on the same endpoint (B here,
    A in children), then the unreachable peer (B in a child)."""
    frozen = Scenario("peer_frozen_resumed")
    killed = Scenario("peer_killed_mid_fetch")
    restarted = Scenario("peer_restarted_same_endpoint")
    flush = Scenario("flush_with_quarantined_peer_op")
    dead = Scenario("unreachable_peer_close_retained")
    started = time.monotonic()
    capture = LogCapture()
    harnesses: list[Harness] = []
    try:
        with capture.attached():
            _peer_sequence(
                children, capture, harnesses, frozen, killed, restarted, flush
            )
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        current = next(
            (s for s in (frozen, killed, restarted, flush) if not s.outcome), flush
        )
        current.error = traceback.format_exc()
    finally:
        for h in harnesses:  # after a failure: close what is still open
            for lk in h.linkers:
                with contextlib.suppress(Exception):
                    h.close(lk)
        children.first.kill()
    for sc in (frozen, killed, restarted, flush):
        sc.wall_s = time.monotonic() - started
        if not sc.checks and not sc.error:
            sc.error = "not reached"
    t0 = time.monotonic()
    try:
        children.restarted.close_linker()
        result = children.restarted.run("unreachable_peer")
        scenario_unreachable_peer_close_retained(dead, result)
    except BaseException:
        dead.error = traceback.format_exc()
    finally:
        children.restarted.kill()
    dead.wall_s = time.monotonic() - t0
    return [frozen, killed, restarted, flush, dead]


def _peer_sequence(
    children: PeerChildren,
    capture: LogCapture,
    harnesses: list[Harness],
    frozen: Scenario,
    killed: Scenario,
    restarted: Scenario,
    flush: Scenario,
) -> None:
    """One peer A (child) serves B (here) through a short freeze, a long freeze and
    SIGCONT; then A is frozen and killed with fetches in flight from B (connected to
    A long before) and from B2 (a fresh linker that never completed a handshake
    with A); then A2 starts on A's endpoint."""
    port = free_port()
    groups = {
        g: hashes_for(3, f"peer-{g}") for g in ("short", "long", "resumed", "kill")
    }
    a = children.first
    peer = a.build({"control_port": port}, groups, seed=71)
    endpoint = peer["endpoint"]
    stored = {g: v["bytes"] for g, v in peer["groups"].items()}
    h_frozen = Harness(frozen)
    harnesses.append(h_frozen)
    pool_b, b = h_frozen.linker()
    op_timeout = BASE_CONFIG["operation_timeout_ms"] / 1000.0
    dest = iter(range(8, 50, 3))

    def restore_matches(
        lk: Any, pool: Any, rid: str, hashes: list[str], expected: list[bytes]
    ) -> bool:
        start = next(dest)
        pages = [start, start + 1, start + 2][: len(hashes)]
        ok = restore(lk, rid, hashes, pages)
        return ok and [page_data(pool, p) for p in pages] == expected

    # -- frozen, then resumed within B's operation timeout: the fetch completes.
    g = groups["short"]
    a.signal(signal.SIGSTOP)
    timer = threading.Timer(0.4, a.signal, args=(signal.SIGCONT,))
    timer.start()
    took = prepare(b, "short", g, fetch_hint(endpoint, g))
    timer.join()
    hit = b.lookup("short", kv_transfer(g))
    frozen.check("short freeze: B waited for the peer", took >= 0.35)
    frozen.check("short freeze: full hit", hit == [1, 2, 3])
    short_ok = hit == [1, 2, 3] and restore_matches(
        b, pool_b, "short", g, stored["short"]
    )
    frozen.check("short freeze: restored bytes equal A's", short_ok)
    b.finish_request("short")
    # -- frozen past B's operation timeout: a miss; after SIGCONT A serves again.
    g = groups["long"]
    a.signal(signal.SIGSTOP)
    try:
        took_long = prepare(b, "long", g, fetch_hint(endpoint, g))
        long_hit = b.lookup("long", kv_transfer(g))
        b.finish_request("long")
        frozen.check(
            "long freeze: the fetch gave up at the operation timeout",
            took_long >= op_timeout * 0.9,
        )
        frozen.check(
            "long freeze: a miss, nothing claimed",
            long_hit == [] and settle(b) == (0, 0),
        )
    finally:
        a.signal(signal.SIGCONT)
    time.sleep(0.5)
    g = groups["resumed"]
    prepare(b, "resumed", g, fetch_hint(endpoint, g))
    resumed_hit = b.lookup("resumed", kv_transfer(g))
    resumed_ok = resumed_hit == [1, 2, 3] and restore_matches(
        b, pool_b, "resumed", g, stored["resumed"]
    )
    frozen.check("after SIGCONT: the peer serves again, byte-exact", resumed_ok)
    b.finish_request("resumed")
    frozen.check("no claims held", settle(b) == (0, 0))
    frozen.check("no quarantine from a freeze", capture.count("state=uncertain") == 0)
    frozen.output_matches_control = short_ok and resumed_ok and long_hit == []
    frozen.outcome = (
        f"0.4 s freeze: hit after {took:.2f} s; {took_long:.2f} s freeze: miss; "
        "after SIGCONT: hit"
    )

    # -- killed while fetches are in flight from B and from a fresh B2.
    h_killed = Harness(killed)
    harnesses.append(h_killed)
    pool_b2, b2 = h_killed.linker()
    g = groups["kill"]
    a.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    handles = {}
    for name, lk in (("B", b), ("B2", b2)):
        fetches = lk._adapter.stats().fetches
        handles[name] = lk.prepare_request(
            ctx("kill", fetch_hint(endpoint, g)), kv_transfer(g)
        )
        wait_until(
            lambda lk=lk, n=fetches: lk._adapter.stats().fetches > n,
            WAIT_S,
            "fetch submitted",
        )
    time.sleep(0.1)
    in_flight = [lk._adapter.stats().inflight_prepare_bytes for lk in (b, b2)]
    killed.check("both fetches are in flight when the peer dies", all(in_flight))
    a.kill()
    for name, lk in (("B", b), ("B2", b2)):
        wait_until(
            lambda lk=lk, name=name: lk.preparation_ready(handles[name]),
            WAIT_S,
            "killed-peer prepare",
        )
    kill_s = time.monotonic() - t0
    kill_hits = [lk.lookup("kill", kv_transfer(g)) for lk in (b, b2)]
    killed.check("a miss on both, never partial KV", kill_hits == [[], []])
    for lk in (b, b2):
        lk.finish_request("kill")
    killed.check("no claims held", settle(b) == (0, 0) and settle(b2) == (0, 0))
    with contextlib.suppress(AssertionError):
        wait_until(lambda: capture.count("state=uncertain") > 0, 10.0, "quarantine")
    uncertain = capture.count("state=uncertain")
    killed.details["quarantined_ops_reported"] = uncertain
    killed.check("KVCR reports the dead peer's operation quarantined", uncertain >= 1)
    # B keeps working locally while the quarantine stands.
    stored, local_ok = local_round_trip(b, pool_b, "peer-local", 60, 61, seed=73)
    killed.check("B still offloads", stored)
    killed.check("B still restores its own pages byte-exact", local_ok)
    killed.claims_leaked = sum(settle(b)) + sum(settle(b2))
    killed.output_matches_control = kill_hits == [[], []] and local_ok
    killed.outcome = (
        f"miss after {kill_s:.2f} s on both; quarantined; local path unaffected"
    )

    # -- a new peer on the same endpoint (different bytes for a new group).
    fresh = hashes_for(3, "peer-restarted")
    peer2 = children.restarted.build({"control_port": port}, {"fresh": fresh}, seed=91)
    restarted.check("A2 listens on A's endpoint", peer2["endpoint"] == endpoint)
    expected = peer2["groups"]["fresh"]["bytes"]
    attempts: dict[str, int] = {}
    ok_by: dict[str, bool] = {}
    for name, lk, pool in (("B", b, pool_b), ("B2", b2, pool_b2)):
        hit, n = [], 0
        while n < 3 and hit != [1, 2, 3]:
            n += 1
            rid = f"restart-{name}-{n}"
            prepare(lk, rid, fresh, fetch_hint(endpoint, fresh))
            hit = lk.lookup(rid, kv_transfer(fresh))
            if hit != [1, 2, 3]:
                lk.finish_request(rid)
        attempts[name] = n
        ok_by[name] = hit == [1, 2, 3] and restore_matches(
            lk, pool, rid, fresh, expected
        )
        lk.finish_request(rid)
        prepare(lk, f"stale-{name}", g, fetch_hint(endpoint, g))
        ok_by[name] = ok_by[name] and lk.lookup(f"stale-{name}", kv_transfer(g)) == []
        lk.finish_request(f"stale-{name}")
    restarted.details["attempts_until_hit"] = attempts
    restarted.check(
        "B gets A2's bytes (not A's), the dead peer's pages miss", ok_by["B"]
    )
    restarted.check("B2 gets A2's bytes, the dead peer's pages miss", ok_by["B2"])
    restarted.check(
        "at most one refused attempt (incarnation mismatch)",
        max(attempts.values()) <= 2,
    )
    with contextlib.suppress(AssertionError):
        wait_until(lambda: capture.count("state=quiesced") > 0, 5.0, "quiesced")
    restarted.details["quiesced_reports"] = capture.count("state=quiesced")
    # B2's pull from the dead A resolves once a probe of it reaches A2; kvcr keeps
    # it (and B2's DRAM) until then, and a probe sent while A was down can be
    # lost. Wait for it, bounded; B2 must close cleanly unless it was still
    # unresolved, and then be retained (DRAM quarantined), never closed as clean.
    with contextlib.suppress(AssertionError):
        wait_until(lambda: unresolved_operations(b2) == 0, PROBE_WAIT_S, "B2 op")
    b2_open = unresolved_operations(b2)
    restarted.details["b2_unresolved_ops_at_close"] = b2_open
    retained0 = retained_count()
    h_killed.finish(allow_retained=True)
    b2_retained = retained_count() - retained0
    restarted.details["b2_retained"] = b2_retained
    killed.check(
        "B2 closes cleanly unless its dead-peer op is unresolved (then retained)",
        b2_retained == 0 or (b2_open > 0 and b2_retained == 1),
    )
    restarted.check("A2 closes cleanly", children.restarted.close_linker() == 0)
    restarted.output_matches_control = ok_by["B"] and ok_by["B2"]

    # -- flush B, whose KVCR may still hold the dead peer's quarantined operation.
    retained0, q0 = retained_count(), b.quarantined_bytes()
    t0 = time.monotonic()
    b.reset()
    flush_s = time.monotonic() - t0
    old_retained = retained_count() - retained0
    quarantined = b.quarantined_bytes() - q0
    flush.details.update(
        {
            "flush_s": round(flush_s, 2),
            "old_kvcr_retained": old_retained,
            "quarantined_bytes": quarantined,
        }
    )
    flush.check(
        "the flush returns within owner_wait_timeout_s",
        flush_s < BASE_CONFIG["owner_wait_timeout_s"],
    )
    flush.check(
        "old DRAM is quarantined exactly when the old KVCR could not close",
        (old_retained == 1) == (quarantined > 0) and old_retained <= 1,
    )
    flush.check(
        "pages fetched before the flush are a miss",
        b.lookup("gone", kv_transfer(fresh)) == [],
    )
    stored, flush_ok = local_round_trip(b, pool_b, "after-flush", 62, 63, seed=97)
    flush.check("the new KVCR stores", stored)
    flush.check("the new KVCR restores byte-exact", flush_ok)
    flush.claims_leaked = sum(settle(b))
    retained0 = retained_count()
    h_frozen.finish(allow_retained=True)
    flush.check("the rebuilt KVCR closes cleanly", retained_count() == retained0)
    flush.output_matches_control = flush_ok
    flush.outcome = (
        f"flush in {flush_s:.2f} s; old KVCR "
        f"{'retained, ' + str(quarantined) + ' DRAM bytes quarantined' if old_retained else 'closed clean'}; "
        "new KVCR serves and closes clean"
    )
    restarted.details["b_quarantine_persisted"] = bool(old_retained)
    restarted.outcome = (
        f"A2 served B after {attempts['B']} attempt(s), B2 after {attempts['B2']}; "
        f"dead peer's pages missed; B2 closed clean; B's quarantine "
        f"{'persisted (its start_write had reached A)' if old_retained else 'cleared'}"
    )
