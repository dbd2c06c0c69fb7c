"""The GPU data path: never wrong bytes, never a host sync on the scheduler thread.

Covers the side threads' device binding, the stream fences a restore and a staged
offload wait on, draining before slots are handed back, exact page-locked sizes,
and byte-exact round trips (staged and direct offload, restore) with fresh random
bytes every repetition. Cases parametrized over ``device`` run on CPU in
``make test``; their ``cuda`` variants and the CUDA-only cases carry the ``gpu``
marker and run under ``gpu_check.sh`` (deselected where torch sees no device).
CPU-only cases stand in for CUDA with recording fakes where a fault or an
ordering cannot be produced without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from typing import Any

import pytest
import torch

from cpu_harness.fresh_process import run_isolated
from cpu_harness.kvcr_pages import (
    LAYERS,
    PAGE,
    PAGE_BYTES,
    REPS,
    fill_random,
    hashes_for,
    kv_transfer,
    make_linker,
    make_pool,
    offload_and_commit,
    page_bytes,
    prepare,
    restore,
    wait_until,
    wrong_bytes,
)
from sglang.srt.mem_cache.storage.kvcr import rank_setup
from sglang.srt.mem_cache.storage.kvcr.datapath.offload_staging import StageJob
from sglang.srt.mem_cache.storage.kvcr.datapath.span_restore import SpanRestore
from sglang.srt.mem_cache.storage.kvcr.device import host_memory
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import DeviceBinding

pytestmark = pytest.mark.kvcr

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# ---- round trips (CPU here, CUDA under gpu_check.sh) ---------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["staged", "direct"])
def test_offload_evict_restore_is_byte_exact_every_repetition(device, path):
    """Device pages -> (staging ->) KVCR DRAM -> other, scattered device pages, with
    fresh random bytes every repetition and the source pages overwritten between
    offload and restore; pages outside the restore are untouched."""
    pool = make_pool(device)
    lk = make_linker(pool, offload_path=path)
    try:
        assert (lk.offloader.staging is not None) == (path == "staged")
        src, dest = [3, 4, 5, 9], [40, 21, 33, 22]
        for rep in range(REPS):
            fill_random(pool, src + [50], seed=100 + rep)
            originals = [page_bytes(pool, p) for p in src]
            untouched = page_bytes(pool, 50)
            hashes = hashes_for(len(src), f"{device}-{path}-{rep}")
            assert offload_and_commit(lk, hashes, src, device) is True
            fill_random(pool, src + dest, seed=200 + rep)  # evicted: bytes gone
            prepare(lk, f"r{rep}", hashes)
            assert restore(lk, f"r{rep}", hashes, dest, device) is True
            assert wrong_bytes(pool, dest, originals) == 0
            assert torch.equal(page_bytes(pool, 50), untouched)
        assert lk.claims_held() == 0
        assert lk.stats.restored_bytes == REPS * len(src) * PAGE_BYTES
    finally:
        lk.close()


@pytest.mark.parametrize("device", DEVICES)
def test_select_picks_a_pools_pages_on_their_device(device):
    """``offload_queue.select`` (a trailing pool's pages among the KV transfer's):
    a leading run is a slice, any other choice an ``index_select`` whose index
    went up page-locked and ``non_blocking``; both stay on the pages' device and
    pick exactly the pages asked for."""
    from sglang.srt.mem_cache.storage.kvcr.datapath.offload_queue import select

    pages = torch.arange(0, 30, 3, device=device)
    lead, picked = select(pages, [0, 1, 2]), select(pages, [1, 4, 7, 9])
    assert lead.device == picked.device == pages.device
    assert lead.tolist() == [0, 3, 6]
    assert picked.tolist() == [3, 12, 21, 27]


# ---- CUDA-only orderings -------------------------------------------------------


def _late_indices(pages):
    """Slot indices computed on the current stream behind ~0.1 s of GPU work, as
    SGLang's allocator produces them on the scheduler stream."""
    base = torch.tensor(
        [p * PAGE + t for p in pages for t in range(PAGE)], device="cuda"
    )
    torch.cuda._sleep(200_000_000)
    return base * 1  # written only after the sleep


