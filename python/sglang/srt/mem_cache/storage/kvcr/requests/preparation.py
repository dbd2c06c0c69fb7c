"""Request preparation: which pages of a request's tail are claimed in KVCR DRAM.

A request's device-uncached tail is prepared at enqueue: pages resident here or
named by a hint are fetched into local KVCR DRAM, and each page that lands holds a
residency claim (a ``Preparation``'s ``ClaimedPage``, claimed_pages).
``Preparations`` owns every preparation, which request owns each fetch in flight
(``FetchOwner``), what fetches of dropped preparations still hold (abandoned
bytes), what the claims of live preparations hold (claimed bytes, landed or
being fetched, bounded so requests waiting in the queue cannot pin the whole DRAM
share) and what the readiness gate is holding back. It never calls KVCR: it
returns the ``Fetch``/``Release``/``DiscardHint`` commands for the linker to
submit, and it is driven by the ``OpDone`` and ``ClaimsTaken`` results the
linker drains, so its logic is tested with plain values.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import PageLayout
from sglang.srt.mem_cache.storage.kvcr.layout.pool_layout import block_part_rows
from sglang.srt.mem_cache.storage.kvcr.observability.linker_stats import (
    LinkerStats,
    PreparationGauges,
    Sample,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import (
    ClaimId,
    ClaimsTaken,
    DiscardHint,
    EntryStatus,
    Fetch,
    OpDone,
    OpId,
    Release,
)
from sglang.srt.mem_cache.storage.kvcr.requests.claimed_pages import (
    ClaimedPage,
    ClaimLedger,
    Preparation,
    PrepState,
)
from sglang.srt.mem_cache.storage.kvcr.requests.fetch_plan import (
    PoolFetch,
    plan_fetches,
    restorable_boundaries,
    wanted_pages,
)
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
    PreparationHandle,
)

__all__ = ["ClaimedPage", "FetchOwner", "PrepState", "Preparation", "Preparations"]

logger = logging.getLogger(__name__)

Command = Fetch | Release | DiscardHint
# Requests the readiness gate holds back, tracked for the admission wait; a
# request that leaves without a release only ages out past this bound.
_MAX_HELD_TRACKED = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class FetchOwner:
    """The request a fetch in flight belongs to, the DRAM it will claim, and
    the plan it was made from (its keys, their pool and page indices, the bytes
    and spans of each)."""

    rid: str
    claimed_bytes: int
    fetch: PoolFetch


@dataclasses.dataclass(slots=True)
class _Held:
    """A request the readiness gate is holding back."""

    since: float  # monotonic time of the first pass that held it
    passes: int = 1


class Preparations:
    """Every preparation of one rank (see the module docstring)."""

    def __init__(self, stats: LinkerStats, max_claimed_bytes: int = 0) -> None:
        self.stats = stats
        self._ledger = ClaimLedger(bound=max_claimed_bytes)
        self._preps: dict[str, Preparation] = {}
        self._held: dict[str, _Held] = {}  # rid -> held by the readiness gate
        self._owners: dict[OpId, FetchOwner] = {}  # fetch op -> owner
        self._abandoned: dict[OpId, int] = {}  # fetch op of a dropped prep -> bytes

    def get(self, rid: str) -> Preparation | None:
        return self._preps.get(rid)

    @property
    def quiet(self) -> bool:
        """No preparation alive and no fetch of one (even dropped) in flight."""
        return not (self._preps or self._owners or self._abandoned)

    def begin(
        self,
        ctx: LinkerRequestContext,
        page_hashes: list[str],
        timeout_s: float,
        hinted: bool,
    ) -> tuple[Preparation, list[Command]]:
        """A new preparation for ``ctx`` (replacing any earlier attempt's), and
        the commands that drop the earlier one."""
        commands: list[Command] = []
        old = self._preps.get(ctx.rid)
        if old is not None:
            commands = self.drop(old)
        prep = Preparation(
            ctx, page_hashes, time.monotonic() + timeout_s, hinted=hinted
        )
        prep.landed.ledger = self._ledger  # its claims count with the rank's
        self._preps[ctx.rid] = prep
        return prep, commands

    def prepare(
        self,
        ctx: LinkerRequestContext,
        page_hashes: list[str],
        hint: Any,
        residency: Any,
        layout: PageLayout,
        cfg: Any,
        refuse: bool,
        next_op_id: Callable[[], OpId],
    ) -> list[Command]:
        """Prepare ``ctx``'s tail: claim its leading resident or hinted pages
        (``hint``: a router_hint.RequestHint). Nothing is fetched when ``refuse``
        (weights changing), when abandoned work is over its bound or when its
        claims would take the claimed bytes over theirs; the commands replace
        an earlier attempt's and start the fetches."""
        wanted = wanted_pages(page_hashes, hint.pages, residency, layout.full_pools)
        timeout_s = cfg.preparation_timeout_ms / 1000.0
        prep, commands = self.begin(ctx, page_hashes, timeout_s, hint.hint is not None)
        if wanted and refuse:
            wanted = 0  # pages of the old weights: recompute
        if wanted and self.abandoned_bytes() > cfg.max_abandoned_bytes:
            # Work for requests that went away is still unresolved in KVCR: do not
            # pile more on; this request recomputes.
            self.stats.refused_abandoned += 1
            wanted = 0
        fetches = plan_fetches(
            page_hashes[:wanted],
            hint.pages,
            residency,
            layout,
            layout.object_bytes,
            cfg.prepare_chunk_pages,
        )
        if wanted and not self._ledger.fits(self.claimed_bytes(), fetches):
            self.stats.refused_claimed += 1  # waiting requests hold enough
            wanted = 0
        if wanted == 0:
            prep.state = PrepState.READY  # zero-hit fast path: no owner round trip
            return commands
        self.stats.prepared += 1
        self.stats.prepared_pages += wanted
        prep.local_only = not any(f.moved for f in fetches)
        envelope = hint.envelope(page_hashes)
        return commands + self.fetch(prep, fetches, next_op_id, envelope)

    def fetch(
        self,
        prep: Preparation,
        fetches: Iterable[PoolFetch],
        next_op_id: Callable[[], OpId],
        envelope: Any,
    ) -> list[Command]:
        """The ``Fetch`` commands of ``prep``'s pool fetches, in order; the hint
        envelope rides on the first that moves bytes (the adapter carries it to
        the request's next fetch if that one is refused)."""
        commands: list[Command] = []
        for f in fetches:
            if not f.keys:
                continue
            op_id = next_op_id()
            claimed = len(f.keys) * f.page_bytes
            prep.pending_ops.add(op_id)
            # The DRAM it will claim (what an abandoned op still holds).
            self._owners[op_id] = FetchOwner(prep.ctx.rid, claimed, f)
            commands.append(
                Fetch(
                    op_id=op_id,
                    keys=f.keys,
                    request_id=str(prep.ctx.handle),
                    expected_layout=f.expected_layout,
                    nbytes=claimed if f.moved else 0,
                    hint=envelope if f.moved else None,
                )
            )
            if f.moved:
                envelope = None
        return commands

    def on_fetch_done(
        self,
        done: OpDone | ClaimsTaken,
        parse_key: Callable[[bytes], tuple[str, str] | None],
    ) -> list[Command]:
        """Record what one fetch landed; claims nobody can use are released."""
        owner = self._owners.pop(done.op_id, None)
        self._abandoned.pop(done.op_id, None)
        prep = self._preps.get(owner.rid) if owner is not None else None
        if (
            prep is None
            or owner is None
            or prep.state is PrepState.RELEASED
            or done.op_id not in prep.pending_ops  # from an earlier attempt
        ):
            late = _claims_of(done)
        else:
            prep.pending_ops.discard(done.op_id)
            if isinstance(done, ClaimsTaken):
                late = _land_taken(prep, owner, done)
            else:
                late = _land_entries(prep, owner, done, parse_key)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug(
                    "KVCR fetch for %s: %d pages landed, %d released, %d ops pending",
                    prep.ctx.handle,
                    len(prep.landed),
                    len(late),
                    len(prep.pending_ops),
                )
            if not prep.pending_ops:
                self.mark_ready(prep)
        if not late:
            return []
        self.stats.late_claims_released += len(late)
        return [Release(tuple(late))]

    def lookup(
        self,
        rid: str,
        page_hashes: list[str],
        window: dict[str, int] | int,
        layout: PageLayout,
        residency: Any,
    ) -> tuple[list[int], list[Command]]:
        """The restorable boundaries of ``rid``'s tail from its claims (``window``:
        trailing pages that need claims in each trailing source's pools, from
        ``fetch_plan.window_pages``), and the commands of a preparation it
        invalidates; each miss is counted by its cause."""
        s = self.stats
        prep = self._preps.get(rid)
        if prep is None:
            # Never prepared (it reached the tree without passing the enqueue
            # hook): a miss, never a wait on the scheduler thread.
            first = layout.block_key(page_hashes[0], layout.pools[0].name)
            if first in residency:
                s.miss_unprepared += 1
            else:
                s.lookup_fast_miss += 1
            return [], []
        start = prep.index_of(page_hashes[0])
        if start is None:  # the device prefix moved past what was prepared
            s.miss_prefix_moved += 1
            return [], self.drop(prep)
        boundaries = restorable_boundaries(prep, start, page_hashes, layout, window)
        if not boundaries:
            s.miss_unclaimed += 1
        s.hit_pages += boundaries[-1] if boundaries else 0
        return boundaries, []

    def mark_ready(self, prep: Preparation) -> None:
        if prep.state is PrepState.FETCHING:
            waited_ms = (time.monotonic() - prep.started) * 1000.0
            self.stats.prepare_done += 1
            self.stats.prepare_ms_total += waited_ms
            self.stats.prepare_ms_max = max(self.stats.prepare_ms_max, waited_ms)
            self.stats.samples.add(Sample.PREPARE_WAIT, waited_ms / 1000.0)
        prep.state = PrepState.READY

    def ready(self, handle: PreparationHandle) -> bool:
        """Whether ``handle``'s attempt may be admitted (a stale handle: yes)."""
        prep = self._preps.get(handle.rid)
        if (
            prep is None
            or prep.ctx.attempt_id != handle.attempt_id
            or prep.state is not PrepState.FETCHING
        ):
            return True
        if time.monotonic() >= prep.deadline:
            self.stats.prepare_deadline_expired += 1
            self.mark_ready(prep)  # late completions still land or release
            return True
        return False

    def note_admission(self, rids: list[str], ready: list[bool]) -> None:
        """One readiness-gate pass: the passes and wait of each request held."""
        held = self._held
        if not held and all(ready):
            return  # the common pass: nothing held before or now
        now = time.monotonic()
        for rid, ok in zip(rids, ready, strict=True):
            if not ok:
                record = held.get(rid)
                if record is not None:
                    record.passes += 1
                    continue
                if len(held) >= _MAX_HELD_TRACKED:
                    del held[next(iter(held))]  # the oldest record goes unmeasured
                held[rid] = _Held(now)
                continue
            released = held.pop(rid, None)
            if released is None:
                continue  # never held: adds nothing
            waited_ms = (now - released.since) * 1000.0
            s = self.stats
            s.admission_held += 1
            s.admission_held_passes += released.passes
            s.admission_wait_ms_total += waited_ms
            s.admission_wait_ms_max = max(s.admission_wait_ms_max, waited_ms)
            s.samples.add(Sample.ADMISSION_WAIT, waited_ms / 1000.0)

    def held_rids(self) -> list[str]:
        return list(self._held)

    def release(self, rid: str) -> list[Command]:
        """The request ended: drop its preparation and what it held."""
        self._held.pop(rid, None)
        prep = self._preps.get(rid)
        return [] if prep is None else self.drop(prep)

    def drop(self, prep: Preparation) -> list[Command]:
        if self._preps.get(prep.ctx.rid) is prep:
            del self._preps[prep.ctx.rid]
        for op_id in prep.pending_ops:
            owner = self._owners.get(op_id)
            if owner is not None:
                self._abandoned[op_id] = owner.claimed_bytes
        claims = prep.claims()
        prep.landed.clear()
        prep.state = PrepState.RELEASED
        commands: list[Command] = []
        if claims:
            commands.append(Release(tuple(claims)))
        if prep.hinted:
            commands.append(DiscardHint(str(prep.ctx.handle)))
        return commands

    def release_all(self) -> list[ClaimId]:
        """Drop every preparation; the claims they held (for one ``Release``)."""
        claims: list[ClaimId] = []
        for prep in self._preps.values():
            claims.extend(prep.claims())
            prep.landed.clear()
            prep.state = PrepState.RELEASED
        self._preps.clear()
        return claims

    def claimed_bytes(self) -> int:
        """Bytes the claims of live preparations hold, landed or being fetched."""
        live = (o for op, o in self._owners.items() if op not in self._abandoned)
        return self._ledger.bytes + sum(o.claimed_bytes for o in live)

    def abandoned_bytes(self) -> int:
        """Bytes still being fetched for preparations that were dropped."""
        return sum(self._abandoned.values())

    def abandon(self, op_id: OpId, owner: FetchOwner) -> None:
        """Record an op whose preparation is gone (its claim still to resolve)."""
        self._owners[op_id] = owner
        self._abandoned[op_id] = owner.claimed_bytes

    def gauges(self) -> PreparationGauges:
        """What the preparations hold: the stats snapshot's figures."""
        claims = sum(len(p.claims()) for p in self._preps.values())
        return PreparationGauges(claims, self.abandoned_bytes(), self.claimed_bytes())

    def reset(self) -> None:
        """Operations of the old core never complete: forget what they owed."""
        self._owners.clear()
        self._abandoned.clear()
        self._held.clear()


def _claims_of(done: OpDone | ClaimsTaken) -> list[ClaimId]:
    """Every claim a fetch's answer holds."""
    if isinstance(done, ClaimsTaken):
        return list(done.claims)
    return [e.claim for e in done.entries.values() if e.claim is not None]


def _land_taken(
    prep: Preparation, owner: FetchOwner, taken: ClaimsTaken
) -> list[ClaimId]:
    """Land a fetch answered in one pass (every key claimed, one slot each, in the
    order planned: ``PoolFetch.pages``); the claims to release (all of them when
    the answer is not for the keys planned, in their order)."""
    f, claims, slots = owner.fetch, taken.claims, taken.slots
    if taken.keys != f.keys or not (len(f.pages) == len(claims) == len(slots)):
        return list(claims)
    nbytes, parts = f.page_bytes, f.parts
    prep.landed.add_pool(
        f.pool,
        [
            (index, ClaimedPage(claim, block_part_rows(slot, parts), nbytes))
            for index, claim, slot in zip(f.pages, claims, slots, strict=True)
        ],
    )
    return []


def _land_entries(
    prep: Preparation,
    owner: FetchOwner,
    done: OpDone,
    parse_key: Callable[[bytes], tuple[str, str] | None],
) -> list[ClaimId]:
    """Land a kvcr fetch's per-key answers; the claims nobody can use (a key
    that failed, is not this preparation's, or is not one slot)."""
    late: list[ClaimId] = []
    nbytes, parts, index_of = owner.fetch.page_bytes, owner.fetch.parts, prep.index_of
    for key, entry in done.entries.items():
        if (claim := entry.claim) is None:
            continue
        parsed = parse_key(key)
        index = None if parsed is None else index_of(parsed[0])
        if (
            entry.status is not EntryStatus.SUCCESS
            or parsed is None
            or index is None
            or len(slots := entry.slots or ()) != 1  # a block is one slot
        ):
            late.append(claim)
            continue
        rows = block_part_rows(slots[0].element_index, parts)
        prep.landed.add(index, parsed[1], ClaimedPage(claim, rows, nbytes))
    return late
