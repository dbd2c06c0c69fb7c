"""Peer linkers in spawned child processes, driven over a Pipe.

A child imports kvcr, NIXL and SGLang once, then on request builds a peer linker
that stores page groups (and reports their bytes and its endpoint), runs a child
scenario, closes its linker, or exits. The parent freezes (SIGSTOP), resumes and
kills it. ``_child_unreachable_peer`` runs in a child because it leaves a KVCR
instance deliberately retained (the documented dead-peer case).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from cpu_harness import kvcr_pages
from cpu_harness.kvcr_pages import (
    fetch_hint,
    fill_random,
    hashes_for,
    kv_transfer,
    make_linker,
    wait_until,
)
from kvcr_drivers.faults.common import (
    BASE_CONFIG,
    CHILD_START_S,
    PEER_CONFIG,
    THREAD_SETTLE_S,
    WAIT_S,
    LogCapture,
    Scenario,
    ctx,
    offload_and_commit,
    page_data,
    retained_count,
    settle,
)


def _child_main(conn: Any) -> None:
    """A spawned child: imports once, then builds a peer linker or runs a child
    scenario on request (see ``Child``)."""
    code = 0
    try:
        logging.basicConfig(level=logging.WARNING, format="child %(name)s: %(message)s")
        import kvcr  # noqa: F401
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: F401

        conn.send(("imported", os.getpid()))
        linker = None
        while True:
            if not conn.poll(1.0):
                if os.getppid() == 1:
                    break  # the parent died
                continue
            cmd, arg = conn.recv()
            if cmd == "build":
                pool = kvcr_pages.make_pool()
                linker = make_linker(pool, **{**PEER_CONFIG, **arg["config"]})
                out = {}
                for group, hashes in arg["groups"].items():
                    pages = list(range(1, 1 + len(hashes)))
                    fill_random(pool, pages, seed=arg["seed"] + len(out))
                    ok = offload_and_commit(linker, hashes, pages)
                    out[group] = {
                        "stored": ok,
                        "bytes": [page_data(pool, p) for p in pages],
                    }
                conn.send(("ready", {"endpoint": linker.endpoint, "groups": out}))
            elif cmd == "run":
                conn.send(("result", CHILD_SCENARIOS[arg]()))
            elif cmd == "close":  # close the peer linker, stay available
                if linker is not None:
                    linker.close()
                    linker = None
                conn.send(("closed", retained_count()))
            elif cmd == "stop":
                if linker is not None:
                    linker.close()
                conn.send(("stopped", retained_count()))
                break
    except BaseException:
        code = 1
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip native teardown (torch, UCX), which takes seconds on a busy machine.
        os._exit(code)


class Child:
    """A spawned process driven over a Pipe; every wait is bounded."""

    def __init__(self, name: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_end = context.Pipe()
        self.proc = context.Process(
            target=_child_main, args=(child_end,), name=name, daemon=True
        )
        self.proc.start()
        child_end.close()
        self.name = name
        self._imported = False

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def _recv(self, timeout: float) -> tuple[str, Any]:
        if not self.conn.poll(timeout):
            raise AssertionError(f"{self.name}: no answer within {timeout} s")
        kind, value = self.conn.recv()
        if kind == "error":
            raise AssertionError(f"{self.name} failed:\n{value}")
        return kind, value

    def wait_imported(self, timeout: float = CHILD_START_S) -> None:
        if not self._imported:
            kind, _ = self._recv(timeout)
            assert kind == "imported", kind
            self._imported = True

    def build(
        self, config: dict[str, Any], groups: dict[str, list[str]], seed: int
    ) -> dict[str, Any]:
        self.wait_imported()
        self.conn.send(("build", {"config": config, "groups": groups, "seed": seed}))
        kind, value = self._recv(60.0)
        assert kind == "ready", kind
        return value

    def run(self, scenario: str, timeout: float = 90.0) -> dict[str, Any]:
        self.wait_imported()
        self.conn.send(("run", scenario))
        kind, value = self._recv(timeout)
        assert kind == "result", kind
        return value

    def close_linker(self, timeout: float = 30.0) -> int:
        """Close the child's peer linker (it stays up); returns its retained count."""
        self.conn.send(("close", None))
        kind, retained = self._recv(timeout)
        assert kind == "closed", kind
        return int(retained)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stop(self, timeout: float = 30.0) -> int | None:
        """Ask the child to close its linker and exit; returns its retained count."""
        retained = None
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.conn.send(("stop", None))
                _, retained = self._recv(timeout)
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        return retained

    def kill(self) -> None:
        if self.proc.is_alive():
            self.signal(signal.SIGKILL)
        self.proc.join(10)