def _restore_under_a_busy_forward(fenced: bool, monkeypatch) -> int:
    """Wrong bytes after restores that race the batch still writing the restore's
    pages on the forward stream, with indices the scheduler stream computes late.
    Only non-default streams: nothing orders the loader but the linker's fences."""
    pool = make_pool("cuda")
    forward = torch.cuda.Stream()
    scheduler = torch.cuda.Stream()
    lk = make_linker(pool, forward_stream=forward, offload_path="staged")
    if not fenced:  # negative control: the race is real
        monkeypatch.setattr(DeviceBinding, "record_fences", lambda self, fwd: ())
    wrong = 0
    try:
        src, dest = [1, 2, 3, 4, 5, 6], [30, 31, 32, 33, 34, 35]
        with torch.cuda.stream(scheduler):
            for rep in range(REPS):
                fill_random(pool, src, seed=300 + rep)
                originals = [page_bytes(pool, p) for p in src]
                hashes = hashes_for(len(src), f"fence-{fenced}-{rep}")
                assert offload_and_commit(lk, hashes, src, "cuda") is True
                prepare(lk, f"f{rep}", hashes)
                torch.cuda.synchronize()
                with torch.cuda.stream(forward):  # the batch already launched
                    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
                    fill_random(pool, dest, seed=400 + rep)
                transfer = kv_transfer(hashes)
                transfer[0].device_indices = _late_indices(dest)
                assert lk.load(f"f{rep}", transfer) is True
                index = lk.start_layer_wise_loading()
                assert lk.finish_layer_wise_loading(index) is True
                torch.cuda.synchronize()
                wrong += wrong_bytes(pool, dest, originals)
    finally:
        lk.close()
    return wrong


@pytest.mark.gpu
def test_restore_waits_for_the_batch_still_writing_freed_pages(monkeypatch):
    """Overlap scheduling: the launched batch (forward stream) may still write pages
    the allocator already handed to a restore, and the destination indices may
    still be in flight on the scheduler stream. The restore lands after both."""
    assert _restore_under_a_busy_forward(True, monkeypatch) == 0


# What an unfenced restore may raise besides landing wrong bytes: stale indices
# make index_copy_ assert on the device, or the CUDA sanitizer reports the race.
RACE_FAULT = re.compile(
    r"CUDA error|device-side assert|AcceleratorError|data race|CSAN"
)


def _unfenced_restore() -> dict[str, Any]:
    """The negative control's body, in a process of its own (``run_isolated``):
    wrong bytes counted, or the fault the race caused, with the CUDA context's
    state after it (a device-side assert is sticky and poisons the process)."""
    with pytest.MonkeyPatch.context() as mp:
        try:
            return {"wrong": _restore_under_a_busy_forward(False, mp), "fault": ""}
        except Exception as exc:
            fault = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
    try:
        torch.cuda.synchronize()
        context = "usable"
    except Exception as exc:
        context = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
    return {"wrong": 0, "fault": fault, "context": context}


@pytest.mark.gpu
def test_restore_without_fences_is_overwritten_negative_control():
    """The same race with the fences removed goes wrong: the test above can fail.
    Run in a fresh process: stale indices can raise a sticky device-side assert,
    which would error every CUDA test after this one in a shared process."""
    out = run_isolated(_unfenced_restore, timeout_s=240, name="kvcr-unfenced")
    raced = out["wrong"] > 0 or RACE_FAULT.search(
        f"{out['fault']} {out.get('context', '')}"
    )
    assert raced, out


def _offload_under_a_busy_forward(path: str, fenced: bool, monkeypatch) -> int:
    """Wrong bytes restored after offloads of pages the forward stream is still
    writing (its batch sleeps ~0.1 s of GPU time first). Only non-default
    streams: nothing orders the copy after the forward but the linker's fences."""
    pool = make_pool("cuda")
    forward = torch.cuda.Stream()
    scheduler = torch.cuda.Stream()
    lk = make_linker(pool, forward_stream=forward, offload_path=path)
    if not fenced:  # negative control: SGLang's forward-stream event is not taken
        monkeypatch.setattr(lk, "forward_stream", None)
    wrong = 0
    try:
        src, dest = [7, 8, 9], [41, 42, 43]
        with torch.cuda.stream(scheduler):
            for rep in range(REPS):
                fill_random(pool, src, seed=500 + rep)
                torch.cuda.synchronize()
                with torch.cuda.stream(forward):  # the KV is still being written
                    torch.cuda._sleep(200_000_000)
                    fill_random(pool, src, seed=600 + rep)
                forward.synchronize()
                written = [page_bytes(pool, p) for p in src]
                fill_random(pool, src, seed=500 + rep)  # back to the old bytes
                torch.cuda.synchronize()
                with torch.cuda.stream(forward):
                    torch.cuda._sleep(200_000_000)
                    fill_random(pool, src, seed=600 + rep)  # queued: host not held
                hashes = hashes_for(len(src), f"offload-fence-{fenced}-{rep}")
                assert offload_and_commit(lk, hashes, src, "cuda") is True
                prepare(lk, f"o{rep}", hashes)
                assert restore(lk, f"o{rep}", hashes, dest, "cuda") is True
                torch.cuda.synchronize()
                wrong += wrong_bytes(pool, dest, written)
    finally:
        lk.close()
    return wrong


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["staged", "direct"])
def test_offload_waits_for_the_forward_that_writes_its_pages(path, monkeypatch):
    """The copy (the stager's, or the one copy into KVCR DRAM) reads the pages
    only after the forward stream wrote them."""
    assert _offload_under_a_busy_forward(path, True, monkeypatch) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["staged", "direct"])
