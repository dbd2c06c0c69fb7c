"""Model families: the KVCR page layout is SGLang's ``DevicePoolGroup``, per family.

For every served family (plain MHA, MLA, FULL+SWA, DSA, FULL+MAMBA, FULL+SWA+MAMBA,
a sidecar draft pool, and DeepSeek V4 in each pool layout that builds on CPU)
real SGLang pools on CPU tensors, a real
``UnifiedRadixCache`` with that family's components and the KVCR linker from
SGLang's factory: insert (write-through), device eviction, match, prepare, load
back and finish restore every component's rows byte-exact. The KVCR spans are
the group entries' own addresses (``get_prepared_layer_range_meta``), the hit
policies are the transfers' (a Mamba state only at the restored prefix's last
page, intersected with the SWA window), the digest is shared by equal geometry
and keeps the TP shard unless the group is rank-replicated, refused families
fail at start-up naming the family and the flag, and the docs table is the
code's ``FAMILIES``. Real kvcr + NIXL.
"""

from __future__ import annotations

import hashlib
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from cpu_harness import kvcr_dsv4, kvcr_families, kvcr_stack
from cpu_harness.kvcr_pages import wait_until
from cpu_harness.server import REPO
from sglang.srt.mem_cache.storage.kvcr.layout import pool_group_layout
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import PageLayout
from sglang.srt.mem_cache.storage.kvcr.layout.pool_group_layout import FAMILIES
from sglang.srt.mem_cache.storage.kvcr.layout.pool_layout import (
    KVCRLayoutError,
    ModelIdentity,
)
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)

pytestmark = pytest.mark.kvcr

DOCS = REPO / "docs" / "kvcr_direct_linker.md"
ALL, WINDOW, LAST = "all_pages", "trailing_window", "last_page"
POOLS = {
    "MHA": [("kv", ALL)],
    "MLA": [("kv", ALL)],
    "FULL+SWA": [("kv", ALL), ("swa", WINDOW)],
    "DSA": [("kv", ALL), ("indexer", ALL)],
    "FULL+MAMBA": [("kv", ALL), ("mamba", LAST), ("mamba_1", LAST)],
    "FULL+SWA+MAMBA": [
        ("kv", ALL),
        ("swa", WINDOW),
        ("mamba", LAST),
        ("mamba_1", LAST),
    ],
    "draft": [("kv", ALL), ("draft", ALL)],
    # no dense KV pool: the compressed pools are the KV-indexed ones
    "DeepSeek V4": [
        ("deepseek_v4_c4", ALL),
        ("deepseek_v4_c4_indexer", ALL),
        ("deepseek_v4_c128", ALL),
        ("swa", WINDOW),
        ("deepseek_v4_c4_state", WINDOW),
        ("deepseek_v4_c4_indexer_state", WINDOW),
    ],
}
REPLICATED = {"MLA", "DSA", "DeepSeek V4"}  # the same KV on every attention rank
TARGET = {"draft": "MHA"}  # the draft rides its target's family
IDENTITY = ModelIdentity("org/model", "rev", "org/draft", 0, 2)


@pytest.fixture(scope="module", params=list(POOLS))
def stack(request: pytest.FixtureRequest, plugin_hooks: None) -> Any:
    built = kvcr_families.build(request.param)
    yield built
    built.linker.close()


def hashes(n: int, salt: str) -> list[str]:
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


# ---- the round trip through SGLang's wrapper and a real UnifiedRadixCache ----------


def test_every_component_round_trips_byte_exact_through_the_cache(stack: Any):
    """Insert, write-through, device eviction, match, load back and finish: every
    buffer's rows land in the request's own slots exactly as written."""
    assert FAMILIES[stack.family].served
    layout = stack.linker.layout
    assert [(p.name, p.policy.value) for p in layout.pools] == POOLS[stack.family]
    pages = 6 if stack.page == 1 else 3
    rt = kvcr_families.round_trip(stack, pages=pages, seed=1)
    assert rt.host_hit_length == rt.loaded_tokens == pages * stack.page
    assert rt.failed == [] and rt.stray == []
    assert set(rt.landed) == set(rt.written)
    for kind, rows in rt.written.items():
        assert len(rt.landed[kind]) == len(rows) > 0
        for want, got in zip(rows, rt.landed[kind], strict=True):
            assert torch.equal(got, want), (stack.family, kind)
    assert stack.linker.claims_held() == 0


