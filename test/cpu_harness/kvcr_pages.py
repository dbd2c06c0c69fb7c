"""Page-level helpers for linker tests on any device: a small real SGLang KV pool,
a bare KVCR linker over it, fresh random page bytes, and the offload / prepare /
restore steps a scheduler would take, each bounded. Test support only.
"""

from __future__ import annotations

import hashlib
import threading
import time

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

from cpu_harness import kvcr_stack
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import page_hash_to_u64
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)

PAGE = 4
LAYERS = 2
HEADS = 2
DIM = 8
POOL_PAGES = 64
PAGE_BYTES = LAYERS * 2 * PAGE * HEADS * DIM * 2  # every part of one page, bf16
REPS = 3


def make_pool(device="cpu", layers=LAYERS):
    return kvcr_stack.mha_pool(POOL_PAGES * PAGE, PAGE, HEADS, DIM, layers, device)


def make_linker(
    pool,
    forward_stream=None,
    draft_pools=(),
    *,
    components=(0,),
    model="tiny-test",
    **overrides,
):
    """A bare linker over ``pool`` (and sidecar draft pools) serving ``components``
    of ``model``; ``overrides`` are linker config fields."""
    config = {
        "local_dram_bytes_per_worker": POOL_PAGES * PAGE_BYTES,
        "operation_timeout_ms": 5000,
        "abandon_timeout_ms": 10000,
        "preparation_timeout_ms": 2000,
        **overrides,
    }
    return kvcr_stack.bare_linker(
        pool,
        PAGE,
        config,
        components=components,
        model=model,
        forward_stream=forward_stream,
        draft="tiny-draft" if draft_pools else None,
        sidecar_draft_device_pools=tuple(draft_pools),
    )


def hashes_for(n, salt):
    return [hashlib.sha256(f"{salt}/{i}".encode()).hexdigest() for i in range(n)]


def kv_transfer(hashes, pages=None, device="cpu", cls=None, page=PAGE):
    """The KV ``PoolTransfer`` of ``hashes``; with ``pages``, their token indices
    (``page`` tokens a page) on ``device``, as SGLang passes them."""
    indices = None
    if pages is not None:
        indices = torch.tensor(
            [p * page + t for p in pages for t in range(page)],
            dtype=torch.int64,
            device=device,
        )
        if cls is not None:
            indices = indices.as_subclass(cls)
    return [
        PoolTransfer(
            name=PoolName.KV,
            keys=list(hashes),
            device_indices=indices,
            hit_policy=PoolHitPolicy.ALL_PAGES,
        )
    ]


def buffers(pool):
    return [
        b
        for layer in range(LAYERS)
        for b in (pool.k_buffer[layer], pool.v_buffer[layer])
    ]


def fill_random(pool, pages, seed):
    """Fresh random bytes (every bit pattern, NaNs included) in ``pages``."""
    gen = torch.Generator(device=pool.device).manual_seed(seed)
    for buf in buffers(pool):
        raw = buf.view(torch.uint8)
        for p in pages:
            rows = raw[p * PAGE : (p + 1) * PAGE]
            rows.copy_(
                torch.randint(
                    0,
                    256,
                    rows.shape,
                    dtype=torch.uint8,
                    generator=gen,
                    device=pool.device,
                )
            )


def page_bytes(pool, page):
    return torch.cat(
        [
            b[page * PAGE : (page + 1) * PAGE].reshape(-1).view(torch.uint8)
            for b in buffers(pool)
        ]
    ).cpu()


def wait_until(predicate, timeout=10.0, what="condition", poll_s=0.002):
    """Poll ``predicate`` every ``poll_s`` until true; returns the seconds waited,
    raises AssertionError at the deadline."""
    started = time.monotonic()
    deadline = started + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic() - started
        time.sleep(poll_s)
    raise AssertionError(f"{what} not reached within {timeout} s")


def offload_and_commit(lk, hashes, pages, device="cpu"):
    assert lk.offload(kv_transfer(hashes, pages, device)) is True
    wait_until(lambda: lk.num_completed_offloads() >= 1, what="offload completion")
    return lk.pop_completed_offload()


def prepare(lk, rid, hashes):
    handle = lk.prepare_request(LinkerRequestContext(rid), kv_transfer(hashes))
    wait_until(lambda: lk.preparation_ready(handle), what="preparation")
    assert lk.lookup(rid, kv_transfer(hashes)) == list(range(1, len(hashes) + 1))


def restore(lk, rid, hashes, pages, device="cpu"):
    assert lk.load(rid, kv_transfer(hashes, pages, device)) is True
    index = lk.start_layer_wise_loading()
    assert index >= 0
    return lk.finish_layer_wise_loading(index)


def wrong_bytes(pool, pages, originals):
    return sum(
        int((page_bytes(pool, p) != want).sum())
        for p, want in zip(pages, originals, strict=True)
    )


def fetch_hint(endpoint, hashes):
    """A ``kv.fetch@1.0`` hint naming ``endpoint`` as the source of ``hashes``
    (SGLang page hashes, or the router's unsigned 64-bit values)."""
    payload = {
        "source_control_endpoint": endpoint,
        "block_hashes": [h if type(h) is int else page_hash_to_u64(h) for h in hashes],
    }
    action = {
        "action_id": "fetch-0",
        "action_type": "kv.fetch",
        "action_version": "1.0",
        "payload": payload,
    }
    return {"protocol_version": "1.0", "message_id": "hint", "actions": [action]}


def stall_owner(lk, timeout=10.0):
    """Park ``lk``'s owner thread so submitted KVCR commands stay queued; returns
    the function that lets it go (bounded)."""
    entered, gate = threading.Event(), threading.Event()

    def hold(_kv):
        entered.set()
        gate.wait(timeout)

    t = threading.Thread(target=lambda: lk._adapter.call(hold, timeout_s=timeout + 5))
    t.start()
    assert entered.wait(timeout), "the owner thread never picked up the stall"

    def release():
        gate.set()
        t.join(timeout + 5)
        assert not t.is_alive(), "the stall call did not return"

    return release
