"""The CPU restore's row-copy team (datapath/row_team.py): pieces shared out
between the caller and helper threads, errors reported after every taken piece
ended, a slow helper always waited for, and no team where SGLang pinned the
scheduler thread to one core (torch's pinned threads copy instead)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from cpu_harness.kvcr_pages import (
    fill_random,
    hashes_for,
    make_linker,
    make_pool,
    offload_and_commit,
    page_bytes,
    prepare,
    restore,
)
from sglang.srt.mem_cache.storage.kvcr.datapath import row_team
from sglang.srt.mem_cache.storage.kvcr.datapath.restore_copy import CpuRestorePlan
from sglang.srt.mem_cache.storage.kvcr.datapath.row_team import (
    RowTeam,
    cuts,
    scatter_piece,
)


@pytest.fixture
def team():
    t = RowTeam(1)
    yield t
    assert t.close(5.0)


def test_cuts_cover_every_row_once_in_pieces_of_about_piece_bytes(monkeypatch):
    monkeypatch.setattr(row_team, "PIECE_BYTES", 100)
    assert cuts(7, 30) == [(0, 3), (3, 6), (6, 7)]
    assert cuts(2, 500) == [(0, 1), (1, 2)]  # a row larger than a piece: one each
    assert cuts(0, 30) == []


def _held_until_both_ran(caller: threading.Thread, ran: dict[int, bool]):
    """Pieces that each wait (bounded) until the caller and a helper have both
    taken one, so neither can run them all alone."""
    both = threading.Event()
    lock = threading.Lock()

    def piece(i: int):
        def run() -> None:
            with lock:
                ran[i] = threading.current_thread() is caller
                if len(set(ran.values())) == 2:
                    both.set()
            both.wait(5.0)

        return run

    return piece


def test_pieces_run_on_the_caller_and_its_helper(team):
    ran: dict[int, bool] = {}  # piece -> run by the caller
    piece = _held_until_both_ran(threading.current_thread(), ran)
    team.run([piece(i) for i in range(6)])
    assert sorted(ran) == list(range(6))
    assert set(ran.values()) == {True, False}


def test_a_scatter_in_pieces_matches_a_plain_assignment(team, monkeypatch):
    monkeypatch.setattr(row_team, "PIECE_BYTES", 16)
    dst = torch.zeros(40, 16, dtype=torch.uint8)
    values = torch.randint(0, 256, (12, 16), dtype=torch.uint8)
    index = torch.randperm(40)[:12]
    want = dst.clone()
    want[index] = values
    d, i, v = dst.numpy(), index.numpy(), values.numpy()
    team.run([scatter_piece(d, i[a:b], v[a:b]) for a, b in cuts(12, 16)])
    assert torch.equal(dst, want)


def test_a_failed_piece_raises_after_the_pieces_taken_and_stops_the_rest(team):
    """The caller's piece fails while the helper still copies one: the error is
    raised only once that piece ended (its pages are given back after), and no
    piece is taken after the failure."""
    caller = threading.current_thread()
    helper_took = threading.Event()
    ended: list[float] = []
    done: list[int] = []

    def first() -> None:
        if threading.current_thread() is caller:
            helper_took.wait(5.0)
            raise ValueError("piece failed")
        helper_took.set()
        time.sleep(0.3)
        ended.append(time.monotonic())

    def ok(i: int):
        return lambda: done.append(i)

    with pytest.raises(ValueError, match="piece failed"):
        try:
            team.run([first, first] + [ok(i) for i in range(50)])
        finally:
            returned = time.monotonic()
    assert ended and ended[0] <= returned  # the helper's piece had landed
    assert done == []  # the rest never ran
    team.run([ok(99)])  # the team still works
    assert done == [99]


def test_a_slow_helper_is_waited_for_and_logged(team, monkeypatch, caplog):
    """The caller never returns while a helper still holds a piece (its pages
    would be given back while written): past SLOW_S it logs and keeps waiting."""
    monkeypatch.setattr(row_team, "SLOW_S", 0.1)
    caller = threading.current_thread()
    helper_took = threading.Event()
    landed: list[float] = []

    def piece() -> None:
        if threading.current_thread() is caller:
            helper_took.wait(5.0)  # leave the helper a piece to hold
        else:
            helper_took.set()
            time.sleep(0.35)
            landed.append(time.monotonic())

    with caplog.at_level(logging.ERROR, logger=row_team.__name__):
        team.run([piece] * 4)
        returned = time.monotonic()
    assert landed and max(landed) <= returned
    assert any("has held a piece" in r.getMessage() for r in caplog.records)


def test_no_team_for_one_thread_or_a_caller_pinned_to_one_cpu(monkeypatch):
    monkeypatch.setattr(row_team.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert RowTeam.for_caller(1, "t") is None
    teams = [RowTeam.for_caller(64, "t")]  # as wide as the CPUs it may use
    monkeypatch.setattr(row_team, "MAX_THREADS", 3)
    teams.append(RowTeam.for_caller(4, "t"))
    try:
        assert [t.size for t in teams if t is not None] == [4, 3]
    finally:
        assert all(t.close(5.0) for t in teams if t is not None)
    monkeypatch.setattr(row_team.os, "sched_getaffinity", lambda pid: {5})
    assert RowTeam.for_caller(2, "t") is None  # SGLang's one core per thread


@pytest.mark.parametrize("teamed", [True, False])
def test_a_linker_restore_is_byte_exact_with_and_without_a_team(teamed, monkeypatch):
    """Without a team (pinned scheduler thread) torch's index_put_ copies; with
    one, pieces of single rows go to the caller and a slow helper, and the load
    only finishes once the helper's pieces landed."""
    monkeypatch.setattr(row_team, "PIECE_BYTES", 1)  # a piece per row
    monkeypatch.setattr(
        RowTeam,
        "for_caller",
        classmethod(lambda cls, n, name: cls(1, name) if teamed else None),
    )
    pool = make_pool()
    src, dst = [1, 2, 3], [20, 9, 14]
    fill_random(pool, src, seed=5)
    want = [page_bytes(pool, p).clone() for p in src]
    lk = make_linker(pool)
    caller = threading.current_thread()
    make_piece = CpuRestorePlan.pieces
    helper_ran: list[bool] = []
    helper_took = threading.Event()

    def pieces(plan):
        def slow(run):
            def piece() -> None:
                if threading.current_thread() is caller:
                    helper_took.wait(5.0)  # leave the helper pieces to hold
                else:
                    helper_took.set()
                    helper_ran.append(True)
                    time.sleep(0.002)  # lands after the caller ran out
                run()

            return piece

        return [slow(run) for run in make_piece(plan)]

    monkeypatch.setattr(CpuRestorePlan, "pieces", pieces)
    try:
        assert (lk.restorer.team is not None) == teamed
        hashes = hashes_for(3, "teamed")
        assert offload_and_commit(lk, hashes, src) is True
        prepare(lk, "r", hashes)
        assert restore(lk, "r", hashes, dst) is True
        lk.finish_request("r")
        for page, expected in zip(dst, want, strict=True):
            assert torch.equal(page_bytes(pool, page), expected)
        assert bool(helper_ran) == teamed
    finally:
        lk.close()


def test_a_linker_whose_loader_cannot_start_leaves_no_row_team_thread(monkeypatch):
    """The restorer is built last; when its loader thread cannot start, it
    stops its row team's helpers before the linker's start-up fails."""
    started = threading.Thread.start
    helpers: list[threading.Thread] = []

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith("kvcr-loader-") and "-rows" not in thread.name:
            raise RuntimeError("can't start new thread")
        if "-rows" in thread.name:
            helpers.append(thread)
        started(thread)

    monkeypatch.setattr(
        RowTeam, "for_caller", classmethod(lambda cls, n, name: cls(1, name))
    )
    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        make_linker(make_pool())
    assert helpers and not any(t.is_alive() for t in helpers)
