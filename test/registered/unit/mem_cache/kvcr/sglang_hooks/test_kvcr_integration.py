"""The KVCR plugin's SGLang hooks in a real CPU stack with a real KVCR.

Each test builds a real ``MHATokenToKVPool(device="cpu")``, paged allocator and
``UnifiedRadixCache`` (Python tree core), and a ``KVCRDirectLinker`` made the
production way: ``create_unified_cache_linker(backend="kvcr")``, then
``cache.init_cache_linker`` and the pool's layer counter, as
``sglang/srt/mem_cache/registry.py`` does. ``load_plugins()`` runs once, so the
real SGLang methods (``Scheduler._add_request_to_queue``,
``UnifiedCacheLinkerWrapper.release_request`` / ``commit_completed_offloads``,
``UnifiedRadixCache.on_release`` / ``check_hicache_events`` /
``init_cache_linker``) carry the plugin's wrappers. A request is made "still
preparing" by really stalling the KVCR owner thread, so its fetch stays queued.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import time
from array import array
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from cpu_harness import kvcr_stack
from cpu_harness.kvcr_pages import buffers, fill_random, owner_stalled, wait_until
from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRUnavailableError
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration, stored_marks
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)

pytestmark = [pytest.mark.kvcr, pytest.mark.usefixtures("plugin_hooks")]

PAGE = 4
LAYERS = 2
HEADS = 2
DIM = 8
POOL_TOKENS = 64 * PAGE
# One page in KVCR DRAM: K and V of every layer, bf16.
PAGE_BYTES = LAYERS * 2 * PAGE * HEADS * DIM * 2
KVCR_CONFIG = {
    "local_dram_bytes_per_worker": 4 * 1024 * 1024,
    "operation_timeout_ms": 5000,  # generous: 2 loaded cores
    "abandon_timeout_ms": 10000,
    # Far past any stall below: readiness must come from landed pages.
    "preparation_timeout_ms": 10_000,
}
GEOMETRY = kvcr_stack.Geometry(PAGE, LAYERS, HEADS, DIM, POOL_TOKENS)


# ---- stack ---------------------------------------------------------------------


Stack = kvcr_stack.KVCRStack


@pytest.fixture
def make_stack() -> Iterator[Callable[..., Stack]]:
    """Builds wired stacks (``kvcr_stack.build_stack``: the linker from SGLang's
    factory, attached); ``kwargs`` are linker config fields over ``KVCR_CONFIG``.
    Every linker built is closed at teardown."""
    linkers: list[Any] = []

    def make(*, tree_core: str = "python", events: bool = False, **cfg: Any) -> Stack:
        stack = kvcr_stack.build_stack(
            {**KVCR_CONFIG, **cfg}, GEOMETRY, tree_core=tree_core, events=events
        )
        linkers.append(stack.linker)
        return stack

    yield make
    for linker in linkers:
        linker.close()


# ---- helpers -------------------------------------------------------------------


def kv_bytes(kvcache: Any, slots: torch.Tensor) -> torch.Tensor:
    return torch.cat(
        [buf[slots].reshape(-1).view(torch.uint8) for buf in buffers(kvcache)]
    )


def radix_key(tokens: list[int], salt: str | None = None) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens), cache_salt=salt)


def device_match(cache: Any, tokens: list[int], salt: str | None = None) -> Any:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    return cache.match_prefix(MatchPrefixParams(key=radix_key(tokens, salt)))


def node_of(cache: Any, tokens: list[int], salt: str | None = None) -> Any:
    result = device_match(cache, tokens, salt)
    assert result.device_prefix_len == len(tokens), "tokens are not on the device"
    return cache.tree_core.node_by_id(result.last_device_node)


def commit_offloads(cache: Any) -> None:
    """Drive the per-step poll until every offload in flight is committed."""

    def committed() -> bool:
        cache.check_hicache_events()
        return not cache.linker.pending_offloads

    wait_until(committed, what="offloads committed")


def insert(stack: Stack, tokens: list[int], *, seed: int, salt: str | None = None):
    """Put random K/V for ``tokens`` on the device and insert them (write-through
    offloads them to KVCR); returns (slots, their original bytes)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    slots = stack.allocator.alloc(len(tokens))
    fill_random(stack.kvcache, slots, seed, page=1)
    original = kv_bytes(stack.kvcache, slots).clone()
    stack.cache.insert(InsertParams(key=radix_key(tokens, salt), value=slots))
    return slots, original


def insert_and_commit(stack: Stack, tokens: list[int], *, seed: int, salt=None):
    slots, original = insert(stack, tokens, seed=seed, salt=salt)
    commit_offloads(stack.cache)
    assert node_of(stack.cache, tokens, salt).external_cache_stored
    return slots, original


def evict_from_device(stack: Stack, tokens: list[int]) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    stack.cache.evict(EvictParams(num_tokens=len(tokens)))
    assert device_match(stack.cache, tokens).device_prefix_len == 0


def make_req(rid: str, tokens: list[int]) -> Any:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=1))


def handle_of(req: Any) -> str:
    return LinkerRequestContext(req.rid, req.cache_request_handle.attempt_id).handle