def test_offload_without_the_forward_event_copies_stale_pages_negative_control(
    path, monkeypatch
):
    """The same offloads without the forward stream's event read the pages before
    the batch wrote them: the test above can fail. (Page numbers reach the
    copy from the host here, so a race only ever reads stale bytes.)"""
    assert _offload_under_a_busy_forward(path, False, monkeypatch) > 0


@pytest.mark.gpu
def test_failed_restore_drains_its_stream_before_slots_are_given_back(monkeypatch):
    """A copy that raises with work still queued: the counter fails only after the
    loader's stream has drained, so freed slots are never written afterwards."""
    pool = make_pool("cuda")
    lk = make_linker(pool)
    try:
        src, dest = [1, 2], [20, 21]
        fill_random(pool, src, seed=7)
        hashes = hashes_for(2, "fail")
        assert offload_and_commit(lk, hashes, src, "cuda") is True
        prepare(lk, "x", hashes)
        queued = {}

        def copy_then_raise(*args, **kwargs):
            torch.cuda._sleep(200_000_000)  # on the loader's stream
            queued["event"] = torch.cuda.Event()
            queued["event"].record()
            raise RuntimeError("injected copy failure")

        drained_at_fail = []
        real_fail = lk.layer_done_counter.fail

        def fail(index, exc):
            drained_at_fail.append(queued["event"].query())
            real_fail(index, exc)

        monkeypatch.setattr(lk.restorer.span_restore, "copy_pool", copy_then_raise)
        monkeypatch.setattr(lk.layer_done_counter, "fail", fail)
        assert restore(lk, "x", hashes, dest, "cuda") is False
        assert drained_at_fail == [True]
        assert lk.claims_held() == 0
    finally:
        lk.close()


@pytest.mark.gpu
def test_pools_on_the_last_device_round_trip_with_side_threads_bound_there():
    """A rank's pools on device N (N = the last device; 0 on a one-GPU host):
    the linker binds its threads to N even when the caller moves elsewhere."""
    last = torch.cuda.device_count() - 1
    torch.cuda.set_device(last)
    pool = make_pool("cuda")  # SGLang passes a bare "cuda" after set_device
    lk = make_linker(pool, offload_path="staged")
    try:
        assert lk._device.device == torch.device("cuda", last)
        torch.cuda.set_device(0)
        src, dest = [1, 2, 3], [10, 12, 11]
        fill_random(pool, src, seed=11)
        originals = [page_bytes(pool, p) for p in src]
        hashes = hashes_for(3, "last-device")
        assert offload_and_commit(lk, hashes, src, f"cuda:{last}") is True
        prepare(lk, "d", hashes)
        assert restore(lk, "d", hashes, dest, f"cuda:{last}") is True
        assert wrong_bytes(pool, dest, originals) == 0
    finally:
        lk.close()
        torch.cuda.set_device(0)


# ---- CPU stand-ins for what needs a GPU to fail ---------------------------------


class _Recorder:
    """Fake CUDA device/stream/event calls, logged with the calling thread."""

    def __init__(self):
        self.log = []

    def add(self, *what):
        self.log.append((threading.current_thread().name, *what))

    def install(self, monkeypatch):
        rec = self

        class FakeStream:
            def __init__(self, device=None):
                rec.add("stream", torch.device(device))

            def wait_event(self, event):
                rec.add("wait_event", event)

            def query(self):
                rec.add("drain")
                return True

        monkeypatch.setattr(
            torch.cuda, "set_device", lambda d: rec.add("set_device", d)
        )
        monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())

    def kinds(self, thread):
        return [entry[1] for entry in self.log if entry[0] == thread]


