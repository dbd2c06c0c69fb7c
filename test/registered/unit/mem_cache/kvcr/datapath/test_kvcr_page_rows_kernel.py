"""The one-launch page-row kernel (``datapath/page_rows_kernel.py``) on CPU.

Triton's interpreter runs the kernel on CPU tensors in a process of its own
(``cpu_harness/row_kernel_check.py``, ``TRITON_INTERPRET=1``): the kernel alone in
both directions, the restore's span copies and host gather, and the offload's
gather all land every byte in its place and touch nothing else, and each of them
did go through the kernel. On CUDA the same code runs compiled, in the gpu round
trips (``test_kvcr_gpu_data_path.py``, ``test_kvcr_scratch_relay.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.kvcr

TEST_ROOT = Path(__file__).resolve().parents[5]


def test_interpreted_kernel_moves_every_row_to_its_place() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(TEST_ROOT), env.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, "-m", "cpu_harness.row_kernel_check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["kernel"] == {"gather": True, "scatter": True, "untouched": True}
    for case in ("restore_dense", "restore_shuffled", "restore_scattered_parts"):
        assert out[case]["exact"] and out[case]["untouched"], (case, out[case])
        assert out[case]["kernel_chunks"] >= 4, (case, out[case])
    for case in ("gather_sorted", "gather_shuffled"):
        assert out[case]["exact"] and out[case]["untouched"], (case, out[case])
        assert out[case]["launches"] >= 7, (case, out[case])


def test_the_kernel_takes_only_dense_word_rows_of_one_width() -> None:
    """Compiled Triton needs CUDA tensors (``usable``) whose rows it can address:
    8-byte words, 2-D, one width, dense; anything else keeps the per-part torch
    calls."""
    from sglang.srt.mem_cache.storage.kvcr.datapath.page_rows_kernel import (
        RowKernel,
        rows_fit,
    )

    words = [torch.zeros(4, 8, dtype=torch.int64) for _ in range(2)]
    assert rows_fit(words) is True
    assert RowKernel.usable(words) is False  # CPU tensors
    assert rows_fit([]) is False
    assert rows_fit([w.view(torch.uint8) for w in words]) is False  # byte rows
    assert rows_fit([words[0], torch.zeros(4, 16, dtype=torch.int64)]) is False
    assert rows_fit([words[0], torch.zeros(4, 16, dtype=torch.int64)[:, ::2]]) is False
    assert rows_fit([torch.zeros(4, 8, 1, dtype=torch.int64)]) is False


def _cpu_kernel(monkeypatch, error: str | None) -> list[int]:
    """Let the kernel take CPU word rows, its launch raising ``error`` (as
    Triton would); the launches attempted."""
    from sglang.srt.mem_cache.storage.kvcr.datapath import page_rows_kernel as prk

    tried: list[int] = []

    def launch(self, *args, **kwargs):
        tried.append(1)
        raise RuntimeError(error)

    monkeypatch.setitem(prk._state, "off", False)
    monkeypatch.setattr(prk.RowKernel, "usable", staticmethod(prk.rows_fit))
    monkeypatch.setattr(prk.RowKernel, "launch", launch)
    return tried


def _restore_case():
    parts, pages, width = 3, 10, 4
    slots = [tuple(range(parts * o, parts * o + parts)) for o in range(pages)]
    store = torch.randint(-(2**62), 2**62, (parts * pages, width), dtype=torch.int64)
    dsts = [torch.zeros(2 * pages, width, dtype=torch.int64) for _ in range(parts)]
    dest = list(range(pages, 2 * pages))
    return dsts, torch.tensor(dest), store, slots


def test_a_kernel_triton_refuses_falls_back_to_per_part_copies(monkeypatch) -> None:
    """A launch Triton refuses (compile error, no toolchain) turns the kernel off
    for the process and the same chunk goes part by part: every byte lands."""
    from sglang.srt.mem_cache.storage.kvcr.datapath import page_rows_kernel as prk
    from sglang.srt.mem_cache.storage.kvcr.datapath.span_restore import SpanRestore

    tried = _cpu_kernel(monkeypatch, "refused (injected)")
    dsts, dest, store, slots = _restore_case()
    span = SpanRestore(torch.device("cpu"), scratch_bytes=2 * 256)  # 5+ chunks
    span.copy_pool(dsts, dest, store, slots)
    assert span._relay.chunks >= 5
    # Refused once, never tried again (a compile failure would recompile).
    assert tried == [1] and prk._state["off"] is True and span.kernel_chunks == 0
    for i, parts in enumerate(slots):
        for p, slot in enumerate(parts):
            assert torch.equal(dsts[p][dest[i]], store[slot])


def test_a_device_fault_at_a_launch_fails_the_copy(monkeypatch) -> None:
    """A CUDA error Triton's launcher reports (a sticky fault of an earlier
    kernel) is the device failing: the copy fails, the kernel stays on."""
    from sglang.srt.mem_cache.storage.kvcr.datapath import page_rows_kernel as prk
    from sglang.srt.mem_cache.storage.kvcr.datapath.span_restore import SpanRestore

    _cpu_kernel(monkeypatch, "Triton Error [CUDA]: an illegal memory access")
    dsts, dest, store, slots = _restore_case()
    span = SpanRestore(torch.device("cpu"), scratch_bytes=1 << 12)
    with pytest.raises(RuntimeError, match="Triton Error"):
        span.copy_pool(dsts, dest, store, slots)
    assert prk._state["off"] is False
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert prk.device_fault(torch.OutOfMemoryError("oom"), cpu) is True
    assert prk.device_fault(ValueError("bad argument"), cpu) is False
    # On CUDA Triton prefixes every CUDA error: a fault only if the device is.
    error = RuntimeError("Triton Error [CUDA]: device kernel image is invalid")

    class Stream:
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        def query(self) -> bool:
            if self.fails:
                raise RuntimeError("CUDA error: an illegal memory access")
            return True

    for fails in (False, True):
        monkeypatch.setattr(torch.cuda, "current_stream", lambda d, f=fails: Stream(f))
        assert prk.device_fault(error, cuda) is fails


@pytest.mark.gpu
def test_serving_compiles_no_kernel_variant_after_warm(monkeypatch) -> None:
    """``warm`` compiles both directions at startup; restores and offloads of
    other widths, chunk sizes and index offsets then reuse them (a compile while
    serving would stall a copy for seconds)."""
    from sglang.srt.mem_cache.storage.kvcr.datapath import page_rows_kernel as prk
    from sglang.srt.mem_cache.storage.kvcr.datapath.copy_jobs import (
        PoolCopy,
        SlotViews,
    )
    from sglang.srt.mem_cache.storage.kvcr.datapath.device_gather import DeviceGather
    from sglang.srt.mem_cache.storage.kvcr.datapath.span_restore import SpanRestore
    from sglang.srt.mem_cache.storage.kvcr.device.host_memory import HostMemory

    device = torch.device("cuda")
    assert prk.warm(device) is True
    before = prk.compiled_variants()
    assert before is not None and before >= 2, before
    launches: list[bool] = []
    real_launch = prk.RowKernel.launch

    def counted(self, *args, **kwargs):
        launches.append(kwargs["to_pool"])
        return real_launch(self, *args, **kwargs)

    monkeypatch.setattr(prk.RowKernel, "launch", counted)
    memory = HostMemory(pin=True)
    for width, pages in ((24, 7), (40, 13)):
        raw = memory.alloc_like((3 * pages, width * 8))
        slots = [tuple(range(3 * o, 3 * o + 3)) for o in range(pages)]
        dsts = [
            torch.zeros(pages, width, dtype=torch.int64, device=device)
            for _ in range(3)
        ]
        span = SpanRestore(device, memory, scratch_bytes=3 * 3 * width * 8)
        span.copy_pool(
            dsts, torch.arange(pages, device=device), raw.view(torch.int64), slots
        )
        torch.cuda.synchronize()
        assert span.kernel_chunks > 0
        span.close()
        memory.release(raw)
        spans = [
            torch.zeros(pages, width * 8, dtype=torch.uint8, device=device)
            for _ in range(3)
        ]
        store = memory.alloc_like((pages * 3 * width * 8,))
        view = store.view(pages, 3 * width * 8)
        group = PoolCopy(
            spans,
            SlotViews((0, view.shape[1], pages), view),
            list(range(pages)),
            list(range(pages)),
            store,
        )
        gather = DeviceGather()
        gather.scratch_bytes = 2 * 5 * view.shape[1]
        gather.copy(group, None)
        torch.cuda.synchronize()
        assert gather._kernels
        memory.release(store)
    assert prk._state["off"] is False  # no launch was refused
    assert True in launches and False in launches  # both directions ran
    assert prk.compiled_variants() == before
