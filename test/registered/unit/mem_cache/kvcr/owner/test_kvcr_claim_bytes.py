"""Claims held by requests waiting to load are bounded in bytes, not by count.

Every prepared request holds residency claims on its pages in KVCR DRAM until it
loads or leaves, so a long queue could pin the whole DRAM share. Past
``max_claimed_bytes`` (0: half the rank's share) a new request's preparation is
refused (``refused_claimed``) and its pages are recomputed; claims a load took
or left behind (it releases them) or a finished request gave back no longer
count. Real kvcr + NIXL on loopback.
"""

from __future__ import annotations

import pytest

from cpu_harness.kvcr_pages import (
    PAGE_BYTES,
    fill_random,
    hashes_for,
    kv_transfer,
    make_linker,
    make_pool,
    offload_and_commit,
    prepare,
    restore,
    wait_until,
)
from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRConfigError
from sglang.srt.mem_cache.storage.kvcr.config.linker_config import KVCRLinkerConfig
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)

pytestmark = pytest.mark.kvcr


def _claimed(lk):
    return lk.stats_snapshot()["claimed_bytes"]


def test_claims_of_waiting_requests_stop_at_the_byte_bound():
    pool = make_pool("cpu")
    lk = make_linker(pool, max_claimed_bytes=2 * PAGE_BYTES)
    try:
        fill_random(pool, [1, 2, 3, 4], seed=5)
        first, second = hashes_for(2, "first"), hashes_for(2, "second")
        assert offload_and_commit(lk, first, [1, 2]) is True
        assert offload_and_commit(lk, second, [3, 4]) is True
        prepare(lk, "r1", first)  # claims both its pages: the bound is reached
        assert _claimed(lk) == 2 * PAGE_BYTES
        ctx = LinkerRequestContext("r2")
        handle = lk.prepare_request(ctx, kv_transfer(second))
        wait_until(lambda: lk.preparation_ready(handle), what="r2 prepared")
        assert lk.lookup("r2", kv_transfer(second)) == []  # recomputed
        assert lk.stats_snapshot()["refused_claimed"] == 1
        assert _claimed(lk) == 2 * PAGE_BYTES
        # r1 loads: its claims go with the load, and no longer count.
        assert restore(lk, "r1", first, [5, 6]) is True
        assert _claimed(lk) == 0
        prepare(lk, "r3", second)  # fits now
        assert _claimed(lk) == 2 * PAGE_BYTES
        for rid in ("r1", "r2", "r3"):
            lk.release_request(rid)
        assert _claimed(lk) == 0
    finally:
        lk.close()


def test_max_claimed_bytes_is_checked():
    base = {"local_dram_bytes_per_worker": 1 << 26}
    assert KVCRLinkerConfig.from_dict(base).max_claimed_bytes == 0  # half the share
    for bad in (-1, 1.5, "1", True):
        with pytest.raises(KVCRConfigError, match="max_claimed_bytes"):
            KVCRLinkerConfig.from_dict({**base, "max_claimed_bytes": bad})


@pytest.mark.parametrize(
    ("loaded", "case"),
    [(slice(1, 2), "the device prefix grew"), (slice(0, 1), "the ranks' MIN cut")],
)
def test_claims_a_load_leaves_behind_stop_counting_at_the_load(loaded, case):
    """A load takes the claims of the pages it restores; the rest of the request's
    (pages the device already has, or past a hit the ranks' MIN cut short) can
    never be restored after it, so they are released with it, not held until the
    request finishes (refusing the next requests meanwhile)."""
    pool = make_pool("cpu")
    lk = make_linker(pool, max_claimed_bytes=2 * PAGE_BYTES)
    try:
        fill_random(pool, [1, 2, 3, 4], seed=5)
        first, second = hashes_for(2, "first"), hashes_for(2, "second")
        assert offload_and_commit(lk, first, [1, 2]) is True
        assert offload_and_commit(lk, second, [3, 4]) is True
        prepare(lk, "r1", first)
        assert restore(lk, "r1", first[loaded], [6]) is True, case
        assert _claimed(lk) == 0, case  # r1 runs: it holds nothing more
        prepare(lk, "r2", second)  # not refused
        assert lk.stats_snapshot()["refused_claimed"] == 0, case
        assert restore(lk, "r2", second, [7, 8]) is True, case
        for rid in ("r1", "r2"):
            lk.release_request(rid)
        assert _claimed(lk) == 0
    finally:
        lk.close()
