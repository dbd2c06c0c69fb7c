"""The example router driven by KV events (examples/runtime/kvcr_direct_linker/
kv_event_router.py): its page index and hints over SGLang's real event objects, as
SGLang's ZMQ publisher encodes them, and its forwarding against stand-in workers
that record what they receive (no server); then, on two CPU linker workers, a
prompt sent twice through the router lands on the other worker the second time
and restores from the first worker's KVCR DRAM with the hint the router built
from the first worker's published events, output equal to a recompute.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest
import requests
from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    StorageMedium,
)
from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

from cpu_harness import kvcr_servers as kvs
from cpu_harness import server as harness
from cpu_harness import tiny_model
from sglang.srt.mem_cache.storage.kvcr.fleet.router_hint import (
    EndpointAllowlist,
    FetchHint,
    RouterHintParser,
)

ROUTER_PATH = (
    harness.REPO / "examples" / "runtime" / "kvcr_direct_linker" / "kv_event_router.py"
)


def _load_router():
    spec = importlib.util.spec_from_file_location("kv_event_router", ROUTER_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ker = _load_router()

PAGE = 4
U64 = (1 << 64) - 1
# Published hashes are signed int64s; include negative ones.
H = [-(1 << 63) + 7, 11, -3, 1 << 40, (1 << 63) - 1, 99]
IDS = list(range(100, 100 + 5 * PAGE + 2))  # five whole pages and a tail
A = ker.Worker("http://a", "tcp://127.0.0.1:1", "tcp://127.0.0.1:47000")
B = ker.Worker("http://b", "tcp://127.0.0.1:2", "tcp://127.0.0.1:47100")
C = ker.Worker("http://c", "tcp://127.0.0.1:3", "tcp://127.0.0.1:47200")


def stored(pages, parent=None, medium=StorageMedium.EXTERNAL, salt=None, hashes=H):
    """SGLang's BlockStored for pages ``pages`` of IDS (a coalesced run)."""
    return BlockStored(
        block_hashes=[hashes[p] for p in pages],
        parent_block_hash=parent,
        token_ids=[t for p in pages for t in IDS[p * PAGE : (p + 1) * PAGE]],
        block_size=PAGE,
        lora_id=None,
        medium=medium,
        cache_salt=salt,
    )


def feed(index, worker, *events):
    """``events`` as SGLang's ZmqEventPublisher puts them on the wire, decoded by
    the router and applied to ``index``."""
    payload = msgspec.msgpack.Encoder().encode(
        KVEventBatch(ts=1.0, events=list(events))
    )
    for event in ker.decode_batch(payload).events:
        index.apply(worker.url, event)


def test_index_follows_stores_removals_per_medium_and_clears():
    index = ker.PageIndex(PAGE)
    # GPU stores in two runs (the second linked to the first), EXTERNAL in one.
    feed(index, A, stored([0, 1, 2], medium=StorageMedium.GPU))
    feed(index, A, stored([3, 4], parent=H[2], medium=StorageMedium.GPU))
    feed(index, A, stored(range(5)))
    chain = index.chain(IDS)
    assert chain == H[:5]
    assert index.leading(A.url, chain) == 5
    assert index.leading(A.url, chain, ker.FETCHABLE) == 5
    assert index.leading(B.url, chain) == 0
    assert index.pages(A.url) == {"GPU": 5, "EXTERNAL": 5}
    diverged = IDS[: 2 * PAGE] + [7] * PAGE + IDS[3 * PAGE :]
    assert index.chain(diverged) == H[:2]

    # KVCR evicted pages 3-4: gone from DRAM, still on the GPU.
    feed(index, A, BlockRemoved(block_hashes=H[3:5], medium=StorageMedium.EXTERNAL))
    assert index.leading(A.url, chain, ker.FETCHABLE) == 3
    assert index.leading(A.url, chain) == 5
    assert index.pages(A.url) == {"GPU": 5, "EXTERNAL": 3}
    # A removal by another worker, or of a medium A does not hold, changes nothing.
    feed(index, B, BlockRemoved(block_hashes=H[:5], medium=StorageMedium.EXTERNAL))
    feed(index, A, BlockRemoved(block_hashes=H[3:5], medium=StorageMedium.EXTERNAL))
    assert index.pages(A.url) == {"GPU": 5, "EXTERNAL": 3}
    # The GPU drops everything: pages 3-4 are held nowhere and leave the chain.
    feed(index, A, BlockRemoved(block_hashes=H[:5], medium=StorageMedium.GPU))
    assert index.pages(A.url) == {"EXTERNAL": 3}
    assert index.chain(IDS) == H[:3]

    feed(index, B, stored(range(2), medium=StorageMedium.GPU))
    feed(index, A, AllBlocksCleared())
    assert index.pages(A.url) == {}
    assert index.chain(IDS) == H[:2]  # B's pages stay
    assert index.leading(B.url, index.chain(IDS)) == 2

    # Another page size is not indexed (and counted); a salt is its own chain.
    feed(index, A, BlockStored([5], None, IDS[:8], 8, None, medium="EXTERNAL"))
    assert index.skipped_stores == 1
    salted = [h ^ 0x5A5A for h in H]
    feed(index, A, stored(range(5), salt="tenant-a", hashes=salted))
    assert index.chain(IDS, ("tenant-a", None)) == salted[:5]
    assert index.chain(IDS, ("tenant-b", None)) == []
    assert index.chain(IDS) == H[:2]


