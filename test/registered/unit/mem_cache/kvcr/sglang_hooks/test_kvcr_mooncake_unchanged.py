"""With the KVCR plugin loaded, SGLang's stock Mooncake direct linker is untouched.

Route: the real factory path. ``create_unified_cache_linker(backend="mooncake")``
is called through the plugin's AROUND hook with SGLang's ``MooncakeStore`` class
replaced by a recording fake (the Mooncake client is not installed and needs a
cluster), so the real ``MooncakeDirectLinker`` is built over real CPU pools. Plain
MHA has no Mooncake pool group in 0.5.23, so the cache is a small FULL+SWA+MAMBA
stack (``SWAKVPool`` + ``HybridReqToTokenPool``), the layout the MambaSwa strategy
serves; it is built here directly, because sglang's own test kit needs the
``datasets`` package, which this environment does not install.

The tests show: the factory hands Mooncake exactly the arguments the unhooked
factory would; a real cache driving the Mooncake linker (insert, offload commit,
reset, external match, load-back, abort release, request release, close) produces
the same trace with every plugin hook installed as with the originals restored;
and each integration hook is a no-op for a linker without the preparation hooks
(no device match or prepare at enqueue, no collective, the waiting queue passed
through as is, the originals called with identical arguments, and no demand for
the Python tree core).
"""

from __future__ import annotations

import contextlib
import importlib
import time
from array import array
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch

from cpu_harness import kvcr_families, kvcr_stack

# Every test runs with the plugin loaded, as a server with it installed does.
pytestmark = pytest.mark.usefixtures("plugin_hooks")

PAGE = 1
KV_TOKENS = 256
HEADS = 2
DIM = 8
FULL_LAYERS = (3,)
MAMBA_SWA_LAYERS = (0, 1, 2)
SLIDING_WINDOW = 8
MAX_EVENT_ROUNDS = 2000
MOONCAKE_CONFIG = {"master_server_address": "127.0.0.1:50051", "protocol": "tcp"}
STORE_TARGET = (
    "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store.MooncakeStore"
)
LINKER_MODULE = "sglang.srt.mem_cache.storage.mooncake_store.mooncake_direct_linker"


# ---- a recording stand-in for sglang's MooncakeStore ------------------------------


class FakeMooncakeStore:
    """Records what the linker asks of its store; an honest in-memory key set.

    ``self.store`` is the low-level client the linker registers buffers with.
    """

    instances: list[FakeMooncakeStore] = []

    def __init__(self, storage_config: Any, mem_pool: Any = None) -> None:
        self.storage_config = storage_config
        self.mem_pool = mem_pool
        self.store = self
        self.registered: list[tuple[int, int]] = []
        self.sets: list[list[tuple[str, list[str], str, list[int]]]] = []
        self.sessions: list[Any] = []
        self.exists: list[list[str]] = []
        self.kv_keys: set[str] = set()
        self.closed = False
        FakeMooncakeStore.instances.append(self)

    def register_buffer(self, ptr: int, nbytes: int) -> int:
        self.registered.append((ptr, nbytes))
        return 0

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict:
        self.sets.append(
            [
                (
                    str(t.name.value),
                    list(t.keys),
                    str(t.hit_policy.value),
                    [int(i) for i in t.host_indices.tolist()],
                )
                for t in transfers
            ]
        )
        self.sessions.append(extra_info)
        for t in transfers:
            if str(t.name.value) == "kv":
                self.kv_keys.update(t.keys)
        return {str(t.name.value): [True] * len(t.keys) for t in transfers}

    def batch_exists_v2(
        self, keys: list[str], transfers: Any = None, extra_info: Any = None
    ) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        self.exists.append(list(keys))
        n = 0
        while n < len(keys) and keys[n] in self.kv_keys:
            n += 1
        return PoolTransferResult(n, {}, restorable_prefix_pages=list(range(1, n + 1)))

    def close(self) -> None:
        self.closed = True


# ---- a FULL+SWA+MAMBA cache on CPU -------------------------------------------------


