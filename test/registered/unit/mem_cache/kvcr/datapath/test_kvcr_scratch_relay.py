"""The two-stream scratch relay: no half is rewritten before its reader is done,
and no half is read before its writer is done.

On CPU the relay's stream protocol runs against recording fake streams and events,
and a happens-before check over what they recorded says whether every chunk's
fill precedes its read and every read precedes the next fill of its half. On CUDA
(``gpu``) the restore and the offload run through real streams with one side made
slow by ``torch.cuda._sleep``, byte-exact; and the same runs with one wait of the
relay removed must come out wrong (the negative control: the test can see a race).
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from sglang.srt.mem_cache.storage.kvcr.datapath import scratch_relay
from sglang.srt.mem_cache.storage.kvcr.datapath.copy_jobs import PoolCopy, SlotViews
from sglang.srt.mem_cache.storage.kvcr.datapath.device_gather import DeviceGather
from sglang.srt.mem_cache.storage.kvcr.datapath.scratch_relay import ScratchRelay
from sglang.srt.mem_cache.storage.kvcr.datapath.span_restore import SpanRestore
from sglang.srt.mem_cache.storage.kvcr.device.host_memory import HostMemory

pytestmark = pytest.mark.kvcr


# ---- the protocol, on recording fakes (CPU) ---------------------------------------


class _Stream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: list[tuple[Any, ...]] = []

    def wait_event(self, event: _Event) -> None:
        self.ops.append(("wait", event.at))


class _Event:
    def __init__(self) -> None:
        self.at: tuple[str, int] | None = None

    def record(self, stream: _Stream) -> None:
        self.at = (stream.name, len(stream.ops))  # after every op queued so far


def _precedes(streams: list[_Stream]) -> Any:
    """``before(a, b)``: op ``a`` (stream name, index) completes before ``b``
    starts, through stream order and waits on recorded events."""
    by_name = {s.name: s for s in streams}

    def before(a: tuple[str, int], b: tuple[str, int]) -> bool:
        seen, todo = set(), [b]
        while todo:  # walk back from b over what it waits for
            name, i = todo.pop()
            if (name, i) in seen:
                continue
            seen.add((name, i))
            if name == a[0] and a[1] < i:
                return True
            for j in range(i - 1, -1, -1):
                op = by_name[name].ops[j]
                if op[0] == "wait" and op[1] is not None:
                    todo.append(op[1])
        return False

    return before


def _drive(relay: ScratchRelay, writer: _Stream, reader: _Stream, chunks: int):
    """Chunks through the relay as the restore and offload do; each chunk's fill
    and read positions."""
    fills, reads = [], []
    for k in range(chunks):
        half, _ = relay.take(8, writer)
        fills.append((writer.name, len(writer.ops)))
        writer.ops.append(("fill", k, half))
        with relay.reading(half, writer, reader):
            reads.append((reader.name, len(reader.ops)))
            reader.ops.append(("read", k, half))
    return fills, reads


@pytest.mark.parametrize("broken", [None, "free", "filled"])
def test_every_fill_precedes_its_read_and_every_read_the_next_fill(
    monkeypatch, broken
) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    relay = ScratchRelay(torch.device("cpu"), 64, two_streams=False)
    relay.two_streams, relay._side = True, _Stream("side")
    if broken == "free":  # the writer no longer waits for the half's reader
        _remove_wait(monkeypatch, "reader")
    if broken == "filled":  # the reader no longer waits for the writer
        _remove_wait(monkeypatch, "writer")
    main = _Stream("main")
    for writer, reader in ((main, relay.side()), (relay.side(), main)):
        fills, reads = _drive(relay, writer, reader, chunks=6)
        before = _precedes([main, relay.side()])
        ordered_reads = all(before(f, r) for f, r in zip(fills, reads, strict=True))
        ordered_fills = all(before(reads[k], fills[k + 2]) for k in range(4))
        assert ordered_reads is (broken != "filled")
        assert ordered_fills is (broken != "free")
        # The two halves alternate, so a read and the next chunk's fill are
        # not ordered against each other: that is the overlap.
        assert not before(reads[0], fills[1])


def test_without_two_streams_both_roles_run_on_the_callers_stream() -> None:
    relay = ScratchRelay(torch.device("cpu"), 64, two_streams=True)
    assert relay.side() is None  # CPU: never a second stream
    halves = [relay.take(8, None)[0] for _ in range(4)]
    assert halves == [0, 1, 0, 1]
    # Halves start 256-byte aligned (a kernel is compiled for aligned pointers).
    assert relay.half_bytes == scratch_relay.ALIGN
    assert relay.grow(scratch_relay.ALIGN) is None
    assert relay.grow(scratch_relay.ALIGN + 1) is not None
    assert relay.half_bytes == 2 * scratch_relay.ALIGN
    starts = [relay.take(8, None) for _ in range(2)]  # halves 0 and 1
    offsets = [t.data_ptr() - relay.scratch.data_ptr() for _, t in starts]
    assert offsets == [0, relay.half_bytes]
    assert relay.half_bytes % scratch_relay.ALIGN == 0


# ---- real streams (CUDA) ---------------------------------------------------------

SLEEP_CYCLES = 5_000_000  # a few ms per chunk on the slow side: any race shows


def _slow(monkeypatch, side: str) -> None:
    """Queue a sleep on the writer before each fill, or on the reader before each
    read, so the other stream runs ahead."""
    if side == "writer":
        real_take = ScratchRelay.take

        def take(self, nbytes, writer):
            got = real_take(self, nbytes, writer)
            with scratch_relay.on(writer):
                torch.cuda._sleep(SLEEP_CYCLES)
            return got

        monkeypatch.setattr(ScratchRelay, "take", take)
    else:
        real_reading = ScratchRelay.reading

        @contextlib.contextmanager
        def reading(self, half, writer, reader):
            with real_reading(self, half, writer, reader):
                torch.cuda._sleep(SLEEP_CYCLES)  # on the reader (current stream)
                yield

        monkeypatch.setattr(ScratchRelay, "reading", reading)


def _remove_wait(monkeypatch, slow: str) -> None:
    """The relay's one wait that the slow side needs, removed."""
    if slow == "reader":  # a fill must wait for the half's slow reader
        real_take = ScratchRelay.take
        monkeypatch.setattr(
            ScratchRelay,
            "take",
            lambda self, n, w: (
                setattr(self, "_free", [None, None]),
                real_take(self, n, w),
            )[1],
        )
    else:  # a read must wait for the slow writer
        monkeypatch.setattr(ScratchRelay, "hand_over", staticmethod(lambda w, r: None))


