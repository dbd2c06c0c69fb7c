"""NVIDIA Dynamo 1.6.1's selection service picks the peer and writes the hint.

Two CPU linker workers (A, B) publish their KV events over ZMQ in Dynamo's
format; Dynamo's selection service (``dynamo_selector``, run by the interop
venv's Python) is subscribed to both, each registered with its page size as
``block_size`` and its control endpoint for DP rank 0. Then:

- ``pinned_booking_restores_from_peer``: A computes a prompt; a booking pinned
  to B (``allowed_worker_ids``) returns Dynamo's ``kv_hint``; that envelope,
  unchanged, is B's ``kv_hints``: B restores >= 90 % of the aligned prompt from A
  and its output equals A's (a recompute: nothing was cached on A before);
- ``free_booking_picks_holder``: a free booking of the same prompt picks A and
  carries no hint;
- ``salted_prompt``: the same with ``cache_salt`` on both sides; a booking of
  that prompt without the salt matches nothing on A;
- ``flush_drops_index``: after A's ``/flush_cache``, how Dynamo's index sees A
  (overlap scores polled until A's drop to zero) and a booking pinned to B
  carries no hint.

``run`` returns the report (every Dynamo answer as written, the checks);
``INTEROP_PYTHON`` is where ``make interop`` builds the venv.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from cpu_harness import kvcr_servers as kvs
from cpu_harness import server as harness
from cpu_harness import tiny_model

REPO = harness.REPO
INTEROP_PYTHON = Path(
    os.environ.get("SGLANG_KVCR_INTEROP_PYTHON", REPO / ".venv-interop/bin/python")
)
SELECTOR = Path(__file__).with_name("dynamo_selector.py")
PROMPT_LEN = 256
ALIGNED = (PROMPT_LEN - 1) // kvs.PAGE * kvs.PAGE
WORKER_A, WORKER_B = 1, 2
SALT = "tenant-a"


class SelectorError(RuntimeError):
    pass


class Selector:
    """The selection service in its own process; ``call`` is one command."""

    def __init__(self, log_path: Path, python: Path = INTEROP_PYTHON) -> None:
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed by close()
        self.proc = subprocess.Popen(
            [str(python), str(SELECTOR)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, "PYTHONPATH": "", "NO_COLOR": "1"},
        )
        self.log_path = log_path

    def call(self, op: str, timeout: float = 60.0, **args: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
        self.proc.stdin.flush()
        timer = threading.Timer(timeout, self.proc.kill)  # a hung call ends the run
        timer.start()
        try:
            line = self.proc.stdout.readline()
        finally:
            timer.cancel()
        if not line:
            raise SelectorError(f"selector exited during {op}: see {self.log_path}")
        reply = json.loads(line)
        if "error" in reply:
            raise SelectorError(f"{op}: {reply['error']}")
        return reply["ok"]

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("quit", timeout=10.0)
                self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait(timeout=10)
        finally:
            self._log.close()


def registration(
    worker_id: int, handle: Any, events_port: int, max_total: int
) -> dict[str, Any]:
    """What Dynamo needs to know about a linker worker. ``block_size`` must be
    the worker's ``--page-size``; DP rank d's control endpoint is the linker's
    ``control_port + d * attn_tp_size`` (one replica here: rank 0 only)."""
    return {
        "worker_id": worker_id,
        "endpoint": handle.base_url,
        "block_size": kvs.PAGE,
        "kv_events_endpoint": f"tcp://127.0.0.1:{events_port}",
        "max_num_batched_tokens": max_total,
        "total_kv_blocks": max_total // kvs.PAGE,
        "router_hint_worker_type": "aggregated",
        "router_hint_source_control_endpoints": {"0": handle.endpoint},
    }


def overlap_of(scores: Any, worker_id: int, tier: str = "device_blocks") -> int:
    """Matched blocks Dynamo's ``overlap_scores`` gives ``worker_id`` on ``tier``
    (``device_blocks``, ``host_pinned_blocks``, ``disk_blocks``), any DP rank."""
    return max(
        (
            int(w.get(tier) or 0)
            for w in scores.get("workers") or []
            if w.get("worker_id") == worker_id
        ),
        default=0,
    )


def wait_overlap(
    sel: Selector, body: dict[str, Any], worker_id: int, want, timeout: float = 15.0
) -> tuple[int, float, Any]:
    """Poll ``overlap_scores`` until ``want(blocks)``; (blocks, seconds, answer)."""
    started = time.monotonic()
    while True:
        answer = sel.call("overlap_scores", **body)
        blocks = overlap_of(answer, worker_id)
        took = time.monotonic() - started
        if want(blocks) or took > timeout:
            return blocks, took, answer
        time.sleep(0.2)


def hint_of(booking: dict[str, Any]) -> Any:
    return booking.get("kv_hint")


def run(work: Path, seed: int = 7) -> dict[str, Any]:
    """The whole scenario on CPU; the report (``checks``: name -> bool)."""
    rng = random.Random(seed)

    def prompt() -> list[int]:
        return [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]

    work.mkdir(parents=True, exist_ok=True)
    model = tiny_model.ensure_tiny_model()
    ports = {WORKER_A: harness.free_port(), WORKER_B: harness.free_port()}
    report: dict[str, Any] = {"checks": {}, "dynamo": {}}
    checks, seen = report["checks"], report["dynamo"]
    servers: dict[int, Any] = {}
    sel: Selector | None = None
    events: Any = None
    try:
        for wid, name in ((WORKER_A, "a"), (WORKER_B, "b")):
            servers[wid] = kvs.launch_linker(
                name,
                model,
                work,
                kvs.kv_events_args(ports[wid], dynamo=True),
                prompt_len=PROMPT_LEN,
            )
        for handle in servers.values():
            handle.wait_ready(420)
        a, b = servers[WORKER_A], servers[WORKER_B]
        sel = Selector(work / "dynamo_selector.log")
        max_total = 4 * PROMPT_LEN  # launch_linker's --max-total-tokens
        seen["registered"] = [
            sel.call("upsert_worker", **registration(wid, h, ports[wid], max_total))
            for wid, h in servers.items()
        ]
        time.sleep(1.0)  # the SUB sockets join before anything is published
        events = kvs.EventSubscriber(
            ports[WORKER_A]
        )  # what A publishes, for the report

        # Pinned booking: Dynamo writes the hint, B restores from A.
        ids = prompt()
        control = kvs.computed_on(a, ids)
        blocks, took, _ = wait_overlap(
            sel, {"token_ids": ids}, WORKER_A, lambda n: n >= ALIGNED // kvs.PAGE
        )
        seen["indexed_blocks_on_a"], seen["indexed_after_s"] = blocks, round(took, 2)
        free = sel.call("select_and_reserve", token_ids=ids)
        sel.call("free_reservation", selection_id=free["selection_id"])
        seen["free_booking"] = free
        checks["free_booking_picks_holder"] = (
            free["worker_id"] == WORKER_A and hint_of(free) is None
        )
        pinned = sel.call(
            "select_and_reserve", token_ids=ids, allowed_worker_ids=[WORKER_B]
        )
        sel.call("free_reservation", selection_id=pinned["selection_id"])
        seen["pinned_booking"] = pinned
        hint = hint_of(pinned)
        seen["hint_as_written"] = hint
        output, external = kvs.run(b, ids, kv_hints=hint)
        seen["restored_tokens"], seen["aligned_tokens"] = external, ALIGNED
        seen["restored_fraction"] = round(external / ALIGNED, 4)
        checks["pinned_booking_restores_from_peer"] = (
            pinned["worker_id"] == WORKER_B
            and hint is not None
            and external >= 0.9 * ALIGNED
            and output == control
        )
        published = events.wait_chain(ids, ALIGNED // kvs.PAGE)
        seen["hint_envelope"] = _envelope_facts(hint, a.endpoint, published)
        checks["hint_carries_a_published_hashes"] = bool(
            seen["hint_envelope"].get("prefix_is_a_published_chain")
        )

        # A cache-salted prompt: the salt reaches Dynamo's hashes and SGLang's.
        salted = prompt()
        control = kvs.computed_on(a, salted, cache_salt=SALT)
        body = {"token_ids": salted, "cache_salt": SALT}
        blocks, _, _ = wait_overlap(
            sel, body, WORKER_A, lambda n: n >= ALIGNED // kvs.PAGE
        )
        unsalted, _, _ = wait_overlap(
            sel, {"token_ids": salted}, WORKER_A, lambda n: False, timeout=0
        )
        pinned = sel.call("select_and_reserve", **body, allowed_worker_ids=[WORKER_B])
        sel.call("free_reservation", selection_id=pinned["selection_id"])
        seen["salted_pinned_booking"] = pinned
        output, external = kvs.run(b, salted, kv_hints=hint_of(pinned), cache_salt=SALT)
        seen["salted_indexed_blocks"], seen["salted_unsalted_blocks"] = (
            blocks,
            unsalted,
        )
        seen["salted_restored_tokens"] = external
        checks["salted_prompt"] = (
            hint_of(pinned) is not None
            and unsalted == 0
            and external >= 0.9 * ALIGNED
            and output == control
        )

        # Device eviction on A (its KVCR DRAM keeps the pages): what Dynamo sees.
        evicted = prompt()
        kvs.computed_on(a, evicted)
        wait_overlap(sel, {"token_ids": evicted}, WORKER_A, lambda n: n > 0)
        mark = len(events.snapshot())
        for _ in range(kvs.FILLERS):
            kvs.run(a, prompt())
        time.sleep(1.0)
        _, _, answer = wait_overlap(
            sel, {"token_ids": evicted}, WORKER_A, lambda n: False, timeout=0
        )
        pinned = sel.call(
            "select_and_reserve", token_ids=evicted, allowed_worker_ids=[WORKER_B]
        )
        sel.call("free_reservation", selection_id=pinned["selection_id"])
        output, external = kvs.run(b, evicted, kv_hints=hint_of(pinned))
        seen["device_eviction"] = {
            "a_events": _event_counts(events.snapshot()[mark:]),
            "a_overlap": {
                t: overlap_of(answer, WORKER_A, t)
                for t in ("device_blocks", "host_pinned_blocks", "disk_blocks")
            },
            "pinned_booking_hint": hint_of(pinned) is not None,
            "b_restored_tokens": external,
        }

        # A flush: what Dynamo's index does with A's pages. A prompt only A
        # computed, so B's own copy cannot hide the hint.
        only_a = prompt()
        kvs.computed_on(a, only_a)
        before, _, _ = wait_overlap(
            sel, {"token_ids": only_a}, WORKER_A, lambda n: n > 0
        )
        hinted = sel.call(
            "select_and_reserve", token_ids=only_a, allowed_worker_ids=[WORKER_B]
        )
        sel.call("free_reservation", selection_id=hinted["selection_id"])
        mark = len(events.snapshot())
        flushed = a.flush_cache().status_code == 200
        after, took, _ = wait_overlap(
            sel, {"token_ids": only_a}, WORKER_A, lambda n: n == 0
        )
        pinned = sel.call(
            "select_and_reserve", token_ids=only_a, allowed_worker_ids=[WORKER_B]
        )
        sel.call("free_reservation", selection_id=pinned["selection_id"])
        time.sleep(0.5)
        seen["flush"] = {
            "flush_ok": flushed,
            "a_events": _event_counts(events.snapshot()[mark:]),
            "a_blocks_before": before,
            "hint_before": hint_of(hinted) is not None,
            "a_blocks_after": after,
            "dropped_within_s": round(took, 2),
            "hint_after": hint_of(pinned) is not None,
        }
        checks["flush_drops_index"] = (
            flushed
            and before > 0
            and hint_of(hinted) is not None
            and after == 0
            and hint_of(pinned) is None
        )
    finally:
        if events is not None:
            events.close()
        if sel is not None:
            sel.close()
        for handle in servers.values():
            handle.stop()
    report["passed"] = bool(checks) and all(checks.values())
    return report


def _event_counts(events: list[Any]) -> dict[str, int]:
    """Published events by type and medium, e.g. ``BlockRemoved/GPU``."""
    counts: dict[str, int] = {}
    for e in events:
        key = f"{type(e).__name__}/{getattr(e, 'medium', None) or '-'}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def _envelope_facts(hint: Any, endpoint_a: str, published: list[int]) -> dict[str, Any]:
    """What the hint Dynamo wrote says, next to the EXTERNAL chain A published
    for the prompt's aligned pages (signed 64-bit in SGLang's events)."""
    if not isinstance(hint, dict):
        return {"present": False}
    actions = hint.get("actions") or []
    payload = actions[0].get("payload", {}) if actions else {}
    hashes = payload.get("block_hashes") or []
    return {
        "present": True,
        "protocol_version": hint.get("protocol_version"),
        "action": [(x.get("action_type"), x.get("action_version")) for x in actions],
        "source_control_endpoint": payload.get("source_control_endpoint"),
        "names_a": payload.get("source_control_endpoint") == endpoint_a,
        "block_hashes": len(hashes),
        "unsigned_64": all(0 <= h < 1 << 64 for h in hashes),
        "prompt_pages": ALIGNED // kvs.PAGE,
        "prefix_is_a_published_chain": hashes[: len(published)]
        == [h & ((1 << 64) - 1) for h in published],
    }
