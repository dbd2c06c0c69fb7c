"""End-to-end validation of the KVCR direct linker on real SGLang servers (the
checks behind ``kvcr_validate.py``, whose docstring says what each one is).

Every replay is compared with a no-linker control server by greedy output ids and
by served cached tokens (device and external). The linker servers run with
``--enable-metrics``; before they stop, each one's ``sglang:kvcr_`` metrics are
scraped from ``/metrics`` and the report ends with those that moved. On CPU with
the default model, ``mla_round_trip`` and ``swa_round_trip`` also run the local
round trip on a seeded-weight tiny MLA (DeepSeek V2) and FULL+SWA (Beam) model
(``kvcr_servers.family_round_trip``, as ``test_kvcr_family_servers`` does): every
aligned token restored as a prefix hit, output and logprobs equal to a recompute
after ``/flush_cache`` (their control), and restored bytes equal to the restored
pages times the page bytes (SWA: only the window's pages).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cpu_harness import kvcr_servers
from cpu_harness import server as harness
from cpu_harness.kvcr_pages import fetch_hint
from kvcr_drivers.bench.serving import (
    STATS_RE,
    ServingRun,
    base_server_args,
    page_aligned,
    server_env,
)

BASE_CHECKS = (
    "local_round_trip",
    "flush_clears_residency",
    "peer_reuse",
    "no_hint_control",
    "stale_hint_control",
    "dead_peer_control",
)
# check name -> tiny model family (CPU harness models only)
FAMILY_CHECKS = {"mla_round_trip": "mla", "swa_round_trip": "swa"}
CHECKS = BASE_CHECKS + tuple(FAMILY_CHECKS)
PEER_CHECKS = frozenset(BASE_CHECKS[2:])
METRIC_PREFIX = "sglang:kvcr_"


def kvcr_metrics(text: str) -> dict[str, float]:
    """The nonzero ``sglang:kvcr_`` counters, gauges and histogram counts and sums
    of a ``/metrics`` page, by name (and own label); SGLang's labels dropped."""
    from prometheus_client.parser import text_string_to_metric_families

    own = ("cause", "reason", "op")
    moved: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(METRIC_PREFIX) or s.name.endswith(
                ("_bucket", "_created")
            ):
                continue
            label = ",".join(f"{k}={s.labels[k]}" for k in own if k in s.labels)
            name = s.name[len(METRIC_PREFIX) :] + (f"{{{label}}}" if label else "")
            if s.value:
                moved[name] = moved.get(name, 0.0) + s.value
    return moved


def page_hashes(token_ids: list[int], page: int) -> list[int]:
    """The router's unsigned 64-bit hashes of a prompt's full pages."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import page_hash_to_u64

    usable = page_aligned(len(token_ids), page)
    hashes = get_storage_hash_str(RadixKey(token_ids[:usable]), None, page_size=page)
    return [page_hash_to_u64(h) for h in hashes]


def family_fields(
    replay: Any,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A ``kvcr_servers.FamilyReplay`` as ``Driver.record`` takes it: the replay
    and control runs, and the report's extra fields (each criterion included)."""
    result = {
        "output_ids": replay.replay["output_ids"],
        "external_cached_tokens": replay.replay["host"],
        "device_cached_tokens": replay.replay["device"],
        "wall_s": replay.wall_s,
    }
    more = {
        "family": kvcr_servers.FAMILY_NAMES[replay.family],
        "criteria": replay.checks(),
        "restored_bytes": replay.stats().get("restored_bytes"),
        "expected_restored_bytes": replay.expected_restored_bytes(),
        "logprobs": replay.replay["logprobs"],
        "control_logprobs": replay.control["logprobs"],
        "startup_s": replay.startup_s,
    }
    return result, {"output_ids": replay.control["output_ids"]}, more


