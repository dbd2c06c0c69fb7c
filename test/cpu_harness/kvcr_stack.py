"""A real SGLang cache stack on CPU with the KVCR linker, built the production way.

Test and driver support only: a CPU ``MHATokenToKVPool``, a paged allocator, a
``UnifiedRadixCache`` on the Python tree core, and a ``KVCRDirectLinker`` created
through ``create_unified_cache_linker(backend="kvcr")`` (so the plugin's factory hook
runs) and attached with ``init_cache_linker`` plus the layer-counter registration,
as ``sglang/srt/mem_cache/registry.py`` does. Call ``load_plugins()`` first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Geometry:
    page: int = 4
    layers: int = 2
    heads: int = 2
    dim: int = 8
    pool_tokens: int = 256
    # Sliding-window model: odd layers attend over this many tokens (SWAKVPool,
    # FULL+SWA tree components); 0 = every layer full attention.
    sliding_window: int = 0


DEFAULT_GEOMETRY = Geometry()


@dataclasses.dataclass
class KVCRStack:
    cache: Any
    kvcache: Any
    allocator: Any
    server_args: Any
    params: Any
    config: dict[str, Any]
    linker: Any = None


def build_cache(
    config: dict[str, Any],
    geometry: Geometry = DEFAULT_GEOMETRY,
    *,
    tree_core: str = "python",
    events: bool = False,
    group: Any = None,
) -> KVCRStack:
    """Pool, allocator and cache with the server args published; no linker yet."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    g = geometry
    server_args = ServerArgs(
        model_path="dummy",  # skips SGLang's HF config resolution (offline)
        load_format="dummy",  # no weights: workers of one test share a digest
        page_size=g.page,
        device="cpu",
        enable_unified_cache_external_linker=True,
        unified_cache_external_linker_backend="kvcr",
        unified_cache_external_linker_config=dict(config),
    )
    set_global_server_args_for_scheduler(server_args)
    components: tuple[Any, ...] = (ComponentType.FULL,)
    if g.sliding_window:
        kvcache, allocator = _swa_pool(g)
        components = (ComponentType.FULL, ComponentType.SWA)
    else:
        kvcache = mha_pool(g.pool_tokens, g.page, g.heads, g.dim, g.layers)
        allocator = PagedTokenToKVPoolAllocator(
            g.pool_tokens, g.page, torch.bfloat16, "cpu", kvcache, False
        )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(8, 512, "cpu", False),
        token_to_kv_pool_allocator=allocator,
        page_size=g.page,
        tp_cache_group=group,
        attn_tp_cache_group=group,
        tree_components=components,
        sliding_window_size=g.sliding_window or None,
        enable_kv_cache_events=events,
        tree_core_backend=tree_core,
    )
    return KVCRStack(
        UnifiedRadixCache(params), kvcache, allocator, server_args, params, config
    )


def mha_pool(
    tokens: int, page: int, heads: int, dim: int, layers: int, device: str = "cpu"
) -> Any:
    """A bf16 ``MHATokenToKVPool`` of ``tokens`` slots (``page`` tokens a page)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        tokens,
        page,
        torch.bfloat16,
        heads,
        dim,
        layers,
        device=device,
        enable_memory_saver=False,
    )


def swa_kv_pool(
    tokens: int,
    page: int,
    heads: int,
    dim: int,
    full_layers: Sequence[int],
    window_layers: Sequence[int],
) -> Any:
    """A bf16 CPU ``SWAKVPool``: ``full_layers`` full attention, ``window_layers``
    sliding-window, ``tokens`` slots in each sub-pool."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    return SWAKVPool(
        size=tokens,
        size_swa=tokens,
        page_size=page,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=dim,
        swa_attention_layer_ids=list(window_layers),
        full_attention_layer_ids=list(full_layers),
        device="cpu",
    )


def swa_allocator(
    kvcache: Any, tokens: int, page: int, swa_tokens: int | None = None
) -> Any:
    """The ``SWATokenToKVPoolAllocator`` over ``kvcache`` (``tokens`` full slots,
    ``swa_tokens`` SWA slots, by default as many)."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    return SWATokenToKVPoolAllocator(
        size=tokens,
        size_swa=tokens if swa_tokens is None else swa_tokens,
        page_size=page,
        dtype=torch.bfloat16,
        device="cpu",
        kvcache=kvcache,
        need_sort=False,
    )


def _swa_pool(g: Geometry) -> tuple[Any, Any]:
    """An SWAKVPool (even layers full, odd layers windowed) and its allocator."""
    kvcache = swa_kv_pool(
        g.pool_tokens,
        g.page,
        g.heads,
        g.dim,
        full_layers=range(0, g.layers, 2),
        window_layers=range(1, g.layers, 2),
    )
    return kvcache, swa_allocator(kvcache, g.pool_tokens, g.page)


def create_linker(stack: KVCRStack) -> Any:
    """The KVCR linker for ``stack`` through SGLang's factory (not attached)."""
    from sglang.srt.mem_cache.unified_cache.linker_factory import (
        create_unified_cache_linker,
    )

    return create_unified_cache_linker(
        stack.server_args,
        stack.params,
        backend="kvcr",
        config=dict(stack.config),
        components=set(stack.cache.components),
    )