def _server_args() -> Any:
    from sglang.srt.server_args import (
        ServerArgs,
        set_global_server_args_for_scheduler,
    )

    # "dummy" skips SGLang's model resolution (no HF config is read).
    server_args = ServerArgs(
        model_path="dummy",
        page_size=PAGE,
        device="cpu",
        enable_unified_cache_external_linker=True,
        unified_cache_external_linker_backend="mooncake",
        unified_cache_external_linker_config=dict(MOONCAKE_CONFIG),
    )
    # No HF config supplies the Mamba chunk size for a dummy model.
    server_args._mamba_cache_chunk_size = 64
    set_global_server_args_for_scheduler(server_args)
    return server_args


def build_hybrid_cache(tree_core_backend: str = "rust") -> SimpleNamespace:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    server_args = _server_args()
    req_to_token = kvcr_families.mamba_request_pool(
        list(MAMBA_SWA_LAYERS), KV_TOKENS, head_dim=16, state_size=16
    )
    kvcache = kvcr_stack.swa_kv_pool(
        KV_TOKENS, PAGE, HEADS, DIM, FULL_LAYERS, MAMBA_SWA_LAYERS
    )
    allocator = kvcr_stack.swa_allocator(kvcache, KV_TOKENS, PAGE)
    params = CacheInitParams(
        req_to_token_pool=req_to_token,
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE,
        disable=False,
        sliding_window_size=SLIDING_WINDOW,
        tree_components=(ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA),
        tree_core_backend=tree_core_backend,
    )
    cache = UnifiedRadixCache(params)
    return SimpleNamespace(
        server_args=server_args,
        params=params,
        cache=cache,
        allocator=allocator,
        req_to_token=req_to_token,
        kvcache=kvcache,
    )


def factory() -> Any:
    """The factory as SGLang's registry calls it: the module attribute, at call time."""
    from sglang.srt.mem_cache.unified_cache import linker_factory

    return linker_factory.create_unified_cache_linker


def build_mooncake_linker(env: SimpleNamespace, **kwargs: Any) -> Any:
    with mock.patch(STORE_TARGET, FakeMooncakeStore):
        return factory()(
            env.server_args,
            env.params,
            backend="mooncake",
            config=dict(MOONCAKE_CONFIG),
            components=set(env.cache.components),
            **kwargs,
        )


def make_req(rid: str, tokens: Sequence[int] = ()) -> Any:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=array("q", tokens),
        sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
    )


def _key(tokens: list[int]) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens))


def _resolve(target: str) -> tuple[Any, str]:
    """(owner, attribute) of a dotted hook target (module function or method)."""
    module_path, _, attr = target.rpartition(".")
    try:
        return importlib.import_module(module_path), attr
    except ImportError:
        module_path, _, cls_name = module_path.rpartition(".")
        return getattr(importlib.import_module(module_path), cls_name), attr


def plugin_targets() -> list[str]:
    from sglang.srt.mem_cache.storage.kvcr import plugin
    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration

    return [plugin.CREATE_LINKER_TARGET, *integration.TARGETS]


@contextlib.contextmanager
def plugin_hooks_removed() -> Iterator[None]:
    """Put SGLang's original functions back for every target the plugin hooks."""
    with contextlib.ExitStack() as stack:
        for target in plugin_targets():
            owner, attr = _resolve(target)
            hooked = owner.__dict__[attr]
            stack.enter_context(mock.patch.object(owner, attr, hooked.__wrapped__))
        yield


# ---- the scenario compared with and without the plugin's hooks ---------------------


def _drain(cache: Any) -> int:
    rounds = 0
    while cache.linker.pending_offloads and rounds < MAX_EVENT_ROUNDS:
        cache.check_hicache_events()
        rounds += 1
        time.sleep(0.002)
    return len(cache.linker.pending_offloads)


