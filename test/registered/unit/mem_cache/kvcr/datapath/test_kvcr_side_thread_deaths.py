"""A side thread that cannot use its device fails its work; nothing waits forever.

The loader and the stager bind their thread to the pools' device and make a
stream before any copy (``torch.cuda.set_device``, ``torch.cuda.Stream``). When
that raises (a device lost, out of memory for a stream), SGLang's layer counter
and the offload results would otherwise wait for a thread that is gone: the
forward hangs. Here the binding raises on purpose, on CPU, through the same code.
"""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from cpu_harness.kvcr_pages import (
    fill_random,
    hashes_for,
    kv_transfer,
    make_linker,
    make_pool,
    offload_and_commit,
    wait_until,
)
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import DeviceBinding
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)

pytestmark = pytest.mark.kvcr


@pytest.fixture
def lost_device(monkeypatch):
    """The loader and the stager lose their device (the DRAM copier, which
    ``test_kvcr_one_copy_offload`` covers, keeps it: offloads still store)."""
    original = DeviceBinding.bind_thread

    def bind_thread(self):
        if threading.current_thread().name == "kvcr-dram-copy":
            return original(self)
        raise RuntimeError("CUDA error: device lost (injected)")

    monkeypatch.setattr(DeviceBinding, "bind_thread", bind_thread)


def test_a_stager_that_cannot_bind_fails_each_offload(lost_device):
    pool = make_pool()
    fill_random(pool, [1, 2], seed=3)
    lk = make_linker(pool, offload_path="staged")
    try:
        hashes = hashes_for(2, "stager-dead")
        assert lk.offload(kv_transfer(hashes, [1, 2])) is True
        wait_until(lambda: lk.num_completed_offloads() >= 1, what="offload result")
        assert lk.pop_completed_offload() is False  # failed, never stored
        assert lk.residency.gauges().resident_keys == 0
    finally:
        lk.close()


def test_a_loader_that_cannot_bind_fails_its_batches_and_lookups_miss(lost_device):
    pool = make_pool()
    fill_random(pool, [1, 2], seed=4)
    lk = make_linker(pool, offload_path="direct")
    try:
        hashes = hashes_for(2, "loader-dead")
        assert offload_and_commit(lk, hashes, [1, 2]) is True
        wait_until(lambda: lk.restorer.paused, what="restores off")
        handle = lk.prepare_request(LinkerRequestContext("r"), kv_transfer(hashes))
        wait_until(lambda: lk.preparation_ready(handle), what="preparation")
        assert lk.lookup("r", kv_transfer(hashes)) == []  # recompute, not a hang
        lk.release_request("r")
        # A batch handed to the loader (the CUDA path) fails within a deadline.
        counter = lk.layer_done_counter
        index = counter.update_producer()
        lk.restorer.jobs.put((index, [], ()))
        done, _ = concurrent.futures.wait(counter.futures[index], timeout=10)
        assert len(done) == len(counter.futures[index])
        assert counter.finish(index) is False
    finally:
        lk.close()
