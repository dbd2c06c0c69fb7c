"""span_rows: a pool's separately allocated span buffers as rows of one tensor,
addressed by (page, span), with the widest element every offset allows."""

from __future__ import annotations

import random

import pytest
import torch

from sglang.srt.mem_cache.storage.kvcr.datapath.span_rows import (
    element_bytes,
    span_rows,
)


def _spans(rng: random.Random, count: int, width: int, pages: int, pad: int):
    """``count`` span row views in separate buffers, page rows ``pad`` bytes
    apart beyond the width, each starting ``shift`` bytes into its buffer."""
    out = []
    for _ in range(count):
        shift = rng.choice([0, pad])
        buf = torch.randint(0, 256, (shift + pages * (width + pad),), dtype=torch.uint8)
        out.append(buf[shift:].as_strided((pages, width), (width + pad, 1)))
    return out


def test_element_bytes_is_the_widest_power_of_two_dividing_all() -> None:
    assert element_bytes(64, 128, 4096) == 16
    assert element_bytes(64, 24) == 8
    assert element_bytes(36) == 4
    assert element_bytes(64, 3) == 1


def test_rows_address_every_page_of_every_span_at_any_element_width() -> None:
    """Property: over spans in separate buffers, with padded page strides and odd
    shifts, row ``index(page)[span]`` of ``rows(elem)`` is that page of that span,
    byte for byte, for every element width the layout allows."""
    rng = random.Random(3)
    widths_seen = set()
    for case in range(40):
        width = rng.choice([16, 24, 36, 64, 96])
        pad = rng.choice([0, 0, 8, 3])
        parts = _spans(rng, rng.randint(1, 6), width, rng.randint(1, 9), pad)
        rows = span_rows(parts)
        widths_seen.add(rows.unit)
        for elem in {rows.unit, 1}:
            table = rows.rows(elem)
            pages = list(range(rows.pages))
            rng.shuffle(pages)
            index = rows.index(pages, elem)
            assert index.shape == (len(pages), len(parts))
            for i, page in enumerate(pages):
                for j, part in enumerate(parts):
                    got = table[int(index[i, j])].view(torch.uint8)
                    assert torch.equal(got, part[page]), (case, elem, page, j)
    assert widths_seen >= {16, 8, 4, 1}  # every element width was drawn


def test_slot_rows_are_spans_of_slots_in_span_order() -> None:
    parts = [torch.zeros(4, 32, dtype=torch.uint8) for _ in range(3)]
    rows = span_rows(parts)
    store = torch.arange(5 * 3 * 32, dtype=torch.int32).to(torch.uint8)
    slot = rows.slot_rows(store, rows.elem(store))
    assert slot.shape[0] == 5 * 3
    for s in range(5):
        for j in range(3):
            start = (s * 3 + j) * 32
            assert torch.equal(
                slot[s * 3 + j].view(torch.uint8), store[start : start + 32]
            )


def test_a_page_outside_the_spans_is_refused() -> None:
    rows = span_rows(
        [torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(6, 16, dtype=torch.uint8)]
    )
    assert rows.pages == 4  # the pages every span holds
    with pytest.raises(IndexError):
        rows.index([4], rows.unit)
    with pytest.raises(IndexError):
        rows.index([-1], rows.unit)


@pytest.mark.parametrize(
    "parts",
    [
        [],
        [torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 32, dtype=torch.uint8)],
        [torch.zeros(4, 16, dtype=torch.int16)],
        [torch.zeros(4, 16, dtype=torch.uint8).t()],
    ],
    ids=["none", "two_widths", "not_bytes", "columns_strided"],
)
def test_parts_that_are_not_dense_byte_rows_of_one_width_are_refused(parts) -> None:
    with pytest.raises(ValueError):
        span_rows(parts)


def test_the_element_width_respects_the_lowest_spans_own_address() -> None:
    """Spans whose offsets, strides and width are all multiples of 16 but whose
    lowest buffer starts at an odd address are read a byte at a time (a wider
    element would be misaligned), and still byte for byte."""
    base = torch.arange(1 + 4 * 64, dtype=torch.int64).to(torch.uint8)
    parts = [base[1 + 64 * i : 1 + 64 * (i + 1)].view(4, 16) for i in range(2)]
    assert parts[0].data_ptr() % 2 == 1
    rows = span_rows(parts)
    assert rows.unit == 1
    table = rows.rows(rows.unit)
    index = rows.index([0, 3], rows.unit)
    for i, page in enumerate([0, 3]):
        for j, part in enumerate(parts):
            assert torch.equal(table[int(index[i, j])].view(torch.uint8), part[page])
