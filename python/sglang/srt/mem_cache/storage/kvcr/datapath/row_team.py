"""CPU row copies shared out among a small team of threads, piece by piece.

A CPU restore scatters thousands of page rows (one per span of each page) from
KVCR DRAM into the pool. torch's indexed copies split each op evenly between
its intra-op threads once and move rows element by element, so one preempted
thread (kvcr's owner thread, the copier, the client on a busy host) holds up
the whole op. A ``RowTeam`` instead cuts a copy into pieces of about
``PIECE_BYTES`` of whole rows (one row when a row is larger), and the calling
thread and its helper threads each take the next piece as they finish one; a
piece is one numpy indexed assignment, which moves each row as one block and
releases the GIL while it does. The caller works too, so a copy never waits on
a helper busy elsewhere, and then waits for the pieces helpers still hold, also
when a piece failed (no piece is taken after a failure): a piece is a memory
copy between buffers it does not lock, so it always ends, and the caller never
returns while one runs (the pages it writes are only given back after). A wait
past ``SLOW_S`` is logged, again every ``SLOW_S``. A team is as wide as torch's
intra-op threads and the CPUs the caller may run on allow: SGLang pins each of
its OpenMP threads, the scheduler thread included, to one core, where helpers
would inherit that core, so ``for_caller`` gives no team and the caller copies
with torch's own pinned threads. numpy copies a piece's source rows first when
they may overlap the destination's address range (KVCR DRAM lying between the
pool's span buffers): correct, one extra pass over that piece.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

PIECE_BYTES = 2 << 20  # a fraction of a millisecond at memory speed
MAX_THREADS = 8  # a few threads saturate a socket's memory bandwidth
SLOW_S = 10.0  # a helper's 2 MiB copy this late: the host is frozen or starved

Piece = Callable[[], object]


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
                    first, self.error = self.error is None, self.error or exc
                if not first:  # only the first is raised to the caller
                    logger.error("KVCR row copy: another piece failed: %r", exc)
            finally:
                with self.lock:
                    self.running -= 1


class RowTeam:
    """The calling thread plus ``helpers`` threads (module docstring)."""

    def __init__(self, helpers: int, name: str = "kvcr-rows") -> None:
        self._inbox: queue.SimpleQueue[_Move | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
            for i in range(max(0, helpers))
        ]
        try:
            for thread in self._threads:
                thread.start()
        except BaseException:
            self.close(1.0)  # the ones started stop at once
            raise

    @classmethod
    def for_caller(cls, intra_op_threads: int, name: str) -> RowTeam | None:
        """A team as wide as torch's intra-op threads, the CPUs the calling
        thread may run on (helpers inherit them) and ``MAX_THREADS`` allow; None
        when that is one (SGLang pins each OpenMP thread, the caller included,
        to a core of its own)."""
        width = min(MAX_THREADS, intra_op_threads, len(os.sched_getaffinity(0)))
        return None if width < 2 else cls(width - 1, name)

    @property
    def size(self) -> int:
        return len(self._threads) + 1

    def run(self, pieces: Sequence[Piece]) -> None:
        """Run every piece; once none is left running, raises the first piece's
        error (the pieces after it are not run)."""
        move = _Move(pieces)
        for _ in range(min(len(self._threads), len(pieces) - 1)):
            self._inbox.put(move)
        move.work()
        waited = 0.0
        while not move.done.wait(SLOW_S):  # see the module docstring
            waited += SLOW_S
            logger.error("KVCR row copy: a helper has held a piece %.0f s", waited)
        if move.error is not None:
            raise move.error

    def close(self, timeout_s: float) -> bool:
        """Stop the helpers (bounded); False if one is still running."""
        for _ in self._threads:
            self._inbox.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread.ident is not None:  # started
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
