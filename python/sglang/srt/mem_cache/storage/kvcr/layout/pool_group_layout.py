"""The model families the KVCR linker serves, and their KVCR pools from SGLang's
``DevicePoolGroup``.

SGLang 0.5.23 builds a direct-linker ``DevicePoolGroup`` for DSA, DeepSeek V4 and
the Mamba hybrids (``resolve_hybrid_device_pool_group``), but none for a plain
MHA/MLA pool or a FULL+SWA ``SWAKVPool``: ``plain_group`` builds those from
SGLang's public ``DevicePoolEntry`` the way its own builders do (one component
``[*k_buffer, *v_buffer]`` with layer ``l -> (l, L+l)`` for MHA, ``kv_buffer``
for MLA, a sidecar ``draft`` entry indexed by the KV slots). ``pool_group``
picks the family (:data:`FAMILIES`) from the KV pool and tree components and
returns its group, or refuses at start-up naming the family and the flag.
``describe_entry`` turns one entry into KVCR pools: a span per buffer over its
rows (a page is ``page_size`` slot rows, or one row when rows are pages), in
layer order of the entry's layer mapping, with the entry's index source, hit
policy and index translation, plus the geometry the compatibility digest covers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from sglang.srt.mem_cache.storage.kvcr.layout.pool_checks import (
    check_plain_pool,
    check_pool,
)
from sglang.srt.mem_cache.storage.kvcr.layout.pool_layout import (
    SUPPORTED,
    HitPolicy,
    KVCRLayoutError,
    PoolLayout,
    Span,
)

_FLAG = "--unified-cache-external-linker-backend"


@dataclasses.dataclass(frozen=True, slots=True)
class Family:
    """Whether the linker serves one model family, and why (docs table row)."""

    served: bool
    why: str


FAMILIES: dict[str, Family] = {
    "MHA": Family(True, "KV pages of every layer (K and V spans)"),
    "MLA": Family(True, "latent KV pages; rank-replicated group"),
    "FULL+SWA": Family(True, "KV pages, and SWA pages of the trailing window"),
    "DSA": Family(True, "SGLang's group: latent KV pages and indexer pages"),
    "FULL+MAMBA": Family(
        True, "SGLang's group (MLA full pool): KV pages, Mamba state of the last page"
    ),
    "FULL+SWA+MAMBA": Family(
        True, "SGLang's group: KV pages, SWA window, Mamba state of the last page"
    ),
    "draft": Family(True, "one sidecar/MTP draft pool, KV-indexed, or SGLang's"),
    "FULL(MHA)+MAMBA": Family(
        False, "SGLang 0.5.23 builds its Mamba group only over an MLA full pool"
    ),
    "DeepSeek V4": Family(
        True,
        "SGLang's group: compressed KV and indexer pages of every ratio, SWA "
        "window and C4 compress states (paged SWA; V4, V4.1 and trtllm FP8 "
        "rows; an MTP layer)",
    ),
    "DeepSeek V4 per-request SWA": Family(
        False,
        "unified_kv, encoder SWA replay and the draft SWA ring keep SWA per "
        "request, outside the tree",
    ),
    "MiniMax sparse": Family(False, "SGLang 0.5.23 builds no direct-linker group"),
    "scaled KV": Family(False, "FP4/MXFP8 scale buffers are outside the group"),
    "page-major/HND": Family(False, "rows are not NHD token slots"),
}

# DeepSeek V4 pool attributes set when SWA is kept per request (and what sets it)
_DSV4_PER_REQUEST = {
    "unified_kv_pool": "unified kv (SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton)",
    "request_window": "request window (--enable-encoder-swa-bounded-replay)",
    "swa_req_ring_size": "swa req ring (the DSpark draft's SWA ring)",
}

_POLICY = {
    "kv": HitPolicy.ALL_PAGES,
    "swa": HitPolicy.TRAILING_WINDOW,
    "mamba": HitPolicy.LAST_PAGE,
}


def refuse(family: str, reason: str, flag: str = _FLAG) -> KVCRLayoutError:
    """The start-up error for a family the linker cannot describe exactly."""
    return KVCRLayoutError(
        f"{family} model: {reason}; the KVCR linker cannot serve it exactly "
        f"(change {flag} for this model; 'Model families' in "
        "docs/kvcr_direct_linker.md)"
    )


# ---- picking the family and its group -------------------------------------------


def pool_group(
    kvcache: Any,
    params: Any,
    components: set[Any],
    draft_pool: Callable[[], Any] = lambda: None,
) -> tuple[str, Any]:
    """(family, DevicePoolGroup) for this rank's KV pool and tree components;
    ``draft_pool`` gives the one draft pool of a plain family (SGLang's own
    groups take their drafts from the cache params themselves)."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.mem_cache.memory_pool import (
        DSATokenToKVPool,
        HybridLinearKVPool,
        HybridReqToTokenPool,
        MiniMaxSparseKVPool,
    )
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    page_size = int(params.page_size)
    names = sorted(ComponentType(int(c)).name for c in components)
    kinds = {ComponentType(int(c)) for c in components}
    mamba = ComponentType.MAMBA in kinds
    if isinstance(kvcache, DeepSeekV4TokenToKVPool):
        for pool in (kvcache, *getattr(params, "mtp_draft_device_pools", ())):
            _check_dsv4_swa(pool, kvcache)
        return "DeepSeek V4", _sglang_group("DeepSeek V4", kvcache, params, kinds)
    if isinstance(kvcache, MiniMaxSparseKVPool):
        raise refuse("MiniMax sparse", FAMILIES["MiniMax sparse"].why)
    if (ComponentType.SWA in kinds) != isinstance(kvcache, SWAKVPool):
        raise KVCRLayoutError(
            f"tree components {names} do not match the KV pool "
            f"{type(kvcache).__name__}: SWA needs an SWAKVPool and vice versa "
            f"(change {_FLAG} for this model)"
        )
    if mamba or isinstance(kvcache, HybridLinearKVPool):
        family = "FULL+SWA+MAMBA" if ComponentType.SWA in kinds else "FULL+MAMBA"
        r2t = getattr(params, "req_to_token_pool", None)
        if not mamba or not isinstance(r2t, HybridReqToTokenPool):
            raise refuse(
                family,
                f"tree components {names} with {type(kvcache).__name__} need the "
                "Mamba component and its HybridReqToTokenPool state pool",
            )
        if hasattr(getattr(kvcache, "full_kv_pool", None), "k_buffer") and not (
            isinstance(kvcache, SWAKVPool)
        ):
            raise refuse("FULL(MHA)+MAMBA", FAMILIES["FULL(MHA)+MAMBA"].why)
        return family, _sglang_group(family, kvcache, params, kinds)
    if isinstance(kvcache, DSATokenToKVPool):
        return "DSA", _sglang_group("DSA", kvcache, params, kinds)
    if kinds - {ComponentType.FULL, ComponentType.SWA}:
        raise refuse("unknown", f"tree components {names} have no KVCR form")
    family = "FULL+SWA" if ComponentType.SWA in kinds else _plain_family(kvcache)
    return family, plain_group(kvcache, page_size, draft_pool())