def test_kvcr_spans_are_the_group_entries_own_addresses(stack: Any):
    """Per entry, page and transfer layer: the spans' (address, size) are what
    SGLang's DevicePoolEntry itself reads; each pool keeps its entry's source."""
    layout = stack.linker.layout
    assert {str(n) for n in stack.linker.pools} == {p.source for p in layout.pools}
    for name, entry in stack.linker.pools.items():
        pools = [p for p in layout.pools if p.source == str(name)]
        assert {p.indices_from for p in pools} == {str(entry.indices_from_pool)}
        step = entry.page_size
        last = min(p.num_pages for p in pools) - 1
        for page in (0, 1, last):
            rows = entry.prepare_locations(torch.arange(page * step, (page + 1) * step))
            for layer in entry.layer_mapping:
                ptrs, sizes, _ = entry.get_prepared_layer_range_meta(rows, layer)
                theirs = sorted(zip(ptrs[0], sizes[0], strict=True))
                ours = sorted(
                    (s.page_addr(page), s.page_bytes)
                    for p in pools
                    for s in p.spans
                    if s.layer == layer
                )
                assert ours == theirs, (stack.family, name, page, layer)


def test_the_digest_is_shared_by_equal_geometry_and_keeps_the_shard(stack: Any):
    """Fresh pools of the same family (other addresses) give the same digest; the
    TP rank changes it unless the group is rank-replicated."""
    page = stack.page
    parts = kvcr_families.family_parts(stack.family, page)
    params = SimpleNamespace(
        page_size=page,
        req_to_token_pool=parts["r2t"],
        mtp_draft_device_pools=(),
        sidecar_draft_device_pools=parts.get("sidecar", ()),
    )
    components = set(parts["components"])
    mine = next(iter(stack.params.sidecar_draft_device_pools), None)
    draft = next(iter(parts.get("sidecar", ())), None)
    ours = pool_group_layout.pool_group(
        stack.kvcache, stack.params, components, lambda: mine
    )
    fresh = pool_group_layout.pool_group(
        parts["kvcache"], params, components, lambda: draft
    )
    assert ours[0] == fresh[0] == TARGET.get(stack.family, stack.family)
    a = PageLayout.from_pool_group(ours[1], identity=IDENTITY)
    b = PageLayout.from_pool_group(fresh[1], identity=IDENTITY)
    assert a.pools[0].spans[0].base_ptr != b.pools[0].spans[0].base_ptr
    assert a.compatibility_digest == b.compatibility_digest
    assert a.rank_replicated == (stack.family in REPLICATED)
    other_rank = ModelIdentity("org/model", "rev", "org/draft", 1, 2)
    c = PageLayout.from_pool_group(fresh[1], identity=other_rank)
    shared = c.compatibility_digest == b.compatibility_digest
    assert shared == (stack.family in REPLICATED)


def test_each_family_has_its_own_digest(plugin_hooks: None):
    """Different geometry (pools, policies, dtypes, layer mapping) never shares."""
    digests = {}
    for family in POOLS:
        page = kvcr_families.PAGES.get(family, 4)
        kvcr_families.publish_server_args(page)
        parts = kvcr_families.family_parts(family, page)
        params = SimpleNamespace(
            page_size=page,
            req_to_token_pool=parts["r2t"],
            mtp_draft_device_pools=(),
            sidecar_draft_device_pools=parts.get("sidecar", ()),
        )
        draft = next(iter(parts.get("sidecar", ())), None)
        _, group = pool_group_layout.pool_group(
            parts["kvcache"], params, set(parts["components"]), lambda d=draft: d
        )
        digests[family] = PageLayout.from_pool_group(group, identity=IDENTITY)
    assert len({d.compatibility_digest for d in digests.values()}) == len(POOLS)


# ---- hit policies: a Mamba state only at the last page, intersected with SWA ------


def _transfer(name: Any, keys: list[str], indices: list[int] | None = None) -> Any:
    policy = (
        PoolHitPolicy.ALL_PAGES
        if name == PoolName.KV
        else (PoolHitPolicy.TRAILING_PAGES)
    )
    return PoolTransfer(
        name=name,
        keys=list(keys),
        device_indices=None if indices is None else torch.tensor(indices),
        hit_policy=policy,
    )


def _offload(linker: Any, transfers: list[Any]) -> bool:
    assert linker.offload(transfers) is True
    wait_until(lambda: linker.num_completed_offloads() >= 1, what="offload")
    return linker.pop_completed_offload()


