"""Claims on pages resident here, taken in one pass instead of through a kvcr fetch.

A kvcr 0.1.1 ``fetch`` of keys that are all READY in this worker's DRAM moves
nothing: per key it records the access and takes a public claim, and around
that it builds a residency operation, registers it on every key's block record,
takes it off them again, and queues the answer for ``poll_completed``. On a
2-core VM that bookkeeping is most of the ~0.3 ms such a fetch of 47 keys takes
on the owner thread, inside the scheduler's wait for a local hit. ``claim_all``
takes the same claims as kvcr's ``_acquire_claim`` takes them (claim count up,
out of the eviction queue; the queue's per-pool slot counts are subtracted once
for the whole fetch, not through a generator per key) and registers them as
``_new_public_claim`` does (the next release handle, the public-claims map),
without the ``OpEntryResult`` and slot descriptors that method builds per key
(two objects per page, most of what is left): it returns the handles and slot
numbers. It updates the capacity pressure once as the fetch does (its empty
``reserve_fill``); what it leaves out (the operation, its dependencies and
the completion) nets to nothing, and kvcr's operation counter, which only
makes its handles unique, does not advance. Anything else (a key not
READY, a layout that differs or is not one slot's, a repeated key, no local
DRAM) changes nothing and returns None: the caller fetches through kvcr.
``page_fills.install`` refuses any kvcr but 0.1.1 and checks the names used here.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches.batched_slots import (
    unevictable,
)

# Off only in tests: every fetch then goes through kvcr.
ENABLED = True


def claim_all(
    kv: Any, keys: tuple[bytes, ...], layout: tuple[str, ...]
) -> tuple[list[int], list[int]] | None:
    """The release handle and DRAM slot (element index) of each of ``keys``, in
    order, claimed as ``kv.fetch`` with ``layout`` would claim them, when every
    key is READY here with that layout, of one slot; None (nothing changed)
    otherwise. Owner thread only, as every KVCR call."""
    from kvcr.local_dram import _LocalDramState

    core = kv._core
    local = core._local_dram
    if not ENABLED or local is None or not keys:
        return None
    if len(layout) != 1:
        return None  # a block of one slot (a residency's layout is its slots')
    label = layout[0]
    ready = _LocalDramState.READY
    with core._state_lock:
        record_of = core._block_record_map.get
        found = []
        for key in keys:
            record = record_of(key)
            residency = None if record is None else record.local_dram
            # kvcr's ``residency.layout == [label]``, without building the list
            if (
                residency is None
                or residency.state is not ready
                or len(slots := residency.slots) != 1
                or slots[0][0] != label
            ):
                return None
            found.append((key, record, residency))
        if len(set(keys)) != len(keys):
            return None
        # Key by key, kvcr's _record_access((key,)), _acquire_claim (every key
        # is READY: checked above) and _new_public_claim; the slot counts of
        # _remove_evictable are subtracted once, after.
        clock, public = core._clock, local._public_claims
        first = handle = local._next_release_handle
        taken: list[int] = []
        freed: Counter[str] = Counter()
        try:
            for key, record, residency in found:
                now = clock()  # kvcr's order: the time, then the count
                record.access_count += 1
                record.last_access = now
                unevictable(local, key, residency.slots, freed)
                residency.claim_count += 1
                local._next_release_handle = handle + 1  # then the claim, as kvcr
                public[handle] = (key, residency)
                taken.append(residency.slots[0][1])
                handle += 1
        finally:  # what was taken stays counted, should one step raise
            local._evictable_slots.subtract(freed)
        local._update_capacity_pressure()
    return list(range(first, handle)), taken