class Progress:
    """One line as each phase starts and one as it ends, with the seconds since
    the run started (so a watcher sees where the time goes)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.t0 = time.monotonic()

    def line(self, text: str) -> None:
        print(f"[{self.tag} +{time.monotonic() - self.t0:6.1f}s] {text}", flush=True)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        self.line(f"start {name}")
        ok = False
        try:
            yield
            ok = True
        finally:
            took = time.monotonic() - started
            self.line(f"{'done ' if ok else 'FAILED'} {name} ({took:.1f} s)")


class Driver(ServingRun):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args, "validate")
        self.progress = Progress(getattr(args, "progress_tag", "validate"))
        self.checks: list[dict[str, Any]] = []
        self.servers: dict[str, harness.ServerHandle] = {}
        self.metrics: dict[str, dict[str, float]] = {}
        default = (
            CHECKS if args.device == "cpu" and not args.model_path else BASE_CHECKS
        )
        self.selected = set(args.checks.split(",")) if args.checks else set(default)
        self.families: dict[str, harness.ServerHandle] = {}

    def port(self, offset: int) -> int | None:
        return self.args.port_base + offset if self.args.port_base else None

    def control_port(self, offset: int) -> int:
        if self.args.port_base:
            return self.args.port_base + 10 + offset * 8
        return harness.free_port()

    def launch(
        self,
        name: str,
        linker: dict[str, Any] | None,
        offset: int,
        wait: bool = True,
    ) -> harness.ServerHandle:
        extra = base_server_args(self.args, self.max_total)
        env = server_env(self.args.device)
        if linker is not None:
            extra += ["--enable-metrics", *harness.kvcr_linker_args(linker)]
        handle = harness.launch_server(
            extra,
            model_path=self.model,
            port=self.port(offset),
            log_path=self.work / f"{name}.log",
            startup_timeout=self.args.startup_timeout,
            env=env,
            wait=wait,
        )
        self.servers[name] = handle
        return handle

    def linker_config(self, control_port: int) -> dict[str, Any]:
        return {
            "local_dram_bytes_per_worker": self.args.dram_bytes,
            "control_port": control_port,
            # KVCR disables serving peers after a progress stall longer than the
            # operation timeout; CPU prefill on two cores stalls it for seconds.
            "operation_timeout_ms": self.args.operation_timeout_ms,
            "abandon_timeout_ms": 2 * self.args.operation_timeout_ms,
            "preparation_timeout_ms": 5000,
        }

    def run(
        self, server: harness.ServerHandle, ids: list[int], **extra: Any
    ) -> dict[str, Any]:
        started = time.monotonic()
        out = server.generate(
            input_ids=ids, max_new_tokens=self.args.output_len, **extra
        )
        meta = out.get("meta_info", {})
        details = meta.get("cached_tokens_details") or {}
        return {
            "output_ids": list(out.get("output_ids") or []),
            "cached_tokens": int(meta.get("cached_tokens", 0) or 0),
            "device_cached_tokens": int(details.get("device", 0) or 0),
            "external_cached_tokens": int(details.get("host", 0) or 0),
            "wall_s": round(time.monotonic() - started, 4),
        }

    def fill(self, server: harness.ServerHandle) -> None:
        count = (
            self.args.filler_requests
            or (2 * self.max_total) // self.args.prompt_len + 2
        )
        for _ in range(count):
            self.run(server, self.prompt())

    def record(
        self,
        name: str,
        result: dict[str, Any],
        control: dict[str, Any],
        expected: int,
        passed_if: bool,
        **more: Any,
    ) -> None:
        matches = result["output_ids"] == control["output_ids"] and bool(
            control["output_ids"]
        )
        check = {
            "name": name,
            "passed": bool(passed_if and matches),
            "external_cached_tokens": result["external_cached_tokens"],
            "device_cached_tokens": result["device_cached_tokens"],
            "expected_tokens": expected,
            "output_matches_control": matches,
            "output_ids": result["output_ids"],
            "control_output_ids": control["output_ids"],
            "wall_s": result["wall_s"],
            **more,
        }
        self.checks.append(check)
        print(
            f"[validate] {name}: {'PASS' if check['passed'] else 'FAIL'} "
            f"external={check['external_cached_tokens']} device={check['device_cached_tokens']} "
            f"expected={expected} output_matches={matches}",
            flush=True,
        )

    def record_hit(self, name: str, result: dict[str, Any]) -> None:
        """A replay that must be served from KVCR (>= 90 % of its aligned tokens)."""
        passed = result["external_cached_tokens"] >= self.need
        self.record(name, result, self.controls[name], self.aligned, passed)

    def record_miss(self, name: str, result: dict[str, Any]) -> None:
        """A replay that must be a clean miss (nothing served from KVCR)."""
        passed = result["external_cached_tokens"] == 0
        self.record(name, result, self.controls[name], 0, passed)

    def main(self) -> int:
        a = self.args
        self.aligned = page_aligned(a.prompt_len, a.page_size)
        self.need = int(0.9 * self.aligned)
        base = [n for n in BASE_CHECKS if n in self.selected]
        self.prompts = {name: self.prompt() for name in base}
        started = time.monotonic()
        try:
            for name, family in FAMILY_CHECKS.items():  # they boot meanwhile
                if name in self.selected:
                    self.progress.line(f"launch {family} server (boots meanwhile)")
                    handle = kvcr_servers.launch_family(family, self.work)
                    self.families[name] = self.servers[family] = handle
            if base:
                self.run_base_checks(base)
            if self.families:  # both round trips at once
                with self.progress.phase("MLA and FULL+SWA round trips"):
                    found = kvcr_servers.family_round_trips(
                        list(self.families.values())
                    )
                for name, handle in self.families.items():
                    self.check_family(name, found[handle.family])
        finally:
            with self.progress.phase("metrics scrape and shutdown"):
                self.scrape_metrics()
                for handle in self.servers.values():
                    handle.stop()
        return self.report(time.monotonic() - started)

    def run_base_checks(self, names: list[str]) -> None:
        ctl_a, ctl_b = self.control_port(1), self.control_port(2)
        with self.progress.phase("boot servers (control, linker A, linker B)"):
            # All at once: their start-ups overlap instead of adding up.
            control = self.launch("control", None, 0, wait=False)
            self.a = self.launch("linker_a", self.linker_config(ctl_a), 1, wait=False)
            if self.selected & PEER_CHECKS:
                self.b = self.launch(
                    "linker_b", self.linker_config(ctl_b), 2, wait=False
                )
            for name, handle in list(self.servers.items()):
                if name in ("control", "linker_a", "linker_b"):
                    took = handle.wait_ready(self.args.startup_timeout)
                    self.progress.line(f"  {name} ready after {took:.1f} s")
        with self.progress.phase("control outputs (no linker)"):
            self.controls = {
                n: self.run(control, ids) for n, ids in self.prompts.items()
            }
            control.stop()
        self.endpoint_a = f"tcp://127.0.0.1:{ctl_a}"
        for name in names:  # dead_peer_control last: it leaves B quarantined
            with self.progress.phase(name):
                getattr(self, f"check_{name}")(name)

    def scrape_metrics(self) -> None:
        """Each live linker server's moved kvcr metrics (after a publish period)."""
        time.sleep(1.5)  # the linker publishes at most once a second
        for name, handle in self.servers.items():
            if name == "control" or not handle.alive():
                continue
            try:
                resp = handle.get("/metrics", timeout=10.0)
                resp.raise_for_status()
                self.metrics[name] = kvcr_metrics(resp.text)
            except Exception as exc:  # the checks' report must still come out
                print(f"[validate] {name}: /metrics not scraped ({exc})", flush=True)

    def check_local_round_trip(self, name: str) -> None:
        """Compute, evict from the device with filler traffic, replay from KVCR."""
        self.run(self.a, self.prompts[name])
        self.fill(self.a)
        r = self.run(self.a, self.prompts[name])
        self.record_hit(name, r)

    def check_flush_clears_residency(self, name: str) -> None:
        """A flush rebuilds KVCR; the replay is a clean miss."""
        self.run(self.a, self.prompts[name])
        time.sleep(0.5)  # let the write-through offload commit
        flushed = self.a.flush_cache().status_code == 200
        r = self.run(self.a, self.prompts[name])
        ok = (
            flushed
            and r["external_cached_tokens"] == 0
            and r["device_cached_tokens"] == 0
        )
        self.record(name, r, self.controls[name], 0, ok, flush_ok=flushed)

    def check_peer_reuse(self, name: str) -> None:
        """A computes; B is told by a hint that A holds the pages."""
        self.run(self.a, self.prompts[name])
        time.sleep(1.0)  # A's offload to its KVCR DRAM completes asynchronously
        hashes = page_hashes(self.prompts[name], self.args.page_size)
        r = self.run(
            self.b, self.prompts[name], kv_hints=fetch_hint(self.endpoint_a, hashes)
        )
        self.record_hit(name, r)

    def check_no_hint_control(self, name: str) -> None:
        """A holds the pages, B is not told: a clean miss."""
        self.run(self.a, self.prompts[name])
        time.sleep(1.0)
        r = self.run(self.b, self.prompts[name])
        self.record_miss(name, r)

    def check_stale_hint_control(self, name: str) -> None:
        """The hint names pages A never computed."""
        stale = page_hashes(self.prompts[name], self.args.page_size)
        r = self.run(
            self.b, self.prompts[name], kv_hints=fetch_hint(self.endpoint_a, stale)
        )
        self.record_miss(name, r)

    def check_dead_peer_control(self, name: str) -> None:
        """The hint names an endpoint nobody listens on."""
        dead = f"tcp://127.0.0.1:{harness.free_port()}"
        hashes = page_hashes(self.prompts[name], self.args.page_size)
        r = self.run(self.b, self.prompts[name], kv_hints=fetch_hint(dead, hashes))
        self.record_miss(name, r)

    def check_family(self, name: str, replay: Any) -> None:
        """The local round trip on a tiny model of another family (a
        ``FamilyReplay``, or what its round trip raised); its control is the same
        server's recompute after ``/flush_cache``."""
        if isinstance(replay, Exception):  # report() records it as not run
            print(f"[validate] {name}: FAIL ({type(replay).__name__}: {replay})")
            return
        result, control, more = family_fields(replay)
        passed = all(more["criteria"].values())
        self.record(name, result, control, replay.aligned, passed, **more)
        if not passed:
            failed = [k for k, ok in more["criteria"].items() if not ok]
            print(f"[validate] {name}: failed criteria {failed}", flush=True)

    def report(self, wall_s: float) -> int:
        stats = {
            name: STATS_RE.findall(h.log_text())[-3:]
            for name, h in self.servers.items()
        }
        done = {c["name"] for c in self.checks}
        for name in CHECKS:
            if name in self.selected and name not in done:
                self.checks.append(
                    {
                        "name": name,
                        "passed": False,
                        "external_cached_tokens": 0,
                        "expected_tokens": 0,
                        "output_matches_control": False,
                        "error": "not run",
                    }
                )
        path = (
            Path(self.args.report)
            if self.args.report
            else self.work / "kvcr_validate_report.json"
        )
        body = {
            "checks": self.checks,
            "config": dict(vars(self.args)),
            "model_path": self.model,
            "wall_s": round(wall_s, 2),
            "linker_stats": stats,
            "kvcr_metrics": self.metrics,
            "logs": {name: str(h.log_path) for name, h in self.servers.items()},
            "env": {k: os.environ.get(k, "") for k in ("UCX_NET_DEVICES", "UCX_TLS")},
        }
        path.write_text(json.dumps(body, indent=2))
        print()
        print(
            f"{'check':<24} {'result':<6} {'external':>9} {'expected':>9} {'output=control':>15}"
        )
        for c in self.checks:
            print(
                f"{c['name']:<24} {'PASS' if c['passed'] else 'FAIL':<6} "
                f"{c['external_cached_tokens']:>9} {c['expected_tokens']:>9} "
                f"{c['output_matches_control']!s:>15}"
            )
        self.print_metrics()
        ok = all(c["passed"] for c in self.checks)
        print(f"overall: {'PASS' if ok else 'FAIL'} in {wall_s:.1f} s")
        print(f"REPORT {path}")
        return 0 if ok else 1

    def print_metrics(self) -> None:
        """What moved, per server, from its /metrics (bytes moved, not only hits)."""
        if not self.metrics:
            return
        print()
        print(f"kvcr metrics moved ({METRIC_PREFIX}*, scraped from /metrics)")
        print(f"{'server':<10} {'metric':<52} {'value':>16}")
        for server, moved in self.metrics.items():
            for name, number in sorted(moved.items()):
                shown = f"{number:,.0f}" if number == int(number) else f"{number:.4f}"
                print(f"{server:<10} {name:<52} {shown:>16}")
