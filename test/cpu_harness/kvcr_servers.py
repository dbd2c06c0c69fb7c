"""KVCR-linker CPU servers and a KV-event subscriber, for end-to-end tests.

``launch_linker`` starts (without waiting) a CPU SGLang server with the KVCR linker
on a free control port and records its endpoint; ``run`` sends one greedy request
and returns its output and how many tokens came from external KVCR pages;
``computed_on`` / ``recompute`` are the control runs. ``EventSubscriber`` reads a
worker's ``KVEventBatch`` messages from SGLang's own ZMQ publisher
(``--kv-events-config``) on a thread, and ``published_chain`` walks them the way a
KV-aware router does: page by page from the sequence head, by tokens and parent
link, returning the block hashes the worker published for a prompt.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cpu_harness import server as harness

PAGE = 16
OUTPUT_LEN = 8
DEFAULT_CONFIG = {
    "local_dram_bytes_per_worker": 64 << 20,
    "operation_timeout_ms": 10000,
    "abandon_timeout_ms": 20000,
    "preparation_timeout_ms": 5000,
}


def launch_linker(
    name: str,
    model: Path,
    work: Path,
    extra: Sequence[str] = (),
    *,
    prompt_len: int = 256,
    config: dict[str, Any] | None = None,
) -> Any:
    """A KVCR-linker server started without waiting (``handle.wait_ready``)."""
    control_port = harness.free_port()
    cfg = {**DEFAULT_CONFIG, "control_port": control_port, **(config or {})}
    args = [
        "--page-size",
        str(PAGE),
        "--max-total-tokens",
        str(4 * prompt_len),
        "--max-running-requests",
        "4",
        *extra,
        *harness.kvcr_linker_args(cfg),
    ]
    handle = harness.launch_server(
        args, model_path=model, log_path=work / f"{name}.log", wait=False
    )
    handle.endpoint = f"tcp://127.0.0.1:{control_port}"
    return handle


def run(server: Any, ids: list[int], **extra: Any) -> tuple[list[int], int]:
    """(output ids, tokens restored from external KVCR pages) of one request."""
    out = server.generate(input_ids=ids, max_new_tokens=OUTPUT_LEN, **extra)
    meta = out.get("meta_info", {})
    external = int((meta.get("cached_tokens_details") or {}).get("host", 0) or 0)
    return list(out["output_ids"]), external


def computed_on(server: Any, ids: list[int], **extra: Any) -> list[int]:
    """``ids`` computed (and offloaded) on ``server``: its output."""
    output, _ = run(server, ids, **extra)
    time.sleep(1.0)  # the write-through offload to KVCR DRAM is asynchronous
    return output


def recompute(server: Any, ids: list[int], **extra: Any) -> list[int]:
    """``server``'s own output for ``ids`` with nothing cached."""
    assert server.flush_cache().status_code == 200
    output, external = run(server, ids, **extra)
    assert external == 0
    return output


def kv_events_args(port: int, *, dynamo: bool = False) -> list[str]:
    """Flags that make a server publish KV events on ``127.0.0.1:port``."""
    config: dict[str, Any] = {
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "bind": True,
        "topic": "kv",
    }
    if dynamo:
        config["format"] = "dynamo"
    return ["--kv-events-config", json.dumps(config)]


class EventSubscriber:
    """Collects a worker's published KV events (a daemon thread, bounded waits)."""

    def __init__(self, port: int) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.connect(f"tcp://127.0.0.1:{port}")
        self._lock = threading.Lock()
        self.events: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        import msgspec
        import zmq
        from sglang.srt.disaggregation.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            batch = decoder.decode(payload)
            with self._lock:
                self.events.extend(batch.events)

    def snapshot(self) -> list[Any]:
        with self._lock:
            return list(self.events)

    def published_chain(
        self, ids: list[int], pages: int, *, medium: str = "EXTERNAL"
    ) -> list[int] | None:
        """The block hashes the worker published (on ``medium``) for the first
        ``pages`` pages of ``ids``, walked by tokens and parent link; None until
        every page has been published."""
        from sglang.srt.disaggregation.kv_events import BlockStored

        by_link: dict[tuple[int | None, tuple[int, ...]], int] = {}
        for event in self.snapshot():
            if not isinstance(event, BlockStored) or event.medium != medium:
                continue
            parent = event.parent_block_hash
            for i, block in enumerate(event.block_hashes):
                tokens = tuple(event.token_ids[i * PAGE : (i + 1) * PAGE])
                by_link[(parent, tokens)] = block
                parent = block
        chain: list[int] = []
        parent = None
        for p in range(pages):
            block = by_link.get((parent, tuple(ids[p * PAGE : (p + 1) * PAGE])))
            if block is None:
                return None
            chain.append(block)
            parent = block
        return chain

    def wait_chain(
        self, ids: list[int], pages: int, timeout: float = 30.0
    ) -> list[int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            chain = self.published_chain(ids, pages)
            if chain is not None:
                return chain
            time.sleep(0.2)
        raise AssertionError(f"no EXTERNAL BlockStored chain of {pages} pages seen")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._sock.close(linger=0)
        self._ctx.term()