class StubScheduler:
    """Exactly what ``Scheduler._add_request_to_queue`` reads in NULL mode."""

    def __init__(self, tree_cache: Any) -> None:
        from sglang.srt.disaggregation.utils import DisaggregationMode

        self.tree_cache = tree_cache
        self.waiting_queue: list[Any] = []
        self.disaggregation_mode = DisaggregationMode.NULL
        self.processed_tokens_counter = 0

    def _set_or_validate_priority(self, req: Any) -> bool:
        return True

    def _abort_on_queued_limit(self, req: Any) -> bool:
        return False

    def _prefetch_kvcache(self, req: Any) -> None:
        return None


def enqueue(scheduler: StubScheduler, req: Any) -> None:
    """The real (hooked) ``Scheduler._add_request_to_queue``."""
    from sglang.srt.managers.scheduler import Scheduler

    Scheduler._add_request_to_queue(scheduler, req)


def count_walks(monkeypatch: Any, cache: Any) -> list[int]:
    """Every device match (tree walk) of ``cache`` from now on, by key length."""
    walks: list[int] = []
    walk = cache.match_prefix

    def counting(params: Any) -> Any:
        walks.append(len(params.key))
        return walk(params)

    monkeypatch.setattr(cache, "match_prefix", counting)
    return walks


def ids(reqs: list[Any]) -> list[str]:
    return [r.rid for r in reqs]


def stored_hashes(events: list[Any], medium: str) -> list[int]:
    from sglang.srt.disaggregation.kv_events import BlockStored

    return [
        h
        for e in events
        if isinstance(e, BlockStored) and e.medium == medium
        for h in e.block_hashes
    ]


def removed_hashes(events: list[Any], medium: str) -> list[int]:
    from sglang.srt.disaggregation.kv_events import BlockRemoved

    return [
        h
        for e in events
        if isinstance(e, BlockRemoved) and e.medium == medium
        for h in e.block_hashes
    ]


# ---- 1. preparation gate and restore -------------------------------------------