def test_same_tokens_under_other_hashes_do_not_hide_a_known_chain():
    """Events carry no ``extra_key``: a worker storing the same tokens under other
    hashes (an ``extra_key`` request) leaves the chain already known in place."""
    index = ker.PageIndex(PAGE)
    feed(index, A, stored(range(2)))
    other = [h ^ 0x77 for h in H]
    feed(index, B, stored(range(2), medium=StorageMedium.GPU, hashes=other))
    assert index.chain(IDS) == H[:2]
    assert index.leading(A.url, index.chain(IDS), ker.FETCHABLE) == 2
    # Once nobody holds the first chain, the other one is learned when stored.
    feed(index, A, AllBlocksCleared())
    assert index.chain(IDS) == []
    feed(index, B, stored(range(2), medium=StorageMedium.GPU, hashes=other))
    assert index.chain(IDS) == other[:2]


def test_plan_names_the_peer_with_the_longest_fetchable_prefix():
    index = ker.PageIndex(PAGE)
    router = ker.Router([A, B, C], index)
    feed(index, A, stored(range(5), medium=StorageMedium.GPU))  # not fetchable
    feed(index, B, stored(range(2), medium=StorageMedium.GPU))
    feed(index, C, stored(range(3)))
    assert router.plan(B, IDS, (None, None)) == (C, H[:3])
    assert router.plan(C, IDS, (None, None)) is None  # A's GPU pages don't count
    assert router.plan(A, IDS, (None, None)) is None  # A holds more itself
    feed(index, A, stored(range(5)))
    assert router.plan(B, IDS, (None, None)) == (A, H[:5])
    assert router.plan(B, IDS, ("tenant-b", None)) is None

    # The hint is one SGLang accepts and the linker's parser reads as meant.
    hint = ker.fetch_hint(A.control, H[:5])
    envelope = decode_kv_hints_envelope(json.loads(json.dumps(hint)))
    parser = RouterHintParser(EndpointAllowlist([], "127.0.0.1"), 0)
    expected = FetchHint(A.control, tuple(h & U64 for h in H[:5]))
    assert parser.parse(envelope) == expected


def test_least_loaded_policy_picks_the_idle_worker():
    router = ker.Router([A, B], ker.PageIndex(PAGE), ker.Policy.LEAST_LOADED)
    first = router.route({"text": "x"})
    second = router.route({"text": "y"})
    assert (first.worker, second.worker) == (A, B)  # a tie: in turn
    router.done(second)
    third = router.route({"text": "z"})
    assert third.worker == B  # A still has one in flight (round robin: A)
    router.done(first)
    assert router.route({"text": "w"}).worker == A  # B busy (round robin: B)