def _unfence_for_good() -> bool:
    """What the negative control does to its process, never undone: the fences
    gone (and on CUDA, possibly a sticky device-side assert)."""
    DeviceBinding.record_fences = lambda self, forward: ()  # type: ignore[method-assign]
    return DeviceBinding.of("cpu").record_fences(None) == ()


def test_the_negative_control_runs_in_a_process_of_its_own():
    """``run_isolated`` (how the negative control runs): what the child breaks
    stays in the child, its result comes back, and a child that dies fails the
    calling test with a report instead of taking the test process with it."""
    real = DeviceBinding.record_fences
    assert run_isolated(_unfence_for_good, timeout_s=120) is True
    assert DeviceBinding.record_fences is real  # this process still fences
    with pytest.raises(pytest.fail.Exception, match="exited with code -6"):
        run_isolated(os.abort, timeout_s=120)
    assert DeviceBinding.of("cpu").record_fences(None) == ()  # CPU: no fences


def test_stager_binds_the_pools_device_and_drains_before_depositing(monkeypatch):
    """The stager thread sets the captured device before creating its stream on
    it, orders its stream after the offload-ready events, and submits the deposit
    only after draining the stream (a deposit must never read slots whose copy is
    still in flight)."""
    from sglang.srt.mem_cache.storage.kvcr.datapath.offload_staging import HostStaging

    rec = _Recorder()
    rec.install(monkeypatch)
    pool = make_pool("cpu")
    lk = make_linker(pool, offload_path="direct")  # a layout and source rows
    try:
        layout = lk.layout
        staging = HostStaging(
            layout.pools,
            lk.restorer.dest_rows,
            8,
            memory=host_memory.HostMemory(pin=False),
            device=DeviceBinding(torch.device("cuda", 3)),
        )
        fill_random(pool, [5, 6], seed=1)
        want = [page_bytes(pool, p) for p in (5, 6)]
        real_copy = staging._copy_part
        staging._copy_part = lambda *a: (rec.add("copy"), real_copy(*a))
        done = threading.Event()
        name = layout.pools[0].name
        ready = object()
        staging.stage(
            StageJob(
                copies=((name, torch.tensor([5, 6]), (3, 4)),),
                events=(ready,),
                submit=lambda: (rec.add("submit"), done.set()),
                fail=lambda exc: done.set(),
            )
        )
        assert done.wait(10)
        assert staging.close(5)
        kinds = rec.kinds("kvcr-stager")
        copies = ["copy"] * len(layout.pools[0].spans)  # one per part
        assert kinds == [
            "set_device",
            "stream",
            "wait_event",
            *copies,
            "drain",
            "submit",
        ]
        assert rec.log[0][2] == torch.device("cuda", 3)
        assert rec.log[1][2] == torch.device("cuda", 3)
        assert rec.log[2][2] is ready
        staged = staging.buffers[name]
        got = [
            torch.cat([staged[part][slot] for part in range(staged.shape[0])])
            for slot in (3, 4)
        ]
        # The pool's page bytes are part-major per page, like the staged rows.
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    finally:
        lk.close()


