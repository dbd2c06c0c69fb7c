"""Claims on pages resident here, taken in one pass instead of through a kvcr fetch.

A kvcr 0.1.1 ``fetch`` of keys that are all READY in this worker's DRAM moves
nothing: per key it records the access and takes a public claim, and around
that it builds a residency operation, registers it on every key's block record,
takes it off them again, and queues the answer for ``poll_completed``. On a
2-core VM that bookkeeping is most of the ~0.3 ms such a fetch of 47 keys takes
on the owner thread, inside the scheduler's wait for a local hit. ``claim_all``
takes the same claims with kvcr's own ``_acquire_claim`` and registers them as
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

from typing import Any

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
    wanted = list(layout)
    if len(wanted) != 1:
        return None  # a block of one slot (a residency's layout is its slots')
    ready = _LocalDramState.READY
    with core._state_lock:
        records = core._block_record_map
        found = []
        for key in keys:
            record = records.get(key)
            residency = None if record is None else record.local_dram
            if (
                residency is None
                or residency.state is not ready
                or residency.layout != wanted
            ):
                return None
            found.append((key, record, residency))
        if len(set(keys)) != len(keys):
            return None
        clock, acquire, public = core._clock, local._acquire_claim, local._public_claims
        handles, slots = [], []
        handle = local._next_release_handle
        for key, record, residency in found:
            # kvcr's _record_access((key,)), then _new_public_claim, key by key.
            record.access_count += 1
            record.last_access = clock()
            acquire(key, residency)
            public[handle] = (key, residency)
            handles.append(handle)
            slots.append(residency.slots[0][1])
            handle += 1
            local._next_release_handle = handle
        local._update_capacity_pressure()
    return handles, slots