class _Recorder(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        data = json.dumps({"output_ids": [1, 2], "meta_info": {"id": "r"}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def _serve(server):
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_forwarded_bodies_carry_the_routers_hint_never_the_clients():
    fakes = [ThreadingHTTPServer(("127.0.0.1", 0), _Recorder) for _ in range(2)]
    for fake in fakes:
        fake.bodies = []
    a, b = (
        ker.Worker(_serve(fake), "tcp://127.0.0.1:1", ctl)
        for fake, ctl in zip(fakes, ("tcp://127.0.0.1:47000", "tcp://127.0.0.1:47100"))
    )
    index = ker.PageIndex(PAGE)
    feed(index, a, stored(range(5)))
    router = ker.Router([a, b], index)
    front = ker.RouterServer(("127.0.0.1", 0), router)
    url = _serve(front)
    client_hint = ker.fetch_hint("tcp://10.9.9.9:1", [123])
    params = {"max_new_tokens": 2, "temperature": 0}
    try:
        replies = [
            requests.post(f"{url}/generate", json=body, timeout=30)
            for body in (
                {"input_ids": IDS, "sampling_params": params, "kv_hints": client_hint},
                {"input_ids": IDS, "sampling_params": params, "kv_hints": client_hint},
                {"text": "no ids", "kv_hints": {"actions": "malformed"}},
            )
        ]
    finally:
        front.shutdown()
        front.server_close()
        for fake in fakes:
            fake.shutdown()
            fake.server_close()
    assert [r.status_code for r in replies] == [200, 200, 200]
    assert replies[0].json() == {"output_ids": [1, 2], "meta_info": {"id": "r"}}
    assert [r.headers["X-KV-Router-Worker"] for r in replies] == [a.url, b.url, a.url]
    assert [r.headers["X-KV-Router-Peer"] for r in replies] == ["", a.url, ""]
    (to_a, to_a_text), (to_b,) = fakes[0].bodies, fakes[1].bodies
    assert to_a == {"input_ids": IDS, "sampling_params": params}  # A holds it all
    assert to_a_text == {"text": "no ids"}
    assert to_b["input_ids"] == IDS and to_b["sampling_params"] == params
    payload = to_b["kv_hints"]["actions"][0]["payload"]
    assert payload == {"source_control_endpoint": a.control, "block_hashes": H[:5]}
    stats = router.snapshot()["router"]
    assert stats["requests"] == 3 and stats["hinted"] == 1
    assert stats["client_hints_stripped"] == 3 and stats["unhintable"] == 1


# ---- two CPU linker workers behind the router -------------------------------

PROMPT_LEN = 256
PAGES = (PROMPT_LEN - 1) // kvs.PAGE  # whole pages SGLang caches of a prompt
ALIGNED = PAGES * kvs.PAGE


def _until(check: Callable[[], object], what: str, timeout: float = 30.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _via(url: str, ids: list[int], **extra: object) -> tuple[list[int], int, str, str]:
    """(output ids, tokens restored from KVCR, worker, hinted peer) of one request
    through the router, read the way ``kvs.run`` reads a worker's reply."""
    params = {"max_new_tokens": kvs.OUTPUT_LEN, "temperature": 0.0, "ignore_eos": True}
    body = {"input_ids": ids, "sampling_params": params, **extra}
    resp = requests.post(f"{url}/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text[:2000]
    out = resp.json()
    details = out.get("meta_info", {}).get("cached_tokens_details") or {}
    external = int(details.get("host", 0) or 0)
    headers = resp.headers
    worker, peer = headers["X-KV-Router-Worker"], headers["X-KV-Router-Peer"]
    return list(out["output_ids"]), external, worker, peer


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two linker workers publishing KV events, and the router in front of them."""
    work = tmp_path_factory.mktemp("kv_event_router")
    model = tiny_model.ensure_tiny_model()
    handles, router, front = [], None, None
    try:
        for name in ("a", "b"):
            port = harness.free_port()
            handle = kvs.launch_linker(name, model, work, kvs.kv_events_args(port))
            handle.events = f"tcp://127.0.0.1:{port}"
            handles.append(handle)
        for handle in handles:
            handle.wait_ready(420)
        workers = [ker.Worker(h.base_url, h.events, h.endpoint) for h in handles]
        router = ker.Router(workers, ker.PageIndex(kvs.PAGE))
        router.start()
        front = ker.RouterServer(("127.0.0.1", 0), router)
        url = _serve(front)
        rng = random.Random(5)
        for handle in handles:  # until each subscription has joined its publisher
            deadline = time.monotonic() + 60.0
            while router.snapshot()["workers"][handle.base_url]["batches"] == 0:
                assert time.monotonic() < deadline, handle.log_tail()
                handle.generate(input_ids=[rng.randrange(3, 300) for _ in range(40)])
                time.sleep(0.5)
        yield handles, router, url
    finally:
        if front is not None:
            front.shutdown()
            front.server_close()
        if router is not None:
            router.close()
        for handle in handles:
            handle.stop()


@pytest.mark.server
@pytest.mark.kvcr
@pytest.mark.slow
def test_second_request_restores_from_the_peer_with_the_routers_hint(pair):
    (a, b), router, url = pair
    index = router.index
    rng = random.Random(17)
    ids = [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]
    # SGLang itself rejects a malformed envelope: the router must strip it.
    malformed = {"protocol_version": "1.0", "actions": "not a list"}
    direct = a.post("/generate", {"input_ids": ids[:8], "kv_hints": malformed})
    assert direct.status_code == 400, direct.text[:500]

    first, external, worker, peer = _via(url, ids, kv_hints=malformed)
    assert (worker, peer, external) == (a.base_url, "", 0)
    # A caches the prompt and its output: at least PAGES pages of the prompt.
    chain = _until(
        lambda: (c := index.chain(ids))
        and index.leading(a.base_url, c, ker.FETCHABLE) >= PAGES
        and c,
        "A's EXTERNAL BlockStored chain in the router's index",
    )

    second, external, worker, peer = _via(url, ids)
    assert (worker, peer) == (b.base_url, a.base_url)
    assert external >= 0.9 * ALIGNED, (external, b.log_tail())
    stats = router.snapshot()
    assert stats["router"]["hinted"] == 1, stats
    assert stats["router"]["client_hints_stripped"] == 1, stats
    assert all(
        w["gaps"] == 0 and w["bad_batches"] == 0 for w in stats["workers"].values()
    )

    # A flush publishes AllBlocksCleared: A leaves the index, B (restored) stays.
    assert a.flush_cache().status_code == 200
    _until(lambda: index.leading(a.base_url, chain) == 0, "A's pages cleared")
    _until(lambda: index.leading(b.base_url, chain) >= PAGES, "B's pages indexed")
    control, external = kvs.run(a, ids)  # recompute on a flushed A
    assert external == 0
    assert second == control and first == control