def _check_dsv4_swa(pool: Any, target: Any) -> None:
    """Refuse a DeepSeek V4 target or MTP draft pool whose SWA rows are not the
    target's paged SWA pages (kept per request, or a draft addressed otherwise:
    SGLang packs each draft's SWA rows into the target's SWA entry)."""
    family = "DeepSeek V4 per-request SWA"
    kept = [a for a in _DSV4_PER_REQUEST if getattr(pool, a, None) is not None]
    if kept:
        raise refuse(family, f"{_DSV4_PER_REQUEST[kept[0]]}: {FAMILIES[family].why}")
    if pool is not target and (
        getattr(pool, "swa_uses_full_indices", False)
        or pool.full_to_swa_index_mapping is not target.full_to_swa_index_mapping
    ):
        raise refuse(
            family,
            "an MTP draft pool's SWA rows are not addressed by the target's SWA "
            f"pages: {FAMILIES[family].why}",
        )


def _plain_family(kvcache: Any) -> str:
    return "MHA" if hasattr(kvcache, "k_buffer") else "MLA"


def _sglang_group(family: str, kvcache: Any, params: Any, kinds: set[Any]) -> Any:
    """SGLang's own group for this family; its refusals name the family."""
    from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import (
        resolve_hybrid_device_pool_group,
    )

    try:
        group = resolve_hybrid_device_pool_group(
            kvcache=kvcache,
            page_size=int(params.page_size),
            params=params,
            components=kinds,
        )
    except (ValueError, AssertionError, ZeroDivisionError) as exc:
        # ZeroDivisionError: an entry over 0-row buffers (DSA layers that share
        # another layer's top-k keep no indexer rows of their own).
        reason = f"SGLang's direct-linker pool group refuses it: {exc!r}"
        raise refuse(family, reason) from exc
    # A pool's scales may ride a sibling entry (DeepSeek V4 FP4 indexer: payload
    # and scale entries over one pool), so every entry's buffers count as carried.
    carried = {b.data_ptr() for e in group.entries for b in e.kv_buffer}
    for entry in group.entries:
        check_pool(entry.device_pool, int(params.page_size), carried, family)
    return group


