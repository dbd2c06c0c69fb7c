"""A base request sent with ``extra_key=<lora_id>`` never shares KV with that LoRA.

SGLang joins ``extra_key`` and ``lora_id`` into one string, so both requests get
the same radix namespace text. In real CPU stacks with a real KVCR (the production
factory, ``load_plugins()`` hooks), requests named through SGLang's own (hooked)
``Scheduler._record_kv_event_lora_name`` must keep separate tree nodes, separate
KVCR pages (locally and at a peer), while a router hint built from what the worker
publishes still restores each request's own KV; and every hash SGLang publishes
over the namespace text stays what it was.
"""

from __future__ import annotations

import pickle
import uuid
from array import array
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cpu_harness import kvcr_stack
from cpu_harness.kvcr_pages import buffers, fetch_hint, fill_random, wait_until
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.lora_namespace import (
    LoraExtraKey,
)

pytestmark = [pytest.mark.kvcr, pytest.mark.usefixtures("plugin_hooks")]

PAGE, LAYERS, HEADS, DIM = 4, 2, 2, 8
POOL_TOKENS = 64 * PAGE
GEOMETRY = kvcr_stack.Geometry(PAGE, LAYERS, HEADS, DIM, POOL_TOKENS)
KVCR_CONFIG = {
    "local_dram_bytes_per_worker": 4 * 1024 * 1024,
    "operation_timeout_ms": 5000,
    "abandon_timeout_ms": 10000,
    "preparation_timeout_ms": 10_000,
}
# SGLang's LoRA ids are deterministic uuid5 hex strings: anyone can compute one.
LORA_ID = uuid.uuid5(uuid.NAMESPACE_URL, "adapter-a").hex
ADAPTER = "adapter-a"
PREFIX = list(range(500, 500 + 4 * PAGE))
TOKENS = [*PREFIX, 1, 2, 3]


@pytest.fixture
def make_stack() -> Iterator[Callable[..., kvcr_stack.KVCRStack]]:
    linkers: list[Any] = []

    def make(*, events: bool = False) -> kvcr_stack.KVCRStack:
        stack = kvcr_stack.build_stack(KVCR_CONFIG, GEOMETRY, events=events)
        linkers.append(stack.linker)
        return stack

    yield make
    for linker in linkers:
        linker.close()


class Scheduler:
    """What the hooked ``Scheduler._record_kv_event_lora_name`` and
    ``_add_request_to_queue`` read, over one stack (its recorder's LoRA names)."""

    def __init__(self, stack: kvcr_stack.KVCRStack) -> None:
        from sglang.srt.disaggregation.utils import DisaggregationMode

        self.tree_cache = stack.cache
        self.kv_events_publisher = SimpleNamespace(enable_kv_cache_events=True)
        self.kv_event_lora_names = stack.cache.tree_core.kv_events.lora_names
        self.waiting_queue: list[Any] = []
        self.disaggregation_mode = DisaggregationMode.NULL
        self.processed_tokens_counter = 0

    def _set_or_validate_priority(self, req: Any) -> bool:
        return True

    def _abort_on_queued_limit(self, req: Any) -> bool:
        return False

    def _prefetch_kvcache(self, req: Any) -> None:
        return None

    def new_req(self, rid: str, *, lora: bool, extra_key=None, hint=None) -> Any:
        """A request as the scheduler builds it: ``Req`` joins the keys, then SGLang
        names its LoRA namespace (the plugin's hook runs there)."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.managers.scheduler import Scheduler as SGLangScheduler
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(
            rid,
            "",
            array("q", TOKENS),
            SamplingParams(max_new_tokens=1),
            lora_id=LORA_ID if lora else None,
            extra_key=extra_key,
            kv_hints=hint,
        )
        SGLangScheduler._record_kv_event_lora_name(self, req, ADAPTER if lora else None)
        return req

    def enqueue(self, req: Any) -> None:
        from sglang.srt.managers.scheduler import Scheduler as SGLangScheduler

        SGLangScheduler._add_request_to_queue(self, req)


def kv_bytes(kvcache: Any, slots: torch.Tensor) -> torch.Tensor:
    return torch.cat(
        [buf[slots].reshape(-1).view(torch.uint8) for buf in buffers(kvcache)]
    )


def radix_key(req: Any, tokens: list[int]) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens), req.extra_key, cache_salt=req.cache_salt)


def computed(stack: kvcr_stack.KVCRStack, req: Any, seed: int) -> torch.Tensor:
    """``req`` computed its prefix here (random K/V, inserted in its namespace,
    written through to KVCR); returns the bytes."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    slots = stack.allocator.alloc(len(PREFIX))
    fill_random(stack.kvcache, slots, seed, page=1)
    original = kv_bytes(stack.kvcache, slots).clone()
    stack.cache.insert(InsertParams(key=radix_key(req, PREFIX), value=slots))

    def committed() -> bool:
        stack.cache.check_hicache_events()
        return not stack.cache.linker.pending_offloads

    wait_until(committed, what="offloads committed")
    return original


def device_hit(stack: kvcr_stack.KVCRStack, req: Any) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    key = radix_key(req, PREFIX)
    return stack.cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len


def forget_device(stack: kvcr_stack.KVCRStack) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    stack.cache.evict(EvictParams(num_tokens=POOL_TOKENS))
    for buf in buffers(stack.kvcache):
        buf.zero_()


