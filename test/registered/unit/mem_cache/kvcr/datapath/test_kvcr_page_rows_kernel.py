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
        assert out[case]["kernel_chunks"] >= 8, (case, out[case])
    for case in ("gather_sorted", "gather_shuffled"):
        assert out[case]["exact"] and out[case]["untouched"], (case, out[case])
        assert out[case]["launches"] >= 7, (case, out[case])


def test_the_kernel_never_takes_cpu_pools_or_byte_rows() -> None:
    """Compiled Triton needs CUDA tensors of 8-byte words in dense rows of one
    width; anything else keeps the per-part torch calls."""
    from sglang.srt.mem_cache.storage.kvcr.datapath.page_rows_kernel import (
        RowKernel,
    )

    words = [torch.zeros(4, 8, dtype=torch.int64) for _ in range(2)]
    assert RowKernel.usable(words) is False  # CPU
    assert RowKernel.usable([]) is False
