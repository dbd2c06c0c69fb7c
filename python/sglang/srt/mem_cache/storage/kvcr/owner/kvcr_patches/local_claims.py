"""Claims on pages resident here, taken in one pass instead of through a kvcr fetch.

A kvcr 0.1.1 ``fetch`` of keys that are all READY in this worker's DRAM moves
nothing: per key it records the access and takes a public claim, and around
that it builds a residency operation, registers it on every key's block record,
takes it off them again, and queues the answer for ``poll_completed``. On a
2-core VM that bookkeeping is most of the ~0.3 ms such a fetch of 47 keys takes
on the owner thread, inside the scheduler's wait for a local hit. ``claim_all``
takes the same claims, through kvcr's own ``_new_public_claim``, and updates the
capacity pressure once as the fetch does (its empty ``reserve_fill``); what it
leaves out nets to nothing (the operation, its dependencies, the op counter and
the completion, which it returns instead). Anything else (a key not READY, a
layout that differs, a repeated key, no local DRAM) changes nothing and returns
None: the caller fetches through kvcr. ``page_fills.install`` refuses any kvcr
but 0.1.1 and checks the methods used here.
"""

from __future__ import annotations

from typing import Any

# Off only in tests: every fetch then goes through kvcr.
ENABLED = True


def claim_all(kv: Any, keys: tuple[bytes, ...], layout: tuple[str, ...]) -> Any:
    """kvcr's per-key answers (``OpEntryResult``, each with its claim and slot
    descriptors) to a fetch of ``keys`` with ``layout`` when every key is READY
    here with that layout, as ``kv.fetch`` would give them; None (nothing
    changed) otherwise. Owner thread only, as every KVCR call."""
    from kvcr.local_dram import _LocalDramState

    core = kv._core
    local = core._local_dram
    if not ENABLED or local is None or not keys:
        return None
    wanted = list(layout)
    with core._state_lock:
        records = core._block_record_map
        found = []
        for key in keys:
            record = records.get(key)
            residency = None if record is None else record.local_dram
            if (
                residency is None
                or residency.state is not _LocalDramState.READY
                or residency.layout != wanted
            ):
                return None
            found.append((key, record, residency))
        if len(set(keys)) != len(keys):
            return None
        clock, claim = core._clock, local._new_public_claim
        results = {}
        for key, record, residency in found:
            # kvcr's _record_access((key,)), then its claim, key by key.
            record.access_count += 1
            record.last_access = clock()
            results[key] = claim(key, residency, include_descriptors=True)
        local._update_capacity_pressure()
    return results
