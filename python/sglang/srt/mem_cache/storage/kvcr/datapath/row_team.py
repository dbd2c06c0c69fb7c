"""CPU row copies shared out among a small team of threads, piece by piece.

A CPU restore scatters thousands of page rows (one per span of each page) from
KVCR DRAM into the pool. torch's indexed copies split each op evenly between
its intra-op threads once and move rows element by element, so one preempted
thread (kvcr's owner thread, the copier, the client on a busy host) holds up
the whole op. A ``RowTeam`` instead cuts a copy into pieces of about
``PIECE_BYTES``, and the calling thread and its helper threads each take the
next piece as they finish one; a piece is one numpy indexed assignment, which
moves each row as one block and releases the GIL while it does. The caller
works too, so a copy never waits on a helper busy elsewhere; it then waits, up
to ``STUCK_S``, for the pieces helpers still hold. A helper that outlives that
bound may still write: the team reports itself ``stuck`` and the caller fails
the copy and stops copying for good.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

PIECE_BYTES = 2 << 20  # a fraction of a millisecond at memory speed
MAX_THREADS = 8  # a few threads saturate a socket's memory bandwidth
STUCK_S = 30.0  # only a frozen process keeps a helper's 2 MiB copy this long

Piece = Callable[[], object]


class TeamStuck(RuntimeError):
    """A helper still held a piece at the deadline: its memory may still be
    written."""


class _Move:
    """One caller's pieces; any thread of the team takes the next one."""

    __slots__ = ("done", "error", "lock", "next", "pieces", "running")

    def __init__(self, pieces: Sequence[Piece]) -> None:
        self.pieces = pieces
        self.next = 0
        self.running = 0  # pieces taken by a thread and not finished
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def work(self) -> None:
        """Run pieces until none is left (the first error stops the rest)."""
        while True:
            with self.lock:
                if self.next >= len(self.pieces) or self.error is not None:
                    if self.running == 0:
                        self.done.set()
                    return
                piece = self.pieces[self.next]
                self.next += 1
                self.running += 1
            try:
                piece()
            except BaseException as exc:
                with self.lock:
                    self.error = self.error or exc
            finally:
                with self.lock:
                    self.running -= 1


class RowTeam:
    """The calling thread plus ``helpers`` threads (module docstring)."""

    def __init__(self, helpers: int, name: str = "kvcr-rows") -> None:
        self._inbox: queue.SimpleQueue[_Move | None] = queue.SimpleQueue()
        self.stuck = False
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
            for i in range(max(0, helpers))
        ]
        for thread in self._threads:
            thread.start()

    @classmethod
    def sized_for(cls, intra_op_threads: int, name: str = "kvcr-rows") -> RowTeam:
        """A team as wide as torch's intra-op threads (at most ``MAX_THREADS``)."""
        return cls(min(MAX_THREADS, max(1, intra_op_threads)) - 1, name)

    @property
    def size(self) -> int:
        return len(self._threads) + 1

    def run(self, pieces: Sequence[Piece], stuck_s: float | None = None) -> None:
        """Run every piece; raises the first piece's error (after every taken
        piece finished) or ``TeamStuck`` (helpers held pieces ``stuck_s``, by
        default ``STUCK_S``, after the caller ran out of pieces)."""
        stuck_s = STUCK_S if stuck_s is None else stuck_s
        if self.stuck:
            raise TeamStuck("a helper thread never finished an earlier copy")
        move = _Move(pieces)
        if len(pieces) > 1:
            for _ in range(min(len(self._threads), len(pieces) - 1)):
                self._inbox.put(move)
        move.work()
        if not move.done.wait(stuck_s):
            self.stuck = True
            logger.error("KVCR row copy: a helper held a piece for %.0f s", stuck_s)
            raise TeamStuck(f"a helper thread held a copy piece for {stuck_s:.0f} s")
        if move.error is not None:
            raise move.error

    def close(self, timeout_s: float) -> bool:
        """Stop the helpers (bounded); False if one is still running."""
        for _ in self._threads:
            self._inbox.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            logger.error("KVCR row copy threads still running: %s", alive)
        return not alive

    def _serve(self) -> None:
        while True:
            move = self._inbox.get()
            if move is None:
                return
            move.work()


def cuts(rows: int, row_bytes: int) -> list[tuple[int, int]]:
    """``[a, b)`` ranges of ``rows`` rows of ``row_bytes``, about ``PIECE_BYTES``
    each."""
    step = max(1, PIECE_BYTES // max(1, row_bytes))
    return [(a, min(rows, a + step)) for a in range(0, rows, step)]


def scatter_piece(dst: np.ndarray, index: np.ndarray, values: np.ndarray) -> Piece:
    """``dst[index] = values`` (``index`` of any shape, matched by ``values``)."""

    def piece() -> None:
        dst[index] = values

    return piece
