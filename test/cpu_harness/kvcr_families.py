"""Real SGLang device pools of each model family on CPU, a UnifiedRadixCache over
them with that family's tree components, and the KVCR linker built the production
way (SGLang's linker factory). Test support only.

``build(family)`` returns a :class:`FamilyStack`; ``round_trip(stack)`` writes
random bytes into every buffer a family restores (slot rows of the full-attention
pools and the draft, indexer pages, SWA rows, one Mamba state slot), inserts the
sequence (write-through to KVCR), evicts it from the device, zeroes every buffer,
then matches, prepares, loads back and finishes one request, and returns what was
written and what landed in the request's own slots, buffer by buffer, as bytes.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable
from typing import Any

import torch

from cpu_harness import kvcr_stack
from cpu_harness.kvcr_dsv4 import (
    DSV4_VARIANTS,
    dsv4_page_rows,
    dsv4_pool,
    dsv4_ring_rows,
)
from cpu_harness.kvcr_pages import wait_until

HEADS, DIM, LORA, ROPE = 2, 8, 16, 8
CONFIG = {
    "local_dram_bytes_per_worker": 4 << 20,
    "operation_timeout_ms": 5000,
    "abandon_timeout_ms": 10000,
    "preparation_timeout_ms": 10000,
}


@dataclasses.dataclass
class FamilyStack:
    family: str
    page: int
    server_args: Any
    cache: Any
    linker: Any
    allocator: Any
    kvcache: Any
    params: Any
    # name -> buffers addressed by token slots (a page is ``page`` rows)
    slot_buffers: dict[str, list[torch.Tensor]]
    # name -> buffers with one row per page (DSA indexer)
    page_buffers: dict[str, list[torch.Tensor]]
    swa_buffers: list[torch.Tensor]
    mamba_states: list[torch.Tensor]  # (layers, slots, ...) per state kind
    window_pages: int = 0
    # buffers with one row per SWA page (DeepSeek V4: SWA rows, compress states)
    swa_page_buffers: list[torch.Tensor] = dataclasses.field(default_factory=list)


def publish_server_args(page: int, draft: str | None = None, **extra: Any) -> Any:
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    args = ServerArgs(
        **extra,
        model_path="dummy",  # no HF config is read
        load_format="dummy",
        page_size=page,
        device="cpu",
        enable_unified_cache_external_linker=True,
        unified_cache_external_linker_backend="kvcr",
        unified_cache_external_linker_config=dict(CONFIG),
    )
    args._mamba_cache_chunk_size = 64  # no HF config supplies it for "dummy"
    if draft:
        args.speculative_draft_model_path = draft
    set_global_server_args_for_scheduler(args)
    return args


def mamba_request_pool(
    layers: list[int], context: int, *, head_dim: int = 8, state_size: int = 4
) -> Any:
    """A ``HybridReqToTokenPool`` (4 requests, 8 bf16 Mamba2 state slots) for
    ``layers``, ``context`` tokens a request."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
        shape = Mamba2StateShape.create(
            tp_world_size=1,
            intermediate_size=64,
            n_groups=1,
            num_heads=2,
            head_dim=head_dim,
            state_size=state_size,
            conv_kernel=4,
        )
        params = Mamba2CacheParams(shape=shape, layers=layers)
    return HybridReqToTokenPool(
        size=4,
        mamba_size=8,
        mamba_spec_state_size=4,
        max_context_len=context,
        device="cpu",
        enable_memory_saver=False,
        cache_params=params,
        mamba_layer_ids=layers,
        enable_mamba_extra_buffer=False,
        speculative_num_draft_tokens=3,
    )


def mha_pool(size: int, page: int, layers: int) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size, page, torch.bfloat16, HEADS, DIM, layers, "cpu", False
    )


def _mla(size: int, page: int, layers: int) -> Any:
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(
        size, page, torch.bfloat16, LORA, ROPE, layers, "cpu", False
    )


def _paged(size: int, page: int, kvcache: Any) -> Any:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator(
        size, page, torch.bfloat16, "cpu", kvcache, False
    )


def _swa(size: int, page: int, full: list[int], window: list[int]) -> tuple[Any, Any]:
    kvcache = kvcr_stack.swa_kv_pool(size, page, HEADS, DIM, full, window)
    return kvcache, kvcr_stack.swa_allocator(kvcache, size, page)


def _kv(pool: Any) -> list[torch.Tensor]:
    if hasattr(pool, "k_buffer"):
        return [*pool.k_buffer, *pool.v_buffer]
    return list(pool.kv_buffer)


