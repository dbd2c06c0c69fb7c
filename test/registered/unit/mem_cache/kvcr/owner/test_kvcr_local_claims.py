"""Pages resident here, claimed in one pass, end as a kvcr fetch would leave them.

``kvcr_patches.local_claims.claim_all`` answers a fetch whose every page is READY
in this worker's DRAM without kvcr's residency operation (taken on and off
every key's record in the same call) and without a completion to poll. Here the
same seeded run of deposits (which evict: more keys than slots), fetches and
releases goes through two real KVCRs of one configuration: one answers fetches
with ``claim_all`` (kvcr's fetch where it declines, as the executor does), the
other with kvcr's ``fetch`` and ``poll_completed``. After every step both hold
the same keys in the same slots and states, with the same claim and access
counts, the same recency order, the same eviction order and evictable counts,
the same public claims, and gave the same answers (status, slot descriptors and
release handle of every key). The run must reach fetches answered in one pass
and fetches it declined (a page missing); a page READY in another layout, or
still being filled, is declined too and leaves kvcr as it was. (kvcr's capacity
pressure, updated once as its fetch does, has no callback in this configuration
or the linker's, so nothing here observes it.)
"""

from __future__ import annotations

import random
from contextlib import closing

import pytest
import torch

from cpu_harness import kvcr_stack
from sglang.srt.mem_cache.storage.kvcr.datapath.dram_copy import DramCopier
from sglang.srt.mem_cache.storage.kvcr.device.device_streams import DeviceBinding
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_adapter import KVCRAdapter
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import (
    AdapterLimits,
    ClaimsTaken,
    Deposit,
    EntryStatus,
    OpDone,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import local_claims

pytestmark = pytest.mark.kvcr

BLOCK = 4096
SLOTS = 8
KEYS = 12
STEPS = 80
LAYOUT = ("kv:page",)


def _key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def _adapter(name: str, copiers: list) -> KVCRAdapter:
    fw = torch.zeros(KEYS, BLOCK, dtype=torch.uint8)
    store = torch.zeros(SLOTS, BLOCK, dtype=torch.uint8)
    copier = DramCopier(
        {"kv": [fw]}, lambda: {"kv": store}, DeviceBinding.of(torch.device("cpu"))
    )
    copiers.append(copier)
    factory = kvcr_stack.small_kvcr_factory(name, store, BLOCK, copier=copier)
    limits = AdapterLimits(
        max_inflight_offload_bytes=1 << 30,
        max_inflight_prepare_bytes=1 << 30,
        wait_timeout_s=20.0,
    )
    return KVCRAdapter(factory, limits, name=name)


def _deposit(adapter: KVCRAdapter, keys: list[int]) -> dict:
    op = adapter.next_op_id()
    blocks = {_key(i): ("kv:page", i) for i in keys}
    adapter.submit(Deposit(op_id=op, blocks=blocks, nbytes=len(keys) * BLOCK))
    deadline = 200
    while deadline:
        for item in adapter.drain(0.05):
            if isinstance(item, OpDone) and item.op_id == op:
                return {k: e.status for k, e in item.entries.items()}
        deadline -= 1
    raise AssertionError("deposit not answered")


def _answers(entries) -> dict:
    """kvcr's per-key answers, as comparable values: status, slot numbers,
    release handle."""
    return {
        key: (
            r.status.name,
            tuple(d.element_index for d in r.descriptors or ()),
            r.release_handle,
        )
        for key, r in entries.items()
    }


def _kvcr_fetch(kv, keys: tuple[bytes, ...]) -> dict:
    handle = kv.fetch(list(keys), request_id="r", expected_layout=list(LAYOUT))
    for done, entries in kv.poll_completed():
        if done == handle:
            return _answers(entries)
    raise AssertionError("a fetch of resident pages was not answered in the call")


def _one_pass(kv, keys: tuple[bytes, ...]) -> tuple[bool, dict]:
    taken = local_claims.claim_all(kv, keys, LAYOUT)
    if taken is None:
        return False, _kvcr_fetch(kv, keys)
    handles, slots = taken
    assert len(handles) == len(slots) == len(keys)
    return True, {
        key: ("SUCCESS", (slot,), handle)
        for key, handle, slot in zip(keys, handles, slots, strict=True)
    }


def _state(kv) -> tuple:
    core = kv._core
    local = core._local_dram
    with core._state_lock:
        records = core._block_record_map
        resident = sorted(
            (
                key,
                tuple(r.local_dram.slots),
                r.local_dram.state.name,
                r.local_dram.claim_count,
                r.access_count,
            )
            for key, r in records.items()
            if r.local_dram is not None
        )
        recency = sorted(records, key=lambda k: (records[k].last_access or 0.0, k))
        with closing(local._evictable.candidates(set())) as order:
            evictable = list(order)
        return (
            resident,
            recency,
            evictable,
            sorted(local._unscored),
            sorted(local._evictable_slots.items()),
            sorted(local._public_claims.items()),
            {n: tuple(d) for n, d in local._free_slots.items()},
            core._outstanding_operations,
            dict(local._pending_residency_ops),
        )


def _declines_a_filling_page(kv, resident: list[bytes]) -> tuple[list, tuple, tuple]:
    """Reserve a FILLING slot for a new key (as a deposit does), ask for it
    after and before the READY pages, then fail the fill: the answers, and
    kvcr's state before and after they were asked."""
    from kvcr.types import CacheTier

    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import batched_slots

    core, filling = kv._core, _key(KEYS + 1)
    with core._state_lock:
        got = batched_slots.reserve(
            core, [filling], "kv:page", core._operation_deadline(), {filling}
        )
    assert got == {filling}
    during = _state(kv)
    # What is still READY (the reservation may have evicted some of it).
    ready = tuple(k for k, _, state, *_ in during[0] if state == "READY")
    assert ready and set(ready) <= set(resident)
    answers = [
        local_claims.claim_all(kv, (*ready, filling), LAYOUT),
        local_claims.claim_all(kv, (filling, *ready), LAYOUT),
    ]
    after = _state(kv)
    with core._state_lock:
        slots = (tuple(core._block_record_map[filling].local_dram.slots),)
        core._local_dram._apply_fill_result((filling,), slots, False, CacheTier.FW_G2)
    return answers, during, after


def test_one_pass_claims_leave_kvcr_as_its_fetch_does():
    rng = random.Random(7)
    copiers: list[DramCopier] = []
    one, ref = _adapter("claims-one", copiers), _adapter("claims-ref", copiers)
    held: list[list[int]] = []
    reached = {"one_pass": 0, "declined": 0}
    try:
        for _ in range(STEPS):
            roll = rng.random()
            if held and (roll < 0.25 or len(held) > 3):
                handles = held.pop(rng.randrange(len(held)))
                assert one.call(lambda kv, h=handles: kv.release(h)) == ref.call(
                    lambda kv, h=handles: kv.release(h)
                )
            elif roll < 0.55:
                keys = rng.sample(range(KEYS), rng.randint(1, 4))
                assert _deposit(one, keys) == _deposit(ref, keys)
            else:
                resident = [k for k, *_ in ref.call(_state)[0]]
                if resident and rng.random() < 0.5:  # what a local hit asks for
                    keys = tuple(rng.sample(resident, rng.randint(1, len(resident))))
                else:
                    picked = rng.sample(range(KEYS), rng.randint(1, 5))
                    keys = tuple(_key(i) for i in picked)
                answered, mine = one.call(lambda kv, k=keys: _one_pass(kv, k))
                theirs = ref.call(lambda kv, k=keys: _kvcr_fetch(kv, k))
                assert mine == theirs
                reached["one_pass" if answered else "declined"] += 1
                held.append([h for _, _, h in mine.values() if h is not None])
            assert one.call(_state) == ref.call(_state)
        assert reached["one_pass"] >= 5 and reached["declined"] >= 5, reached
        # A fetch whose pages are all READY in another layout is declined, and
        # leaves kvcr as it was.
        resident = [k for k, *_ in one.call(_state)[0]]
        assert resident
        before = one.call(_state)
        assert (
            one.call(
                lambda kv: local_claims.claim_all(kv, tuple(resident), ("kv:other",))
            )
            is None
        )
        assert one.call(_state) == before
        # So is one with a page still being filled (its slot reserved, not
        # READY), wherever it stands among READY ones.
        answers, during, after = one.call(
            lambda kv: _declines_a_filling_page(kv, resident)
        )
        assert answers == [None, None] and during == after
    finally:
        for adapter in (one, ref):
            adapter.close()
        for copier in copiers:
            assert copier.close(5)


def test_a_fetch_of_resident_pages_is_answered_without_kvcr_fetch():
    """Through the adapter: a preparation's fetch of resident pages is answered
    with claims, and kvcr's ``fetch`` never runs for it."""
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import Fetch

    copiers: list[DramCopier] = []
    adapter = _adapter("claims-adapter", copiers)
    try:
        assert set(_deposit(adapter, [0, 1, 2]).values()) == {EntryStatus.SUCCESS}
        fetches = []
        kv = adapter.call(lambda kv: kv)
        real = kv.fetch
        kv.fetch = lambda *a, **k: fetches.append(a) or real(*a, **k)
        op = adapter.next_op_id()
        keys = (_key(0), _key(1), _key(2))
        adapter.submit(
            Fetch(op_id=op, keys=keys, request_id="r", expected_layout=LAYOUT, nbytes=0)
        )
        done = None
        for _ in range(200):
            done = next(
                (i for i in adapter.drain(0.05) if isinstance(i, ClaimsTaken)), None
            )
            if done is not None:
                break
        assert done is not None and done.op_id == op
        assert len(set(done.claims)) == 3 and len(done.slots) == 3
        public = adapter.call(lambda kv: dict(kv._core._local_dram._public_claims))
        assert [public[c][0] for c in done.claims] == list(keys)
        assert fetches == []
        assert adapter.stats().fetches == 1
    finally:
        adapter.close()
        for copier in copiers:
            assert copier.close(5)