def attach(stack: KVCRStack, linker: Any) -> KVCRStack:
    """Wire ``linker`` into the cache and the pool's layer counter."""
    stack.cache.init_cache_linker(linker)
    stack.kvcache.register_layer_transfer_counter(linker.layer_done_counter)
    stack.linker = linker
    return stack


def load_back(cache: Any, req: Any) -> Any:
    """``cache.init_load_back`` for ``req`` as matched (its best node and host hit),
    as the scheduler calls it when the request is admitted."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    return cache.init_load_back(
        InitLoadBackParams(
            best_match_node=req.best_match_node,
            host_hit_length=req.host_hit_length,
            req=req,
        )
    )


def build_stack(
    config: dict[str, Any], geometry: Geometry = DEFAULT_GEOMETRY, **kwargs: Any
) -> KVCRStack:
    """A wired stack: cache + KVCR linker attached."""
    stack = build_cache(config, geometry, **kwargs)
    return attach(stack, create_linker(stack))


class PoolAllocator:
    """Hands a linker its KV pool, as SGLang's allocator does (``get_kvcache``)."""

    def __init__(self, kvcache: Any) -> None:
        self._kvcache = kvcache

    def get_kvcache(self) -> Any:
        return self._kvcache


def bare_linker(
    pool: Any,
    page_size: int,
    config: dict[str, Any],
    *,
    components: Any = (0,),
    model: str = "tiny-test",
    draft: str | None = None,
    allocator: Any = None,
    forward_stream: Any = None,
    server_args: dict[str, Any] | None = None,
    **params: Any,
) -> Any:
    """The plugin's linker over ``pool`` alone (no cache, no SGLang loader):
    stand-in server args and cache params carrying only what the linker reads."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.storage.kvcr.builder import build_linker

    server_args = SimpleNamespace(
        model_path=model,
        revision=None,
        speculative_draft_model_path=draft,
        load_format="dummy",  # no weights: the pages' digest is the layout's
        **(server_args or {}),
    )
    cache_params = SimpleNamespace(
        token_to_kv_pool_allocator=allocator or PoolAllocator(pool),
        page_size=page_size,
        attn_tp_cache_group=None,
        tp_cache_group=None,
        **params,
    )
    return build_linker(
        server_args,
        cache_params,
        components=set(components),
        extra_config=dict(config),
        forward_stream=forward_stream,
    )


class IntKeys:
    """KVCR key adapter for tests whose keys are 8-byte big-endian integers."""

    def encode(self, key: object) -> bytes:
        return bytes(key)  # type: ignore[call-overload]

    def decode(self, key: bytes) -> int:
        return int.from_bytes(key[:8], "big")


def small_kvcr_factory(
    name: str,
    store: torch.Tensor,
    block: int,
    *,
    operation_timeout_ms: int = 5000,
    copier: Any = None,
) -> Any:
    """The production KVCR factory over one pool ``kv`` of ``block``-byte blocks
    (label ``kv:page``), ``store`` as KVCR's DRAM, loopback control on an
    OS-chosen port; ``copier`` (a ``DramCopier``) fills its deposits (without
    one they fail)."""
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_factory import make_kvcr_factory

    return make_kvcr_factory(
        agent_name=name,
        pool_layouts=[("kv", block)],
        local_dram_pools=[("kv", store.data_ptr(), store.numel())],
        key_adapter=IntKeys(),
        control_bind_host="127.0.0.1",
        control_advertise_host="127.0.0.1",
        control_port=0,
        operation_timeout_ms=operation_timeout_ms,
        abandon_timeout_ms=2 * operation_timeout_ms,
        eviction_policy="lru",
        nixl_progress_thread=False,
        local_copier=copier,
    )


@dataclasses.dataclass(frozen=True)
class SlotRef:
    """The part of a kvcr ``MemoryRef`` the linker reads: the DRAM slot."""

    element_index: int


def as_op_done(item: Any) -> Any:
    """An adapter result with a fetch's answers per key: a ``ClaimsTaken``
    (resident pages claimed in one pass) as the ``OpDone`` kvcr's fetch gives
    for them (every key SUCCESS, one slot each); anything else as it is."""
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import (
        ClaimsTaken,
        EntryResult,
        EntryStatus,
        OpDone,
        OpKind,
    )

    if not isinstance(item, ClaimsTaken):
        return item
    entries = {
        key: EntryResult(EntryStatus.SUCCESS, (SlotRef(slot),), claim)
        for key, claim, slot in zip(item.keys, item.claims, item.slots, strict=True)
    }
    return OpDone(item.op_id, OpKind.FETCH, entries)


def kvcr_stall_error(timeout_ms: int, gap_s: float) -> Exception:
    """The error kvcr 0.1.1's own stall check (``_DanglingOps``) raises for a
    progress loop that last polled ``gap_s`` ago: its wording, not a copy."""
    import time
    import types

    from kvcr.dangling_ops import _DanglingOps

    backend = types.SimpleNamespace(
        _kvcr=types.SimpleNamespace(
            config=types.SimpleNamespace(operation_timeout_ms=timeout_ms)
        ),
        _progress_outbound=[],
    )
    ops = _DanglingOps(backend)
    ops._last_progress_at = time.monotonic() - gap_s
    assert not ops.check_source_progress()
    [error] = backend._progress_outbound
    return error