def _states(r2t: Any) -> list[torch.Tensor]:
    cache = r2t.mamba_pool.mamba_cache
    return [s for s in (cache.temporal, *cache.conv) if s.numel()]


PAGES = {"DSA": 64, "FULL+MAMBA": 1, "FULL+SWA+MAMBA": 1, "DeepSeek V4": 256}


def family_parts(family: str, page: int, variant: str = "v4") -> dict[str, Any]:
    """Pools, allocator and what to compare, per family (page 4; DSA needs 64;
    Mamba without its extra tracking buffer needs 1)."""
    from sglang.srt.mem_cache.memory_pool import (
        DSATokenToKVPool,
        HybridLinearKVPool,
        ReqToTokenPool,
    )
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType as C

    out: dict[str, Any] = {"components": (C.FULL,)}
    size = 256
    if family in ("MHA", "draft"):
        kvcache = mha_pool(size, 4, 2)
        out.update(kvcache=kvcache, allocator=_paged(size, 4, kvcache))
        out["slot"] = {"kv": _kv(kvcache)}
        if family == "draft":
            draft = mha_pool(size, 4, 1)
            out.update(sidecar=(draft,))
            out["slot"]["draft"] = _kv(draft)
    elif family == "MLA":
        kvcache = _mla(size, 4, 2)
        out.update(kvcache=kvcache, allocator=_paged(size, 4, kvcache))
        out["slot"] = {"kv": _kv(kvcache)}
    elif family == "DSA":
        size = 512
        kvcache = DSATokenToKVPool(
            size, 64, LORA, torch.bfloat16, ROPE, 2, "cpu", 128, False, LORA + ROPE
        )
        out.update(kvcache=kvcache, allocator=_paged(size, page, kvcache))
        out["slot"] = {"kv": _kv(kvcache)}
        out["page_rows"] = {"indexer": list(kvcache.index_k_with_scale_buffer)}
    elif family == "FULL+SWA":
        kvcache, allocator = _swa(size, 4, [0, 2], [1, 3])
        out.update(kvcache=kvcache, allocator=allocator, window=2)
        out["components"] = (C.FULL, C.SWA)
        out["slot"] = {"kv": _kv(kvcache.full_kv_pool)}
        out["swa"] = _kv(kvcache.swa_kv_pool)
    elif family == "FULL+MAMBA":
        r2t = mamba_request_pool([1, 3], 512)
        kvcache = HybridLinearKVPool(
            size=size,
            dtype=torch.bfloat16,
            page_size=page,
            head_num=1,
            head_dim=LORA + ROPE,
            full_attention_layer_ids=[0, 2],
            device="cpu",
            enable_memory_saver=False,
            mamba_pool=r2t.mamba_pool,
            use_mla=True,
            kv_lora_rank=LORA,
            qk_rope_head_dim=ROPE,
        )
        out.update(kvcache=kvcache, allocator=_paged(size, page, kvcache), r2t=r2t)
        out["components"] = (C.FULL, C.MAMBA)
        out["slot"] = {"kv": _kv(kvcache.full_kv_pool)}
    elif family == "FULL+SWA+MAMBA":
        r2t = mamba_request_pool([1], 512)
        kvcache, allocator = _swa(size, page, [0], [2])
        out.update(kvcache=kvcache, allocator=allocator, r2t=r2t, window=2)
        out["components"] = (C.FULL, C.SWA, C.MAMBA)
        out["slot"] = {"kv": _kv(kvcache.full_kv_pool)}
        out["swa"] = _kv(kvcache.swa_kv_pool)
    elif family == "DeepSeek V4":
        full, swa = 8 * page, 4 * page
        kvcache = dsv4_pool(full, swa, page, variant)
        allocator = kvcr_stack.swa_allocator(kvcache, full, page, swa)
        out.update(kvcache=kvcache, allocator=allocator, window_tokens=128)
        out["components"] = (C.FULL, C.SWA)
        out["slot"] = {}
        out["page_rows"] = dsv4_page_rows(kvcache, page)
        out["swa_pages"] = [*kvcache.swa_kv_pool.kv_buffer, *dsv4_ring_rows(kvcache)]
        if DSV4_VARIANTS[variant].get("mtp_layers"):
            draft = dsv4_pool(full, swa, page, variant, draft=True)
            draft.register_mapping(allocator.full_to_swa_index_mapping)
            out["mtp"] = (draft,)
            out["swa_pages"] += list(draft.swa_kv_pool.kv_buffer)
    else:
        raise ValueError(f"no CPU stack for family {family!r}")
    out.setdefault("r2t", ReqToTokenPool(8, 512, "cpu", False))
    return out


