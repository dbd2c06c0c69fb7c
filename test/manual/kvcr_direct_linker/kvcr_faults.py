"""Fault injection, soak, hostile-input fuzzing and TP=2 for the KVCR direct linker.

``make faults`` runs this command line over ``test/kvcr_drivers/faults`` (the
package docstrings say what each part does). Everything runs on the real kvcr
0.1.1 + NIXL over CPU tensors on loopback; nothing is mocked except one injected
device-copy fault.

1. Scenarios (``suite.run_fast_scenarios``; all of them also run in ``make test``
   through ``test/registered/unit/mem_cache/kvcr/owner/test_kvcr_faults.py``):
   in-process linkers over real CPU pools, and peer linkers in spawned child
   processes (frozen, killed, restarted, never answering). Each checks that no wrong KV was admitted, that claims were
   released (in the linker and in KVCR), that no thread outlived ``close()``,
   and that RSS stayed bounded.
2. Soak: two CPU SGLang servers with the KVCR linker, ``--soak-requests``
   requests over mixed shared prefixes, some hinted at the other server.
3. Fuzz: ``test/registered/unit/mem_cache/kvcr/fuzz/test_kvcr_fuzz.py`` under pytest
   with ``--fuzz-examples`` examples.
4. TP=2: one CPU server with ``--tp 2``; replays restored from KVCR on both ranks
   (tiny Llama), then the tiny DeepSeek-V2 (MLA): only the owner rank stores
   each page, the follower receives the restored rows.
5. Interop: NVIDIA Dynamo 1.6.1's selection service in front of two linker
   workers, its hint restoring from the peer (``kvcr_drivers.interop``; needs
   ``.venv-interop``, which ``make faults`` builds through ``make interop-venv``).
6. Multi-host: linker servers in Linux network namespaces joined by a bridge
   (``test_kvcr_multihost.py``, ``-m netns``; needs root, fails without
   namespaces): peer reuse across hosts with the allowlist and with CURVE, a host
   off the allowlist refused pages and NIXL metadata on every port, a peer killed
   mid-transfer (``kvcr_drivers.faults.pytest_parts``).
7. Injection: ``e2e/test_kvcr_fault_injection_e2e.py`` (``-m server_faults``): one
   CPU linker server with faults injected into KVCR and the linker's side threads
   (an owner-thread exception, kvcr's progress thread dying, a failed restore
   copy, a close stuck during ``/flush_cache``, the loader dying); each answer
   equals the recompute and the linker comes back (``pytest_parts``).
8. Validate: ``e2e/test_kvcr_e2e.py`` (``-m scenario``): the validation driver's
   local round trip, hinted peer reuse and no-hint control against a no-linker
   server, in one run (make test covers most of it in smaller server tests,
   without the no-linker comparison; this scenario takes two minutes on 2 cores).
9. Digest: ``e2e/test_kvcr_digest_e2e.py`` (``-m scenario``): three linker
   servers; a hinted fetch restores only between workers whose KV bytes agree,
   through a weight update and back (two minutes on 2 cores; make test covers the
   digest in ``layout/test_kvcr_digest.py`` and hinted restores in smaller server
   tests).

Writes a JSON report (top-level ``scenarios``, ``soak``, ``fuzz``, ``injection``,
``multihost``, ``validate``, ``digest``);
the last line printed is ``REPORT <path>``. Exits non-zero when anything failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _paths  # noqa: F401  (the repository's test/ on sys.path)

from kvcr_drivers import cli
from kvcr_drivers.faults.common import Scenario
from kvcr_drivers.faults.fuzz import run_fuzz
from kvcr_drivers.faults.pytest_parts import run_part
from kvcr_drivers.faults.soak import run_soak
from kvcr_drivers.faults.suite import run_fast_scenarios
from kvcr_drivers.faults.tp2 import run_tp2, run_tp2_mla
from kvcr_drivers.interop import dynamo_interop

PARTS = (
    "scenarios",
    "soak",
    "fuzz",
    "tp2",
    "injection",
    "interop",
    "multihost",
    "validate",
    "digest",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_run_options(p)
    p.add_argument("--soak-requests", type=int, default=2000)
    p.add_argument("--soak-warmup", type=int, default=120)
    p.add_argument("--soak-concurrency", type=int, default=4)
    p.add_argument("--fuzz-examples", type=int, default=10_000)
    p.add_argument(
        "--skip",
        default="",
        help=f"comma-separated parts to skip: {','.join(PARTS)}",
    )
    args = p.parse_args(argv)
    cli.comma_list(p, "--skip", args.skip, PARTS)
    if args.soak_requests < 1 or args.fuzz_examples < 1:
        p.error("--soak-requests and --fuzz-examples must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s"
    )
    work = cli.work_dir(args, "faults")
    skip = set(filter(None, args.skip.split(",")))
    timings: dict[str, float] = {}
    started = time.monotonic()
    scenarios: list[Scenario] = []
    soak: dict[str, Any] = {"requests": 0, "passed": False, "skipped": "soak" in skip}
    fuzz: list[dict[str, Any]] = []
    fuzz_meta: dict[str, Any] = {}

    def phase(name: str, fn: Callable[[], Any]) -> Any:
        t = time.monotonic()
        print(f"[faults] {name} ...", flush=True)
        try:
            return fn()
        finally:
            timings[name] = round(time.monotonic() - t, 1)
            print(f"[faults] {name} done in {timings[name]} s", flush=True)

    if "scenarios" not in skip:
        scenarios = phase("scenarios", run_fast_scenarios)
        for sc in scenarios:
            print(f"[faults]   {sc.summary()}", flush=True)
    if "fuzz" not in skip:
        fuzz, fuzz_meta = phase("fuzz", lambda: run_fuzz(args.fuzz_examples, work))
        for row in fuzz:
            print(f"[faults]   fuzz {row}", flush=True)
    if "tp2" not in skip:
        for tp2 in phase("tp2", lambda: [run_tp2(args, work), run_tp2_mla(args, work)]):
            print(f"[faults]   {tp2.summary()}", flush=True)
            scenarios.append(tp2)
    if "soak" not in skip:
        soak = phase("soak", lambda: run_soak(args, work))
        print(
            f"[faults]   soak: {'PASS' if soak['passed'] else 'FAIL'} "
            + json.dumps(
                {
                    k: soak.get(k)
                    for k in (
                        "requests",
                        "rss_start_mb",
                        "rss_end_mb",
                        "claims_held_end",
                        "quarantined_bytes_end",
                        "external_hits",
                        "peer_hits",
                        "mismatches",
                        "errors",
                    )
                }
            ),
            flush=True,
        )

    def pytest_part(name: str) -> dict[str, Any]:
        if name in skip:
            return {"skipped": True}
        out = phase(name, lambda: run_part(name, work / name))
        print(f"[faults]   {name} tests: {json.dumps(out['tests'])}", flush=True)
        return out

    injection = pytest_part("injection")
    interop: dict[str, Any] = {"skipped": "interop" in skip}
    if "interop" not in skip:
        interop = phase("interop", lambda: dynamo_interop.run(work / "interop"))
        print(f"[faults]   interop checks: {json.dumps(interop['checks'])}", flush=True)
    multihost = pytest_part("multihost")
    validate = pytest_part("validate")
    digest = pytest_part("digest")
    wall = time.monotonic() - started
    fuzz_ok = "fuzz" in skip or (
        bool(fuzz)
        and fuzz_meta.get("pytest_rc") == 0
        and all(
            r["failures"] == 0 and r["examples"] >= args.fuzz_examples for r in fuzz
        )
    )
    ok = (
        all(sc.passed for sc in scenarios)
        and ("soak" in skip or soak["passed"])
        and fuzz_ok
        and ("injection" in skip or injection["passed"])
        and ("interop" in skip or interop["passed"])
        and ("multihost" in skip or multihost["passed"])
        and ("validate" in skip or validate["passed"])
        and ("digest" in skip or digest["passed"])
    )
    body = {
        "passed": ok,
        "scenarios": [sc.as_dict() for sc in scenarios],
        "soak": soak,
        "fuzz": fuzz,
        "fuzz_run": fuzz_meta,
        "injection": injection,
        "interop": interop,
        "multihost": multihost,
        "validate": validate,
        "digest": digest,
        "timings_s": {**timings, "total": round(wall, 1)},
        "config": dict(vars(args)),
        "env": {
            k: os.environ.get(k, "")
            for k in ("UCX_NET_DEVICES", "UCX_TLS", "NIXL_LOG_LEVEL")
        },
        "cpus": os.cpu_count(),
    }
    path = Path(args.report) if args.report else work / "kvcr_faults_report.json"
    path.write_text(json.dumps(body, indent=2, default=str))
    print()
    print(
        f"{'scenario':<40} {'result':<7} {'claims':>6} {'output=control':>15} {'wall_s':>7}"
    )
    for sc in scenarios:
        print(
            f"{sc.name:<40} {'PASS' if sc.passed else 'FAIL':<7} {sc.claims_leaked:>6} "
            f"{sc.output_matches_control!s:>15} {sc.wall_s:>7.1f}"
        )
    print(f"overall: {'PASS' if ok else 'FAIL'} in {wall:.1f} s")
    print(f"REPORT {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
