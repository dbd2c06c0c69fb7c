"""The in-process fault scenarios: linkers over real CPU pools in this process.

A stale hint, a preparation deadline with late completions, a flush with work in
flight (direct and staged offload paths), KVCR capacity exhausted, offload
backpressure, and hints outside the endpoint allowlist. Each takes a
``Scenario``, records named checks and ends with ``Harness.finish``.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from typing import Any

from cpu_harness.kvcr_pages import (
    PAGE_BYTES,
    fetch_hint,
    fill_random,
    hashes_for,
    kv_transfer,
    owner_stalled,
    wait_until,
)
from kvcr_drivers.faults.common import (
    DEADLINE_MS,
    STALE_TIMEOUT_MS,
    WAIT_S,
    Harness,
    Scenario,
    ctx,
    offload_and_commit,
    page_data,
    prepare,
    restore,
    rss_mb,
    settle,
)

# offload_backpressure: the in-flight offload budget in pages, and how many more
# one-page offloads are submitted while the owner thread is stalled.
BACKPRESSURE_BUDGET_PAGES = 2
BACKPRESSURE_STORM = 200


def scenario_stale_hint(sc: Scenario) -> None:
    """B is told A holds pages A never had or has evicted: only A's resident pages
    are fetched, the hit stops at the first gap, nothing stale is restored."""
    h = Harness(sc)
    slow = {
        "operation_timeout_ms": STALE_TIMEOUT_MS,
        "abandon_timeout_ms": 2 * STALE_TIMEOUT_MS,
    }
    pool_a, a = h.linker(local_dram_bytes_per_worker=4 * PAGE_BYTES, **slow)
    pool_b, b = h.linker(**slow)
    old = hashes_for(2, "stale-old")
    new = hashes_for(4, "stale-new")
    fill_random(pool_a, [1, 2, 3, 4, 5, 6], seed=11)
    sc.check("A stores the old pages", offload_and_commit(a, old, [1, 2]))
    sc.check("A stores four new pages", offload_and_commit(a, new, [3, 4, 5, 6]))
    evicted = set(a.take_removed_page_hashes())
    sc.check("capacity evicted exactly the old pages from A", evicted == set(old))
    a_bytes = {x: page_data(pool_a, p) for x, p in zip(new, [3, 4, 5, 6])}
    never = hashes_for(2, "stale-never")

    # [held, evicted, held]: the claimed prefix stops at the evicted page.
    tail = [new[0], old[0], new[1]]
    took = prepare(b, "mixed", tail, fetch_hint(a.endpoint, tail))
    sc.details["mixed_prepare_s"] = round(took, 3)
    sc.check(
        "a stale hint fails fast (within the operation timeout)",
        took < STALE_TIMEOUT_MS / 2000.0,
    )
    hit = b.lookup("mixed", kv_transfer(tail))
    sc.check("lookup reports only the claimed prefix [1]", hit == [1])
    sentinel = page_data(pool_b, 21)
    ok = restore(b, "mixed", tail[:1], [20])
    matches = ok and page_data(pool_b, 20) == a_bytes[new[0]]
    sc.check("the one restored page equals A's bytes", matches)
    sc.check("nothing else was written", page_data(pool_b, 21) == sentinel)
    b.finish_request("mixed")

    # Nothing the hint names exists on A.
    gone = [*old, *never]
    prepare(b, "gone", gone, fetch_hint(a.endpoint, gone))
    sc.check(
        "a wholly stale hint is a clean miss", b.lookup("gone", kv_transfer(gone)) == []
    )
    b.finish_request("gone")
    sc.details["hints"] = b.hints.stats.as_dict()
    sc.output_matches_control = matches
    sc.outcome = f"mixed hint hit {hit}; wholly stale hint missed; prepare {took:.3f} s"
    h.finish()


def scenario_preparation_deadline_late_completions(sc: Scenario) -> None:
    """Fetches that complete after the preparation deadline: released at once when
    the request already ended, held by the request (then released) otherwise."""
    h = Harness(sc)
    pool, lk = h.linker(preparation_timeout_ms=DEADLINE_MS)
    hashes = hashes_for(3, "deadline")
    fill_random(pool, [1, 2, 3], seed=21)
    original = [page_data(pool, p) for p in (1, 2, 3)]
    sc.check("pages stored", offload_and_commit(lk, hashes, [1, 2, 3]))
    late_before = lk.stats.late_claims_released
    with owner_stalled(lk, WAIT_S) as release:
        ha = lk.prepare_request(ctx("early-end"), kv_transfer(hashes))
        hb = lk.prepare_request(ctx("late-land"), kv_transfer(hashes))
        sc.check("not ready before the deadline", not lk.preparation_ready(ha))
        waited = wait_until(lambda: lk.preparation_ready(ha), WAIT_S, "deadline")
        sc.check("ready once the deadline passed", waited >= DEADLINE_MS / 2000.0)
        wait_until(lambda: lk.preparation_ready(hb), WAIT_S, "second deadline")
        sc.check(
            "admitted at the deadline with nothing claimed: a miss",
            lk.lookup("early-end", kv_transfer(hashes)) == []
            and lk.lookup("late-land", kv_transfer(hashes)) == [],
        )
        lk.finish_request("early-end")  # this request ends before its fetch lands
        release()
    sc.check("deadline counted", lk.stats.prepare_deadline_expired >= 2)
    settle(lk)
    late = lk.stats.late_claims_released - late_before
    sc.check("the ended request's late claims were released (3)", late == 3)
    sc.check("the live request holds its late-landed claims (3)", lk.claims_held() == 3)
    hit = lk.lookup("late-land", kv_transfer(hashes))
    ok = hit == [1, 2, 3] and restore(lk, "late-land", hashes, [30, 31, 32])
    matches = ok and [page_data(pool, p) for p in (30, 31, 32)] == original
    sc.check("late-landed claims restore the right bytes", matches)
    lk.finish_request("late-land")
    sc.check("abandoned bytes drained", lk.abandoned_bytes() == 0)
    sc.output_matches_control = matches
    sc.outcome = (
        f"deadline after {waited:.2f} s; {late} late claims released; "
        f"later lookup {hit}"
    )
    h.finish()


def scenario_reset_during_inflight(sc: Scenario, offload_path: str = "direct") -> None:
    """flush (reset) while an offload and a preparation are queued in KVCR: both
    resolve, nothing is claimed afterwards, no stale result pairs with a later
    offload, and the old pages are a clean miss."""
    h = Harness(sc)
    pool, lk = h.linker(offload_path=offload_path)
    stored = hashes_for(3, f"reset-{offload_path}")
    fill_random(pool, [1, 2, 3, 4, 5], seed=41)
    sc.check("pages stored", offload_and_commit(lk, stored, [1, 2, 3]))
    inflight = hashes_for(2, f"reset-inflight-{offload_path}")
    threads_before = len(threading.enumerate())
    timings = []
    with owner_stalled(lk, WAIT_S) as release:
        lk.offload(kv_transfer(inflight, [4, 5]))
        handle = lk.prepare_request(ctx("r-reset"), kv_transfer(stored))
        lk.num_completed_offloads()  # pumps: a deferred deposit is submitted now
        wait_until(
            lambda: lk._adapter.stats().inflight_offload_bytes > 0,
            WAIT_S,
            "deposit handed to the owner",
        )
        sc.check("preparation in flight at the flush", not lk.preparation_ready(handle))
        threading.Timer(0.3, release).start()
        started = time.monotonic()
        lk.reset()
        timings.append(time.monotonic() - started)
    sc.check("no offload result survives the flush", lk.num_completed_offloads() == 0)
    sc.check(
        "the dropped preparation is ready (nothing to wait for)",
        lk.preparation_ready(handle),
    )
    sc.check(
        "old pages are a clean miss", lk.lookup("r-reset", kv_transfer(stored)) == []
    )
    sc.check("the flushed KVCR holds no claims", settle(lk) == (0, 0))
    # Racing flushes: submit and reset at once, a few times.
    for i in range(3):
        lk.offload(kv_transfer(hashes_for(1, f"race{i}-{offload_path}"), [4]))
        lk.prepare_request(ctx(f"race{i}"), kv_transfer(stored))
        started = time.monotonic()
        lk.reset()
        timings.append(time.monotonic() - started)
        sc.check(f"race {i}: FIFO empty after flush", lk.num_completed_offloads() == 0)
    fill_random(pool, [6], seed=42)
    fresh = hashes_for(1, f"reset-fresh-{offload_path}")
    ok = lk.offload(kv_transfer(fresh, [6]))
    wait_until(lambda: lk.num_completed_offloads() >= 1, WAIT_S, "fresh offload")
    sc.check("the next offload gets its own result", ok and lk.pop_completed_offload())
    sc.check("and only that one", lk.num_completed_offloads() == 0)
    prepare(lk, "fresh", fresh)
    ok = lk.lookup("fresh", kv_transfer(fresh)) == [1] and restore(
        lk, "fresh", fresh, [40]
    )
    matches = ok and page_data(pool, 40) == page_data(pool, 6)
    sc.check("the rebuilt KVCR restores byte-exact", matches)
    lk.finish_request("fresh")
    sc.check(
        "the owner thread was replaced, not added",
        len(threading.enumerate()) == threads_before,
    )
    sc.details["reset_s"] = [round(t, 3) for t in timings]
    sc.output_matches_control = matches
    sc.outcome = (
        f"4 flushes with work in flight ({offload_path}); max {max(timings):.2f} s"
    )
    h.finish()


def scenario_capacity_exhausted(sc: Scenario) -> None:
    """Every KVCR slot is claimed or filling: deposits fail, results keep their
    positions (a fast failure waits behind a slower success), failed pages are
    never reported as hits, and capacity returns once the claims are released."""
    h = Harness(sc)
    pool, lk = h.linker(local_dram_bytes_per_worker=4 * PAGE_BYTES)
    held = hashes_for(3, "cap-held")
    fill_random(pool, list(range(1, 10)), seed=51)
    sc.check("three pages stored", offload_and_commit(lk, held, [1, 2, 3]))
    prepare(lk, "holder", held)
    sc.check(
        "a request claims all three",
        lk.lookup("holder", kv_transfer(held)) == [1, 2, 3],
    )
    s, f, g = (hashes_for(n, f"cap-{x}") for n, x in ((1, "s"), (1, "f"), (2, "g")))
    failures_before = lk.stats.offload_failures
    with owner_stalled(lk, WAIT_S):
        # One deposit batch: S takes the last free slot; F and G find nothing to evict.
        lk.offload(kv_transfer(s, [4]))
        lk.offload(kv_transfer(f, [5]))
        lk.offload(kv_transfer([], []))
        lk.offload(kv_transfer(g, [6, 7]))
        lk.num_completed_offloads()  # pump: all three deposits queue behind the stall
    wait_until(lambda: lk.num_completed_offloads() == 4, WAIT_S, "four offload results")
    results = [lk.pop_completed_offload() for _ in range(4)]
    sc.details["results"] = results
    sc.check(
        "results in submission order [True, False, False, False]",
        results == [True, False, False, False],
    )
    sc.check(
        "two capacity failures counted",
        lk.stats.offload_failures - failures_before == 2,
    )
    sc.check("a failed page is never a hit", lk.lookup("probe-f", kv_transfer(f)) == [])
    ok = restore(lk, "holder", held, [20, 21, 22])
    matches = ok and [page_data(pool, p) for p in (20, 21, 22)] == [
        page_data(pool, p) for p in (1, 2, 3)
    ]
    sc.check("the claimed pages still restore byte-exact", matches)
    lk.finish_request("holder")
    sc.check(
        "capacity is back once claims are released", offload_and_commit(lk, g, [6, 7])
    )
    sc.output_matches_control = matches
    sc.outcome = f"results {results}; recovered after release"
    h.finish()


def scenario_offload_backpressure(sc: Scenario, offload_path: str = "direct") -> None:
    """max_inflight_offload_bytes bounds queued offload work: extra offloads fail at
    once and in position instead of queueing; the bound never grows the queue."""
    h = Harness(sc)
    fits = BACKPRESSURE_BUDGET_PAGES
    limit = fits * PAGE_BYTES
    pool, lk = h.linker(max_inflight_offload_bytes=limit, offload_path=offload_path)
    fill_random(pool, list(range(1, 9)), seed=61)
    # (tag, pages) in submission order: ``fits`` one-page offloads fill the budget;
    # one more page, three pages at once, and the storm find it full.
    offloads = [(f"bp-ok{i}", [1 + i]) for i in range(fits)]
    offloads += [("bp-over", [fits + 1]), ("bp-big", [4, 5, 6])]
    offloads += [(f"bp-storm{i}", [7]) for i in range(BACKPRESSURE_STORM)]
    rss0 = rss_mb()
    with owner_stalled(lk, WAIT_S):
        for tag, pages in offloads:
            hashes = hashes_for(len(pages), f"{tag}-{offload_path}")
            lk.offload(kv_transfer(hashes, pages))
        lk.num_completed_offloads()  # pump: deferred deposits meet the budget now
        time.sleep(0.1)  # the staged path submits from its stager thread
        queued = lk._adapter._inbox.queued()
        deferred = lk.offloader.queue.deferred_count
    total = len(offloads)
    wait_until(
        lambda: lk.num_completed_offloads() == total, WAIT_S, "all offload results"
    )
    results = [lk.pop_completed_offload() for _ in range(total)]
    expected = [True] * fits + [False] * (total - fits)
    sc.details["submitted"] = total
    sc.details["stored"] = results.count(True)
    sc.check(
        f"results stay positional: {fits} stored, the rest failed", results == expected
    )
    sc.details["queued_commands_at_peak"] = queued
    sc.details["deferred_after_pump"] = deferred
    sc.check(
        f"the owner's command queue stayed bounded (<= {fits} deposits)",
        queued <= fits,
    )
    after = lk._adapter.stats()
    refused = after.refused_offload + lk.stats.offload_staging_full
    sc.details["refused"] = refused
    sc.details["peak_offload_bytes"] = after.peak_offload_bytes
    sc.check("every extra offload was refused and counted", refused == total - fits)
    sc.check(
        "peak in-flight offload bytes within the bound",
        after.peak_offload_bytes <= limit,
    )
    sc.check("in-flight bytes return to zero", after.inflight_offload_bytes == 0)
    sc.details["storm_rss_growth_mb"] = round(rss_mb() - rss0, 1)
    first = hashes_for(1, f"bp-ok0-{offload_path}")
    prepare(lk, "bp", first)
    ok = restore(lk, "bp", first, [30])
    matches = ok and page_data(pool, 30) == page_data(pool, 1)
    sc.check("an accepted offload restores byte-exact", matches)
    lk.finish_request("bp")
    sc.output_matches_control = matches
    sc.outcome = (
        f"{refused} of {total} offloads refused at once ({offload_path}); "
        f"queue peak {queued}"
    )
    h.finish()


def _no_connection(listener: socket.socket, wait_s: float) -> bool:
    readable, _, _ = select.select([listener], [], [], wait_s)
    if readable:
        conn, _ = listener.accept()
        conn.close()
        return False
    return True


def scenario_hint_outside_allowlist(
    sc: Scenario, positive_control: dict[str, Any] | None = None
) -> None:
    """A hint naming a peer outside peer_endpoint_allowlist never opens a
    connection: a listening socket there sees nothing while the request is prepared
    and looked up; the rejection is counted. (Positive control: the same hint with
    the listener allowed does connect; see unreachable_peer_close_retained.)"""
    h = Harness(sc)
    listen_wait = 1.0
    cases = []
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(socket.socket())
        other.bind(("127.0.0.2", 0))
        other.listen(8)
        local = stack.enter_context(socket.socket())
        local.bind(("127.0.0.1", 0))
        local.listen(8)
        _, default_lk = h.linker()  # allowlist: its advertised host, 127.0.0.1
        _, ranged_lk = h.linker(peer_endpoint_allowlist=["127.0.0.1:1-1023"])
        cases = [
            (
                "other host",
                default_lk,
                other,
                f"tcp://127.0.0.2:{other.getsockname()[1]}",
            ),
            (
                "host name",
                default_lk,
                local,
                f"tcp://localhost:{local.getsockname()[1]}",
            ),
            (
                "port outside range",
                ranged_lk,
                local,
                f"tcp://127.0.0.1:{local.getsockname()[1]}",
            ),
        ]
        for i, (label, lk, listener, endpoint) in enumerate(cases):
            hashes = hashes_for(2, f"allow{i}")
            before = lk.hints.stats.rejected.copy()
            fetches = lk._adapter.stats().fetches
            handle = lk.prepare_request(
                ctx(f"allow{i}", fetch_hint(endpoint, hashes)), kv_transfer(hashes)
            )
            sc.check(f"{label}: ready at once", lk.preparation_ready(handle))
            sc.check(
                f"{label}: lookup is a miss",
                lk.lookup(f"allow{i}", kv_transfer(hashes)) == [],
            )
            sc.check(
                f"{label}: no connection within {listen_wait} s",
                _no_connection(listener, listen_wait),
            )
            sc.check(
                f"{label}: no KVCR fetch issued", lk._adapter.stats().fetches == fetches
            )
            counted = {
                r.value: n - before[r]
                for r, n in lk.hints.stats.rejected.items()
                if n - before[r]
            }
            sc.check(
                f"{label}: rejection counted", counted == {"endpoint_not_allowed": 1}
            )
            lk.finish_request(f"allow{i}")
    if positive_control is not None:
        sc.details["positive_control"] = {
            k: positive_control.get(k) for k in ("connected", "endpoint", "connect_s")
        }
        sc.check(
            "positive control: an allowlisted listener does get the connection",
            positive_control.get("connected") is True,
        )
    sc.output_matches_control = True  # nothing admitted; the control is a miss
    sc.outcome = f"{len(cases)} hints outside the allowlist: no connection, counted"
    h.finish()
