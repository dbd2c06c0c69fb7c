"""Restore copy planning and execution (restore_copy.py) against plain row copies."""

from __future__ import annotations

import random

import pytest
import torch

from sglang.srt.mem_cache.storage.kvcr.datapath import row_team
from sglang.srt.mem_cache.storage.kvcr.datapath.restore_copy import (
    CpuRestorePlan,
    Segment,
    plan_segments,
    wide_rows,
)
from sglang.srt.mem_cache.storage.kvcr.datapath.row_team import RowTeam
from sglang.srt.mem_cache.storage.kvcr.datapath.span_rows import span_rows


def test_plan_segments_coalesces_object_major_slots() -> None:
    # Three objects of 4 parts, filled back to back: one run of stride 4.
    slots = [tuple(range(4 * i, 4 * i + 4)) for i in range(3)]
    assert plan_segments(slots) == [Segment(0, 3, (0, 1, 2, 3), 4)]


def test_plan_segments_breaks_on_stride_change_and_backwards_steps() -> None:
    slots = [(0, 1), (2, 3), (4, 5), (10, 11), (12, 13), (1, 2), (6, 9)]
    assert plan_segments(slots) == [
        Segment(0, 3, (0, 1), 2),
        Segment(3, 5, (10, 11), 2),
        Segment(5, 6, (1, 2), 1),  # step 4 in part 0 but 7 in part 1
        Segment(6, 7, (6, 9), 1),
    ]
    assert plan_segments([]) == []


def _segments_page_by_page(slots):
    """The rule plan_segments implements, page by page: a run grows while every
    part steps by the run's one positive stride."""
    out, i = [], 0
    while i < len(slots):
        j, stride = i + 1, 0
        while j < len(slots):
            steps = {b - a for a, b in zip(slots[j - 1], slots[j], strict=True)}
            step = steps.pop() if len(steps) == 1 else 0
            if step <= 0 or (stride and step != stride):
                break
            stride, j = step, j + 1
        out.append(Segment(i, j, slots[i], stride or 1))
        i = j
    return out


def test_plan_segments_agrees_with_the_page_by_page_rule() -> None:
    # Slot lists as KVCR hands them out (one run), with a page moved, a stride
    # changed, a part out of order or a page repeated: the one-pass check must
    # take exactly the single runs and leave the rest to the page-by-page split.
    rng = random.Random(23)
    single = split = 0
    for _ in range(3000):
        parts, stride = rng.choice([1, 2, 4]), rng.choice([1, 1, 2, 3])
        at, slots = rng.randrange(64), []
        for _ in range(rng.randrange(0, 9)):
            slots.append(tuple(range(at * parts, at * parts + parts)))
            at += stride if rng.random() < 0.85 else rng.choice([-2, 0, 1, 5])
        if slots and parts > 1 and rng.random() < 0.1:
            k = rng.randrange(len(slots))
            slots[k] = slots[k][::-1]
        got = plan_segments(slots)
        assert got == _segments_page_by_page(slots), slots
        single += len(slots) > 1 and len(got) == 1
        split += len(got) > 1
    assert single >= 600 and split >= 600  # both paths drawn often


