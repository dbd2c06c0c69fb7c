"""kvcr's slot bookkeeping for a deposit, batched: one allocation, one commit.

kvcr 0.1.1 reserves, evicts for and completes local-DRAM fills one key at a
time (policy calls, block metadata built twice and counter updates per key),
Python that holds the GIL next to the scheduler: for 63 pages of a full DRAM
about 0.8 ms to reserve and 0.5 ms to commit on a 2-core test VM. For the
linker's own deposits (``page_fills``) this reserves every slot of a chunk with
one ``_allocate_slots`` call, first evicting what that call would evict under
kvcr's built-in policies without their per-victim no-op calls, and marks a
landed chunk READY in one pass, each leaving kvcr's state exactly as its
per-key path would (the tests compare them step by step). It falls back to that
path whenever the batch would not: an allocation that cannot be met whole, a
failed copy, a fetch waiting on a key being filled, kvcr's key history on.
``page_fills.install`` refuses any kvcr but 0.1.1 and checks the methods used
here; the instance attributes are 0.1.1's.
"""

from __future__ import annotations

from collections import Counter
from heapq import heappop, heappush
from typing import Any

# Off only in tests: every deposit then allocates key by key, as kvcr does.
ONE_ALLOCATION = True


def reserve(
    core: Any, keys: list[bytes], label: str, deadline: float, keep: set[bytes]
) -> set[bytes]:
    """Under kvcr's state lock: reserve a FILLING slot of ``label`` for each of
    ``keys`` as kvcr's ``reserve_fill`` does, except that no page of the deposit
    (``keep``, which holds ``keys``) is evicted for another; the keys that got
    one. kvcr's own loop asks its policy about each key (kvcr's built-in FIFO and
    LRU, the only ones the linker runs, keep every ingest: ``attach`` checks) and
    allocates one slot at a time; one allocation of every slot at once picks the
    same victims in the same order and hands out the same slots, so that comes
    first, and only an allocation that cannot be met whole goes key by key."""
    from kvcr.local_dram import _LocalDramResidency, _LocalDramState
    from kvcr.types import CacheTier

    local = core._local_dram
    fresh = [key for key in keys if core._block_record(key).local_dram is None]
    got: list[tuple[bytes, tuple[str, int]]] = []
    evicted: list[bytes] = []
    if fresh and ONE_ALLOCATION:
        locations, evicted = allocate(core, label, len(fresh), keep, deadline)
        if locations is not None:
            got = list(zip(fresh, locations, strict=True))
            fresh = []
    for key in fresh:
        locations, victims, _ = local._allocate_slots([label], keep, deadline)
        evicted += victims
        if locations is not None:
            got.append((key, locations[0]))
    for key, location in got:
        core._block_record(key).local_dram = _LocalDramResidency(
            [location], _LocalDramState.FILLING
        )
    local._update_capacity_pressure()
    core._publish_inventory(evicted, CacheTier.LOCAL_G2, removed=True)
    return {key for key, _ in got}


# Off only in tests: a deposit's one allocation then goes through kvcr's own
# ``_allocate_slots``.
ONE_EVICTION = True


def builtin_policy(core: Any) -> bool:
    """Whether ``core`` runs kvcr's built-in FIFO or LRU policy (exactly) with no
    disk tier: ingest always KEEP, eviction always DROP, never pending."""
    from kvcr.policy import FIFOPolicy, LRUPolicy

    return core._g3 is None and type(core._policy._policy) in (FIFOPolicy, LRUPolicy)


def unevictable(
    local: Any, key: bytes, slots: list[tuple[str, int]], freed: Counter[str]
) -> None:
    """kvcr's ``_remove_evictable(key, residency)`` but for its slot counts,
    which go into ``freed`` (the caller subtracts them from
    ``_evictable_slots`` once, not through a generator per key)."""
    local._unscored.discard(key)
    if local._evictable.remove(key):
        for label, _ in slots:
            freed[label.partition(":")[0]] += 1


def allocate(
    core: Any, label: str, count: int, keep: set[bytes], deadline: float
) -> tuple[list[tuple[str, int]] | None, list[bytes]]:
    """Under kvcr's state lock: ``count`` slots of ``label`` as kvcr's
    ``_allocate_slots([label] * count, keep, deadline)`` hands them out (its
    locations, or None with nothing changed, and the keys it evicted), by that
    call itself. Where free slots fall short, the entries it would evict go
    first, as kvcr evicts under its built-in policies: READY entries in
    eviction-score order, none of ``keep``, those holding a slot of the label's
    pool, until enough are free; kvcr then finds the slots free. Those policies
    always drop and keep no state, so their per-victim calls (the eviction
    decision, block metadata twice, the removal hook) are left out. Any other
    policy, a capacity eviction pending in kvcr, or kvcr's key history leaves the
    whole allocation to kvcr."""
    from kvcr.types import CacheTier

    local = core._local_dram
    pool = label.partition(":")[0]
    victims: list[bytes] = []
    need = count - len(local._free_slots[pool])
    if (
        need > 0
        and ONE_EVICTION
        and builtin_policy(core)
        and not core._key_history_enabled
        and local._capacity_eviction_key is None
    ):
        chosen = _victims(core, pool, need, keep)
        if chosen is None:
            return None, []
    else:
        chosen = []
    freed: Counter[str] = Counter()  # _remove_evictable's slot counts
    try:
        try:
            for key, record, residency in chosen:
                unevictable(local, key, residency.slots, freed)
                record.local_dram = None
                victims.append(key)  # gone from kvcr from here on
                local._residency_observer(key, record)
                core._prune_block_record(key)
                local._free(residency.slots)
        finally:  # subtracted once, for every victim taken off the queue
            local._evictable_slots.subtract(freed)
        locations, more, _ = local._allocate_slots([label] * count, keep, deadline)
    except BaseException:
        if victims:  # the linker must hear of every entry kvcr no longer holds
            local._update_capacity_pressure()
            core._publish_inventory(victims, CacheTier.LOCAL_G2, removed=True)
        raise
    return locations, victims + more


