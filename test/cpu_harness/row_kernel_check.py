"""The one-launch page-row kernel and its callers, run by Triton's interpreter on CPU.

``python -m cpu_harness.row_kernel_check`` with ``TRITON_INTERPRET=1`` (set before
Triton is imported, so this runs in a process of its own) lets the kernel take CPU
tensors (``RowKernel.usable`` is widened to any device) and runs: the kernel alone,
both directions, on a span of an index that does not start at 0; ``SpanRestore``
over dense, shuffled and scattered slots (span copies and the host gather); and
``DeviceGather`` over sorted and shuffled slots. It prints one JSON object: per case
whether every byte landed, and how many chunks went through the kernel.
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

import torch


def _widen() -> None:
    from sglang.srt.mem_cache.storage.kvcr.datapath import page_rows_kernel as prk

    def usable(parts: Any) -> bool:
        if not parts:
            return False
        width = parts[0].shape[1]
        return all(
            p.dtype == torch.int64 and p.dim() == 2 and p.stride() == (width, 1)
            for p in parts
        )

    prk.RowKernel.usable = staticmethod(usable)  # type: ignore[method-assign]


def kernel_alone() -> dict[str, Any]:
    from sglang.srt.mem_cache.storage.kvcr.datapath.page_rows_kernel import RowKernel

    width, nparts, n = 40, 5, 7
    parts = [
        torch.randint(-(2**62), 2**62, (20, width), dtype=torch.int64)
        for _ in range(nparts)
    ]
    kernel = RowKernel(parts)
    pages = random.Random(1).sample(range(20), n + 2)
    index = torch.tensor(pages)
    pitch = nparts * width
    scratch = torch.zeros(n * pitch, dtype=torch.int64)
    kernel.launch(
        index, (2, n + 2), scratch, kernel.offsets(range(nparts)), pitch, False
    )
    want = torch.cat([p[index[2:]] for p in parts], dim=1).reshape(-1)
    gathered = torch.equal(scratch, want)
    dst = [torch.zeros_like(p) for p in parts]
    back = RowKernel(dst)
    dest = torch.tensor(random.Random(2).sample(range(20), n))
    back.launch(dest, (0, n), scratch, back.offsets(range(nparts)), pitch, True)
    scattered = all(
        torch.equal(d[dest], p[index[2:]]) for d, p in zip(dst, parts, strict=True)
    )
    untouched = all(
        int(d[[r for r in range(20) if r not in dest.tolist()]].count_nonzero()) == 0
        for d in dst
    )
    return {"gather": gathered, "scatter": scattered, "untouched": untouched}


def span_restore(source: str) -> dict[str, Any]:
    from sglang.srt.mem_cache.storage.kvcr.datapath.span_restore import SpanRestore

    rng = random.Random(source)
    parts, pages, store_rows, width = 4, 24, 200, 6
    if source == "scattered_parts":
        slots = [tuple(rng.sample(range(store_rows), parts)) for _ in range(pages)]
    else:
        order = list(range(pages))
        if source == "shuffled":
            rng.shuffle(order)
        slots = [tuple(range(parts * o, parts * o + parts)) for o in order]
    dest = rng.sample(range(40), pages)
    store = torch.randint(-(2**62), 2**62, (store_rows, width), dtype=torch.int64)
    dsts = [torch.zeros(40, width, dtype=torch.int64) for _ in range(parts)]
    span = SpanRestore(torch.device("cpu"), scratch_bytes=2 * 3 * parts * width * 8)
    span.copy_pool(dsts, torch.tensor(dest), store, slots)
    exact = all(
        torch.equal(dsts[p][dest[i]], store[slots[i][p]])
        for i in range(pages)
        for p in range(parts)
    )
    others = [r for r in range(40) if r not in dest]
    untouched = all(int(d[others].count_nonzero()) == 0 for d in dsts)
    return {"exact": exact, "untouched": untouched, "kernel_chunks": span.kernel_chunks}


def device_gather(shuffled: bool) -> dict[str, Any]:
    from sglang.srt.mem_cache.storage.kvcr.datapath.copy_jobs import (
        PoolCopy,
        SlotViews,
    )
    from sglang.srt.mem_cache.storage.kvcr.datapath.device_gather import DeviceGather
    from sglang.srt.mem_cache.storage.kvcr.datapath.page_rows_kernel import RowKernel

    rng = random.Random(f"g{shuffled}")
    nparts, pages, row = 3, 20, 48
    spans = [
        torch.randint(0, 256, (pages, row), dtype=torch.uint8) for _ in range(nparts)
    ]
    slot_bytes = nparts * row
    store = torch.zeros(40 * slot_bytes, dtype=torch.uint8)
    view = store.view(40, slot_bytes)
    slots = sorted(rng.sample(range(40), pages))
    src = rng.sample(range(pages), pages) if shuffled else list(range(pages))
    group = PoolCopy(spans, SlotViews((0, slot_bytes, 40), view), src, slots, store)
    launches: list[int] = []
    real = RowKernel.launch

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        launches.append(1)
        real(self, *args, **kwargs)

    RowKernel.launch = counted  # type: ignore[method-assign]
    try:
        gather = DeviceGather()
        gather.scratch_bytes = 2 * 3 * slot_bytes
        gather.copy(group, None)
    finally:
        RowKernel.launch = real  # type: ignore[method-assign]
    want = torch.cat(spans, dim=1)
    exact = all(torch.equal(view[s], want[p]) for s, p in zip(slots, src, strict=True))
    others = [s for s in range(40) if s not in slots]
    untouched = int(view[others].count_nonzero()) == 0
    return {"exact": exact, "untouched": untouched, "launches": len(launches)}


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("row_kernel_check: run with TRITON_INTERPRET=1")
    _widen()
    out = {
        "kernel": kernel_alone(),
        **{
            f"restore_{s}": span_restore(s)
            for s in ("dense", "shuffled", "scattered_parts")
        },
        "gather_sorted": device_gather(False),
        "gather_shuffled": device_gather(True),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
