"""NVIDIA Dynamo's selection service in process, driven over stdin/stdout.

Runs under the interop venv's Python (``.venv-interop``, ai-dynamo-runtime
1.6.1), never under this project's: Dynamo pins another pydantic than SGLang.
Standard library and ``dynamo`` only. It binds no port: the service subscribes
to the workers' ZMQ KV-event publishers itself, and every command comes in as one
JSON line ``{"op": NAME, "args": {...}}`` on stdin; the answer goes out as one
JSON line ``{"ok": RESULT}`` or ``{"error": TEXT}`` on stdout. Dynamo's own log
goes to stderr. Ops: the ``SelectionService`` coroutines and methods
``upsert_worker``, ``select``, ``select_and_reserve``, ``overlap_scores``,
``free_reservation``, ``list_workers``, ``ready``, and ``quit``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

# Run by path: this directory must not shadow anything (the ``dynamo`` package).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]


def _int_keys(worker: dict) -> dict:
    """The in-process binding wants integer DP-rank keys for the endpoints map."""
    endpoints = worker.get("router_hint_source_control_endpoints")
    if isinstance(endpoints, dict):
        worker = {
            **worker,
            "router_hint_source_control_endpoints": {
                int(k): v for k, v in endpoints.items()
            },
        }
    return worker


async def serve() -> None:
    from dynamo.llm import SelectionService

    service = SelectionService(indexer_threads=1)
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            msg = json.loads(line)
            op, args = msg["op"], msg.get("args") or {}
            try:
                if op == "quit":
                    print(json.dumps({"ok": None}), flush=True)
                    return
                if op == "upsert_worker":
                    result = await service.upsert_worker(_int_keys(args))
                elif op in ("select", "select_and_reserve", "overlap_scores"):
                    result = await getattr(service, op)(args)
                elif op == "free_reservation":
                    result = await service.free_reservation(args["selection_id"])
                elif op == "list_workers":
                    result = service.list_workers()
                elif op == "ready":
                    result = service.ready()
                else:
                    raise ValueError(f"unknown op {op!r}")
                print(json.dumps({"ok": result}), flush=True)
            except Exception as exc:  # the driver reports it
                print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
    finally:
        service.shutdown()


if __name__ == "__main__":
    asyncio.run(serve())
