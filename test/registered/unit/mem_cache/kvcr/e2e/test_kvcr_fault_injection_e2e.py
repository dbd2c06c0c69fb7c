"""End to end on a CPU server: KVCR and side-thread faults never take serving down
(issue 24, findings 1 and 2).

One KVCR-linker server (``--enable-metrics``) runs with the test-only
``kvcr_fault_hook`` (``test/cpu_harness/pythonpath``, switched on by
``KVCR_TEST_FAULTS_DIR``); the tests, in file order, inject into it: an exception
on the adapter's owner thread (a KVCR deposit raises), the death of kvcr's progress
thread (kvcr's own ``_RemoteAgentCleanupError``, which it re-raises there from its
peer-message handlers), a failed restore copy (on CPU the copy runs inline on the
scheduler thread), a KVCR close stuck past ``owner_wait_timeout_s`` during
``/flush_cache``, and last the restore loader thread dying as it binds to its
device (restores off for good). Before any fault a bank of prompts is computed
once with nothing cached: those outputs are the recompute references, and every
later request of a bank prompt must return exactly them (greedy). Cycled through a
device pool that holds fewer of them, bank prompts come back from KVCR while it is
up (``host`` cached tokens). A KVCR fault takes the linker DOWN and a restart
brings it back (logged; ``kvcr_failures_total`` and ``kvcr_restarts_total``), after
which prompts restore again. Every request and the flush have a deadline.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cpu_harness import tiny_model
from cpu_harness.kvcr_servers import OUTPUT_LEN, launch_linker

# About 70 s of one server: in ``make faults`` (part ``injection``), not ``make test``.
pytestmark = [pytest.mark.server, pytest.mark.kvcr, pytest.mark.server_faults]

PROMPT_LEN = 128  # launch_linker's device pool: 4 prompts
BANK = 6  # cycled: each is evicted from the device before it comes back
VOCAB = 300
OWNER_WAIT_S = 4.0  # owner_wait_timeout_s: the flush's bound on a stuck close
HANG_S = OWNER_WAIT_S + 3.0  # how long the stuck close hangs
REQUEST_TIMEOUT_S = 60.0
FIRE_TIMEOUT_S = 10.0
PUBLISH_S = 1.1  # past linker_metrics.PUBLISH_PERIOD_S
MAX_REQUESTS = 4 * BANK  # requests within which a restore must come back
PHASE_TIMEOUT_S = 60.0  # a phase's bound on serving until it is done
CONFIG = {
    "owner_wait_timeout_s": OWNER_WAIT_S,
    "local_dram_bytes_per_worker": 16 << 20,
    # Unclean closes below each quarantine a share: keep restoring after them.
    "max_quarantined_cores": 4,
}
DOWN = "KVCR is down ("
RESTARTED = "KVCR restarted after"


class Rig:
    """The server, its bank of prompts with their references, and the fault files."""

    def __init__(self, server: Any, faults: Path) -> None:
        self.server = server
        self.faults = faults
        rng = random.Random(24)
        self.bank = [
            [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)] for _ in range(BANK)
        ]
        self.refs: list[list[int]] = []
        self.turn = 0
        self.fresh_seed = 1000

    # ---- requests ------------------------------------------------------------

    def post(self, ids: list[int]) -> tuple[int, dict[str, Any]]:
        payload = {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": OUTPUT_LEN,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        }
        resp = self.server.post("/generate", payload, timeout=REQUEST_TIMEOUT_S)
        return resp.status_code, resp.json()

    def compute_references(self) -> None:
        for ids in self.bank:
            status, out = self.post(ids)
            assert status == 200, out
            assert int(out["meta_info"].get("cached_tokens", 0) or 0) == 0
            self.refs.append(list(out["output_ids"]))

    def serve(self, n: int = 1) -> list[int]:
        """The next ``n`` bank prompts, each checked against its reference; the
        tokens each restored from KVCR."""
        restored = []
        for _ in range(n):
            i, self.turn = self.turn % BANK, self.turn + 1
            status, out = self.post(self.bank[i])
            assert status == 200, (i, out, self.server.log_tail())
            assert list(out["output_ids"]) == self.refs[i], (i, self.server.log_tail())
            details = out["meta_info"].get("cached_tokens_details") or {}
            restored.append(int(details.get("host", 0) or 0))
        return restored

    def fresh(self) -> list[int]:
        """A prompt this server has not seen (its compute offloads new pages)."""
        self.fresh_seed += 1
        rng = random.Random(self.fresh_seed)
        return [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]

    def serve_until(self, done: Callable[[], bool], what: str) -> int:
        """Serve bank prompts until ``done``; how many it took (bounded)."""
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        n = 0
        while not done():
            assert time.monotonic() < deadline, f"{what}: not in {PHASE_TIMEOUT_S} s"
            self.serve()
            n += 1
        return n

    def restores_again(self) -> int:
        """Serve until a bank prompt is restored from KVCR; requests it took."""
        for n in range(1, MAX_REQUESTS + 1):
            if self.serve()[0] > 0:
                return n
        raise AssertionError(f"no restore within {MAX_REQUESTS} requests")

    # ---- faults ----------------------------------------------------------------

    def arm(self, fault: str, arg: str = "") -> None:
        (self.faults / f"{fault}.arm").write_text(arg)

    def fired(self, fault: str) -> dict[str, Any] | None:
        path = self.faults / f"{fault}.fired"
        return json.loads(path.read_text()) if path.exists() else None

    def wait_fired(self, fault: str) -> dict[str, Any]:
        deadline = time.monotonic() + FIRE_TIMEOUT_S
        while (record := self.fired(fault)) is None:
            assert time.monotonic() < deadline, f"{fault} never fired"
            time.sleep(0.05)
        return record

    # ---- what the server says --------------------------------------------------

    def log_mark(self) -> int:
        return len(self.server.log_text())

    def log_since(self, mark: int) -> str:
        return self.server.log_text()[mark:]

    def scrape(self) -> dict[str, float]:
        """``sglang:kvcr_`` series as last published, summed by name (and by
        ``cause`` for misses)."""
        resp = self.server.get("/metrics")
        assert resp.status_code == 200
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(resp.text):
            for s in family.samples:
                if s.name.startswith("sglang:kvcr_"):
                    cause = s.labels.get("cause")
                    name = f"{s.name}:{cause}" if cause else s.name
                    out[name] = out.get(name, 0.0) + s.value
        return out

    def counters(self) -> dict[str, float]:
        """``scrape`` once the linker published what it counted so far: a
        publish period later, a request pumps it."""
        time.sleep(PUBLISH_S)
        self.serve()
        return self.scrape()

    def check_counts(self) -> dict[str, float]:
        """The metrics agree with the log: one failure per DOWN line, one
        restart per restart line, and UP now."""
        text = self.server.log_text()
        m = self.counters()
        assert m["sglang:kvcr_failures_total"] == text.count(DOWN), m
        assert m["sglang:kvcr_restarts_total"] == text.count(RESTARTED), m
        assert m["sglang:kvcr_down"] == 0, m
        return m


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    work = tmp_path_factory.mktemp("kvcr-fault-injection")
    faults = work / "faults"
    faults.mkdir()
    started = time.monotonic()
    with pytest.MonkeyPatch.context() as env:  # this server's processes only
        env.setenv("KVCR_TEST_FAULTS_DIR", str(faults))
        server = launch_linker(
            "faults",
            tiny_model.ensure_tiny_model(),
            work,
            ["--enable-metrics"],
            prompt_len=PROMPT_LEN,
            config=CONFIG,
        )
    try:
        server.wait_ready(420)
        rig = Rig(server, faults)
        rig.compute_references()
        print(f"server up and references in {time.monotonic() - started:.1f} s")
        yield rig
    finally:
        print(f"server stopped in {server.stop():.1f} s")


def down_and_back(rig: Rig, mark: int, fault: str) -> str:
    """After ``fault`` fired: serve until the linker restarted and a prompt is
    restored again; the log since ``mark``."""
    rig.serve_until(lambda: RESTARTED in rig.log_since(mark), f"{fault}: restart")
    rig.restores_again()
    log = rig.log_since(mark)
    assert log.count(DOWN) == 1 and log.count(RESTARTED) == 1, log[-3000:]
    return log


def test_an_exception_on_the_owner_thread_takes_the_linker_down_and_back(rig):
    started, mark = time.monotonic(), rig.log_mark()
    rig.restores_again()  # up, restoring, before the fault
    rig.arm("owner_deposit")
    fresh = rig.fresh()
    status, first = rig.post(fresh)  # its pages' deposit raises on the owner thread
    assert status == 200, first
    rig.serve_until(lambda: rig.fired("owner_deposit") is not None, "deposit")
    record = rig.wait_fired("owner_deposit")
    assert record["thread"].startswith("kvcr-owner-"), record
    log = down_and_back(rig, mark, "owner_deposit")
    assert f"{DOWN}owner thread failed: InjectedFault(" in log, log[-3000:]
    status, again = rig.post(fresh)  # recomputed or restored: the same output
    assert status == 200 and again["output_ids"] == first["output_ids"]
    m = rig.check_counts()
    assert m["sglang:kvcr_failures_total"] >= 1
    print(f"owner-thread fault: down and back in {time.monotonic() - started:.1f} s")


def test_the_death_of_kvcrs_progress_thread_takes_the_linker_down_and_back(rig):
    started, mark = time.monotonic(), rig.log_mark()
    failures = rig.server.log_text().count(DOWN)
    rig.arm("progress")
    record = rig.wait_fired("progress")  # the loop iterates on its own
    assert record["thread"] == "kvcr-progress", record
    log = down_and_back(rig, mark, "progress")
    assert "_RemoteAgentCleanupError" in log, log[-3000:]
    m = rig.check_counts()
    assert m["sglang:kvcr_failures_total"] == failures + 1
    print(f"progress-thread death: down and back in {time.monotonic() - started:.1f} s")


def test_a_failed_restore_copy_fails_its_request_at_once_and_nothing_else(rig):
    started, mark = time.monotonic(), rig.log_mark()
    rig.restores_again()
    rig.arm("restore_copy")
    failed = None
    for _ in range(MAX_REQUESTS):  # the next restore's copy raises
        i, rig.turn = rig.turn % BANK, rig.turn + 1
        t0 = time.monotonic()
        status, out = rig.post(rig.bank[i])
        if rig.fired("restore_copy") is not None:
            failed = (i, status, out, time.monotonic() - t0)
            break
        assert status == 200 and out["output_ids"] == rig.refs[i], out
    assert failed is not None, "no restore ran"
    i, status, out, took = failed
    # SGLang aborts the requests of a batch whose load failed (any page may be
    # partial): answered at once, not left waiting on the layer counter.
    assert status == 503, out
    assert "External KV cache load failed" in json.dumps(out), out
    assert took < REQUEST_TIMEOUT_S / 2
    status, again = rig.post(rig.bank[i])  # the retry recomputes
    assert status == 200 and again["output_ids"] == rig.refs[i], again
    assert rig.serve(2) == [0, 0]  # restores paused: recomputed
    log = rig.log_since(mark)
    assert "KVCR restore copy failed; its requests are aborted" in log
    assert DOWN not in log
    m = rig.check_counts()
    assert m["sglang:kvcr_restore_copy_failures_total"] >= 1
    assert m["sglang:kvcr_misses_total:restore_disabled"] >= 1
    print(f"restore copy fault: handled in {time.monotonic() - started:.1f} s")


def test_a_close_stuck_during_a_flush_is_abandoned_at_the_deadline(rig):
    """The flush answers at ``owner_wait_timeout_s``, not when the close ends.
    The stuck KVCR still holds the worker's control port until its close
    finishes, so the next one may not bind it yet: the linker is then DOWN
    (recompute) and a restart brings it back once the old one let go."""
    started, mark = time.monotonic(), rig.log_mark()
    rig.arm("close_hang", str(HANG_S))
    t0 = time.monotonic()
    resp = rig.server.flush_cache(timeout=HANG_S + 30)
    flush_s = time.monotonic() - t0
    assert resp.status_code == 200, resp.text
    record = rig.wait_fired("close_hang")
    assert record["thread"].startswith("kvcr-owner-"), record
    assert OWNER_WAIT_S <= flush_s < HANG_S, flush_s  # bounded by the owner wait
    rig.serve_until(
        lambda: rig.log_since(mark).count(DOWN) == rig.log_since(mark).count(RESTARTED),
        "UP again after the flush",
    )
    rig.restores_again()  # a new KVCR, on a fresh DRAM share
    log = rig.log_since(mark)
    assert "KVCR close was not clean (KVCR owner thread still alive" in log, log
    assert "old core not quiescent" in log, log[-3000:]
    rig.check_counts()
    downs = [ln for ln in log.splitlines() if DOWN in ln]
    print(
        f"stuck close: flush answered in {flush_s:.1f} s, restoring again "
        f"{time.monotonic() - started:.1f} s after the fault; down {len(downs)}x "
        f"{downs[:1]}"
    )


def test_a_loader_thread_that_dies_turns_restores_off_and_serving_goes_on(rig):
    """Last: restores stay off for good (the loader never copies again)."""
    started, mark = time.monotonic(), rig.log_mark()
    rig.restores_again()
    rig.arm("loader")
    record = rig.wait_fired("loader")
    assert record["thread"].startswith("kvcr-loader-"), record
    deadline = time.monotonic() + FIRE_TIMEOUT_S
    while "restores are off" not in rig.log_since(mark):
        assert time.monotonic() < deadline, rig.log_since(mark)[-3000:]
        time.sleep(0.05)
    before = rig.scrape()["sglang:kvcr_misses_total:restore_disabled"]  # or less
    assert rig.serve(BANK) == [0] * BANK  # recomputed, equal outputs
    m = rig.check_counts()
    assert m["sglang:kvcr_misses_total:restore_disabled"] >= before + BANK
    assert DOWN not in rig.log_since(mark)
    print(f"loader death: restores off, served in {time.monotonic() - started:.1f} s")
