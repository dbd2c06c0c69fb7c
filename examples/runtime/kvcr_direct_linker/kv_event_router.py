"""A router driven by KV events: an example of the ``kv.fetch@1.0`` hint contract.

This is an example of the contract between SGLang's KV events and the KVCR linker's
hints, not a production router: no retries, health checks, replay of missed events
or tokenizer (only ``input_ids`` requests get hints), and one publisher per worker
(no DP ranks). It subscribes to each worker's ``KVEventBatch`` messages on SGLang's
own ZMQ publisher (workers started with ``--kv-events-config``), decoding the wire
format itself (tagged msgpack maps; no SGLang import), and keeps an index of which
worker holds which published page hash on which medium (``GPU``; ``EXTERNAL`` is
KVCR DRAM). Each ``/generate`` goes to a worker picked round robin or least loaded;
when that worker holds fewer leading pages of the request than a peer holds in KVCR
DRAM, the router adds a ``kv.fetch@1.0`` hint naming the peer's KVCR control
endpoint and the hashes the peer published. Client-sent ``kv_hints`` are always
stripped. See "A router driven by KV events" in docs/kvcr_direct_linker.md. Usage::

    python kv_event_router.py --port 8000 --page-size 64 \
        --worker http://127.0.0.1:30000 tcp://127.0.0.1:5557 tcp://127.0.0.1:47000 \
        --worker http://127.0.0.1:30001 tcp://127.0.0.1:5558 tcp://127.0.0.1:47100
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
import requests
import zmq

logger = logging.getLogger("kv_event_router")

GPU, EXTERNAL = "GPU", "EXTERNAL"  # SGLang's StorageMedium values on the wire
FETCHABLE = frozenset({EXTERNAL})  # what a peer can serve: pages in KVCR DRAM
Namespace = tuple[str | None, str | None]  # (cache_salt, lora name) of a chain
LinkKey = tuple[Namespace, int | None, tuple[int, ...]]  # (ns, parent, page tokens)


# The wire format of SGLang's KVEventBatch: [ts, events, attn_dp_rank], each event
# a msgpack map tagged by "type". Only the fields the router reads; others ignored.
class Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int]
    token_ids: list[int]
    block_size: int
    parent_block_hash: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    lora_name: str | None = None


class Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Stored | Removed | Cleared]
    attn_dp_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(Batch)


def decode_batch(payload: bytes) -> Batch:
    """One published ``KVEventBatch`` (raises ``msgspec.DecodeError`` if not one)."""
    return _DECODER.decode(payload)


class PageIndex:
    """Which worker holds which published page hash on which medium (thread-safe).

    Stores are walked page by page by parent link and tokens, the way the worker
    published them; a page is forgotten when no worker holds it on any medium."""

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1 (--page-size), got {page_size}")
        self.page_size = page_size
        self.skipped_stores = 0  # stores of another page size (check --page-size)
        self._lock = threading.Lock()
        self._links: dict[LinkKey, int] = {}
        self._link_of: dict[int, LinkKey] = {}
        self._held: dict[int, dict[str, set[str]]] = {}  # hash -> worker -> media

    def apply(self, worker: str, event: Stored | Removed | Cleared) -> None:
        with self._lock:
            if isinstance(event, Stored):
                self._store(worker, event)
            elif isinstance(event, Removed):
                self._remove(worker, event.block_hashes, event.medium or GPU)
            else:  # AllBlocksCleared: the worker dropped every page, every medium
                for block in [b for b, who in self._held.items() if worker in who]:
                    self._drop(worker, block)

    def _store(self, worker: str, event: Stored) -> None:
        size, hashes, tokens = self.page_size, event.block_hashes, event.token_ids
        if event.block_size != size or len(tokens) != size * len(hashes):
            self.skipped_stores += 1
            return
        namespace, parent = (event.cache_salt, event.lora_name), event.parent_block_hash
        for i, block in enumerate(hashes):
            key = (namespace, parent, tuple(tokens[i * size : (i + 1) * size]))
            # Events carry no extra_key: a chain stored under one (same tokens,
            # other hashes) must not replace the link already known; the first
            # one held stays until no worker holds it (a missed hint at worst).
            if self._links.setdefault(key, block) == block:
                self._link_of[block] = key
            media = self._held.setdefault(block, {}).setdefault(worker, set())
            media.add(event.medium or GPU)
            parent = block

    def _remove(self, worker: str, hashes: Iterable[int], medium: str) -> None:
        for block in hashes:
            media = self._held.get(block, {}).get(worker)
            if media is not None:
                media.discard(medium)
                if not media:
                    self._drop(worker, block)

    def _drop(self, worker: str, block: int) -> None:
        holders = self._held[block]
        del holders[worker]
        if not holders:
            del self._held[block]
            key = self._link_of.pop(block, None)
            if key is not None and self._links.get(key) == block:
                del self._links[key]

    def chain(
        self, ids: Sequence[int], namespace: Namespace = (None, None)
    ) -> list[int]:
        """The published hashes of the leading whole pages of ``ids``, as far as
        any worker has published them."""
        size, parent, out = self.page_size, None, []
        with self._lock:
            for start in range(0, len(ids) - size + 1, size):
                key = (namespace, parent, tuple(ids[start : start + size]))
                block = self._links.get(key)
                if block is None:
                    break
                out.append(block)
                parent = block
        return out

    def leading(
        self, worker: str, chain: Sequence[int], media: frozenset[str] | None = None
    ) -> int:
        """How many leading pages of ``chain`` ``worker`` holds (on ``media``; on
        any medium when None)."""
        with self._lock:
            for n, block in enumerate(chain):
                held = self._held.get(block, {}).get(worker)
                if not held or (media is not None and media.isdisjoint(held)):
                    return n
        return len(chain)

    def pages(self, worker: str) -> dict[str, int]:
        """Pages ``worker`` holds, per medium."""
        counts: dict[str, int] = {}
        with self._lock:
            for holders in self._held.values():
                for medium in holders.get(worker, ()):
                    counts[medium] = counts.get(medium, 0) + 1
        return counts


@dataclass(frozen=True, slots=True)
class Worker:
    """A worker: its HTTP URL, KV-event publisher, and KVCR control endpoint (the
    one its linker config's ``control_port`` makes attention rank 0 listen on)."""

    url: str
    events: str
    control: str


class EventSubscriber:
    """Feeds one worker's published KV events into the index (a daemon thread)."""

    def __init__(self, ctx: zmq.Context, worker: Worker, index: PageIndex) -> None:
        self.worker, self._index = worker, index
        self.batches = self.gaps = self.bad_batches = 0
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")  # every topic
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.connect(worker.events)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        last: int | None = None
        while not self._stop.is_set():
            try:
                frames = self._sock.recv_multipart()
            except zmq.Again:
                continue
            try:
                _topic, seq_bytes, payload = frames
                batch = decode_batch(payload)
            except (ValueError, msgspec.DecodeError) as exc:
                self.bad_batches += 1
                logger.warning(
                    "Undecodable KV event batch from %s: %s", self.worker.url, exc
                )
                continue
            seq = int.from_bytes(seq_bytes, "big")
            if last is not None and seq != last + 1:
                # PUB/SUB drops under load; SGLang's replay_endpoint can refill.
                self.gaps += 1
                logger.warning(
                    "KV events from %s: seq %d after %d", self.worker.url, seq, last
                )
            last = seq
            for event in batch.events:
                self._index.apply(self.worker.url, event)
            self.batches += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._sock.close(linger=0)


def fetch_hint(control: str, hashes: Sequence[int]) -> dict[str, Any]:
    """A ``kv_hints`` envelope: fetch ``hashes`` (as published) from ``control``."""
    payload = {"source_control_endpoint": control, "block_hashes": list(hashes)}
    action = {
        "action_id": "fetch-0",
        "action_type": "kv.fetch",
        "action_version": "1.0",
    }
    action["payload"] = payload
    message_id = f"kv-router-{uuid.uuid4().hex[:12]}"
    return {"protocol_version": "1.0", "message_id": message_id, "actions": [action]}


class Policy(enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"  # fewest requests in flight, ties in turn


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes, the body sent there, and the peer it was hinted to."""

    worker: Worker
    body: dict[str, Any]
    peer: Worker | None = None
    hinted_pages: int = 0


@dataclass(slots=True)
class RouterStats:
    requests: int = 0
    hinted: int = 0
    client_hints_stripped: int = 0
    unhintable: int = 0  # no input_ids list, or extra_key (not in the events)
    forward_errors: int = 0


class Router:
    """Picks a worker per request and adds a fetch hint from the index."""

    def __init__(
        self,
        workers: Sequence[Worker],
        index: PageIndex,
        policy: Policy = Policy.ROUND_ROBIN,
        timeout_s: float = 300.0,
    ) -> None:
        if not workers:
            raise ValueError(
                "at least one worker is needed (--worker URL EVENTS CONTROL)"
            )
        self.workers, self.index, self.policy = tuple(workers), index, policy
        self.timeout_s = timeout_s
        self.stats = RouterStats()
        self._lock = threading.Lock()
        self._turn = 0
        self._in_flight = dict.fromkeys(self.workers, 0)
        self._ctx: zmq.Context | None = None
        self.subscribers: list[EventSubscriber] = []

    def start(self) -> None:
        self._ctx = zmq.Context()
        self.subscribers = [
            EventSubscriber(self._ctx, w, self.index) for w in self.workers
        ]

    def close(self) -> None:
        for sub in self.subscribers:
            sub.close()
        if self._ctx is not None:
            self._ctx.term()

    def plan(
        self, worker: Worker, ids: Sequence[int], namespace: Namespace
    ) -> tuple[Worker, list[int]] | None:
        """The peer holding the longest run of leading pages of ``ids`` in KVCR
        DRAM and those pages' hashes, when that run is longer than ``worker``'s."""
        chain = self.index.chain(ids, namespace)
        best, peer = self.index.leading(worker.url, chain), None
        for other in self.workers:
            held = self.index.leading(other.url, chain, FETCHABLE)
            if other != worker and held > best:
                best, peer = held, other
        return None if peer is None else (peer, chain[:best])

    def route(self, body: dict[str, Any]) -> Route:
        """Pick a worker for ``body`` (counted in flight until ``done``)."""
        body = dict(body)
        with self._lock:
            self.stats.requests += 1
            if body.pop("kv_hints", None) is not None:
                self.stats.client_hints_stripped += 1
            order = self.workers[self._turn :] + self.workers[: self._turn]
            self._turn = (self._turn + 1) % len(self.workers)
            if self.policy is Policy.LEAST_LOADED:
                order = tuple(sorted(order, key=self._in_flight.__getitem__))
            worker = order[0]
            self._in_flight[worker] += 1
        ids, salt, lora = (
            body.get("input_ids"),
            body.get("cache_salt"),
            body.get("lora_path"),
        )
        hintable = isinstance(ids, list) and all(type(t) is int for t in ids)
        hintable = hintable and body.get("extra_key") is None
        hintable = hintable and all(
            v is None or isinstance(v, str) for v in (salt, lora)
        )
        if not hintable:
            with self._lock:
                self.stats.unhintable += 1
            return Route(worker, body)
        plan = self.plan(worker, ids, (salt, lora))
        if plan is None:
            return Route(worker, body)
        peer, hashes = plan
        with self._lock:
            self.stats.hinted += 1
        msg = "Hinting %s to fetch %d pages from %s"
        logger.info(msg, worker.url, len(hashes), peer.url)
        body["kv_hints"] = fetch_hint(peer.control, hashes)
        return Route(worker, body, peer, len(hashes))

    def done(self, route: Route, *, failed: bool = False) -> None:
        with self._lock:
            self._in_flight[route.worker] -= 1
            self.stats.forward_errors += int(failed)

    def forward(self, route: Route) -> requests.Response:
        """POST the route's body to its worker's ``/generate`` (streamed)."""
        url = f"{route.worker.url}/generate"
        return requests.post(url, json=route.body, timeout=self.timeout_s, stream=True)

    def snapshot(self) -> dict[str, Any]:
        workers = {
            sub.worker.url: {
                "batches": sub.batches,
                "gaps": sub.gaps,
                "bad_batches": sub.bad_batches,
                "pages": self.index.pages(sub.worker.url),
            }
            for sub in self.subscribers
        }
        with self._lock:
            router = asdict(self.stats)
        router["skipped_stores"] = self.index.skipped_stores
        return {"router": router, "workers": workers}


class _Handler(BaseHTTPRequestHandler):
    server: RouterServer

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, b"ok", "text/plain")
        elif self.path == "/router_stats":
            self._reply(200, json.dumps(self.server.router.snapshot()).encode())
        else:
            self._reply(404, b'{"error": "GET /health or /router_stats"}')

    def do_POST(self) -> None:
        if self.path != "/generate":
            self._reply(404, b'{"error": "only POST /generate is routed"}')
            return
        try:
            body = json.loads(
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
            )
        except ValueError as exc:
            self._reply(400, json.dumps({"error": f"body is not JSON: {exc}"}).encode())
            return
        if not isinstance(body, dict):
            self._reply(400, b'{"error": "body must be a JSON object"}')
            return
        router = self.server.router
        route = router.route(body)
        try:
            resp = router.forward(route)
        except requests.RequestException as exc:
            router.done(route, failed=True)
            self._reply(
                502, json.dumps({"error": f"{route.worker.url}: {exc}"}).encode()
            )
            return
        try:
            self.send_response(resp.status_code)
            self.send_header(
                "Content-Type", resp.headers.get("Content-Type", "application/json")
            )
            self.send_header("X-KV-Router-Worker", route.worker.url)
            self.send_header("X-KV-Router-Peer", route.peer.url if route.peer else "")
            self.end_headers()  # HTTP/1.0: the body runs until the connection closes
            for chunk in resp.iter_content(chunk_size=None):
                self.wfile.write(chunk)
        finally:
            resp.close()
            router.done(route)

    def _reply(self, code: int, data: bytes, kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug(format, *args)


class RouterServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], router: Router) -> None:
        super().__init__(address, _Handler)
        self.router = router


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--page-size", type=int, required=True, help="the workers' --page-size"
    )
    p.add_argument("--policy", choices=[x.value for x in Policy], default="round_robin")
    p.add_argument(
        "--worker",
        nargs=3,
        action="append",
        required=True,
        metavar=("URL", "EVENTS", "CONTROL"),
        help="HTTP URL, --kv-events-config endpoint, KVCR control endpoint",
    )
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
    )
    workers = [Worker(url.rstrip("/"), ev, ctl) for url, ev, ctl in args.worker]
    router = Router(workers, PageIndex(args.page_size), Policy(args.policy))
    router.start()
    server = RouterServer((args.host, args.port), router)
    logger.info(
        "KV event router on http://%s:%d, %d workers",
        args.host,
        args.port,
        len(workers),
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        router.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