def _insert(env: SimpleNamespace, tokens: list[int], value: Any) -> Any:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    req = make_req(f"insert-{len(tokens)}")
    env.req_to_token.alloc([req])
    return env.cache.insert(
        InsertParams(
            key=_key(tokens),
            value=value,
            mamba_value=req.kv.mamba_pool_idx.unsqueeze(0),
        )
    )


def run_mooncake_scenario() -> list[tuple[str, Any]]:
    """Drive a real cache + Mooncake linker through its life; return a trace."""
    from sglang.srt.mem_cache.base_prefix_cache import (
        InitLoadBackParams,
        MatchPrefixParams,
    )

    FakeMooncakeStore.instances.clear()
    env = build_hybrid_cache("rust")
    cache = env.cache
    linker = build_mooncake_linker(env)
    store = FakeMooncakeStore.instances[-1]
    trace: list[tuple[str, Any]] = [
        ("linker", type(linker).__qualname__),
        ("store_config", repr(store.storage_config)),
        ("registered", len(store.registered)),
    ]
    cache.init_cache_linker(linker)
    trace.append(("tree_core", type(cache.tree_core).__name__))
    trace.append(("cache_attrs", sorted(k for k in vars(cache) if "kvcr" in k)))

    first = list(range(100, 120))
    value = env.allocator.alloc(len(first))
    _insert(env, first, value)
    trace.append(("pending_after_insert", len(cache.linker.pending_offloads)))
    trace.append(("pending_after_drain", _drain(cache)))
    first_sets = len(store.sets)
    trace.append(("sets_1", list(store.sets)))

    second = first + list(range(200, 204))
    trace.append(("extended_tokens", len(second)))
    tail = env.allocator.alloc(4)
    _insert(env, second, torch.cat([value, tail]))
    trace.append(("pending_after_extend", len(cache.linker.pending_offloads)))
    trace.append(("pending_after_drain_2", _drain(cache)))
    trace.append(("sets_2", list(store.sets[first_sets:])))
    trace.append(("sessions", [repr(s) for s in store.sessions]))

    cache.reset()
    req = make_req("external-hit", second)
    match = cache.match_prefix(MatchPrefixParams(key=_key(second), req=req))
    trace.append(("match", (match.device_prefix_len, match.host_hit_length)))
    trace.append(("exists", list(store.exists)))
    trace.append(("hit_markers", sorted(cache.linker.hit_markers)))

    req.last_node = match.last_device_node
    env.req_to_token.alloc([req])
    loaded = cache.init_load_back(
        InitLoadBackParams(
            best_match_node=match.last_host_node,
            host_hit_length=match.host_hit_length,
            req=req,
        )
    )
    trace.append(("load_back_tokens", None if loaded is None else loaded[0]))
    trace.append(("inflight", list(cache.linker.inflight_load_rids)))
    trace.append(
        (
            "pending_loads",
            {
                rid: [
                    (str(t.name.value), list(t.keys), t.host_indices.tolist())
                    for t in ts
                ]
                for rid, ts in linker.pending_loads.items()
            },
        )
    )

    cache.release_aborted_request(req.cache_request_handle)
    trace.append(("after_abort_markers", sorted(cache.linker.hit_markers)))
    trace.append(("after_abort_inflight", list(cache.linker.inflight_load_rids)))
    trace.append(("after_abort_pending_loads", sorted(linker.pending_loads)))

    mamba_free = env.req_to_token.mamba_allocator.available_size()
    cache.on_release(req, checkpointed=False)
    trace.append(
        (
            "on_release_mamba_freed",
            env.req_to_token.mamba_allocator.available_size() - mamba_free,
        )
    )
    trace.append(("stats", dict(linker.stats)))
    cache.linker.close()
    trace.append(("store_closed", store.closed))
    trace.append(
        (
            "threads_alive",
            [linker.load_thread.is_alive(), linker.offload_thread.is_alive()],
        )
    )
    return trace


# ---- tests -------------------------------------------------------------------------


def test_plugin_hooks_are_installed_on_every_target():
    """The comparison below is meaningful: each target carries a registry wrapper."""
    for target in plugin_targets():
        owner, attr = _resolve(target)
        assert hasattr(owner.__dict__[attr], "__wrapped__"), target


