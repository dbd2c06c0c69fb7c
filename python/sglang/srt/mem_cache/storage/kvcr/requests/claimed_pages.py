"""A preparation and its claimed pages: what one request attempt holds in KVCR DRAM.

``Preparation`` is one request attempt's prepared tail and the pages it claimed
(``Landed``: page index -> pool -> ``ClaimedPage``, a claim, its DRAM slots and
its bytes), and answers which boundaries of a tail its claims make restorable.
Every preparation of a rank adds its claims' bytes to one ``ClaimLedger`` and
whatever takes pages out of it (a load taking a page's claims, a drop) takes
them off, so the rank's claimed bytes are known at any time without a walk
(``preparation.Preparations`` bounds them). Plain values, no KVCR calls.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import ClaimId, OpId
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)


class PrepState(enum.Enum):
    FETCHING = "fetching"
    READY = "ready"
    RELEASED = "released"


@dataclasses.dataclass(slots=True)
class ClaimedPage:
    """One pool's object of one page, claimed in KVCR DRAM: the claim to release,
    the DRAM slot (element index) of each of its parts, and its bytes. Not
    frozen only because a frozen one costs three times as much to make (one per
    page of every hit); nothing changes one once made."""

    claim: ClaimId
    slots: tuple[int, ...]
    nbytes: int = 0


@dataclasses.dataclass(slots=True)
class ClaimLedger:
    """Bytes of KVCR DRAM the landed claims of a rank's preparations hold, and
    the bound on what they may claim (0: none)."""

    bytes: int = 0
    bound: int = 0

    def fits(self, held: int, fetches: Any) -> bool:
        """Whether claiming ``fetches`` (``PoolFetch``) on top of ``held`` claimed
        bytes stays within the bound; a preparation alone always fits (refusing
        it would refuse it forever)."""
        if not self.bound or held == 0:
            return True
        return held + sum(len(f.keys) * f.page_bytes for f in fetches) <= self.bound


class Landed(dict[int, dict[str, ClaimedPage]]):
    """A preparation's claimed pages: page index -> {pool name: its object}.
    Whatever takes pages out (a load takes its pages' claims with ``take``, a
    drop clears them) takes their bytes off the rank's ``ClaimLedger``."""

    __slots__ = ("ledger",)

    def __init__(self, ledger: ClaimLedger | None = None) -> None:
        super().__init__()
        self.ledger = ClaimLedger() if ledger is None else ledger

    def add(self, index: int, pool: str, page: ClaimedPage) -> None:
        self.add_pool(pool, [(index, page)])

    def add_pool(self, pool: str, pages: list[tuple[int, ClaimedPage]]) -> None:
        """Each ``(index, page)`` of one pool (replacing what the index held in
        it), the ledger updated once."""
        delta = 0
        for index, page in pages:
            objs = self.get(index)
            if objs is None:
                objs = self[index] = {}
            old = objs.get(pool)
            objs[pool] = page
            delta += page.nbytes - (0 if old is None else old.nbytes)
        self.ledger.bytes += delta

    def pop(self, index: int, default: Any = None) -> Any:
        objs = super().pop(index, None)
        if objs is None:
            return default
        self.ledger.bytes -= sum(p.nbytes for p in objs.values())
        return objs

    def take(self, indices: list[int | None]) -> list[dict[str, ClaimedPage]]:
        """``pop`` of each index in order (``{}`` for None or an index not held),
        the ledger updated once: a load takes every page of its tail."""
        pop, nbytes = super().pop, 0
        taken: list[dict[str, ClaimedPage]] = []
        for index in indices:
            objs = None if index is None else pop(index, None)
            if objs is None:
                taken.append({})
                continue
            taken.append(objs)
            for page in objs.values():
                nbytes += page.nbytes
        self.ledger.bytes -= nbytes
        return taken

    def clear(self) -> None:
        self.ledger.bytes -= sum(p.nbytes for o in self.values() for p in o.values())
        super().clear()


@dataclasses.dataclass(slots=True)
class Preparation:
    """One request attempt's prepared tail: which pages are claimed in KVCR DRAM."""

    ctx: LinkerRequestContext
    page_hashes: list[str]
    deadline: float
    state: PrepState = PrepState.FETCHING
    started: float = dataclasses.field(default_factory=time.monotonic)
    pending_ops: set[OpId] = dataclasses.field(default_factory=set)
    # page index -> {pool name: its claimed object}
    landed: Landed = dataclasses.field(default_factory=Landed)
    hinted: bool = False
    # Every fetch only claims pages resident here (nothing moves): the owner
    # thread answers at once, so preparing may wait for it (local_hit_wait_ms).
    local_only: bool = False
    positions: dict[str, int] | None = None  # page hash -> index, built on demand

    def index_of(self, page_hash: str) -> int | None:
        if self.page_hashes and self.page_hashes[0] == page_hash:
            return 0  # the usual case: asked about the tail it was prepared for
        return self._positions().get(page_hash)

    def indices_of(self, page_hashes: list[str]) -> list[int | None]:
        """``index_of`` of each of ``page_hashes`` (a load's whole tail)."""
        positions = self._positions()
        return [positions.get(h) for h in page_hashes]

    def _positions(self) -> dict[str, int]:
        """Page hash -> its first index in the prepared tail, built once."""
        if self.positions is None:
            self.positions = {}
            for i, h in enumerate(self.page_hashes):
                self.positions.setdefault(h, i)
        return self.positions

    def restorable(
        self,
        start: int,
        tail: list[str],
        full: frozenset[str],
        window: frozenset[str],
        window_pages: int,
    ) -> list[int]:
        """Every boundary ``b`` of ``tail`` (which starts at prepared page
        ``start``) restorable from claims: ``full`` pools claimed for all ``b``
        pages and ``window`` pools for the last ``window_pages`` of them. Sparse
        when a window page in the middle is missing (0.5.23's restorable-set
        rule); stops where the tail leaves the prepared pages."""
        out: list[int] = []
        last_gap = -1  # latest tail page lacking a window-pool claim
        prepared = self.page_hashes
        for b in range(1, len(tail) + 1):
            index = start + b - 1
            have = self.landed.get(index)
            if (
                have is None
                or not full <= have.keys()
                or index >= len(prepared)
                or prepared[index] != tail[b - 1]
            ):
                break
            if not window <= have.keys():
                last_gap = b - 1
            if last_gap < max(0, b - window_pages):
                out.append(b)
        return out

    def claims(self) -> list[ClaimId]:
        return [page.claim for objs in self.landed.values() for page in objs.values()]