def _child_unreachable_peer() -> dict[str, Any]:
    """In a child: B's hint names an allowlisted endpoint where only a raw TCP
    listener answers (a peer that never speaks KVCR). KVCR connects (the allowlist
    positive control), the fetch fails, the request is a miss with no claim, and
    KVCR keeps the quarantined operation: close() cannot be clean, and the adapter
    retains the instance (kvcr 0.1.1 behaviour, reference §4.4)."""
    out: dict[str, Any] = {
        "threads_before": sorted(t.name for t in threading.enumerate())
    }
    baseline = set(threading.enumerate())
    capture = LogCapture()
    with socket.socket() as listener, capture.attached():
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        out["endpoint"] = endpoint
        pool = kvcr_pages.make_pool()
        lk = make_linker(pool, **BASE_CONFIG)
        hashes = hashes_for(2, "unreachable")
        started = time.monotonic()
        handle = lk.prepare_request(
            ctx("u", fetch_hint(endpoint, hashes)), kv_transfer(hashes)
        )
        readable, _, _ = select.select([listener], [], [], 5.0)
        out["connected"] = bool(readable)
        out["connect_s"] = round(time.monotonic() - started, 3)
        held = []
        if readable:
            held.append(listener.accept()[0])  # keep it open and silent
        wait_until(lambda: lk.preparation_ready(handle), WAIT_S, "unreachable prepared")
        out["ready_s"] = round(time.monotonic() - started, 3)
        out["lookup"] = lk.lookup("u", kv_transfer(hashes))
        lk.finish_request("u")
        out["claims"] = list(settle(lk))
        # The quarantine is reported through KVCR's resilience callback.
        with contextlib.suppress(AssertionError):
            wait_until(
                lambda: lk._adapter.stats().resilience_events > 0, 10.0, "resilience"
            )
        out["resilience_events"] = lk._adapter.stats().resilience_events
        started = time.monotonic()
        close_error = ""
        try:
            lk.close()
        except Exception as exc:
            close_error = repr(exc)
        out["close_s"] = round(time.monotonic() - started, 2)
        out["close_error"] = close_error
        out["retained"] = retained_count()
        for conn in held:
            conn.close()
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not (set(threading.enumerate()) - baseline), THREAD_SETTLE_S)
    out["threads_left"] = sorted(
        t.name for t in set(threading.enumerate()) - baseline if t.is_alive()
    )
    out["os_threads"] = len(os.listdir("/proc/self/task"))
    out["log_not_clean"] = capture.count("close was not clean")
    out["log_uncertain"] = capture.count("state=uncertain")
    return out


CHILD_SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "unreachable_peer": _child_unreachable_peer,
}


def scenario_unreachable_peer_close_retained(
    sc: Scenario, result: dict[str, Any]
) -> None:
    """Judge the child's dead-peer run (see ``_child_unreachable_peer``)."""
    sc.details.update(result)
    sc.check("KVCR dialled the allowlisted endpoint", result["connected"])
    sc.check("the request is a miss", result["lookup"] == [])
    sc.check("no claims held", result["claims"] == [0, 0])
    sc.claims_leaked = sum(result["claims"])
    sc.check(
        "the quarantine is reported (resilience event)",
        result["resilience_events"] >= 1,
    )
    sc.check(
        "close() returns; KVCR resources are retained, as documented",
        not result["close_error"] and result["retained"] == 1,
    )
    sc.check(
        "only KVCR's own threads may remain",
        all(name.startswith("kvcr") for name in result["threads_left"]),
    )
    sc.output_matches_control = result["lookup"] == []
    sc.outcome = (
        f"miss after {result['ready_s']} s; close {result['close_s']} s, "
        f"retained={result['retained']}, threads left {result['threads_left']}"
    )


@dataclasses.dataclass
class PeerChildren:
    """The peer processes of the peer scenarios, spawned early so their imports
    overlap with other work. The restarted peer's process, once its linker is
    closed, also hosts the unreachable-peer scenario."""

    first: Child
    restarted: Child

    @classmethod
    def spawn(cls) -> PeerChildren:
        return cls(Child("peer-A"), Child("peer-A-restarted"))

    def close(self) -> None:
        for child in (self.first, self.restarted):
            child.kill()