@pytest.mark.parametrize("fails", [False, True])
def test_loader_binds_the_device_waits_its_fences_and_drains_first(monkeypatch, fails):
    """The restore loader binds the captured device, orders its stream after the
    fences taken at start_layer_wise_loading, and drains the stream before it
    completes the layers or, when a copy raises, fails the batch."""
    pool = make_pool("cpu")
    lk = make_linker(pool)
    rec = _Recorder()
    cpu_binding = lk.restorer._device
    try:
        src, dest = [1, 2, 3], [11, 12, 13]
        fill_random(pool, src, seed=3)
        originals = [page_bytes(pool, p) for p in src]
        hashes = hashes_for(3, f"loader-{fails}")
        assert offload_and_commit(lk, hashes, src, "cpu") is True
        prepare(lk, "l", hashes)
        assert lk.load("l", kv_transfer(hashes, dest)) is True
        # The loader thread as on a GPU host: device cuda:2, CUDA calls recorded.
        lk.restorer.jobs.put(None)
        lk.restorer.thread.join(5)
        rec.install(monkeypatch)
        lk.restorer._device = DeviceBinding(torch.device("cuda", 2))
        lk.restorer.span_restore = span = SpanRestore(torch.device("cpu"))
        real_copy = span.copy_pool

        def copy_pool(*args):
            rec.add("copy")
            if fails:
                raise RuntimeError("injected copy failure")
            real_copy(*args)

        monkeypatch.setattr(span, "copy_pool", copy_pool)
        counter = lk.layer_done_counter
        for method in ("complete", "fail"):
            real = getattr(counter, method)
            monkeypatch.setattr(
                counter,
                method,
                lambda *a, _real=real, _m=method: (rec.add(_m), _real(*a))[1],
            )
        loader = lk.restorer.loader_main
        lk.restorer.thread = threading.Thread(target=loader, name="kvcr-loader-t")
        lk.restorer.thread.start()
        fence = object()
        monkeypatch.setattr(
            DeviceBinding, "record_fences", lambda self, forward: (fence,)
        )
        index = lk.start_layer_wise_loading()
        ok = lk.finish_layer_wise_loading(index)
        kinds = rec.kinds("kvcr-loader-t")
        assert kinds[:3] == ["set_device", "stream", "wait_event"]
        assert rec.log[0][2] == torch.device("cuda", 2)
        assert next(e for e in rec.log if e[1] == "wait_event")[2] is fence
        if fails:
            assert ok is False
            assert kinds[3:] == ["copy", "drain", "fail"]
        else:
            assert ok is True
            assert kinds[3:] == ["copy", "drain"] + ["complete"] * LAYERS
            assert wrong_bytes(pool, dest, originals) == 0
    finally:
        lk.restorer._device = cpu_binding
        lk.close()


def test_loader_releases_an_outgrown_scratch_only_after_draining(monkeypatch):
    """A restore whose pages outgrow the device scratch replaces it on the loader
    stream; the loader drains the stream first and only then lets the old block
    go (``SpanRestore.drained``), so no copy still queued reads freed memory."""
    pool = make_pool("cpu")
    lk = make_linker(pool)
    rec = _Recorder()
    cpu_binding = lk.restorer._device
    try:
        src, dest = [1, 2], [11, 12]
        fill_random(pool, src, seed=4)
        originals = [page_bytes(pool, p) for p in src]
        hashes = hashes_for(2, "outgrown")
        assert offload_and_commit(lk, hashes, src, "cpu") is True
        prepare(lk, "o", hashes)
        assert lk.load("o", kv_transfer(hashes, dest)) is True
        lk.restorer.jobs.put(None)
        lk.restorer.thread.join(5)
        rec.install(monkeypatch)
        lk.restorer._device = DeviceBinding(torch.device("cuda", 1))
        # A scratch smaller than one page's parts: the first copy outgrows it.
        lk.restorer.span_restore = span = SpanRestore(
            torch.device("cpu"), scratch_bytes=8
        )
        real_drained = span.drained
        monkeypatch.setattr(
            span,
            "drained",
            lambda: (rec.add("drained", len(span._retired)), real_drained())[1],
        )
        loader = lk.restorer.loader_main
        lk.restorer.thread = threading.Thread(target=loader, name="kvcr-loader-o")
        lk.restorer.thread.start()
        monkeypatch.setattr(DeviceBinding, "record_fences", lambda self, fwd: ())
        index = lk.start_layer_wise_loading()
        assert lk.finish_layer_wise_loading(index) is True
        kinds = rec.kinds("kvcr-loader-o")
        assert kinds[kinds.index("drain") :][:2] == ["drain", "drained"]
        held = next(e[2] for e in rec.log if e[1] == "drained")
        assert held >= 1  # the outgrown block was alive through the drain
        assert span._retired == []  # and released after it
        assert wrong_bytes(pool, dest, originals) == 0
    finally:
        lk.restorer._device = cpu_binding
        lk.close()


class _SyncSpy(torch.Tensor):
    """An index tensor that records calls which would block the host on CUDA."""

    calls: list[str] = []
    active = False
    BLOCKING = frozenset(
        {
            *("tolist", "item", "__int__", "__index__", "__bool__", "__float__"),
            *("numpy", "cpu", "to", "copy_", "nonzero"),
        }
    )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if cls.active and name in cls.BLOCKING:
            cls.calls.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


