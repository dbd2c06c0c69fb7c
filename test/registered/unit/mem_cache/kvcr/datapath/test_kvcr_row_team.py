"""The CPU restore's row-copy team (datapath/row_team.py): pieces shared out
between the caller and helper threads, errors and stuck helpers reported, and a
stuck helper stopping restores for good."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cpu_harness.kvcr_pages import (
    LinkerRequestContext,
    fill_random,
    hashes_for,
    kv_transfer,
    make_linker,
    make_pool,
    offload_and_commit,
    prepare,
    restore,
    wait_until,
)
from sglang.srt.mem_cache.storage.kvcr.datapath import row_team
from sglang.srt.mem_cache.storage.kvcr.datapath.restore_copy import CpuRestorePlan
from sglang.srt.mem_cache.storage.kvcr.datapath.row_team import (
    RowTeam,
    TeamStuck,
    cuts,
    scatter_piece,
)


@pytest.fixture
def team():
    t = RowTeam(1)
    yield t
    t.close(5.0)


def test_cuts_cover_every_row_once_in_pieces_of_about_piece_bytes(monkeypatch):
    monkeypatch.setattr(row_team, "PIECE_BYTES", 100)
    assert cuts(7, 30) == [(0, 3), (3, 6), (6, 7)]
    assert cuts(2, 500) == [(0, 1), (1, 2)]  # a row larger than a piece: one each
    assert cuts(0, 30) == []


def test_pieces_run_on_the_caller_and_its_helper(team):
    """While the caller holds a piece, the helper takes the next ones."""
    ran: dict[int, threading.Thread] = {}
    caller = threading.current_thread()
    helper_ran = threading.Event()

    def piece(i: int):
        def run() -> None:
            ran[i] = threading.current_thread()
            if ran[i] is caller:
                helper_ran.wait(5.0)  # held until the helper took one
            else:
                helper_ran.set()

        return run

    team.run([piece(i) for i in range(6)])
    assert sorted(ran) == list(range(6))
    assert {t is caller for t in ran.values()} == {True, False}


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
    done: list[int] = []

    def ok(i: int):
        return lambda: (time.sleep(0.01), done.append(i))

    def bad() -> None:
        raise ValueError("piece failed")

    with pytest.raises(ValueError, match="piece failed"):
        team.run([bad] + [ok(i) for i in range(50)])
    assert len(done) < 50  # the rest never ran
    assert not team.stuck
    team.run([ok(99)])  # the team still works


def test_a_helper_holding_a_piece_past_the_bound_makes_the_team_stuck(team):
    release, helper_took = threading.Event(), threading.Event()
    caller = threading.current_thread()

    def piece() -> None:
        if threading.current_thread() is caller:
            helper_took.wait(5.0)  # leave the helper a piece to hold
        else:
            helper_took.set()
            release.wait(10.0)

    try:
        with pytest.raises(TeamStuck):
            team.run([piece] * 4, stuck_s=0.2)
        assert team.stuck
        with pytest.raises(TeamStuck):  # refused at once from now on
            team.run([lambda: None])
    finally:
        release.set()
    assert team.close(5.0)  # the helper came back: the threads stop


def test_a_stuck_restore_helper_fails_the_load_and_stops_restores(monkeypatch):
    """A helper still writing the pool after the bound: that load fails, the
    restorer never copies again (later lookups miss), and its close reports
    it was not quiet, so the caller keeps the DRAM quarantined."""
    monkeypatch.setattr(row_team, "PIECE_BYTES", 1)  # many pieces
    monkeypatch.setattr(row_team, "STUCK_S", 0.2)
    pool = make_pool()
    fill_random(pool, [1, 2], seed=5)
    lk = make_linker(pool)
    release, helper_took = threading.Event(), threading.Event()
    caller = threading.current_thread()
    make_piece = CpuRestorePlan.piece

    def piece(plan, *args):
        run = make_piece(plan, *args)

        def held() -> None:
            if threading.current_thread() is caller:
                helper_took.wait(5.0)  # leave the helper a piece to hold
            else:
                helper_took.set()
                release.wait(10.0)
            run()

        return held

    try:
        assert lk.restorer.team.size == 2
        hashes = hashes_for(2, "stuck")
        assert offload_and_commit(lk, hashes, [1, 2]) is True
        prepare(lk, "r", hashes)
        monkeypatch.setattr(CpuRestorePlan, "piece", piece)
        assert restore(lk, "r", hashes, [20, 21]) is False
        assert lk.restorer.dead is not None and lk.restorer.paused
        handle = lk.prepare_request(LinkerRequestContext("r2"), kv_transfer(hashes))
        wait_until(lambda: lk.preparation_ready(handle), what="prepare")
        assert lk.lookup("r2", kv_transfer(hashes)) == []
        lk.release_request("r2")
    finally:
        release.set()
    try:
        assert lk.restorer.close(5.0) is False
    finally:
        lk.close()
