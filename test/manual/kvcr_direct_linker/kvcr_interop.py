"""NVIDIA Dynamo 1.6.1's selection service in front of two CPU linker workers.

``make interop`` builds ``.venv-interop`` (ai-dynamo-runtime==1.6.1, kept apart
from SGLang's venv: their pydantic pins conflict) and runs this. Dynamo is
subscribed to both workers' KV events; a booking pinned to B returns Dynamo's
``kv.fetch`` hint, which goes unchanged into B's ``kv_hints``. What each check is:
``test/kvcr_drivers/interop/dynamo_interop.py``. Prints the hint as Dynamo wrote
it, the checks and what Dynamo's index did on device eviction and flush; writes
the JSON report (last line ``REPORT <path>``); exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import _paths  # noqa: F401  (the repository's test/ on sys.path)

from kvcr_drivers import cli
from kvcr_drivers.interop import dynamo_interop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_run_options(p)
    args = p.parse_args(argv)
    if not dynamo_interop.INTEROP_PYTHON.exists():
        p.error(f"{dynamo_interop.INTEROP_PYTHON} missing: run `make interop`")
    work = cli.work_dir(args, "interop")
    started = time.monotonic()
    report = dynamo_interop.run(work, seed=args.seed or 7)
    report["wall_s"] = round(time.monotonic() - started, 1)
    seen = report["dynamo"]
    print("hint as Dynamo wrote it (pinned booking to B):")
    print(json.dumps(seen.get("hint_as_written"), indent=1))
    for name, ok in report["checks"].items():
        print(f"{name:<36} {'PASS' if ok else 'FAIL'}")
    print(
        f"restored on B: {seen.get('restored_tokens')}/{seen.get('aligned_tokens')} "
        f"aligned tokens; salted: {seen.get('salted_restored_tokens')}"
    )
    print(f"device eviction on A: {json.dumps(seen.get('device_eviction'))}")
    print(f"flush of A: {json.dumps(seen.get('flush'))}")
    print(f"overall: {'PASS' if report['passed'] else 'FAIL'} in {report['wall_s']} s")
    path = Path(args.report) if args.report else work / "kvcr_interop_report.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"REPORT {path}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