@contextlib.contextmanager
def _watching():
    _SyncSpy.calls = []
    _SyncSpy.active = True
    try:
        yield _SyncSpy.calls
    finally:
        _SyncSpy.active = False


@pytest.mark.parametrize("path", ["staged", "direct"])
def test_scheduler_thread_never_reads_device_indices_on_the_host(path):
    """``load`` and ``offload`` run on the scheduler thread: on CUDA every host read
    of a device index tensor (``int()``, ``.tolist()``, ``.item()``) waits for the
    GPU. They must not read any (the pages stay on the device until a side
    thread or a later pump needs them). A device pool always has a fence to wait
    for, so the offload here carries one, complete already (a CPU pool has none,
    and its host reads cost nothing)."""
    pool = make_pool("cpu")
    lk = make_linker(pool, offload_path=path)
    try:
        fence = _Fence()
        fence.done = True
        lk.offloader._device = _FencedBinding(lk.offloader._device, fence)
        src, dest = [1, 2, 3, 4], [20, 22, 21, 23]
        fill_random(pool, src, seed=9)
        originals = [page_bytes(pool, p) for p in src]
        hashes = hashes_for(4, f"spy-{path}")
        with _watching() as calls:  # the spy's positive control: a host read
            kv_transfer(hashes, src, cls=_SyncSpy)[0].device_indices.tolist()
        assert calls == ["tolist"]
        with _watching() as calls:
            assert lk.offload(kv_transfer(hashes, src, cls=_SyncSpy)) is True
        assert calls == []
        wait_until(lambda: lk.num_completed_offloads() >= 1, what="offload")
        assert lk.pop_completed_offload() is True
        prepare(lk, "s", hashes)
        with _watching() as calls:
            assert lk.load("s", kv_transfer(hashes, dest, cls=_SyncSpy)) is True
        assert calls == []
        index = lk.start_layer_wise_loading()
        assert lk.finish_layer_wise_loading(index) is True
        assert wrong_bytes(pool, dest, originals) == 0
    finally:
        lk.close()