def test_pending_preparation_is_held_back_then_its_tail_is_restored_bit_exact(
    make_stack,
):
    """A still-fetching request skips a pass in place; once ready it restores exact KV."""
    stack = make_stack()
    cache, linker = stack.cache, stack.linker
    prefix = list(range(100, 100 + 4 * PAGE))
    _, original = insert_and_commit(stack, prefix, seed=1)
    evict_from_device(stack, prefix)
    for buf in buffers(stack.kvcache):
        buf.zero_()  # nothing of the prefix survives on the device

    a = make_req("A", [*prefix, 7, 8, 9])
    b = make_req("B", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    c = make_req("C", [*prefix, 5, 6])
    late = make_req("late", [40, 41, 42, 43, 44])
    sched = StubScheduler(cache)
    passes: list[list[str]] = []
    arrivals = [[late], []]

    def admit_everything_seen(scheduler, *args, **kwargs):
        assert args == ("delayer",) and kwargs == {"running_batch": "rb"}
        seen = list(scheduler.waiting_queue)
        passes.append(ids(seen))
        scheduler.waiting_queue.extend(arrivals.pop(0))  # e.g. grammar-ready
        scheduler.waiting_queue = [
            r for r in scheduler.waiting_queue if all(r is not s for s in seen)
        ]
        return "batch"

    def prefill_pass():
        return integration._around_get_new_batch_prefill(
            admit_everything_seen, sched, "delayer", running_batch="rb"
        )

    with owner_stalled(linker):
        for req in (a, b, c):
            enqueue(sched, req)
        assert ids(sched.waiting_queue) == ["A", "B", "C"]
        assert not linker.preparation_ready(handle_of(a))
        assert linker.preparation_ready(handle_of(b))  # nothing to fetch
        assert prefill_pass() == "batch"
        assert passes == [["B"]]
        assert ids(sched.waiting_queue) == ["A", "C", "late"]

    wait_until(lambda: linker.preparation_ready(handle_of(a)), what="A prepared")
    wait_until(lambda: linker.preparation_ready(handle_of(c)), what="C prepared")
    assert linker.stats.prepare_deadline_expired == 0
    assert linker.claims_held() == 2 * len(prefix) // PAGE
    assert prefill_pass() == "batch"
    assert passes[1] == ["A", "C", "late"]
    assert sched.waiting_queue == []

    a.init_next_round_input(cache)  # match -> lookup answers from A's claims
    assert a.prefix_len == 0
    assert a.host_hit_length == len(prefix)
    loaded = kvcr_stack.load_back(cache, a)
    assert loaded[0] == len(prefix)
    private = cache.linker.private_load_indices[a.rid].clone()
    assert len(private) == len(prefix)
    assert not kv_bytes(stack.kvcache, private).any()  # nothing copied yet
    assert cache.ready_to_load_host_cache() >= 0
    assert cache.finish_external_linker_loads([a]) == []
    assert torch.equal(kv_bytes(stack.kvcache, private), original)
    assert linker.claims_held() == len(prefix) // PAGE  # only C's remain


def test_tail_behind_a_device_resident_prefix_is_prepared_and_restored_bit_exact(
    make_stack,
):
    """The enqueue-time tail is anchored on the device prefix and restores exactly."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    stack = make_stack()
    cache, linker = stack.cache, stack.linker
    x = list(range(400, 400 + 4 * PAGE))
    slots, _ = insert_and_commit(stack, x, seed=3)
    tail_slots = slots[2 * PAGE :].clone()
    tail_bytes = kv_bytes(stack.kvcache, tail_slots).clone()
    head_bytes = kv_bytes(stack.kvcache, slots[: 2 * PAGE]).clone()
    # Branch off after two pages (splits x's node), then evict the older branch:
    # x's last two pages leave the device, its first two stay.
    insert_and_commit(stack, [*x[: 2 * PAGE], *range(900, 900 + 2 * PAGE)], seed=4)
    cache.evict(EvictParams(num_tokens=2 * PAGE))
    assert device_match(cache, x).device_prefix_len == 2 * PAGE
    for buf in buffers(stack.kvcache):
        buf[tail_slots] = 0

    a = make_req("A", [*x, 1, 2, 3])
    enqueue(StubScheduler(cache), a)
    wait_until(lambda: linker.preparation_ready(handle_of(a)), what="A prepared")
    assert linker.claims_held() == 2
    a.init_next_round_input(cache)
    assert (a.prefix_len, a.host_hit_length) == (2 * PAGE, 2 * PAGE)
    loaded = kvcr_stack.load_back(cache, a)
    assert loaded[0] == 2 * PAGE
    private = cache.linker.private_load_indices[a.rid].clone()
    assert cache.ready_to_load_host_cache() >= 0
    assert cache.finish_external_linker_loads([a]) == []
    assert torch.equal(kv_bytes(stack.kvcache, private), tail_bytes)
    assert torch.equal(kv_bytes(stack.kvcache, slots[: 2 * PAGE]), head_bytes)
    assert linker.claims_held() == 0


def test_a_cold_tail_is_not_prepared_and_only_its_first_page_is_hashed(
    make_stack, monkeypatch
):
    """Hint-less, first tail page not resident: no preparation and no full tail
    hash at enqueue (``prepare_skipped``), and the request is admitted at once.
    Its first page resident (the rest not): prepared through the full path. An
    attempt with an earlier preparation always takes the full path. Neither
    prompt has a device node, so neither is walked: the skip is the tree's
    word, the same on every rank whatever each one's KVCR holds."""
    stack = make_stack()
    cache, linker = stack.cache, stack.linker
    resident = list(range(500, 500 + 2 * PAGE))
    insert_and_commit(stack, resident, seed=5)
    evict_from_device(stack, resident)
    full_tails: list[int] = []
    tail_hashes = type(cache.linker)._tail_hashes

    def counting(wrapper, *args, **kwargs):
        full_tails.append(1)
        return tail_hashes(wrapper, *args, **kwargs)

    monkeypatch.setattr(type(cache.linker), "_tail_hashes", counting)
    walks = count_walks(monkeypatch, cache)
    sched = StubScheduler(cache)
    cold = make_req("cold", [*range(700, 700 + 3 * PAGE), 1])
    enqueue(sched, cold)
    assert full_tails == []
    assert linker.preparations.get("cold") is None
    assert linker.stats.prepare_skipped == 1
    warm = make_req("warm", [*resident, *range(800, 800 + PAGE), 1])
    enqueue(sched, warm)
    assert full_tails == [1]
    assert linker.preparations.get("warm") is not None
    assert linker.stats.prepare_skipped == 1
    assert walks == []
    # A new attempt of a prepared request (retract, requeue) replaces the old
    # preparation through the full path even when its first page left DRAM.
    monkeypatch.setattr(linker, "residency", _Hiding(linker.residency))
    enqueue(sched, warm)
    assert full_tails == [1, 1]
    assert linker.stats.prepare_skipped == 1


def test_a_cold_prompt_skips_the_tree_walk_and_a_device_prefix_still_anchors_its_tail(
    make_stack, monkeypatch
):
    """No device node for the first page (under the request's namespace): no
    tree walk at enqueue, on every rank alike, and skipped when that page is
    not in KVCR either. A salted prompt whose first pages are on the device is
    walked and its tail checked behind that prefix: prepared though its
    (device-resident) first page is hidden from the residency."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    stack = make_stack()
    cache, linker = stack.cache, stack.linker
    x, salt = list(range(400, 400 + 4 * PAGE)), "tenant-a"
    insert_and_commit(stack, x, seed=3, salt=salt)
    branch = [*x[: 2 * PAGE], *range(900, 900 + 2 * PAGE)]
    insert_and_commit(stack, branch, seed=4, salt=salt)
    cache.evict(EvictParams(num_tokens=2 * PAGE))
    assert device_match(cache, x, salt).device_prefix_len == 2 * PAGE
    walks = count_walks(monkeypatch, cache)
    sched = StubScheduler(cache)
    enqueue(sched, make_req("cold", [*range(700, 700 + 3 * PAGE), 1]))
    assert walks == []
    assert linker.preparations.get("cold") is None
    assert linker.stats.prepare_skipped == 1
    # The same tokens unsalted: no device node under that namespace, no walk;
    # their first page is not in KVCR either.
    enqueue(sched, make_req("unsalted", [*x, 1, 2, 3]))
    assert walks == []
    assert linker.stats.prepare_skipped == 2
    # Salted, x's first page is on the device: only the tail behind it is
    # looked up (its first page hidden from the residency changes nothing).
    key = radix_key(x[:PAGE], salt)
    first = get_storage_hash_str(key, None, page_size=PAGE)[0]
    monkeypatch.setattr(linker, "residency", _Hiding(linker.residency, {first}))
    a = make_req("a", [*x, 1, 2, 3])
    a.cache_salt = salt
    enqueue(sched, a)
    assert len(walks) == 1
    assert linker.preparations.get("a") is not None
    assert linker.stats.prepare_skipped == 2


def test_one_attention_rank_gates_readiness_without_a_tensor_or_a_collective(
    make_stack, monkeypatch
):
    """A single attention rank has no group to reduce over: readiness (and the
    restore verdicts' MIN) are the local flags, with no tensor made."""
    stack = make_stack()
    cache = stack.cache
    reduced: list[Any] = []
    monkeypatch.setattr(cache, "_all_reduce_attn_groups", reduced.append)
    monkeypatch.setattr(integration, "torch", _NoTensors(integration.torch))
    reqs = [make_req("r0", [1, 2]), make_req("r1", [3, 4])]
    assert integration.wrapper_sync_preparation(cache.linker, reqs) == [True, True]
    assert integration._min_across_ranks(cache, [3, 0, 1]) == [3, 0, 1]
    assert reduced == []


def test_a_single_attention_rank_reports_only_its_longest_restorable_length(
    make_stack, monkeypatch
):
    """Bound on one attention rank, a lookup reports the longest restorable
    length alone (SGLang writes each reported length into its MIN mask, one
    indexed write apiece); told of a group to reduce over, every length, so the
    ranks' MIN can still intersect them. The hit restores the same pages."""
    stack = make_stack()
    cache, linker = stack.cache, stack.linker
    wrapper = cache.linker
    seen: list[list[int]] = []
    sync = wrapper._sync_restorable_prefix

    def spy(restorable: list[int], **kw: Any) -> int:
        seen.append(list(restorable))
        return sync(restorable, **kw)

    monkeypatch.setattr(wrapper, "_sync_restorable_prefix", spy)
    prefix = list(range(600, 600 + 4 * PAGE))
    _, original = insert_and_commit(stack, prefix, seed=8)
    evict_from_device(stack, prefix)

    def hit(rid: str) -> None:
        req = make_req(rid, [*prefix, 1, 2])
        enqueue(StubScheduler(cache), req)
        wait_until(lambda: linker.preparation_ready(handle_of(req)), what="prepared")
        req.init_next_round_input(cache)
        assert req.host_hit_length == len(prefix)
        assert kvcr_stack.load_back(cache, req)[0] == len(prefix)
        private = wrapper.private_load_indices[rid].clone()
        assert cache.ready_to_load_host_cache() >= 0
        assert cache.finish_external_linker_loads([req]) == []
        assert torch.equal(kv_bytes(stack.kvcache, private), original)
        _release(cache, req)

    hit("alone")  # make_stack binds the linker as SGLang does, on one rank
    monkeypatch.setattr(stored_marks, "reduce_groups", lambda c: ["tp"])
    integration._after_init_cache_linker(None, cache, linker)
    evict_from_device(stack, prefix)
    hit("grouped")
    assert seen == [[4], [1, 2, 3, 4]]


class _NoTensors:
    """``torch`` as the integration module sees it, where making a tensor fails."""

    def __init__(self, torch_module: Any) -> None:
        self._torch = torch_module

    def tensor(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a tensor was made")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


class _Hiding:
    """A residency index that does not hold the ``hidden`` page hashes (None:
    no page and no key at all); everything else passes through."""

    def __init__(self, inner: Any, hidden: set[str] | None = None) -> None:
        self._inner, self._hidden = inner, hidden

    def holds(self, page_hash: str, pools: Any) -> bool:
        if self._hidden is None or page_hash in self._hidden:
            return False
        return self._inner.holds(page_hash, pools)

    def __contains__(self, key: Any) -> bool:
        return self._hidden is not None and key in self._inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _scheduler_of(linker: Any, **attrs: Any) -> Any:
    """A stand-in scheduler whose tree cache's linker wrapper holds ``linker``."""
    from types import SimpleNamespace

    wrapper = SimpleNamespace(cache_linker=linker)
    return SimpleNamespace(tree_cache=SimpleNamespace(linker=wrapper), **attrs)


def test_an_idle_pass_asks_a_preparing_linker_first_and_only_when_fully_idle():
    """The ``on_idle`` hook: a preparing linker's ``scheduler_idle`` runs before
    SGLang's idle work (and its ``--sleep-on-idle`` poll, which it is told
    about), only when nothing waits in any queue; a linker without the hooks
    (Mooncake, mori) is never asked, and SGLang's own idle work always runs."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
        PreparationHooks,
    )

    calls: list[str] = []

    class Preparing(PreparationHooks):
        prepares_requests = True

        def scheduler_idle(self, sleeps: bool = False, holds_sessions=None) -> None:
            held = holds_sessions is not None and holds_sessions()
            calls.append(f"linker sleeps={sleeps}" + " sessions" * held)

    def sglang_on_idle(sched: Any) -> str:
        calls.append("sglang")
        return "idle"

    # A rank without the sleeper of a --sleep-on-idle server waits for the first
    # rank's sleep in its receive: it sleeps too.
    sleepy = SimpleNamespace(sleep_on_idle=True)
    awake = SimpleNamespace(sleep_on_idle=False)
    for linker, fully_idle, sleeper, args, want in (
        (Preparing(), True, None, awake, ["linker sleeps=False", "sglang"]),
        (Preparing(), True, object(), sleepy, ["linker sleeps=True", "sglang"]),
        (Preparing(), True, None, sleepy, ["linker sleeps=True", "sglang"]),
        (Preparing(), False, None, awake, ["sglang"]),
        (object(), True, None, awake, ["sglang"]),
    ):
        calls.clear()
        scheduler = _scheduler_of(
            linker,
            is_fully_idle=lambda v=fully_idle: v,
            idle_sleeper=sleeper,
            server_args=args,
            session_controller=SimpleNamespace(sessions={}),
        )
        got = integration._around_on_idle(sglang_on_idle, scheduler)
        assert (got, calls) == ("idle", want)
    # Whether SGLang holds a session's requests is passed on (the linker then
    # freezes nothing): open sessions, or the overlap loop's pinned batches
    # (``batch_record_buf``: a batch and its field snapshot) holding one.
    from sglang.srt.session.session_controller import SessionController

    def controller(*open_ids: str) -> SessionController:
        ctl = SessionController(None)  # SGLang's own: its ``sessions`` dict
        ctl.sessions.update({rid: object() for rid in open_ids})
        return ctl

    plain, in_session = SimpleNamespace(session=None), SimpleNamespace(session=1)
    batch = SimpleNamespace(reqs=[plain])
    for attrs, want in (
        ({"session_controller": controller()}, ""),
        ({"session_controller": controller("s")}, " sessions"),
        ({}, " sessions"),  # no controller: unknown counts as held
        (
            {
                "session_controller": controller(),
                "batch_record_buf": [[batch, [3, [plain]]], None],
            },
            "",
        ),
        (
            {
                "session_controller": controller(),
                "batch_record_buf": [None, [batch, [3, [plain, in_session]]]],
            },
            " sessions",
        ),
        (
            {
                "session_controller": controller(),
                "batch_record_buf": [[SimpleNamespace(reqs=[in_session]), []], None],
            },
            " sessions",
        ),
    ):
        calls.clear()
        scheduler = _scheduler_of(
            Preparing(),
            is_fully_idle=lambda: True,
            idle_sleeper=None,
            server_args=awake,
            **attrs,
        )
        integration._around_on_idle(sglang_on_idle, scheduler)
        assert calls == ["linker sleeps=False" + want, "sglang"]


def test_a_batch_result_is_bracketed_for_a_preparing_linker_even_when_it_raises():
    """The ``process_batch_result`` hook: a preparing linker hears
    ``batch_result_started`` before SGLang processes the result (the
    write-through offloads made inside it are stamped as such) and
    ``batch_done`` after, also when SGLang raises; other linkers hear nothing."""
    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
        PreparationHooks,
    )

    calls: list[str] = []

    class Preparing(PreparationHooks):
        prepares_requests = True

        def batch_result_started(self) -> None:
            calls.append("started")

        def batch_done(self) -> None:
            calls.append("done")

    def sglang_result(sched: Any, batch: Any, result: Any) -> str:
        calls.append("sglang")
        if batch == "bad":
            raise RuntimeError("result processing failed (injected)")
        return "processed"

    for linker, want in (
        (Preparing(), ["started", "sglang", "done"]),
        (object(), ["sglang"]),
    ):
        calls.clear()
        got = integration._around_process_batch_result(
            sglang_result, _scheduler_of(linker), "batch", "result"
        )
        assert (got, calls) == ("processed", want)
    calls.clear()
    with pytest.raises(RuntimeError, match="injected"):
        integration._around_process_batch_result(
            sglang_result, _scheduler_of(Preparing()), "bad", "result"
        )
    assert calls == ["started", "sglang", "done"]


# ---- 2. aborts release claims ----------------------------------------------------


def _abort(cache: Any, req: Any) -> None:
    """The scheduler's waiting-queue abort: tree_cache.finish(handle, ABORT)."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome

    cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)


def _release(cache: Any, req: Any) -> None:
    """release_kv_cache's tree call for a finished, aborted or retracted request."""
    cache.on_release(req, checkpointed=False)


@pytest.mark.parametrize(
    ("end", "while_fetching"),
    [(_abort, True), (_abort, False), (_release, False)],
    ids=["abort-while-fetching", "abort-after-landing", "release-after-landing"],
)
def test_ending_a_prepared_request_releases_every_claim_in_kvcr(
    make_stack, end, while_fetching
):
    """Aborting or releasing a prepared request leaves no claim held, here or in KVCR."""
    stack = make_stack()
    cache, linker = stack.cache, stack.linker
    prefix = list(range(200, 200 + 3 * PAGE))
    insert_and_commit(stack, prefix, seed=2)
    evict_from_device(stack, prefix)
    pages = len(prefix) // PAGE
    req = make_req("R", [*prefix, 1, 2])
    sched = StubScheduler(cache)
    released_before = linker._adapter.stats().claims_released

    if while_fetching:
        with owner_stalled(linker):
            enqueue(sched, req)
            assert not linker.preparation_ready(handle_of(req))
            end(cache, req)
            assert linker.claims_held() == 0
    else:
        enqueue(sched, req)
        wait_until(lambda: linker.preparation_ready(handle_of(req)), what="R prepared")
        assert linker.claims_held() == pages
        end(cache, req)
        assert linker.claims_held() == 0

    def all_released() -> bool:
        cache.check_hicache_events()  # the per-step poll pumps KVCR results
        return linker._adapter.stats().claims_released - released_before >= pages

    wait_until(all_released, what="claims released in KVCR")
    assert linker._adapter.stats().claims_released - released_before == pages
    assert linker.claims_held() == 0
    assert linker.stats.late_claims_released == (pages if while_fetching else 0)


# ---- 2b. admission wait -------------------------------------------------------------


def stat(linker: Any, name: str) -> float:
    """One ``name=value`` figure of the linker's KVCR_STATS line."""
    match = re.search(rf"(?:^| ){name}=([0-9.]+)(?: |$)", linker.stats_line())
    assert match, f"{name} missing from {linker.stats_line()}"
    return float(match.group(1))


def test_admission_wait_counts_a_held_request_once_and_nothing_else(make_stack):
    """A request the gate held back is counted once, with its passes and a positive
    wait, when the gate lets it through; a zero-hit request and one aborted while
    held add nothing and leave no record."""
    stack = make_stack()
    cache, linker = stack.cache, stack.linker
    prefix = list(range(100, 100 + 2 * PAGE))
    insert_and_commit(stack, prefix, seed=5)
    evict_from_device(stack, prefix)
    held = make_req("held", [*prefix, 1, 2])
    zero = make_req("zero", [60, 61, 62, 63, 64])
    gone = make_req("gone", [*prefix, 3, 4])
    sched = StubScheduler(cache)

    def admit_all(scheduler: Any, *args: Any, **kwargs: Any) -> str:
        scheduler.waiting_queue = []
        return "batch"

    def prefill_pass() -> None:
        assert integration._around_get_new_batch_prefill(admit_all, sched) == "batch"

    with owner_stalled(linker):
        for req in (held, zero, gone):
            enqueue(sched, req)
        first_pass = time.monotonic()
        prefill_pass()
        assert ids(sched.waiting_queue) == ["held", "gone"]  # zero admitted
        prefill_pass()  # still fetching: held a second time
        assert ids(sched.waiting_queue) == ["held", "gone"]
        _abort(cache, gone)
        sched.waiting_queue.remove(gone)
    assert stat(linker, "admission_held") == 0  # nothing let through yet

    wait_until(lambda: linker.preparation_ready(handle_of(held)), what="held prepared")
    prefill_pass()
    elapsed_ms = (time.monotonic() - first_pass) * 1000.0
    assert sched.waiting_queue == []
    assert stat(linker, "admission_held") == 1
    assert stat(linker, "admission_held_passes") == 2
    wait_ms = stat(linker, "admission_wait_ms_max")
    assert 0 < wait_ms <= elapsed_ms
    assert stat(linker, "admission_wait_ms_avg") == wait_ms
    assert linker.preparations.held_rids() == []


def test_admission_records_are_bounded_and_cleared_by_reset(make_stack, monkeypatch):
    """Held requests that never come back age out past the bound; reset forgets all."""
    from sglang.srt.mem_cache.storage.kvcr.requests import preparation

    linker = make_stack().linker
    monkeypatch.setattr(preparation, "_MAX_HELD_TRACKED", 2)
    linker.note_admission(["a", "b", "c"], [False, False, False])
    assert linker.preparations.held_rids() == ["b", "c"]
    linker.note_admission(["a", "b", "c"], [True, True, True])
    assert stat(linker, "admission_held") == 2
    assert linker.preparations.held_rids() == []
    linker.note_admission(["d"], [False])
    linker.reset()
    assert linker.preparations.held_rids() == []


# ---- 3. EXTERNAL stored events ----------------------------------------------------


def test_committed_offload_publishes_external_block_stored_with_gpu_hashes(
    make_stack,
):
    """EXTERNAL BlockStored mirrors the GPU event of the same pages, salted or not."""
    from sglang.srt.disaggregation.kv_events import BlockStored, StorageMedium

    stack = make_stack(events=True)
    cache = stack.cache
    tokens = list(range(300, 300 + 3 * PAGE))
    per_salt: dict[str | None, list[int]] = {}
    for seed, salt in enumerate((None, "s1")):
        insert(stack, tokens, seed=seed, salt=salt)
        before_commit = cache.take_events()
        assert stored_hashes(before_commit, StorageMedium.EXTERNAL) == []
        gpu = stored_hashes(before_commit, StorageMedium.GPU)
        assert len(gpu) == len(tokens) // PAGE
        commit_offloads(cache)
        events = cache.take_events()
        external = [
            e
            for e in events
            if isinstance(e, BlockStored) and e.medium == StorageMedium.EXTERNAL
        ]
        assert stored_hashes(events, StorageMedium.EXTERNAL) == gpu
        gpu_event = next(
            e
            for e in before_commit
            if isinstance(e, BlockStored) and e.medium == StorageMedium.GPU
        )
        assert all(e.cache_salt == gpu_event.cache_salt == salt for e in external)
        assert [t for e in external for t in e.token_ids] == tokens
        per_salt[salt] = gpu
    assert not set(per_salt[None]) & set(per_salt["s1"])


# ---- 4. KVCR eviction ---------------------------------------------------------------


def test_kvcr_eviction_clears_stored_marks_publishes_removal_and_reoffloads(
    make_stack,
):
    """Pages KVCR evicts lose their stored mark, emit EXTERNAL BlockRemoved, re-offload."""
    from sglang.srt.disaggregation.kv_events import StorageMedium

    stack = make_stack(events=True, local_dram_bytes_per_worker=2 * PAGE_BYTES)
    cache, linker = stack.cache, stack.linker
    seqs = [[1000 * (i + 1) + t for t in range(PAGE)] for i in range(4)]
    gpu_hashes: dict[int, list[int]] = {}
    slots: dict[int, torch.Tensor] = {}
    events: list[Any] = []  # removals may be published by any commit below
    for i, tokens in enumerate(seqs):
        slots[i], _ = insert(stack, tokens, seed=10 + i)
        inserted = cache.take_events()
        gpu_hashes[i] = stored_hashes(inserted, StorageMedium.GPU)
        events += inserted
        commit_offloads(cache)
        events += cache.take_events()

    def marks() -> dict[int, bool]:
        return {i: node_of(cache, t).external_cache_stored for i, t in enumerate(seqs)}

    def two_cleared() -> bool:
        cache.check_hicache_events()
        return sum(not v for v in marks().values()) >= 2

    wait_until(two_cleared, what="stored marks cleared for KVCR-evicted pages")
    events += cache.take_events()
    cleared = sorted(i for i, stored in marks().items() if not stored)
    assert len(cleared) == 2, marks()
    assert linker.stats.evicted_pages == 2
    assert sorted(removed_hashes(events, StorageMedium.EXTERNAL)) == sorted(
        h for i in cleared for h in gpu_hashes[i]
    )
    assert removed_hashes(events, StorageMedium.GPU) == []

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    kept = next(i for i in range(4) if i not in cleared)
    offloads = linker.stats.offloads
    cache.insert(InsertParams(key=radix_key(seqs[kept]), value=slots[kept]))
    assert linker.stats.offloads == offloads  # still stored: nothing to do
    gone = cleared[0]
    cache.insert(InsertParams(key=radix_key(seqs[gone]), value=slots[gone]))
    assert linker.stats.offloads == offloads + 1
    commit_offloads(cache)
    assert node_of(cache, seqs[gone]).external_cache_stored
    assert (
        stored_hashes(cache.take_events(), StorageMedium.EXTERNAL) == gpu_hashes[gone]
    )


def test_kvcr_eviction_clears_the_mark_a_node_split_moved_to_a_new_parent(make_stack):
    """A split hands the stored mark to a new parent; evicting its page clears it too."""
    from sglang.srt.disaggregation.kv_events import StorageMedium

    stack = make_stack(events=True, local_dram_bytes_per_worker=3 * PAGE_BYTES)
    cache = stack.cache
    x = list(range(500, 500 + 3 * PAGE))
    insert_and_commit(stack, x, seed=20)
    x_hashes = stored_hashes(cache.take_events(), StorageMedium.GPU)
    assert len(x_hashes) == 3
    # y shares x's first page: the insert splits x's node, and the new parent
    # (a new node id) inherits the stored mark for that page.
    y = [*x[:PAGE], *range(600, 600 + 3 * PAGE)]
    insert(stack, y, seed=21)
    parent = node_of(cache, x[:PAGE])
    assert parent.external_cache_stored
    assert parent is not node_of(cache, x)
    events = cache.take_events()
    commit_offloads(cache)  # y's three new pages evict all of x's from KVCR

    def x_marks_cleared() -> bool:
        cache.check_hicache_events()
        return not node_of(cache, x).external_cache_stored

    wait_until(x_marks_cleared, what="x's stored mark cleared")
    events += cache.take_events()
    assert stack.linker.stats.evicted_pages == 3
    assert not node_of(cache, x[:PAGE]).external_cache_stored
    assert sorted(removed_hashes(events, StorageMedium.EXTERNAL)) == sorted(x_hashes)


def test_kvcr_eviction_of_pages_no_longer_on_the_device_still_publishes_removal(
    make_stack,
):
    """EXTERNAL BlockRemoved follows KVCR residency even after the device dropped the node."""
    from sglang.srt.disaggregation.kv_events import StorageMedium

    stack = make_stack(events=True, local_dram_bytes_per_worker=2 * PAGE_BYTES)
    cache = stack.cache
    x = list(range(700, 700 + 2 * PAGE))
    insert_and_commit(stack, x, seed=30)
    x_hashes = stored_hashes(cache.take_events(), StorageMedium.EXTERNAL)
    assert len(x_hashes) == 2
    evict_from_device(stack, x)
    events = cache.take_events()
    assert sorted(removed_hashes(events, StorageMedium.GPU)) == sorted(x_hashes)
    insert_and_commit(stack, list(range(800, 800 + 2 * PAGE)), seed=31)

    def x_evicted_from_kvcr() -> bool:
        cache.check_hicache_events()
        return stack.linker.stats.evicted_pages >= 2

    wait_until(x_evicted_from_kvcr, what="x evicted from KVCR")
    cache.check_hicache_events()
    events += cache.take_events()
    assert sorted(removed_hashes(events, StorageMedium.EXTERNAL)) == sorted(x_hashes)


def test_one_evicted_page_announces_only_that_page_removed(make_stack):
    """KVCR evicting one page of a three-page (salted) node publishes one EXTERNAL
    removal, with that page's namespaced hash; a later eviction of another page of
    the same node is announced too."""
    from sglang.srt.disaggregation.kv_events import StorageMedium

    stack = make_stack(events=True, local_dram_bytes_per_worker=3 * PAGE_BYTES)
    cache, linker = stack.cache, stack.linker
    x = list(range(900, 900 + 3 * PAGE))
    insert_and_commit(stack, x, seed=40, salt="tenant-a")
    x_hashes = stored_hashes(cache.take_events(), StorageMedium.EXTERNAL)
    assert len(x_hashes) == 3
    removed: list[int] = []

    def evicted(n: int) -> bool:
        cache.check_hicache_events()
        removed.extend(removed_hashes(cache.take_events(), StorageMedium.EXTERNAL))
        return linker.stats.evicted_pages >= n and len(removed) >= n

    insert_and_commit(stack, list(range(950, 950 + PAGE)), seed=41)
    wait_until(lambda: evicted(1), what="one of x's pages evicted")
    assert len(removed) == 1 and removed[0] in x_hashes, (removed, x_hashes)
    assert not node_of(cache, x, "tenant-a").external_cache_stored
    insert_and_commit(stack, list(range(970, 970 + PAGE)), seed=42)
    wait_until(lambda: evicted(2), what="a second page of x evicted")
    assert len(set(removed)) == len(removed) == 2, removed
    assert set(removed) <= set(x_hashes)


def test_an_eviction_announced_before_its_offload_commits_clears_the_mark(make_stack):
    """The gathered removals name a page whose offload has not committed yet: the
    commit that follows must not leave a stale stored mark (nor the router a
    stale EXTERNAL page)."""
    from sglang.srt.disaggregation.kv_events import StorageMedium

    stack = make_stack(events=True)
    cache = stack.cache
    x = list(range(1100, 1100 + 2 * PAGE))
    insert(stack, x, seed=43)
    assert cache.linker.pending_offloads  # not committed
    first = node_of(cache, x).hash_value[0]
    assert stored_marks.clear_stored_marks(cache, [first]) == 0  # nothing indexed
    cache.take_events()
    commit_offloads(cache)
    events = cache.take_events()
    stored = stored_hashes(events, StorageMedium.EXTERNAL)
    assert len(stored) == 2
    assert not node_of(cache, x).external_cache_stored
    assert removed_hashes(events, StorageMedium.EXTERNAL) == stored[:1]


# ---- 5./6. refusals at linker start ---------------------------------------------------


@contextlib.contextmanager
def unhooked(target: str) -> Iterator[None]:
    """Temporarily put the original method back in place of its hook wrapper."""
    module_path, cls_name, attr = target.rsplit(".", 2)
    cls = getattr(importlib.import_module(module_path), cls_name)
    wrapper = getattr(cls, attr)
    setattr(cls, attr, wrapper.__wrapped__)
    try:
        yield
    finally:
        setattr(cls, attr, wrapper)


@pytest.mark.parametrize(
    "target", integration.TARGETS, ids=lambda t: t.rsplit(".", 2)[-1]
)
def test_missing_hook_is_reported_by_name(target):
    """require_hooks_installed names exactly the target whose wrapper is gone."""
    with unhooked(target):
        with pytest.raises(KVCRUnavailableError) as excinfo:
            integration.require_hooks_installed()
        named = [t for t in integration.TARGETS if t in str(excinfo.value)]
        assert named == [target]
    integration.require_hooks_installed()


def test_linker_refuses_to_start_when_a_scheduler_hook_is_missing():
    """init_cache_linker raises, naming the unhooked scheduler method."""
    target = integration.TARGETS[1]
    stack = kvcr_stack.build_cache(KVCR_CONFIG, GEOMETRY)
    linker = kvcr_stack.create_linker(stack)
    try:
        with (
            unhooked(target),
            pytest.raises(KVCRUnavailableError, match=re.escape(target)),
        ):
            stack.cache.init_cache_linker(linker)
    finally:
        linker.close()


def test_linker_refuses_the_rust_tree_core_naming_the_python_setting():
    """A non-Python tree core is refused with the environment setting to use."""
    stack = kvcr_stack.build_cache(KVCR_CONFIG, GEOMETRY, tree_core="rust")
    assert type(stack.cache.tree_core).__name__ != "UnifiedTreeCore"
    linker = kvcr_stack.create_linker(stack)
    try:
        with pytest.raises(
            KVCRUnavailableError,
            match="SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python",
        ):
            stack.cache.init_cache_linker(linker)
    finally:
        linker.close()


def test_flush_clears_the_stored_page_index_and_kvcr_residency(make_stack):
    """reset() (flush_cache) empties the hash->node index and the KVCR tier."""
    stack = make_stack()
    tokens = list(range(500, 500 + 2 * PAGE))
    insert_and_commit(stack, tokens, seed=3)
    assert stored_marks.stored_pages(stack.linker).by_hash
    stack.cache.reset()
    assert stored_marks.stored_pages(stack.linker).by_hash == {}
    assert stack.linker.stats_line().count("resident_keys=0") == 1