def build(family: str, variant: str = "v4") -> FamilyStack:
    """The family's pools, a UnifiedRadixCache over them and the KVCR linker
    (``variant``: a :data:`DSV4_VARIANTS` key for DeepSeek V4)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    page = PAGES.get(family, 4)
    extra = (
        DSV4_VARIANTS[variant].get("server_args", {}) if family == "DeepSeek V4" else {}
    )
    server_args = publish_server_args(
        page, "org/draft" if family == "draft" else None, **extra
    )
    parts = family_parts(family, page, variant)
    window = parts.get("window", 0)
    window_tokens = parts.get("window_tokens", window * page)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=parts["r2t"],
        token_to_kv_pool_allocator=parts["allocator"],
        page_size=page,
        tree_components=parts["components"],
        sliding_window_size=window_tokens or None,
        tree_core_backend="python",
        sidecar_draft_device_pools=parts.get("sidecar", ()),
        mtp_draft_device_pools=parts.get("mtp", ()),
    )
    cache = UnifiedRadixCache(params)
    stack = kvcr_stack.KVCRStack(
        cache, parts["kvcache"], parts["allocator"], server_args, params, dict(CONFIG)
    )
    kvcr_stack.attach(stack, kvcr_stack.create_linker(stack))
    r2t = parts["r2t"]
    return FamilyStack(
        family=family,
        page=page,
        server_args=server_args,
        cache=cache,
        linker=stack.linker,
        allocator=parts["allocator"],
        kvcache=parts["kvcache"],
        params=params,
        slot_buffers=parts["slot"],
        page_buffers=parts.get("page_rows", {}),
        swa_buffers=parts.get("swa", []),
        mamba_states=_states(r2t) if hasattr(r2t, "mamba_pool") else [],
        window_pages=-(-window_tokens // page),
        swa_page_buffers=parts.get("swa_pages", []),
    )


def _randomize(t: torch.Tensor, gen: torch.Generator) -> None:
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def _rows(buffers: list[torch.Tensor], index: torch.Tensor) -> list[torch.Tensor]:
    return [b[index].reshape(-1).view(torch.uint8).clone() for b in buffers]


def _state_rows(states: list[torch.Tensor], slot: int) -> list[torch.Tensor]:
    return [s[:, slot].reshape(-1).view(torch.uint8).clone() for s in states]


def _written_elsewhere(
    buffers: list[torch.Tensor], index: torch.Tensor, dim: int = 0
) -> bool:
    """Whether any row of ``buffers`` outside ``index`` (along ``dim``) is not
    zero: the buffers were zeroed before the restore, which must write only
    the request's own rows."""
    for b in buffers:
        keep = torch.ones(b.shape[dim], dtype=torch.bool)
        keep[index.long()] = False
        if b.view(torch.uint8).movedim(dim, 0)[keep].any():
            return True
    return False


@dataclasses.dataclass
class RoundTrip:
    """What was written and what landed, per buffer kind (lists of byte rows)."""

    written: dict[str, list[torch.Tensor]]
    landed: dict[str, list[torch.Tensor]]
    host_hit_length: int
    loaded_tokens: int
    failed: list[str]
    # buffer kinds with a non-zero row outside the request's own after the
    # restore (every buffer was zeroed before it)
    stray: list[str] = dataclasses.field(default_factory=list)


