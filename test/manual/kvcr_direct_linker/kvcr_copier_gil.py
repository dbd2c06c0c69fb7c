"""How long the DRAM copier takes one deposit alone, and beside a thread that
runs Python without pause (what SGLang's CPU scheduler loop does), side by side
in one run.

Every torch call on the copier thread releases the GIL and must take it back;
beside such a loop each one waits up to a switch interval (the linker sets
500 us). The figure is the copier's own cost, through ``DramCopier`` on CPU
tensors (no KVCR): ``--spans`` spans of ``--span-bytes`` per page, ``--pages``
pages per deposit into consecutive slots, checked byte for byte.

    python test/manual/kvcr_direct_linker/kvcr_copier_gil.py [--spans 4 ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import _paths  # noqa: F401  (the repository's test/ on sys.path)
import torch

from sglang.srt.mem_cache.storage.kvcr.datapath.dram_copy import DramCopier
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import DeviceBinding
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches.page_fills import SlotRef


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spans", type=int, default=4, help="tiny model: 2 layers x K/V")
    p.add_argument("--span-bytes", type=int, default=1024, help="one page of a span")
    p.add_argument("--pages", type=int, default=64, help="pages per deposit")
    p.add_argument("--jobs", type=int, default=100)
    p.add_argument("--switch-interval-us", type=int, default=500)
    args = p.parse_args()
    sys.setswitchinterval(args.switch_interval_us / 1e6)
    pool_pages, slots = 4 * args.pages, 8 * args.pages
    parts = [
        torch.randint(0, 256, (pool_pages, args.span_bytes), dtype=torch.uint8)
        for _ in range(args.spans)
    ]
    slot_bytes = args.spans * args.span_bytes
    store = torch.zeros(slots * slot_bytes, dtype=torch.uint8)
    copier = DramCopier(
        {"kv": parts}, lambda: {"kv": store}, DeviceBinding.of(torch.device("cpu"))
    )
    first_page, first_slot = args.pages, 2 * args.pages
    pairs = [
        (first_page + k, SlotRef("kv", store.data_ptr(), slot_bytes, first_slot + k))
        for k in range(args.pages)
    ]
    results: dict[str, list[float]] = {}
    try:
        for i in range(2 * args.jobs):
            mode = ("alone", "beside_loop")[i % 2]  # alternated, side by side
            done = threading.Event()
            started = time.perf_counter()
            job = copier.start(pairs, time.monotonic() + 30.0, done.set)
            if mode == "alone":
                if not done.wait(30.0):
                    raise TimeoutError("a copy did not finish within 30 s")
            else:
                deadline = time.monotonic() + 30.0
                while not done.is_set():  # Python without pause, like the loop
                    if time.monotonic() > deadline:
                        raise TimeoutError("a copy did not finish within 30 s")
            results.setdefault(mode, []).append(time.perf_counter() - started)
            if job.poll() is not True:
                raise RuntimeError("a copy failed")
    finally:
        if not copier.close(10.0):
            print("the copier did not stop", file=sys.stderr)
    rows = store.view(slots, args.spans, args.span_bytes)
    for k in range(args.pages):
        for s in range(args.spans):
            if not torch.equal(rows[first_slot + k, s], parts[s][first_page + k]):
                raise RuntimeError(f"slot {first_slot + k} span {s} is wrong")
    med = {m: statistics.median(v) * 1e6 for m, v in results.items()}
    for mode, values in results.items():
        p90 = sorted(values)[int(0.9 * len(values))] * 1e6
        print(f"{mode:<12} deposit p50 {med[mode]:8.1f} us  p90 {p90:8.1f} us")
    print(f"beside_loop / alone: {med['beside_loop'] / med['alone']:.2f}x (bytes ok)")


if __name__ == "__main__":
    main()