def test_factory_hands_mooncake_the_arguments_the_unhooked_factory_would():
    """backend='mooncake': the AROUND hook calls the original with identical arguments."""
    env = build_hybrid_cache("rust")
    components = set(env.cache.components)
    stream = object()
    calls = []
    for create in (factory(), factory().__wrapped__):
        recorder = mock.Mock(name="MooncakeDirectLinker", return_value=object())
        with mock.patch(f"{LINKER_MODULE}.MooncakeDirectLinker", recorder):
            result = create(
                env.server_args,
                env.params,
                backend="mooncake",
                config=dict(MOONCAKE_CONFIG),
                components=components,
                forward_stream=stream,
            )
        assert result is recorder.return_value
        recorder.assert_called_once()
        calls.append(recorder.call_args)
    hooked, original = calls
    assert hooked == original
    args, kwargs = hooked
    assert args[0] is env.server_args and args[1] is env.params
    assert kwargs["components"] is components
    assert kwargs["forward_stream"] is stream
    assert kwargs["extra_config"] == MOONCAKE_CONFIG
    assert set(kwargs) == {"components", "extra_config", "forward_stream"}


def test_factory_builds_the_stock_mooncake_linker_over_the_fake_store():
    """The real MooncakeDirectLinker comes back, with its own store and pools."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_direct_linker import (
        MooncakeDirectLinker,
    )

    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import HOOK_NAMES

    FakeMooncakeStore.instances.clear()
    env = build_hybrid_cache("rust")
    linker = build_mooncake_linker(env)
    try:
        assert type(linker) is MooncakeDirectLinker
        assert not any(hasattr(linker, name) for name in HOOK_NAMES)
        (store,) = FakeMooncakeStore.instances
        assert linker.storage is store and store.mem_pool is None
        assert store.storage_config.extra_config == MOONCAKE_CONFIG
        assert store.storage_config.model_name == "dummy"
        assert set(linker.pools) == {PoolName.KV, PoolName.SWA, PoolName.MAMBA}
        # Every distinct allocation registered once.
        assert len(store.registered) == len(set(store.registered)) > 0
    finally:
        linker.close()


def test_cache_drives_mooncake_identically_with_and_without_the_plugin():
    """Insert, offload, commit, match, load-back, abort, release: the same trace."""
    hooked = run_mooncake_scenario()
    with plugin_hooks_removed():
        assert not hasattr(factory(), "__wrapped__")
        original = run_mooncake_scenario()
    assert hooked == original
    facts = dict(hooked)
    # The scenario did real work, so the comparison covers every hooked seam.
    assert facts["linker"] == "MooncakeDirectLinker"
    assert facts["tree_core"] == "RustUnifiedTreeCore"  # no Python core demanded
    assert facts["cache_attrs"] == []
    assert facts["pending_after_insert"] > 0 and facts["pending_after_drain"] == 0
    assert facts["sets_1"]
    # Only the new four-token node is offloaded on the extension: the stored
    # marks of the first offloads held.
    ((kv, swa, mamba),) = facts["sets_2"]
    assert (kv[0], len(kv[1]), swa[0], len(swa[1]), mamba[0]) == (
        "kv",
        4,
        "swa",
        4,
        "mamba",
    )
    # The extended prompt misses the device and hits in full externally.
    assert facts["match"] == (0, facts["extended_tokens"])
    assert facts["hit_markers"] == ["external-hit"]
    assert facts["load_back_tokens"] == facts["extended_tokens"]
    assert facts["inflight"] == list(facts["pending_loads"]) == ["external-hit"]
    assert facts["after_abort_markers"] == []
    assert facts["after_abort_inflight"] == facts["after_abort_pending_loads"] == []
    assert facts["on_release_mamba_freed"] == 1
    assert facts["store_closed"] is True
    assert facts["threads_alive"] == [False, False]


@pytest.fixture
def mooncake_env() -> Iterator[SimpleNamespace]:
    env = build_hybrid_cache("rust")
    env.linker = build_mooncake_linker(env)
    env.cache.init_cache_linker(env.linker)
    yield env
    env.cache.linker.close()


def test_enqueue_hook_does_no_device_match_and_no_prepare(mooncake_env):
    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration

    cache = mooncake_env.cache
    req = make_req("enqueued", list(range(10, 18)))
    scheduler = SimpleNamespace(tree_cache=cache, waiting_queue=[req])
    with (
        mock.patch.object(cache, "match_prefix") as match,
        mock.patch.object(mooncake_env.linker, "lookup") as lookup,
        mock.patch.object(integration, "wrapper_prepare_request") as prepare,
    ):
        assert integration._after_add_request_to_queue(None, scheduler, req) is None
        assert integration._after_optimistic_requeue(None, scheduler) is None
    match.assert_not_called()
    lookup.assert_not_called()
    prepare.assert_not_called()
    assert scheduler.waiting_queue == [req]


def test_prefill_gate_passes_the_queue_through_without_a_collective(mooncake_env):
    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration

    cache = mooncake_env.cache
    reqs = [make_req(f"w{i}") for i in range(3)]
    queue = list(reqs)
    scheduler = SimpleNamespace(tree_cache=cache, waiting_queue=queue)
    seen = []
    sentinel = object()

    def original(sched: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(
            (sched, sched.waiting_queue, list(sched.waiting_queue), args, kwargs)
        )
        return sentinel

    with (
        mock.patch.object(cache, "_all_reduce_attn_groups") as reduce,
        mock.patch("torch.distributed.all_reduce") as all_reduce,
        # Single-rank, the gate would reduce nothing: it must not run at all.
        mock.patch.object(integration, "wrapper_sync_preparation") as gate,
    ):
        result = integration._around_get_new_batch_prefill(
            original, scheduler, "delayer", running_batch="rb"
        )
    assert result is sentinel
    ((sched, queue_seen, contents, args, kwargs),) = seen
    assert sched is scheduler and queue_seen is queue and contents == reqs
    assert args == ("delayer",) and kwargs == {"running_batch": "rb"}
    assert scheduler.waiting_queue is queue and queue == reqs
    reduce.assert_not_called()
    all_reduce.assert_not_called()
    gate.assert_not_called()


def test_release_and_event_hooks_add_nothing_for_mooncake(mooncake_env):
    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration, stored_marks

    cache, wrapper = mooncake_env.cache, mooncake_env.cache.linker
    req = make_req("done")
    with (
        mock.patch("torch.distributed.all_gather_object") as gather,
        mock.patch.object(stored_marks, "clear_stored_marks") as clear,
        mock.patch.object(stored_marks, "node_or_none") as node_lookup,
    ):
        assert integration._after_wrapper_release_request(None, wrapper, "done") is None
        assert (
            integration._after_on_release(None, cache, req, checkpointed=True) is None
        )
        assert integration._after_check_hicache_events(None, cache) is None
        original = mock.Mock(return_value="committed")
        successes = [True, False]
        assert (
            integration._around_commit_completed_offloads(original, wrapper, successes)
            == "committed"
        )
    original.assert_called_once_with(wrapper, successes)
    assert original.call_args.args[1] is successes  # not copied or rewrapped
    gather.assert_not_called()
    clear.assert_not_called()
    node_lookup.assert_not_called()  # no EXTERNAL event, no stored-mark index


def test_init_cache_linker_hook_demands_nothing_of_a_mooncake_cache(mooncake_env):
    """No hook check and no Python tree core required; no KVCR state attached."""
    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration

    cache = mooncake_env.cache
    assert type(cache.tree_core).__name__ == "RustUnifiedTreeCore"
    with mock.patch.object(
        integration, "require_hooks_installed", side_effect=AssertionError("called")
    ):
        assert (
            integration._after_init_cache_linker(None, cache, mooncake_env.linker)
            is None
        )
    assert not [name for name in vars(cache) if name.startswith("_kvcr")]