def _layout(rng, source, dest, *, parts, pages, objects, dest_rows):
    """Source slots (object-major, optionally shuffled, in two runs or every
    other slot) and
    destination pages (consecutive or scattered) for one planned restore."""
    order = list(range(objects))
    if source == "shuffled":
        rng.shuffle(order)
    elif source == "two_runs":
        order = order[5 : 5 + pages // 2] + order[: pages - pages // 2]
    elif source == "gapped":  # one run whose stride is two slots, not one
        order = order[::2] + order[1::2]
    slots = [tuple(o * parts + p for p in range(parts)) for o in order[:pages]]
    if dest == "contiguous":
        return slots, list(range(4, 4 + pages))
    return slots, rng.sample(range(dest_rows), pages)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _reference(dst, dest_pages, src, slots, part):
    out = dst.clone()
    for d, s in zip(dest_pages, slots, strict=True):
        out[d] = src[s[part]]
    return out


def _run_plan(dest_pages, slots, parts, store, torch_copy=False) -> int:
    """A CPU restore plan of ``parts`` (separate span tensors) run by a team of
    two threads, or by torch (``torch_copy``); returns how many pieces it took."""
    plan = CpuRestorePlan(dest_pages, slots, span_rows(parts), store)
    if torch_copy:
        plan.copy()
        return 0
    pieces = plan.pieces()
    team = RowTeam(1)
    try:
        team.run(pieces)
    finally:
        assert team.close(5.0)
    return len(pieces)


# "torch": no team (a pinned scheduler thread); else pieces of the default size,
# of single rows, or of (page, 2 spans) blocks.
@pytest.mark.parametrize("engine", ["torch", "pieces", "1-row", "2-row"])
@pytest.mark.parametrize("row_bytes", [64, 36])  # 36: rows of 4-byte elements
@pytest.mark.parametrize("source", ["object_major", "shuffled", "two_runs", "gapped"])
@pytest.mark.parametrize("dest", ["contiguous", "scattered"])
def test_restore_plan_matches_row_copies(
    row_bytes, source, dest, engine, monkeypatch
) -> None:
    rng = random.Random(f"{row_bytes}{source}{dest}")
    parts, pages, store_rows = 3, 30, 120
    piece_rows = {"1-row": 1, "2-row": 2}.get(engine)
    if piece_rows is not None:
        monkeypatch.setattr(row_team, "PIECE_BYTES", piece_rows * row_bytes)
    store = torch.randint(0, 256, (store_rows, row_bytes), dtype=torch.uint8)
    slots, dest_pages = _layout(
        rng,
        source,
        dest,
        parts=parts,
        pages=pages,
        objects=store_rows // parts,
        dest_rows=80,
    )
    dst = [torch.randint(0, 256, (80, row_bytes), dtype=torch.uint8) for _ in range(3)]
    expected = [_reference(d, dest_pages, store, slots, i) for i, d in enumerate(dst)]
    pieces = _run_plan(dest_pages, slots, dst, store, torch_copy=engine == "torch")
    # Small pieces cut each page's spans; by default a piece is a whole run.
    want = {
        "torch": 0,
        "pieces": len(plan_segments(slots)),
        "1-row": pages * parts,
        "2-row": pages * 2,
    }[engine]
    assert pieces == want
    for got, want_rows in zip(dst, expected, strict=True):
        assert same_bytes(got, want_rows)  # every page landed, no other row moved


def test_restore_plan_refuses_parts_that_are_not_one_slot() -> None:
    parts = [torch.zeros(8, 16, dtype=torch.uint8) for _ in range(2)]
    store = torch.zeros(16, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="one slot"):
        CpuRestorePlan([1], [(0, 5)], span_rows(parts), store)
    with pytest.raises(IndexError):
        CpuRestorePlan([8], [(0, 1)], span_rows(parts), store)  # no page 8


def test_wide_rows_keeps_bytes() -> None:
    rows = torch.arange(64, dtype=torch.uint8).view(2, 32)
    wide = wide_rows(rows)
    assert wide.dtype == torch.complex128 and wide.shape == (2, 2)
    assert torch.equal(wide.view(torch.uint8), rows)
    eight = torch.arange(48, dtype=torch.uint8).view(2, 24)
    assert wide_rows(eight).dtype == torch.int64
    odd = torch.arange(36, dtype=torch.uint8).view(2, 18)
    assert wide_rows(odd) is odd


@pytest.mark.parametrize("source", ["object_major", "shuffled"])
@pytest.mark.parametrize("dest", ["contiguous", "scattered"])
def test_nan_payloads_survive_the_restore_copy(source, dest) -> None:
    """Rows are moved as complex128/int64 elements: signalling and quiet NaNs with
    payloads, infinities and negative zero arrive bit for bit."""
    specials = torch.tensor(
        [
            0x7FF0000000000001,  # signalling NaN, payload 1
            0x7FF4DEADBEEF0001,  # signalling NaN, large payload
            0xFFF8000000000123 - (1 << 64),  # negative quiet NaN with payload
            0x7FF0000000000000,  # +inf
            0x8000000000000000 - (1 << 64),  # -0.0
        ],
        dtype=torch.int64,
    )
    rng = random.Random(f"nan{source}{dest}")
    parts, pages = 2, 24
    store = torch.randint(-(1 << 62), 1 << 62, (parts * 40, 32), dtype=torch.int64)
    store[:, :10] = specials.repeat(2)  # every row carries the specials
    store_rows = store.view(torch.uint8)
    slots, dest_pages = _layout(
        rng, source, dest, parts=parts, pages=pages, objects=40, dest_rows=60
    )
    dst = [torch.zeros(60, 32, dtype=torch.int64) for _ in range(parts)]
    expected = [_reference(d, dest_pages, store, slots, i) for i, d in enumerate(dst)]
    _run_plan(dest_pages, slots, [d.view(torch.uint8) for d in dst], store_rows)
    for got, want in zip(dst, expected, strict=True):
        assert torch.equal(got, want)  # compared as integers: every bit


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("row_bytes", [64, 36])  # 36: byte rows, not words
@pytest.mark.parametrize("source", ["object_major", "shuffled", "scattered_parts"])
def test_span_restore_matches_row_copies(device, row_bytes, source) -> None:
    """The GPU restore's steps (span copies into a reused scratch buffer, device-
    side scatter per part, a host gather for pages whose parts lie far apart):
    every part of every page lands in its row, and only those rows change. On
    CUDA the store is page-locked (as KVCR DRAM is there), the copies are
    asynchronous on the current stream, and the bytes are read after it
    drained; on CPU the same steps run synchronously."""
    from sglang.srt.mem_cache.storage.kvcr.datapath.span_restore import SpanRestore
    from sglang.srt.mem_cache.storage.kvcr.device.host_memory import HostMemory

    dev = torch.device(device)
    memory = HostMemory(pin=dev.type == "cuda")
    rng = random.Random(f"{row_bytes}{source}")
    parts, pages, store_rows = 4, 24, 200
    if source == "scattered_parts":  # parts of one object far apart: host gather
        slots = [tuple(rng.sample(range(store_rows), parts)) for _ in range(pages)]
    else:
        order = list(range(pages))
        if source == "shuffled":
            rng.shuffle(order)
        slots = [tuple(range(parts * o, parts * o + parts)) for o in order]
    dest = rng.sample(range(40), pages)
    store = memory.alloc_like((store_rows, row_bytes))
    store.copy_(torch.randint(0, 256, (store_rows, row_bytes), dtype=torch.uint8))
    before = [
        torch.randint(0, 256, (40, row_bytes), dtype=torch.uint8) for _ in range(parts)
    ]
    expected = [_reference(d, dest, store, slots, p) for p, d in enumerate(before)]
    dsts = [d.to(dev) for d in before]
    # Halves of three pages' span: runs are chunked and both halves reused.
    span = SpanRestore(dev, memory, scratch_bytes=2 * 3 * parts * row_bytes)
    try:
        span.copy_pool(dsts, torch.tensor(dest, device=dev), store, slots)
        if dev.type == "cuda":
            torch.cuda.current_stream().synchronize()
        span.drained()
        for got, want in zip(dsts, expected, strict=True):
            assert torch.equal(got.cpu(), want)
    finally:
        span.close()
        memory.release(store)
    if source == "scattered_parts":  # gathered three pages at a time
        assert span.gathered_pages == pages and span.span_copies == 0
    else:
        assert span.gathered_pages == 0
        assert span.span_copies >= pages // 3  # chunked through the small scratch


def _spread_parts(parts: int, pages: int) -> list[tuple[int, ...]]:
    """Slots whose parts lie two rows apart: each page's span (2 * parts - 1
    rows) outgrows a scratch of ``parts`` rows, yet stays a dense span copy."""
    return [tuple(40 * o + 2 * p for p in range(parts)) for o in range(pages)]


def test_outgrown_device_scratch_stays_alive_until_the_stream_drained() -> None:
    """A page part larger than the scratch replaces it from the loader stream,
    whose queued copies may still read the old block: the old block stays
    referenced until ``drained`` (on CUDA the caching allocator would otherwise
    hand it to the stream it came from while the loader stream reads it)."""
    import weakref

    from sglang.srt.mem_cache.storage.kvcr.datapath.span_restore import SpanRestore

    parts, pages, row = 4, 3, 64
    slots = _spread_parts(parts, pages)
    store = torch.randint(0, 256, (40 * pages, row), dtype=torch.uint8)
    dsts = [torch.zeros(8, row, dtype=torch.uint8) for _ in range(parts)]
    dest = [5, 1, 6]
    expected = [_reference(d, dest, store, slots, p) for p, d in enumerate(dsts)]
    span = SpanRestore(torch.device("cpu"), scratch_bytes=2 * parts * row)
    first = weakref.ref(span._relay.scratch)
    span.copy_pool(dsts, torch.tensor(dest), store, slots)
    assert all(torch.equal(g, w) for g, w in zip(dsts, expected, strict=True))
    assert span._relay.half_bytes >= (2 * parts - 1) * row  # it grew once
    assert first() is not None and first() in span._retired  # still referenced
    span.drained()
    assert first() is None and span._retired == []  # released once drained


def test_scratch_sized_for_the_largest_page_never_grows() -> None:
    """``scratch_for`` (what the rank's restorer is built with) covers a span of
    two pages' parts of the largest pool: the growth above never happens."""
    from sglang.srt.mem_cache.storage.kvcr.datapath.span_restore import SpanRestore

    parts, pages, row = 4, 3, 64
    largest = 2 * 4 * (64 << 20)  # two pages' parts, in each half
    assert SpanRestore.scratch_for([(2, 8), (parts, 64 << 20)]) == 2 * largest
    assert SpanRestore.scratch_for([(parts, row)]) == SpanRestore.SCRATCH_BYTES
    store = torch.randint(0, 256, (40 * pages, row), dtype=torch.uint8)
    dsts = [torch.zeros(8, row, dtype=torch.uint8) for _ in range(parts)]
    # The rule at this row size (the 32 MiB floor would hide a wrong rule).
    span = SpanRestore(torch.device("cpu"), scratch_bytes=2 * 2 * parts * row)
    scratch = span._relay.scratch
    span.copy_pool(dsts, torch.tensor([5, 1, 6]), store, _spread_parts(parts, pages))
    assert span._relay.scratch is scratch and span._retired == []


def test_a_layer_completes_only_once_every_span_of_it_landed(monkeypatch) -> None:
    """CPU restore through a linker: each layer is
    reported complete (to layer-wise loading) only after its K and V rows of
    every page are in place, in layer order, every layer exactly once."""
    from cpu_harness.kvcr_pages import (
        PAGE,
        fill_random,
        hashes_for,
        make_linker,
        make_pool,
        offload_and_commit,
        prepare,
        restore,
    )

    layers, src, dst = 8, [1, 2, 3], [20, 21, 22]
    pool = make_pool(layers=layers)
    fill_random(pool, src, seed=41)

    def layer_rows(layer: int, pages: list[int]) -> list[torch.Tensor]:
        return [
            buf[p * PAGE : (p + 1) * PAGE].reshape(-1).view(torch.uint8).clone()
            for buf in (pool.k_buffer[layer], pool.v_buffer[layer])
            for p in pages
        ]

    want = [layer_rows(layer, src) for layer in range(layers)]
    lk = make_linker(pool)
    try:
        hashes = hashes_for(3, "layer-order")
        assert offload_and_commit(lk, hashes, src) is True
        prepare(lk, "r", hashes)
        seen: list[tuple[int, bool]] = []
        real = lk.restorer.counter.complete

        def complete(index, layer):
            got = layer_rows(layer, dst)
            seen.append(
                (layer, all(torch.equal(a, b) for a, b in zip(got, want[layer])))
            )
            return real(index, layer)

        monkeypatch.setattr(lk.restorer.counter, "complete", complete)
        assert restore(lk, "r", hashes, dst) is True
        assert [layer for layer, _ in seen] == list(range(layers))
        assert all(landed for _, landed in seen), seen
    finally:
        lk.close()