def prepared_hit(stack: kvcr_stack.KVCRStack, sched: Scheduler, req: Any) -> int:
    """Enqueue ``req``, wait for its preparation, match it: its host hit."""
    sched.enqueue(req)
    handle = LinkerRequestContext(req.rid, req.cache_request_handle.attempt_id).handle
    wait_until(lambda: stack.linker.preparation_ready(handle), what="prepared")
    req.init_next_round_input(stack.cache)
    assert req.prefix_len == 0
    return req.host_hit_length


def restored(stack: kvcr_stack.KVCRStack, req: Any) -> torch.Tensor:
    """Load ``req``'s host hit into the device pool; the bytes that landed."""
    cache = stack.cache
    assert kvcr_stack.load_back(cache, req)[0] == len(PREFIX)
    private = cache.linker.private_load_indices[req.rid].clone()
    assert cache.ready_to_load_host_cache() >= 0
    assert cache.finish_external_linker_loads([req]) == []
    return kv_bytes(stack.kvcache, private)


def published(stack: kvcr_stack.KVCRStack) -> list[int]:
    """The block hashes of the GPU stores SGLang published since the last take."""
    from sglang.srt.disaggregation.kv_events import BlockStored, StorageMedium

    return [
        h
        for e in stack.cache.take_events()
        if isinstance(e, BlockStored) and e.medium == StorageMedium.GPU
        for h in e.block_hashes
    ]


def test_a_base_request_keyed_with_a_lora_id_gets_none_of_that_loras_pages(
    make_stack,
):
    """Same joined text, different namespaces: the base request matches nothing of
    the LoRA's on the device nor in KVCR; another request of the adapter restores
    the adapter's KV bit-exact."""
    stack = make_stack()
    sched = Scheduler(stack)
    lora = sched.new_req("lora-1", lora=True)
    base = sched.new_req("base", lora=False, extra_key=LORA_ID)
    assert str(lora.extra_key) == str(base.extra_key) == LORA_ID  # SGLang's join
    original = computed(stack, lora, seed=1)
    assert device_hit(stack, lora) == len(PREFIX)
    assert device_hit(stack, base) == 0

    forget_device(stack)
    assert prepared_hit(stack, sched, base) == 0
    assert stack.linker.claims_held() == 0
    again = sched.new_req("lora-2", lora=True)
    assert prepared_hit(stack, sched, again) == len(PREFIX)
    assert torch.equal(restored(stack, again), original)


def test_a_hinted_peer_fetch_restores_each_namespace_its_own_kv(make_stack):
    """Worker A computed the same prompt as the LoRA and as the base request (other
    KV each); B, hinted with what A published for each, restores each request's
    own bytes from A."""
    a, b = make_stack(events=True), make_stack()
    sched_a, sched_b = Scheduler(a), Scheduler(b)
    published(a)
    want_lora = computed(a, sched_a.new_req("a-lora", lora=True), seed=1)
    lora_hashes = published(a)
    want_base = computed(
        a, sched_a.new_req("a-base", lora=False, extra_key=LORA_ID), seed=2
    )
    base_hashes = published(a)
    pages = len(PREFIX) // PAGE
    assert len(lora_hashes) == len(base_hashes) == pages
    assert not torch.equal(want_lora, want_base)

    endpoint = a.linker.endpoint
    for rid, lora, hashes, want in (
        ("b-lora", True, lora_hashes, want_lora),
        ("b-base", False, base_hashes, want_base),
    ):
        req = sched_b.new_req(
            rid,
            lora=lora,
            extra_key=None if lora else LORA_ID,
            hint=fetch_hint(endpoint, hashes),
        )
        assert prepared_hit(b, sched_b, req) == len(PREFIX), rid
        assert torch.equal(restored(b, req), want), rid


def test_sglang_publishes_the_same_hashes_for_a_tagged_key_and_stores_apart():
    """A tagged key hashes for KV events exactly as its text does (what a router
    learned stays valid); its storage chain differs from a base request's."""
    from sglang.srt.disaggregation.kv_events import kv_event_namespace_seed
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    tagged = LoraExtraKey("own" + LORA_ID, LORA_ID)
    plain = "own" + LORA_ID
    for salt in (None, "tenant-a"):
        assert kv_event_namespace_seed(
            extra_key=tagged, cache_salt=salt
        ) == kv_event_namespace_seed(extra_key=plain, cache_salt=salt)
        pages = [
            get_storage_hash_str(
                RadixKey(array("q", PREFIX), k, cache_salt=salt), None, PAGE
            )
            for k in (tagged, plain, LoraExtraKey(plain, "f" * 32))
        ]
        assert len({h for chain in pages for h in chain}) == 3 * len(PREFIX) // PAGE
    # A key of the same text but another adapter (or none) is another namespace.
    assert tagged != plain and plain != tagged and hash(tagged) != hash(plain)
    assert tagged == LoraExtraKey(plain, LORA_ID)
    assert tagged != LoraExtraKey(plain, "f" * 32)
    assert {(tagged, 1): "x"}.get((plain, 1)) is None
    copy = pickle.loads(pickle.dumps(tagged))
    assert copy == tagged and copy.lora_id == LORA_ID