def _lookup_transfers(stack: Any, tail: list[str]) -> list[Any]:
    out = [_transfer(PoolName.KV, tail)]
    if stack.swa_buffers:
        out.append(_transfer(PoolName.SWA, tail[-stack.window_pages :]))
    out.append(_transfer(PoolName.MAMBA, tail[-1:]))
    return out


@pytest.mark.parametrize(
    ("family", "swa_pages", "want"),
    [("FULL+MAMBA", None, [3, 6]), ("FULL+SWA+MAMBA", [3, 4, 5], [6])],
    ids=["mamba-last-page", "swa-and-mamba-intersect"],
)
def test_a_boundary_needs_the_mamba_state_of_its_last_page(
    plugin_hooks: None, family: str, swa_pages: list[int] | None, want: list[int]
):
    """Two nodes of three pages, each with its end state: boundaries 3 and 6 only.
    With a 2-page SWA window held for pages 3-5 only, the window alone allows 5
    and 6 and the states 3 and 6: only 6 has both. A load restores the state
    stored for its last page; one asking for another page's state, or none,
    fails and writes nothing."""
    stack = kvcr_families.build(family)
    linker, states = stack.linker, stack.mamba_states
    try:
        keys = hashes(6, family)
        gen = torch.Generator().manual_seed(5)
        for s in states:
            s.view(torch.uint8).copy_(
                torch.randint(
                    0, 256, s.view(torch.uint8).shape, dtype=torch.uint8, generator=gen
                )
            )
        want_state = [s[:, 3].clone().view(torch.uint8) for s in states]
        for first, slot in ((0, 2), (3, 3)):
            node = keys[first : first + 3]
            xfers = [
                _transfer(PoolName.KV, node, list(range(10 + first, 13 + first))),
                _transfer(PoolName.MAMBA, node[-1:], [slot]),
            ]
            if swa_pages is not None:
                held = [p for p in swa_pages if first <= p < first + 3]
                xfers.append(
                    _transfer(
                        PoolName.SWA, [keys[p] for p in held], [20 + p for p in held]
                    )
                )
            assert _offload(linker, xfers) is True
        handle = linker.prepare_request(
            LinkerRequestContext("m"), _lookup_transfers(stack, keys)
        )
        wait_until(lambda: linker.preparation_ready(handle), what="prepared")
        # Bound on one attention rank, the longest length alone (SGLang's MIN has
        # nothing to intersect); under TP every one, for the ranks' MIN.
        assert linker.lookup("m", _lookup_transfers(stack, keys)) == want[-1:]
        linker.lookup_groups(1)
        assert linker.lookup("m", _lookup_transfers(stack, keys)) == want
        assert linker.lookup("m", _lookup_transfers(stack, keys[:3])) == (
            [3] if swa_pages is None else []
        )
        for s in states:
            s.zero_()
        for rid, mamba_keys in (("other", keys[2:3]), ("none", None)):
            xfers = [_transfer(PoolName.KV, keys, list(range(40, 46)))]
            if swa_pages is not None:
                xfers.append(_transfer(PoolName.SWA, keys[-2:], [50, 51]))
            if mamba_keys is not None:
                xfers.append(_transfer(PoolName.MAMBA, mamba_keys, [6]))
            prep = linker.prepare_request(LinkerRequestContext(rid), xfers)
            wait_until(lambda h=prep: linker.preparation_ready(h), what="prepared")
            assert linker.load(rid, xfers) is True
            index = linker.start_layer_wise_loading()
            assert linker.finish_layer_wise_loading(index) is False
            assert all(not s[:, 6].any() for s in states)
            linker.release_request(rid)
        xfers = [
            _transfer(PoolName.KV, keys, list(range(40, 46))),
            *(
                [_transfer(PoolName.SWA, keys[-2:], [50, 51])]
                if swa_pages is not None
                else []
            ),
            _transfer(PoolName.MAMBA, keys[-1:], [7]),
        ]
        assert linker.load("m", xfers) is True
        assert linker.finish_layer_wise_loading(linker.start_layer_wise_loading())
        for want_rows, s in zip(want_state, states, strict=True):
            assert torch.equal(s[:, 7].view(torch.uint8), want_rows)
        assert linker.claims_held() == 0
    finally:
        linker.close()


# ---- refusals ------------------------------------------------------------------------