def _victims(
    core: Any, pool: str, need: int, keep: set[bytes]
) -> list[tuple[bytes, Any, Any]] | None:
    """The evictable entries (key, record, residency) whose slots in ``pool``
    free ``need`` of them, taken in kvcr's eviction order, none of ``keep``; None
    when there are not enough (nothing is changed).

    It walks kvcr's eviction queue as its ``candidates`` generator does (pop in
    score order, drop stale entries, put back every live one popped), without
    the generator and the two ``_Entry`` objects that builds per entry."""
    from kvcr.local_dram import _LocalDramState

    local = core._local_dram
    local._retry_unscored()
    ready, records = _LocalDramState.READY, core._block_record_map
    queue = local._evictable
    heap, live = queue._heap, queue._live
    popped: list[tuple[float, int, bytes]] = []  # live: all go back
    chosen = []
    try:
        while heap:
            item = heappop(heap)
            score, sequence, key = item
            entry = live.get(key)
            if entry is None or entry.score != score or entry.sequence != sequence:
                continue  # stale: kvcr drops it too
            popped.append(item)
            if key in keep:
                continue
            record = records.get(key)
            residency = None if record is None else record.local_dram
            if (
                residency is None
                or residency.state is not ready
                or residency.claim_count
            ):
                raise RuntimeError(f"invalid evictable local DRAM entry {key!r}")
            freed = 0
            for name, _ in residency.slots:
                freed += name.partition(":")[0] == pool
            if freed:
                chosen.append((key, record, residency))
                need -= freed
                if need <= 0:
                    return chosen
        return None
    finally:
        for item in popped:
            heappush(heap, item)


# Off only in tests: every landed chunk then goes through kvcr's own
# ``_apply_fill_result``.
ONE_COMMIT = True


def commit_landed(
    core: Any,
    keys: tuple[bytes, ...],
    slots: tuple[tuple[tuple[str, int], ...], ...],
    success: bool,
) -> bool:
    """Under kvcr's state lock: mark a chunk whose every byte landed
    (``success``) READY as kvcr's ``_apply_fill_result`` does, when that is all
    it would do: every key
    still FILLING in the slots reserved for it, no kvcr operation waiting on any
    of them (a fetch of a key being filled), kvcr's key history off. Per key it
    builds kvcr's block metadata once and hands the same one to the policy's
    ingest (skipped where the policy keeps the no-op default) and to its eviction
    score (kvcr builds it twice, from the same record fields, neither call
    changing them); the evictable-slot counts, inventory event, capacity
    pressure and capacity waiters follow once for the chunk. Whether it did;
    when not, nothing was changed and kvcr's own path applies the result."""
    from kvcr.local_dram import _LocalDramState
    from kvcr.policy import KVCachePolicy
    from kvcr.types import CacheTier

    local = core._local_dram
    if not (success and ONE_COMMIT) or core._key_history_enabled:
        return False
    records = []
    for key, reserved in zip(keys, slots, strict=True):
        record = core._block_record_map.get(key)
        residency = None if record is None else record.local_dram
        if (
            residency is None
            or residency.state is not _LocalDramState.FILLING
            or residency.slots != list(reserved)
            or record.active_op_ids
        ):
            return False
        records.append(record)
    now = core._clock()
    evictable, policy = local._evictable, core._policy
    # kvcr's built-in policies (``attach`` admits no other) keep no ingest state.
    ingest = type(policy._policy).on_ingest is not KVCachePolicy.on_ingest
    sizes: dict[tuple[str, ...], int] = {}  # by the slots' labels
    newly: Counter[str] = Counter()
    try:
        for key, record, reserved in zip(keys, records, slots, strict=True):
            residency = record.local_dram
            record.last_access = now
            residency.state = _LocalDramState.READY
            local._residency_observer(key, record)
            labels = tuple(label for label, _ in reserved)
            size = sizes.get(labels)
            if size is None:
                size = sizes[labels] = local._size_bytes(reserved)
            meta = core._block_meta(key, record, size)
            if ingest:
                core._on_ingest(meta, CacheTier.FW_G2)
            if residency.claim_count:  # kvcr's _make_evictable from here on
                continue
            score = policy.eviction_score(
                meta, CacheTier.LOCAL_G2, previous_score=evictable.score(key)
            )
            if score is None:
                local._unscored.add(key)
                continue
            local._unscored.discard(key)
            if evictable.insert(key, score):
                for label in labels:
                    newly[label.partition(":")[0]] += 1
    finally:  # counted for every key made evictable, should one raise
        local._evictable_slots.update(newly)
    local._update_capacity_pressure()
    core._publish_inventory(list(keys), CacheTier.LOCAL_G2, removed=False)
    local._resume_capacity_waiters()
    return True