# ---- the plain groups SGLang 0.5.23 does not build ---------------------------------


def plain_group(kvcache: Any, page_size: int, draft_pool: Any = None) -> Any:
    """The direct-linker group of a plain MHA/MLA pool or an ``SWAKVPool`` over
    them (``kv`` + ``swa``), with a sidecar ``draft`` entry on the KV slots."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import (
        DevicePoolGroup,
    )
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    entries = []
    if isinstance(kvcache, SWAKVPool):
        if type(kvcache) is not SWAKVPool:
            raise KVCRLayoutError(
                f"{type(kvcache).__name__}: only the plain SWAKVPool sliding-window "
                f"layout can be described; {SUPPORTED}"
            )
        start = int(getattr(kvcache, "start_layer", 0))
        full: dict[int, int] = {}
        window: dict[int, int] = {}
        for global_layer, (index, is_swa) in kvcache.layers_mapping.items():
            (window if is_swa else full)[int(global_layer) - start] = int(index)
        for name, pool, mapping in (
            (PoolName.KV, kvcache.full_kv_pool, full),
            (PoolName.SWA, kvcache.swa_kv_pool, window),
        ):
            entries.append(_plain_entry(name, name, pool, mapping, page_size))
        replicated = False
    else:
        layers = {layer: layer for layer in range(_layer_count(kvcache))}
        entries.append(
            _plain_entry(PoolName.KV, PoolName.KV, kvcache, layers, page_size)
        )
        replicated = not hasattr(kvcache, "k_buffer")  # MLA: same KV on every rank
    if draft_pool is not None:
        layers = {layer: layer for layer in range(_layer_count(draft_pool))}
        entries.append(
            _plain_entry(PoolName.DRAFT, PoolName.KV, draft_pool, layers, page_size)
        )
        # An MHA draft holds this rank's heads only: then no page is the same on
        # every rank (an MLA target's included, as one page covers both pools).
        replicated = replicated and not hasattr(draft_pool, "k_buffer")
    num_layers = 1 + max(layer for e in entries for layer in e.layer_mapping)
    return DevicePoolGroup(entries, num_layers, page_size, rank_replicated=replicated)


def _layer_count(pool: Any) -> int:
    buffers = getattr(pool, "k_buffer", None) or getattr(pool, "kv_buffer", None)
    return len(buffers or ())


def _plain_entry(
    name: Any, source: Any, pool: Any, layers: dict[int, int], page_size: int
) -> Any:
    from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import (
        DevicePoolEntry,
    )

    check_plain_pool(pool, page_size)
    if hasattr(pool, "k_buffer"):
        count = len(pool.k_buffer)
        components = [[*pool.k_buffer, *pool.v_buffer]]
        mapping: dict[int, Any] = {t: (i, count + i) for t, i in layers.items()}
    else:
        components, mapping = [list(pool.kv_buffer)], dict(layers)
    return DevicePoolEntry(
        name=name,
        indices_from_pool=source,
        device_pool=pool,
        components=components,
        layer_mapping=mapping,
        page_size=page_size,
        rows_are_pages=False,
    )


# ---- one entry -> KVCR pools ----------------------------------------------------------


def describe_entry(
    entry: Any, page_size: int
) -> tuple[list[PoolLayout], dict[str, Any]]:
    """The KVCR pools of one ``DevicePoolEntry`` and the geometry its digest covers."""
    name, source = str(entry.name), str(entry.indices_from_pool)
    policy = _POLICY.get(source)
    if policy is None:
        raise KVCRLayoutError(
            f"pool group entry {name!r} takes indices from {source!r}, which has no "
            f"KVCR hit policy; {SUPPORTED}"
        )
    parts = list(_parts(entry))
    rows = {rows for *_, rows in parts}
    if len(rows) != 1:
        raise KVCRLayoutError(f"entry {name!r}: buffers differ in rows per page {rows}")
    rows_per_page = rows.pop()
    groups: dict[int, list[tuple[str, int, torch.Tensor, int]]] = {}
    for part, layer, t, page_bytes, _ in parts:
        groups.setdefault(page_bytes, []).append((part, layer, t, page_bytes))
    devices = {t.device for _, _, t, _, _ in parts}
    device = next(iter(devices))
    if len(devices) != 1 or device.type not in ("cpu", "cuda"):
        raise KVCRLayoutError(f"entry {name!r}: unsupported devices {devices}")
    layouts = []
    for i, (page_bytes, members) in enumerate(groups.items()):
        pool_name = name if i == 0 else f"{name}_{i}"
        spans = tuple(
            Span(
                label=f"{pool_name}:{part}",
                base_ptr=t.data_ptr(),
                page_stride_bytes=rows_per_page * t.stride(0) * t.element_size(),
                page_bytes=page_bytes,
                num_pages=t.shape[0] // rows_per_page,
                layer=layer,
            )
            for part, layer, t, _ in members
        )
        layouts.append(
            PoolLayout(
                name=pool_name,
                source=name,
                spans=spans,
                indices_from=source,
                policy=policy,
                index_page_size=int(entry.page_size),
                rows_per_page=rows_per_page,
                tensors=tuple(t for _, _, t, _ in members),
                translate=entry.translate_indices,
            )
        )
    geometry: dict[str, Any] = {
        "entry": name,
        "source": source,
        "policy": policy.value,
        "class": type(entry.device_pool).__name__,
        "index_page_size": int(entry.page_size),
        "rows_per_page": rows_per_page,
        "buffers": [
            [part, layer, str(t.dtype), list(t.shape[1:]), page_bytes]
            for part, layer, t, page_bytes, _ in parts
        ],
    }
    row_format = _row_format(entry.device_pool)
    if any(row_format):
        geometry["format"] = row_format
    return layouts, geometry


# Device-pool settings that change the bytes of a row whose size they leave
# alone (DeepSeek V4: V4.1 and V4.1-new order data and scales differently).
_FORMAT_ATTRS = (
    "kv_layout",
    "uniform_fp8",
    "use_fp4_indexer",
    "index_k_page8",
    "index_k_rne",
    "ring_size",
    "ratio",
)


def _row_format(device_pool: Any) -> list[dict[str, str]]:
    pools = device_pool if isinstance(device_pool, list | tuple) else [device_pool]
    out = []
    for pool in pools:
        if pool is None:
            continue
        found = {a: str(getattr(pool, a)) for a in _FORMAT_ATTRS if hasattr(pool, a)}
        state = getattr(getattr(pool, "kv_score_buffer", None), "kv_score", None)
        if isinstance(state, torch.Tensor):
            found["state_dtype"] = str(state.dtype)
        out.append(found)
    return out


def _parts(entry: Any) -> Iterator[tuple[str, int, torch.Tensor, int, int]]:
    """(part name, transfer layer, buffer, page bytes, rows per page) of every
    buffer, layer by layer; every buffer must be mapped to exactly one layer."""
    seen: set[tuple[int, int]] = set()
    names = _buffer_names(entry)
    for layer in sorted(entry.layer_mapping):
        mapped = entry.layer_mapping[layer]
        indices = [mapped] if isinstance(mapped, int) else list(mapped)
        for c, component in enumerate(entry.components):
            for b in indices:
                t = component[b]
                meta = entry.buffer_meta[c][b]
                row_bytes = t.nbytes // max(1, t.shape[0])
                if (
                    (c, b) in seen
                    or not t.is_contiguous()
                    or t.dim() < 1
                    or not row_bytes
                ):
                    raise KVCRLayoutError(
                        f"entry {entry.name}: buffer {c}/{b} is mapped twice or is "
                        f"not contiguous rows; {SUPPORTED}"
                    )
                seen.add((c, b))
                yield (
                    names[c][b],
                    int(layer),
                    t,
                    int(meta[2]),
                    int(meta[2]) // row_bytes,
                )
    total = sum(len(component) for component in entry.components)
    if len(seen) != total:
        raise KVCRLayoutError(
            f"entry {entry.name}: {total - len(seen)} buffer(s) have no transfer "
            f"layer, so no restore would write them; {SUPPORTED}"
        )


_BUFFER_ATTRS = (
    ("k_buffer", "k"),
    ("v_buffer", "v"),
    ("kv_buffer", "kv"),
    ("index_k_with_scale_buffer", "idx"),
)


def _buffer_names(entry: Any) -> list[list[str]]:
    """A part name per buffer: ``k3`` when it is the device pool's ``k_buffer[3]``
    (likewise ``v``, ``kv``, ``idx``), else ``c<component>.<index>``."""
    known: dict[int, str] = {}
    for attr, short in _BUFFER_ATTRS:
        for i, t in enumerate(getattr(entry.device_pool, attr, None) or ()):
            if isinstance(t, torch.Tensor):
                known.setdefault(id(t), f"{short}{i}")
    return [
        [known.get(id(t), f"c{c}.{b}") for b, t in enumerate(component)]
        for c, component in enumerate(entry.components)
    ]