def _mha_mamba(_: pytest.MonkeyPatch) -> tuple[Any, dict[str, Any]]:
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    kvcr_families.publish_server_args(1)
    r2t = kvcr_families.mamba_request_pool([1], 64)
    kvcache = HybridLinearKVPool(
        size=64,
        dtype=torch.bfloat16,
        page_size=1,
        head_num=2,
        head_dim=8,
        full_attention_layer_ids=[0],
        device="cpu",
        enable_memory_saver=False,
        mamba_pool=r2t.mamba_pool,
    )
    comps = {ComponentType.FULL, ComponentType.MAMBA}
    return kvcache, {"components": comps, "req_to_token_pool": r2t, "page": 1}


def _bare(cls_path: str) -> Any:
    def build(_: pytest.MonkeyPatch) -> tuple[Any, dict[str, Any]]:
        import importlib

        module, _, name = cls_path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        return cls.__new__(cls), {}  # only its type is inspected before refusing

    return build


def _dsv4_per_request(_: pytest.MonkeyPatch) -> tuple[Any, dict[str, Any]]:
    pool = kvcr_dsv4.per_request_pool("request_window")
    return pool, {"components": {ComponentType.FULL, ComponentType.SWA}}


def _scaled(_: pytest.MonkeyPatch) -> tuple[Any, dict[str, Any]]:
    pool = kvcr_families.mha_pool(64, 4, 2)
    pool.k_scale_buffer = [torch.zeros(1)]
    return pool, {}


def _hnd(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, dict[str, Any]]:
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    return kvcr_families.mha_pool(64, 4, 2), {}


REFUSED = {
    "FULL(MHA)+MAMBA": (_mha_mamba, "--unified-cache-external-linker-backend"),
    "DeepSeek V4 per-request SWA": (
        _dsv4_per_request,
        "--unified-cache-external-linker-backend",
    ),
    "MiniMax sparse": (
        _bare("sglang.srt.mem_cache.memory_pool.MiniMaxSparseKVPool"),
        "--unified-cache-external-linker-backend",
    ),
    "scaled KV": (_scaled, "--kv-cache-dtype"),
    "page-major/HND": (_hnd, "SGLANG_USE_HND_KVCACHE"),
}


def test_every_refused_family_has_a_refusal_case():
    assert set(REFUSED) == {f for f, s in FAMILIES.items() if not s.served}


@pytest.mark.parametrize("family", list(REFUSED), ids=list(REFUSED))
def test_refused_families_fail_at_startup_naming_family_and_flag(
    family: str, monkeypatch: pytest.MonkeyPatch
):
    build, flag = REFUSED[family]
    kvcache, extra = build(monkeypatch)
    page = extra.pop("page", 4)
    components = extra.pop("components", {ComponentType.FULL})
    with pytest.raises(KVCRLayoutError) as info:
        kvcr_stack.bare_linker(
            kvcache,
            page,
            {"local_dram_bytes_per_worker": 1 << 20},
            components=components,
            **extra,
        )
    message = str(info.value)
    assert family in message and flag in message, message


def test_sglang_group_refusals_name_the_family_and_the_flag(plugin_hooks: None):
    """A DSA model with a sidecar draft: SGLang's group builder refuses it, and the
    start-up error says which family and which flag."""
    kvcr_families.publish_server_args(64)
    parts = kvcr_families.family_parts("DSA", 64)
    with pytest.raises(KVCRLayoutError) as info:
        kvcr_stack.bare_linker(
            parts["kvcache"],
            64,
            {"local_dram_bytes_per_worker": 1 << 20},
            draft="org/draft",
            sidecar_draft_device_pools=(kvcr_families.mha_pool(512, 64, 1),),
            mtp_draft_device_pools=(),
            req_to_token_pool=parts["r2t"],
        )
    message = str(info.value)
    assert message.startswith("DSA model:") and "draft KV" in message
    assert "--unified-cache-external-linker-backend" in message


# ---- the docs table is the code's list ----------------------------------------------


def test_the_docs_model_families_table_matches_the_code():
    text = DOCS.read_text()
    section = text.split("## Model families", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in ("served", "refused"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    assert set(rows) == set(FAMILIES)
    for family, spec in FAMILIES.items():
        status, why = rows[family]
        assert status == ("served" if spec.served else "refused"), family
        assert re.sub(r"\s+", " ", why) == spec.why, family