def round_trip(
    stack: FamilyStack,
    pages: int = 3,
    seed: int = 0,
    before_load: Callable[[FamilyStack], None] | None = None,
) -> RoundTrip:
    """Insert ``pages`` pages, write through, evict, zero, then restore them for
    one request through the wrapper (see the module docstring)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InitLoadBackParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration

    set_global_server_args_for_scheduler(stack.server_args)  # another may have run
    cache, allocator, page = stack.cache, stack.allocator, stack.page
    gen = torch.Generator().manual_seed(seed)
    base = 1000 * (seed + 1)
    tokens = list(range(base, base + pages * page))
    n = len(tokens)
    zero, last, count = torch.tensor([0]), torch.tensor([-1]), torch.tensor([n])
    if page == 1:
        slots = allocator.alloc(n)
    else:
        slots = allocator.alloc_extend(zero, zero, count, count, last, n)
    assert slots is not None, "no free slots"
    page_index = slots[::page] // page
    every = [b for bufs in stack.slot_buffers.values() for b in bufs]
    every += [b for bufs in stack.page_buffers.values() for b in bufs]
    every += stack.swa_buffers + stack.swa_page_buffers + stack.mamba_states
    for b in every:
        _randomize(b, gen)
    written = {name: _rows(bufs, slots) for name, bufs in stack.slot_buffers.items()}
    for name, bufs in stack.page_buffers.items():
        written[name] = _rows(bufs, page_index)
    insert = InsertParams(key=RadixKey(array("q", tokens)), value=slots)
    tail = slice(n - stack.window_pages * page, n)
    if stack.swa_buffers:
        swa_slots = allocator.translate_loc_from_full_to_swa(slots)
        written["swa"] = _rows(stack.swa_buffers, swa_slots[tail])
    if stack.swa_page_buffers:
        swa_pages = allocator.translate_loc_from_full_to_swa(slots[tail])[::page]
        written["swa_pages"] = _rows(stack.swa_page_buffers, swa_pages // page)
    if stack.mamba_states:
        r2t = stack.params.req_to_token_pool
        state = r2t.mamba_allocator.alloc(1)
        written["mamba"] = _state_rows(stack.mamba_states, int(state[0]))
        insert.mamba_value = state
    cache.insert(insert)

    def committed() -> bool:
        cache.check_hicache_events()
        return not cache.linker.pending_offloads

    wait_until(committed, what=f"{stack.family} offloads committed")
    cache.evict(EvictParams(num_tokens=n, swa_num_tokens=n, mamba_num=1))
    probe = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
    assert probe.device_prefix_len == 0, "the sequence is still on the device"
    for b in every:
        b.zero_()
    if before_load is not None:
        before_load(stack)

    req = Req(
        f"{stack.family}-{seed}",
        "",
        array("q", [*tokens, 1, 2]),
        SamplingParams(max_new_tokens=1),
    )
    handle = integration.wrapper_prepare_request(cache.linker, req)
    ready = cache.linker.cache_linker.preparation_ready
    wait_until(lambda: ready(handle), what=f"{stack.family} tail prepared")
    req.init_next_round_input(cache)
    hit = int(req.host_hit_length)
    loaded, failed = 0, []
    landed: dict[str, list[torch.Tensor]] = {}
    if hit:
        result = cache.init_load_back(
            InitLoadBackParams(
                best_match_node=req.best_match_node,
                host_hit_length=req.host_hit_length,
                req=req,
            )
        )
        loaded = int(result[0])
        private = cache.linker.private_load_indices[req.rid].clone()
        assert cache.ready_to_load_host_cache() >= 0
        failed = cache.finish_external_linker_loads([req])
        landed = {n_: _rows(b, private) for n_, b in stack.slot_buffers.items()}
        for name, bufs in stack.page_buffers.items():
            landed[name] = _rows(bufs, private[::page] // page)
        if stack.swa_buffers:
            window = allocator.translate_loc_from_full_to_swa(private[tail])
            landed["swa"] = _rows(stack.swa_buffers, window)
        if stack.swa_page_buffers:
            window = allocator.translate_loc_from_full_to_swa(private[tail])[::page]
            landed["swa_pages"] = _rows(stack.swa_page_buffers, window // page)
        if stack.mamba_states:
            landed["mamba"] = _state_rows(
                stack.mamba_states, int(req.kv.mamba_pool_idx)
            )
        slot = int(req.kv.mamba_pool_idx) if stack.mamba_states else None
        stray = _stray_kinds(stack, private, tail, slot)
    stack.linker.finish_request(req.rid)
    return RoundTrip(written, landed, hit, loaded, failed, stray if hit else [])


def _stray_kinds(
    stack: FamilyStack, private: torch.Tensor, tail: slice, mamba_slot: int | None
) -> list[str]:
    """The buffer kinds a restore wrote outside the request's own rows."""
    page, allocator = stack.page, stack.allocator
    out = [n for n, b in stack.slot_buffers.items() if _written_elsewhere(b, private)]
    pages = private[::page] // page
    out += [n for n, b in stack.page_buffers.items() if _written_elsewhere(b, pages)]
    if stack.swa_buffers or stack.swa_page_buffers:
        window = allocator.translate_loc_from_full_to_swa(private[tail])
        if _written_elsewhere(stack.swa_buffers, window):
            out.append("swa")
        if _written_elsewhere(stack.swa_page_buffers, window[::page] // page):
            out.append("swa_pages")
    if mamba_slot is not None and _written_elsewhere(
        stack.mamba_states, torch.tensor([mamba_slot]), dim=1
    ):
        out.append("mamba")
    return out