class _Fence:
    """A CUDA event stand-in: completes when told; blocking on it is an error."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        raise AssertionError("the scheduler thread blocked on an event")


class _FencedBinding:
    def __init__(self, real, fence):
        self._real, self._fence = real, fence

    def __getattr__(self, name):
        return getattr(self._real, name)

    def record_fences(self, forward_stream):
        return (self._fence,)


def test_direct_offload_is_deposited_once_its_fences_complete_without_blocking():
    """A direct-path offload whose pages are not yet written is held back, in
    order, by later pumps, without the scheduler thread blocking on an event;
    it is deposited and stored once the fence completes."""
    pool = make_pool("cpu")
    lk = make_linker(pool, offload_path="direct")
    try:
        fence = _Fence()
        lk.offloader._device = _FencedBinding(lk.offloader._device, fence)
        fill_random(pool, [1, 2], seed=5)
        originals = [page_bytes(pool, p) for p in (1, 2)]
        hashes = hashes_for(2, "fenced")
        assert lk.offload(kv_transfer(hashes, [1, 2])) is True
        for _ in range(20):
            assert lk.num_completed_offloads() == 0
            time.sleep(0.005)
        assert lk.offloader.queue.deferred_count == 1
        assert lk._adapter.stats().inflight_offload_bytes == 0  # nothing submitted
        fence.done = True
        wait_until(lambda: lk.num_completed_offloads() == 1, what="fenced offload")
        assert lk.pop_completed_offload() is True
        prepare(lk, "d", hashes)
        assert restore(lk, "d", hashes, [30, 31], "cpu") is True
        assert wrong_bytes(pool, [30, 31], originals) == 0
    finally:
        lk.close()


# ---- exact page-locked sizes ----------------------------------------------------


def test_host_memory_locks_exactly_the_bytes_asked_for():
    registered, unregistered = [], []
    mem = host_memory.HostMemory(
        pin=True,
        register=lambda ptr, n: registered.append((ptr, n)),
        unregister=unregistered.append,
    )
    buf = mem.alloc(3 * 4096 + 17)  # far from a power of two
    assert buf.numel() == 3 * 4096 + 17 and not bool(buf.any())
    assert registered == [(buf.data_ptr(), 3 * 4096 + 17)]
    assert buf.data_ptr() % 4096 == 0
    assert mem.pinned_bytes == 3 * 4096 + 17
    mem.release(buf)
    assert unregistered == [buf.data_ptr()] and mem.pinned_bytes == 0
    assert not host_memory.HostMemory(pin=False).alloc(100).is_pinned()


def test_linker_pins_exactly_its_dram_share_and_staging(monkeypatch):
    """What a GPU host would lock, counted through a stand-in for
    cudaHostRegister: KVCR DRAM and staging at exactly their sizes (torch's
    caching host allocator would round each up to a power of two), reported as
    ``pinned_bytes`` in the stats, and all unlocked at close."""
    locked: dict[int, int] = {}
    monkeypatch.setattr(
        host_memory, "_cuda_register", lambda p, n: locked.update({p: n})
    )
    monkeypatch.setattr(host_memory, "_cuda_unregister", lambda p: locked.pop(p))
    real = host_memory.HostMemory
    # rank_setup builds the rank's memory with a pinning HostMemory.
    monkeypatch.setattr(rank_setup, "HostMemory", lambda pin: real(pin=True))
    pool = make_pool("cpu")
    share = 37 * PAGE_BYTES + 123  # not a power of two, not whole pages
    inflight = 5 * PAGE_BYTES
    lk = make_linker(
        pool,
        local_dram_bytes_per_worker=share,
        offload_path="staged",
        max_inflight_offload_bytes=inflight,
    )
    try:
        storage = sum(t.numel() for t in lk.dram.storage.values())
        staging = sum(t.numel() for t in lk.offloader.staging.buffers.values())
        assert storage == share // PAGE_BYTES * PAGE_BYTES  # whole pages only
        assert staging == inflight
        assert sorted(locked.values()) == sorted(
            [t.numel() for t in lk.dram.storage.values()]
            + [t.numel() for t in lk.offloader.staging.buffers.values()]
        )
        assert lk.dram.memory.pinned_bytes == storage + staging
        assert f"pinned_bytes={storage + staging} " in lk.stats_line()
        fill_random(pool, [1], seed=2)
        want = page_bytes(pool, 1)
        hashes = hashes_for(1, "pinned")
        assert offload_and_commit(lk, hashes, [1], "cpu") is True
        prepare(lk, "p", hashes)
        assert restore(lk, "p", hashes, [9], "cpu") is True
        assert torch.equal(page_bytes(pool, 9), want)
    finally:
        lk.close()
    assert locked == {}


def test_a_load_whose_indices_do_not_cover_its_pages_is_not_queued():
    """A transfer with fewer slot indices than pages is refused (the wrapper
    recomputes the request) instead of failing a restore batch later."""
    pool = make_pool("cpu")
    lk = make_linker(pool)
    try:
        fill_random(pool, [1, 2], seed=4)
        hashes = hashes_for(2, "short")
        assert offload_and_commit(lk, hashes, [1, 2], "cpu") is True
        prepare(lk, "short", hashes)
        transfer = kv_transfer(hashes, [20, 21])
        transfer[0].device_indices = transfer[0].device_indices[: PAGE + 1]
        assert lk.load("short", transfer) is False
        assert lk.start_layer_wise_loading() == -1
        assert lk.stats.restore_copy_failures == 0 and lk.stats.load_failures == 0
        short = kv_transfer(hashes_for(2, "short-o"), [1])  # 2 pages, 1 page of slots
        assert lk.offload(short) is True
        wait_until(lambda: lk.num_completed_offloads() == 1, what="short offload")
        assert lk.pop_completed_offload() is False  # stored nothing
    finally:
        lk.close()


def test_a_direct_offload_whose_pages_never_get_written_fails_at_its_deadline():
    """Fences that never complete (a wedged stream) fail that offload after
    ``operation_timeout_ms`` instead of holding every later result back."""
    pool = make_pool("cpu")
    lk = make_linker(pool, offload_path="direct", operation_timeout_ms=300)
    try:
        lk.offloader._device = _FencedBinding(lk.offloader._device, _Fence())
        fill_random(pool, [1], seed=6)
        assert lk.offload(kv_transfer(hashes_for(1, "wedged"), [1])) is True
        lk.offloader._device = (
            lk.offloader._device._real
        )  # later offloads have nothing to wait for
        assert lk.offload(kv_transfer(hashes_for(1, "after"), [1])) is True
        wait_until(lambda: lk.num_completed_offloads() == 2, what="both results")
        assert [lk.pop_completed_offload(), lk.pop_completed_offload()] == [False, True]
    finally:
        lk.close()
