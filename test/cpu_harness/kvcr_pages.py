"""Page-level helpers for linker tests on any device: a small real SGLang KV pool,
a bare KVCR linker over it, fresh random page bytes, and the offload / prepare /
restore steps a scheduler would take, each bounded. Test support only.

``make_linker``, ``fill_random`` and ``wait_until`` here are the only ones: the
registered tests and the drivers (``kvcr_drivers``: faults, bench) pass their own
geometry, config, bounds and poll periods as arguments.
"""

from __future__ import annotations

import contextlib
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
    page=PAGE,
    server_args=None,
    **overrides,
):
    """A bare linker over ``pool`` (``page`` tokens a page; sidecar draft pools)
    serving ``components`` of ``model``, built the one way every test and driver
    builds one (``kvcr_stack.bare_linker``: the plugin's ``build_linker``);
    ``server_args`` are more stand-in server arguments, ``overrides`` linker config
    fields over defaults sized for ``make_pool``."""
    config = {
        "local_dram_bytes_per_worker": POOL_PAGES * PAGE_BYTES,
        "operation_timeout_ms": 5000,
        "abandon_timeout_ms": 10000,
        "preparation_timeout_ms": 2000,
        **overrides,
    }
    return kvcr_stack.bare_linker(
        pool,
        page,
        config,
        components=components,
        model=model,
        forward_stream=forward_stream,
        draft="tiny-draft" if draft_pools else None,
        sidecar_draft_device_pools=tuple(draft_pools),
        server_args=server_args,
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
    """Every layer buffer of ``pool``: K then V, layer by layer (MHA), or the
    latent buffers (MLA)."""
    if hasattr(pool, "k_buffer"):
        return [b for kv in zip(pool.k_buffer, pool.v_buffer, strict=True) for b in kv]
    return list(pool.kv_buffer)


def fill_random(pool, pages, seed, *, page=PAGE):
    """Fresh random bytes (every bit pattern, NaNs included) in ``pages`` (``page``
    token rows each; ``page=1``: token slots) of every buffer of ``pool``. The
    same seed and pages give the same bytes on every device and rank.

    Never blocks the host on a CUDA stream: a test fills pages on a forward
    stream still busy (``torch.cuda._sleep``) to show the linker's fences wait
    for it, and a pageable host-to-device copy of the page numbers would wait
    for that stream to finish first, leaving nothing to race."""
    dev = buffers(pool)[0].device  # the pool's own device (cuda:N, not "cuda")
    pages = torch.as_tensor(pages, dtype=torch.int64)
    if dev.type == "cuda" and not pages.is_cuda:
        pages = pages.pin_memory()
    pages = pages.to(dev, non_blocking=True)
    rows = (pages[:, None] * page + torch.arange(page, device=dev)).reshape(-1)
    gen = torch.Generator(device=dev).manual_seed(seed)
    for buf in buffers(pool):
        raw = buf.view(torch.uint8)
        shape = (len(rows), *raw.shape[1:])
        raw[rows] = torch.randint(
            0, 256, shape, dtype=torch.uint8, generator=gen, device=dev
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
    raises AssertionError naming ``what`` at the deadline."""
    started = time.monotonic()
    deadline = started + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic() - started
        time.sleep(poll_s)
    raise AssertionError(f"{what}: not reached within {timeout} s")


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


@contextlib.contextmanager
def owner_stalled(lk, timeout=10.0):
    """``stall_owner`` as a block: ``lk``'s owner thread stays parked inside it;
    the yielded function (or leaving the block) lets it go."""
    release = stall_owner(lk, timeout)
    try:
        yield release
    finally:
        release()