@contextlib.contextmanager
def _raced(control: bool) -> Iterator[None]:
    """A negative control under ``TORCH_CUDA_SANITIZER=1`` (gpu_check's second
    pass) is stopped at the racing launch: that report counts as the race seen."""
    try:
        yield
    except Exception as exc:
        if not (control and re.search(r"data race|CSAN|Sanitizer", repr(exc))):
            raise


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("control", [False, True])
@pytest.mark.parametrize("slow", ["writer", "reader"])
def test_restore_through_two_streams_is_byte_exact(monkeypatch, slow, control, kernel):
    """SpanRestore with halves of two pages: 16 chunks alternate; every page
    lands, scattered in one launch per chunk (``kernel``) or part by part; with
    the relay's wait removed (``control``) some page is wrong."""
    from sglang.srt.mem_cache.storage.kvcr.datapath import page_rows_kernel

    parts, pages, row = 6, 32, 4096
    memory = HostMemory(pin=True)
    raw = memory.alloc_like((parts * pages, row))
    raw.copy_(torch.randint(0, 256, (parts * pages, row), dtype=torch.uint8))
    store = raw.view(torch.int64)  # words, as the restorer hands them over
    order = random.Random(slow).sample(range(pages), pages)
    slots = [tuple(range(parts * o, parts * o + parts)) for o in order]
    dest = random.Random(f"{slow}d").sample(range(2 * pages), pages)
    dsts = [
        torch.zeros(2 * pages, row // 8, dtype=torch.int64, device="cuda")
        for _ in range(parts)
    ]
    monkeypatch.setitem(page_rows_kernel._state, "off", not kernel)
    _slow(monkeypatch, slow)
    if control:
        _remove_wait(monkeypatch, slow)
    span = SpanRestore(torch.device("cuda"), memory, scratch_bytes=2 * 2 * parts * row)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()  # the zeroed pages, before the side streams write
    try:
        with _raced(control):
            with torch.cuda.stream(stream):
                span.copy_pool(dsts, torch.tensor(dest, device="cuda"), store, slots)
            stream.synchronize()
            span.drained()
            assert span._relay.chunks >= pages // 2
            assert (span.kernel_chunks > 0) is kernel
            wrong = sum(
                not torch.equal(dsts[p][dest[i]].cpu(), store[slots[i][p]])
                for i in range(pages)
                for p in range(parts)
            )
            assert (wrong > 0) is control
    finally:
        torch.cuda.synchronize()
        span.close()
        memory.release(raw)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("control", [False, True])
@pytest.mark.parametrize("slow", ["writer", "reader"])
def test_offload_gather_through_two_streams_is_byte_exact(
    monkeypatch, slow, control, kernel
):
    """DeviceGather with halves of two slots: every slot gets its page's spans,
    gathered in one launch per chunk (``kernel``) or span by span; with the
    relay's wait removed (``control``) some slot is wrong."""
    from sglang.srt.mem_cache.storage.kvcr.datapath import page_rows_kernel

    monkeypatch.setitem(page_rows_kernel._state, "off", not kernel)
    nparts, pages, row = 6, 32, 4096
    spans = [
        torch.randint(0, 256, (pages, row), dtype=torch.uint8, device="cuda")
        for _ in range(nparts)
    ]
    slot_bytes = nparts * row
    memory = HostMemory(pin=True)
    store = memory.alloc_like((pages * slot_bytes,))
    store.zero_()
    view = store.view(pages, slot_bytes)
    src = random.Random(slow).sample(range(pages), pages)
    group = PoolCopy(
        spans, SlotViews((0, slot_bytes, pages), view), src, list(range(pages)), store
    )
    _slow(monkeypatch, slow)
    if control:
        _remove_wait(monkeypatch, slow)
    gather = DeviceGather()
    gather.scratch_bytes = 2 * 2 * slot_bytes
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()  # the random pages, before the side streams read
    try:
        with _raced(control):
            with torch.cuda.stream(stream):
                gather.copy(group, None)
            stream.synchronize()
            want = torch.cat([s.cpu() for s in spans], dim=1)
            wrong = sum(not torch.equal(view[i], want[src[i]]) for i in range(pages))
            assert (wrong > 0) is control
            assert bool(gather._kernels) is kernel  # the kernel path was taken
    finally:
        torch.cuda.synchronize()
        memory.release(store)


def _fail_at_read(monkeypatch, n: int) -> None:
    """The ``n``-th read of a half raises once its slow work is queued (the
    copy fails half-way, with work still queued on the second stream)."""
    real_reading = ScratchRelay.reading
    seen = [0]

    @contextlib.contextmanager
    def reading(self, half, writer, reader):
        with real_reading(self, half, writer, reader):
            torch.cuda._sleep(SLEEP_CYCLES)
            seen[0] += 1
            if seen[0] == n:
                raise RuntimeError("copy failed half-way (injected)")
            yield

    monkeypatch.setattr(ScratchRelay, "reading", reading)


def _fail_at_take(monkeypatch, n: int) -> None:
    """The ``n``-th fill of a half raises once a slow step is queued on its
    writer (the offload's second stream): work the copier's stream never
    waited for is still queued there."""
    real_take = ScratchRelay.take
    seen = [0]

    def take(self, nbytes, writer):
        got = real_take(self, nbytes, writer)
        with scratch_relay.on(writer):
            torch.cuda._sleep(SLEEP_CYCLES)
        seen[0] += 1
        if seen[0] == n:
            raise RuntimeError("copy failed half-way (injected)")
        return got

    monkeypatch.setattr(ScratchRelay, "take", take)


@pytest.mark.gpu
@pytest.mark.parametrize("joined", [True, False])
def test_a_restore_failing_half_way_leaves_nothing_running_once_drained(
    monkeypatch, joined
):
    """The loader drains only its own stream before the claims and destination
    pages are given back: after a copy that raised half-way, that drain must
    also cover the scatters queued on the second stream. Without the final
    join (``joined`` False, the negative control) the second stream is still
    busy when the loader's stream has drained."""
    from sglang.srt.mem_cache.storage.kvcr.datapath import span_restore

    parts, pages, row = 4, 16, 512
    memory = HostMemory(pin=True)
    raw = memory.alloc_like((parts * pages, row))
    store = raw.view(torch.int64)
    slots = [tuple(range(parts * o, parts * o + parts)) for o in range(pages)]
    dsts = [
        torch.zeros(pages, row // 8, dtype=torch.int64, device="cuda")
        for _ in range(parts)
    ]
    _fail_at_read(monkeypatch, 3)
    if not joined:
        monkeypatch.setattr(span_restore, "join", lambda main, side: None)
    span = SpanRestore(torch.device("cuda"), memory, scratch_bytes=2 * 2 * parts * row)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    try:
        with torch.cuda.stream(stream), pytest.raises(RuntimeError, match="half-way"):
            span.copy_pool(dsts, torch.arange(pages, device="cuda"), store, slots)
        stream.synchronize()  # what the loader's drain waits for
        assert span._relay.side().query() is joined
    finally:
        torch.cuda.synchronize()
        span.close()
        memory.release(raw)


@pytest.mark.gpu
@pytest.mark.parametrize("joined", [True, False])
def test_an_offload_failing_half_way_leaves_nothing_running_once_drained(
    monkeypatch, joined
):
    """The copier drains only its own stream before a failed job's slots are
    freed: the gathers queued on the second stream must be covered too."""
    from sglang.srt.mem_cache.storage.kvcr.datapath import device_gather

    nparts, pages, row = 4, 16, 512
    spans = [
        torch.zeros(pages, row, dtype=torch.uint8, device="cuda") for _ in range(nparts)
    ]
    slot_bytes = nparts * row
    memory = HostMemory(pin=True)
    store = memory.alloc_like((pages * slot_bytes,))
    view = store.view(pages, slot_bytes)
    group = PoolCopy(
        spans,
        SlotViews((0, slot_bytes, pages), view),
        list(range(pages)),
        list(range(pages)),
        store,
    )
    _fail_at_take(monkeypatch, 3)
    if not joined:
        monkeypatch.setattr(device_gather, "join", lambda main, side: None)
    gather = DeviceGather()
    gather.scratch_bytes = 2 * 2 * slot_bytes
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    try:
        with torch.cuda.stream(stream), pytest.raises(RuntimeError, match="half-way"):
            gather.copy(group, None)
        stream.synchronize()  # what the copier's drain waits for
        assert gather._relay.side().query() is joined
    finally:
        torch.cuda.synchronize()
        memory.release(store)
