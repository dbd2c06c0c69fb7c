"""The microbench's offload timeline (kvcr_drivers/bench/transfer.py): where one
offload's time went, read from its copy jobs' own timestamps."""

from __future__ import annotations

import pytest

from kvcr_drivers.bench.transfer import copy_timeline
from sglang.srt.mem_cache.storage.kvcr.datapath.copy_jobs import CopyJob

pytestmark = pytest.mark.kvcr


def _job(pages: int, created: float, claimed: float, issued: float, ended: float):
    job = CopyJob([(0, None)] * pages, deadline=float("inf"))  # type: ignore[list-item]
    job.created, job.claimed, job.issued, job.ended = created, claimed, issued, ended
    return job


def test_copy_timeline_splits_an_offload_by_its_jobs():
    before = _job(8, 0.5, 0.6, 0.7, 0.8)  # an earlier offload's: left out
    first = _job(8, 10.001, 10.002, 10.004, 10.007)
    second = _job(16, 10.005, 10.0071, 10.009, 10.013)
    unreached = _job(4, 10.014, 0.0, 0.0, 0.0)  # never taken (cancelled, say)
    got = copy_timeline([before, first, second, unreached], 10.0, 10.020)
    assert got["jobs"] == 3 and got["pages"] == [8, 16, 4]
    assert got["reserve"] == [1.0, 4.0, 9.0]  # from the offload, then job to job
    assert got["wait"] == [1.0, 2.1, None]
    assert got["issue"] == [2.0, 1.9, None]
    assert got["copy"] == [3.0, 4.0, None]
    assert got["result"] is None  # the last job never reported
    assert copy_timeline([first], 10.0, 10.010)["result"] == 3.0
    assert copy_timeline([], 10.0, 10.010) == {
        "jobs": 0,
        "pages": [],
        "reserve": [],
        "wait": [],
        "issue": [],
        "copy": [],
        "result": None,
    }


def test_restore_split_reads_the_batch_timeline():
    from kvcr_drivers.bench.pools import restore_split
    from sglang.srt.mem_cache.storage.kvcr.datapath.restore import BatchTimes

    gpu = BatchTimes(started=5.001, taken=5.0015, issued=5.003, drained=5.010)
    assert restore_split(gpu, 5.0, 5.012) == {
        "start": 1.0,
        "wake": 0.5,
        "issue": 1.5,
        "copy": 7.0,
        "finish": 2.0,
    }
    cpu = BatchTimes(started=5.001, taken=5.001, issued=5.004)  # never drained
    got = restore_split(cpu, 5.0, 5.005)
    assert got["copy"] is None and got["issue"] == 3.0 and got["finish"] == 1.0
