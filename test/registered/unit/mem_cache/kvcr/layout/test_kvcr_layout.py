"""kvcr_layout: real SGLang CPU KV pools described as KVCR multi-part blocks."""

from __future__ import annotations

import hashlib
import itertools
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    PageMajorMHATokenToKVPool,
)
from sglang.srt.mem_cache.utils import hash_str_to_int64

from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRConfigError
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import (
    KEY_TAG,
    NO_MATCH_HASH,
    KeyAdapter,
    PageLayout,
    plan_capacity,
)
from sglang.srt.mem_cache.storage.kvcr.layout.pool_layout import (
    KVCRLayoutError,
    ModelIdentity,
    PoolLayout,
    Span,
    block_part_rows,
)

IDENTITY = ModelIdentity("org/model", "rev-a", "", 0, 2)
DRAFT_IDENTITY = ModelIdentity("org/model", "rev-a", "org/draft", 0, 2)
AGENT = "kvcr-layout-test"


def mha(
    size: int = 64,
    page_size: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    head_num: int = 2,
    head_dim: int = 8,
    layers: int = 3,
    v_head_dim: int | None = None,
) -> MHATokenToKVPool:
    return MHATokenToKVPool(
        size,
        page_size,
        dtype,
        head_num,
        head_dim,
        layers,
        device="cpu",
        enable_memory_saver=False,
        v_head_dim=v_head_dim,
    )


def mla(size: int = 64, page_size: int = 4, layers: int = 2) -> MLATokenToKVPool:
    return MLATokenToKVPool(
        size,
        page_size,
        torch.bfloat16,
        16,
        8,
        layers,
        device="cpu",
        enable_memory_saver=False,
    )


def layout_of(pool: Any, page_size: int = 4, **kw: Any) -> PageLayout:
    kw.setdefault("identity", IDENTITY)
    return PageLayout.from_kv_pool(pool, page_size, **kw)


def page_hash(i: int) -> str:
    return hashlib.sha256(f"page-{i}".encode()).hexdigest()


def buffers(pool: Any) -> list[torch.Tensor]:
    if hasattr(pool, "k_buffer"):
        return [*pool.k_buffer, *pool.v_buffer]
    return list(pool.kv_buffer)


# --- geometry ---------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4], ids=["page1", "page4"])
def test_span_addresses_are_the_real_buffer_pages_of_every_layer(page_size: int):
    """Span page i of k_l / v_l is exactly k_buffer[l][i*page_size]."""
    pool = mha(page_size=page_size)
    kv = layout_of(pool, page_size).pool("kv")
    last = kv.num_pages - 1
    for layer in range(3):
        k_span, v_span = (kv.spans[i] for i in kv.layer_part_indices(layer))
        assert (k_span.label, v_span.label) == (f"kv:k{layer}", f"kv:v{layer}")
        for page in (0, 1, 5, last):
            row = page * page_size
            assert k_span.page_addr(page) == pool.k_buffer[layer][row].data_ptr()
            assert v_span.page_addr(page) == pool.v_buffer[layer][row].data_ptr()
    assert last == (64 + page_size) // page_size - 1


@pytest.mark.parametrize(
    ("dtype", "itemsize"),
    [(torch.bfloat16, 2), (torch.float32, 4), (torch.float8_e4m3fn, 1)],
    ids=["bf16", "fp32", "fp8-stored-as-uint8"],
)
def test_page_bytes_is_page_size_times_heads_times_head_dim_times_itemsize(
    dtype: torch.dtype, itemsize: int
):
    """A page of one span holds page_size rows of head_num*head_dim elements."""
    layout = layout_of(mha(dtype=dtype, head_num=2, head_dim=8))
    assert [p.page_bytes for p in layout.pools] == [4 * 2 * 8 * itemsize]
    assert all(s.page_stride_bytes == s.page_bytes for s in layout.pools[0].spans)


def test_parts_are_layer_major_with_k_and_v_of_a_layer_adjacent():
    """Part order is k0 v0 k1 v1 ...; layer_part_indices returns adjacent pairs."""
    layout = layout_of(mha(layers=3))
    kv = layout.pool("kv")
    assert kv.part_labels == ["kv:k0", "kv:v0", "kv:k1", "kv:v1", "kv:k2", "kv:v2"]
    assert [kv.layer_part_indices(layer) for layer in range(3)] == [
        [0, 1],
        [2, 3],
        [4, 5],
    ]
    assert kv.layer_part_indices(7) == []
    assert (layout.num_layers, layout.page_size) == (3, 4)


def test_a_block_is_one_slot_holding_every_span_in_span_order():
    """One part per block (``kv:page``), every span's page in it; slot ``s`` is
    rows ``s*n .. s*n+n-1`` of the pool's DRAM viewed as span-sized rows."""
    kv = layout_of(mha(layers=2)).pool("kv")
    assert kv.block_label == "kv:page"
    assert kv.block_bytes == len(kv.spans) * kv.page_bytes == 4 * kv.page_bytes
    assert block_part_rows(3, len(kv.spans)) == (12, 13, 14, 15)
    assert block_part_rows(0, 1) == (0,)


def test_mla_pool_is_one_span_per_layer_of_the_latent_row():
    """MLA: parts kv0..kvL-1, page = page_size*(kv_lora_rank+rope)*itemsize."""
    pool = mla(layers=2)
    kv = layout_of(pool).pool("kv")
    assert kv.part_labels == ["kv:kv0", "kv:kv1"]
    assert kv.page_bytes == 4 * (16 + 8) * 2
    assert kv.spans[1].page_addr(2) == pool.kv_buffer[1][8].data_ptr()


def test_k_and_v_of_different_sizes_become_separate_kvcr_pools():
    """v_head_dim != head_dim splits the pool into kv (K parts) and kv_1 (V parts)."""
    layout = layout_of(mha(head_dim=8, v_head_dim=4, layers=2))
    assert layout.kvcr_pool_layouts() == [
        ("kv", 2 * (4 * 2 * 8 * 2)),  # a block: both layers' K pages
        ("kv_1", 2 * (4 * 2 * 4 * 2)),
    ]
    assert layout.pool("kv").part_labels == ["kv:k0", "kv:k1"]
    assert layout.pool("kv_1").part_labels == ["kv_1:v0", "kv_1:v1"]
    assert {p.source for p in layout.pools} == {"kv"}


def test_a_sidecar_draft_pool_is_its_own_kvcr_pool_and_needs_a_draft_identity():
    """The draft pool is KVCR pool 'draft'; its layers ride transfer layers 0.."""
    layout = layout_of(mla(layers=2), identity=DRAFT_IDENTITY, draft_pool=mha(layers=1))
    assert layout.pool_names == ["kv", "draft"]
    assert layout.pool("draft").part_labels == ["draft:k0", "draft:v0"]
    assert layout.num_layers == 2
    with pytest.raises(KVCRLayoutError, match=r"ModelIdentity\.draft"):
        layout_of(mla(), draft_pool=mha(layers=1))


def test_spans_that_overlap_or_differ_in_size_are_refused():
    span = Span(
        "kv:k0", 4096, page_stride_bytes=512, page_bytes=256, num_pages=8, layer=0
    )
    assert PoolLayout("kv", "kv", (span,)).block_bytes == 256
    with pytest.raises(KVCRLayoutError, match="non-overlapping"):
        PoolLayout("kv", "kv", (Span("kv:k0", 0, 128, 256, 8, 0),))
    with pytest.raises(KVCRLayoutError, match="equal-sized"):
        PoolLayout("kv", "kv", (span, Span("kv:v0", 0, 128, 128, 8, 0)))


# --- compatibility digest ---------------------------------------------------


def test_digest_ignores_addresses_page_counts_and_runtime_identity():
    """Same geometry at other addresses and with more pages gives the same digest."""
    a, b = mha(size=64), mha(size=128)
    la, lb = layout_of(a), layout_of(b)
    assert la.pools[0].spans[0].base_ptr != lb.pools[0].spans[0].base_ptr
    assert la.pools[0].num_pages != lb.pools[0].num_pages
    assert la.compatibility_digest == lb.compatibility_digest
    assert len(la.compatibility_digest) == 16
    assert int(la.compatibility_digest, 16) >= 0


CHANGES: dict[str, Callable[[], PageLayout]] = {
    "dtype": lambda: layout_of(mha(dtype=torch.float32)),
    "page_size": lambda: layout_of(mha(page_size=8), 8),
    "head_dim": lambda: layout_of(mha(head_dim=16)),
    "head_layout_same_bytes": lambda: layout_of(mha(head_num=4, head_dim=4)),
    "checkpoint": lambda: layout_of(
        mha(), identity=ModelIdentity("o/m2", "rev-a", "", 0, 2)
    ),
    "revision": lambda: layout_of(
        mha(), identity=ModelIdentity("org/model", "rev-b", "", 0, 2)
    ),
    "draft": lambda: layout_of(mha(), identity=DRAFT_IDENTITY),
    "tp_rank": lambda: layout_of(
        mha(), identity=ModelIdentity("org/model", "rev-a", "", 1, 2)
    ),
    "tp_size": lambda: layout_of(
        mha(), identity=ModelIdentity("org/model", "rev-a", "", 0, 4)
    ),
    "layers": lambda: layout_of(mha(layers=2)),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_digest_changes_with_each_compatibility_input(change: str):
    """Changing any byte-relevant input (or the MHA shard) changes the digest."""
    assert (
        CHANGES[change]().compatibility_digest != layout_of(mha()).compatibility_digest
    )


def test_mla_digest_is_replicated_across_tp_ranks():
    """MLA KV is the same on every attention rank, so the TP rank is not hashed."""
    other_rank = ModelIdentity("org/model", "rev-a", "", 1, 2)
    assert layout_of(mla()).compatibility_digest == (
        layout_of(mla(), identity=other_rank).compatibility_digest
    )


# --- keys -------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["kv", "kv_1"], ids=["kv", "kv_1"])
def test_make_key_round_trips_through_parse_key(pool: str):
    """make_key embeds tag, digest and pool; parse_key gives them back."""
    layout = layout_of(mha(v_head_dim=4))
    key = layout.make_key(page_hash(1), pool)
    assert key == f"{page_hash(1)}#{KEY_TAG}#{layout.compatibility_digest}#{pool}"
    assert layout.parse_key(key) == (page_hash(1), layout.compatibility_digest, pool)
    assert layout.block_key(page_hash(1), pool) == key.encode()


@pytest.mark.parametrize(
    "key",
    [
        f"{'a' * 64}#{KEY_TAG}#0123456789abcdef#kv",
        f"{'a' * 64}#kvcr-linker-v0#{{digest}}#kv",
        f"{'a' * 64}#{KEY_TAG}#{{digest}}#draft",
        f"#{KEY_TAG}#{{digest}}#kv",
        "a" * 64,
        f"{'a' * 64}#{KEY_TAG}#{{digest}}#kv#extra",
    ],
    ids=["foreign-digest", "other-tag", "unknown-pool", "empty-hash", "bare", "extra"],
)
def test_parse_key_rejects_foreign_and_malformed_keys(key: str):
    """Only keys of this very layout parse; the rest raise KVCRLayoutError."""
    layout = layout_of(mha())
    with pytest.raises(KVCRLayoutError):
        layout.parse_key(key.format(digest=layout.compatibility_digest))


def test_parse_block_key_matches_parse_key_and_refuses_foreign_keys():
    """The remembered keys parse as parse_key does; foreign ones give None."""
    layout = layout_of(mha(v_head_dim=4))
    for i, pool in itertools.product(range(3), ("kv", "kv_1")):
        key = layout.block_key(page_hash(i), pool)
        assert layout.parse_block_key(key) == (page_hash(i), pool)
        fresh = layout_of(mha(v_head_dim=4))  # nothing remembered: parsed
        assert fresh.parse_block_key(key) == (page_hash(i), pool)
    other = layout_of(mha())
    assert other.parse_block_key(layout.block_key(page_hash(0), "kv")) is None
    assert layout.parse_block_key(b"\xff#not-a-key") is None


def test_the_key_memo_is_bounded_and_keys_stay_right_past_it(monkeypatch):
    """A worker keys millions of pages over its life: the memo starts over at
    KEY_MEMO entries, and keys made after that are still the right ones."""
    from sglang.srt.mem_cache.storage.kvcr.layout import page_layout

    monkeypatch.setattr(page_layout, "KEY_MEMO", 8)
    layout = layout_of(mha())
    for i in range(40):
        key = layout.block_key(page_hash(i), "kv")
        assert key == layout.make_key(page_hash(i), "kv").encode()
        assert layout.parse_block_key(key) == (page_hash(i), "kv")
        assert len(layout.key_memo) <= 8 and len(layout.parsed_memo) <= 8


def test_make_key_refuses_unknown_pools_and_hashes_with_separators():
    """A key must be parseable again, so '#' in a hash or a foreign pool is refused."""
    layout = layout_of(mha())
    for bad_hash, pool in (("ab#cd", "kv"), ("", "kv"), ("abcd", "draft")):
        with pytest.raises(KVCRLayoutError, match="cannot key"):
            layout.make_key(bad_hash, pool)


@pytest.mark.parametrize(
    "h",
    [page_hash(1), page_hash(2), "f" * 64, "0" * 64],
    ids=["h1", "h2", "max", "zero"],
)
def test_key_adapter_decode_is_the_unsigned_router_hash_of_the_page(h: str):
    """decode(key) == hash_str_to_int64(page_hash) as unsigned 64-bit, any pool."""
    layout = layout_of(mha(v_head_dim=4))
    adapter = KeyAdapter(layout)
    want = hash_str_to_int64(h) & (2**64 - 1)
    for pool in layout.pool_names:
        key = adapter.encode(layout.make_key(h, pool))
        assert adapter.decode(key) == want
        assert 0 <= want < 2**64


@pytest.mark.parametrize(
    "key",
    [
        b"",
        b"\xff\xfe\x00",
        b"zz#kvcr-linker-v1#{d}#kv",
        b"a#kvcr-linker-v1#0000#kv",
        None,
        7,
    ],
    ids=["empty", "not-utf8", "non-hex-hash", "foreign-digest", "none", "int"],
)
def test_key_adapter_decode_never_raises_and_never_matches_garbage(key: Any):
    """Garbage decodes to NO_MATCH_HASH (-1), outside the router's [0, 2**64)."""
    layout = layout_of(mha())
    if isinstance(key, bytes):
        key = key.replace(b"{d}", layout.compatibility_digest.encode())
    assert KeyAdapter(layout).decode(key) == NO_MATCH_HASH == -1


def test_key_adapter_encode_accepts_only_this_layouts_keys():
    """encode checks the key first, so a foreign digest never reaches KVCR."""
    layout, other = layout_of(mha()), layout_of(mha(dtype=torch.float32))
    adapter = KeyAdapter(layout)
    assert adapter.encode(layout.make_key("ab", "kv")) == layout.block_key("ab", "kv")
    for bad in (other.make_key("ab", "kv"), b"ab", 3):
        with pytest.raises(KVCRLayoutError):
            adapter.encode(bad)


# --- capacity ---------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2, 3], ids=["1rank", "2ranks", "3ranks"])
def test_capacity_gives_every_pool_the_same_page_count_within_a_rank_share(ranks: int):
    """slot_count = pages per pool (one slot a page); bytes fit budget//ranks;
    tail reported."""
    layout = layout_of(
        mha(head_dim=8, v_head_dim=4, layers=2),
        identity=DRAFT_IDENTITY,
        draft_pool=mha(head_num=1, head_dim=16, layers=1),
    )
    per_page = sum(len(p.spans) * p.page_bytes for p in layout.pools)
    budget = 10 * per_page * ranks + per_page - 1
    plan = plan_capacity(layout, budget, ranks)
    assert plan.pages == 10 and plan.budget_bytes == budget // ranks
    assert [c.name for c in plan.pools] == layout.pool_names
    for cap, pool in zip(plan.pools, layout.pools, strict=True):
        assert cap.slot_count == plan.pages
        assert cap.block_size == pool.block_bytes == len(pool.spans) * pool.page_bytes
        assert cap.bytes == cap.slot_count * cap.block_size
    used = sum(c.bytes for c in plan.pools)
    assert used + plan.unused_bytes == budget // ranks
    assert 0 <= plan.unused_bytes < per_page


def test_capacity_refuses_a_budget_below_one_page_and_names_the_minimum():
    """The error names local_dram_bytes_per_worker and the bytes one page needs."""
    layout = layout_of(mha(layers=2))
    per_page = 4 * layout.pools[0].page_bytes
    with pytest.raises(KVCRConfigError) as info:
        plan_capacity(layout, per_page * 2 - 1, 2)
    message = str(info.value)
    assert "local_dram_bytes_per_worker" in message
    assert f"at least {per_page * 2}" in message


def test_local_dram_regions_follow_the_pool_layout_order():
    """One (name, ptr, nbytes) per KVCR pool, same order as kvcr_pool_layouts."""
    layout = layout_of(mha(v_head_dim=4))
    plan = plan_capacity(layout, 1 << 20, 1)
    storage = [torch.zeros(c.bytes, dtype=torch.uint8) for c in plan.pools]
    regions = layout.local_dram_regions(storage)
    assert [r[0] for r in regions] == [n for n, _ in layout.kvcr_pool_layouts()]
    assert [(r[1], r[2]) for r in regions] == [
        (t.data_ptr(), t.numel()) for t in storage
    ]
    with pytest.raises(KVCRLayoutError, match="storage tensors"):
        layout.local_dram_regions(storage[:1])


# --- refusals ---------------------------------------------------------------


def _scaled(attr: str, make: Callable[[], Any]) -> Callable[[pytest.MonkeyPatch], Any]:
    def build(_: pytest.MonkeyPatch) -> Any:
        pool = make()
        setattr(pool, attr, [torch.zeros(1)])
        return pool

    return build


def _hnd(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    return mha()


class _OtherPool:
    page_size = 4


REFUSALS: dict[str, tuple[Callable[[pytest.MonkeyPatch], Any], str, str]] = {
    "mha-k-scales": (_scaled("k_scale_buffer", mha), "MHATokenToKVPool", "scaled"),
    "mha-native-scales": (
        _scaled("native_k_scale_buffer", mha),
        "MHATokenToKVPool",
        "scaled",
    ),
    "mla-scales": (_scaled("kv_scale_buffer", mla), "MLATokenToKVPool", "scaled"),
    "page-major": (
        lambda _: PageMajorMHATokenToKVPool.__new__(PageMajorMHATokenToKVPool),
        "PageMajorMHATokenToKVPool",
        "page-major",
    ),
    "hnd": (_hnd, "MHATokenToKVPool", "'hnd'"),
    "unknown-class": (lambda _: _OtherPool(), "_OtherPool", "cannot be described"),
    "page-size-mismatch": (
        lambda _: mha(page_size=8),
        "MHATokenToKVPool",
        "page_size 8",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
def test_pools_it_cannot_describe_are_refused_naming_the_class(
    case: str, monkeypatch: pytest.MonkeyPatch
):
    """Scaled, page-major, HND and foreign pools fail with what is supported."""
    build, class_name, reason = REFUSALS[case]
    with pytest.raises(KVCRLayoutError) as info:
        layout_of(build(monkeypatch))
    message = str(info.value)
    assert message.startswith(f"{class_name}:") and reason in message
    assert "supports dense MHA/MLA pools" in message


# --- real kvcr --------------------------------------------------------------


def _poll(kv: Any, handle: int, deadline_s: float = 10.0) -> dict[bytes, Any]:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for done, results in kv.poll_completed():
            if done == handle:
                return dict(results)
        time.sleep(0.001)
    raise AssertionError(f"kvcr op {handle} did not complete in {deadline_s}s")


GEOMETRIES: dict[str, Callable[[], Any]] = {
    "mha": lambda: mha(layers=2),
    "mha-split-k-v": lambda: mha(head_dim=8, v_head_dim=4, layers=2),
    "mla": lambda: mla(layers=2),
}


@pytest.mark.kvcr
@pytest.mark.parametrize("geometry", list(GEOMETRIES), ids=list(GEOMETRIES))
def test_real_kvcr_fills_and_claims_whole_pages_byte_exact(
    geometry: str, monkeypatch: pytest.MonkeyPatch
):
    """Pages 1,2 of every pool -> one KVCR slot each (the linker's copier through
    kvcr's own fill path) -> fetched with the block label: each claimed slot
    holds every span's page, in span order, exactly; nothing of the pools is
    registered with KVCR."""
    import kvcr.progress
    from kvcr import KVCR, KVCRBindings
    from kvcr.config import KVCRBackendConfigs, KVCRConfig, LocalDramOptions
    from kvcr.types import OpEntryStatus

    from sglang.srt.mem_cache.storage.kvcr.datapath.device_pages import page_rows
    from sglang.srt.mem_cache.storage.kvcr.datapath.dram_copy import DramCopier
    from sglang.srt.mem_cache.storage.kvcr.device.device_streams import (
        DeviceBinding,
    )
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import EntryStatus
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import page_fills

    original = kvcr.progress.nixl_agent_config
    monkeypatch.setattr(
        kvcr.progress,
        "nixl_agent_config",
        lambda *a, **kw: original(*a, **{**kw, "enable_prog_thread": False}),
    )
    pool = GEOMETRIES[geometry]()
    generator = torch.Generator().manual_seed(0)
    for buf in buffers(pool):
        raw = buf.view(torch.uint8)
        raw.copy_(
            torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator)
        )
    layout = layout_of(pool)
    plan = plan_capacity(layout, 4 * layout.page_total + 100, 1)
    storage = {c.name: torch.zeros(c.bytes, dtype=torch.uint8) for c in plan.pools}
    rows = {
        p.name: [page_rows(t, 4, p.page_bytes) for t in p.tensors] for p in layout.pools
    }
    copier = DramCopier(rows, lambda: storage, DeviceBinding.of(torch.device("cpu")))
    ids = itertools.count(1)
    kv = KVCR(
        KVCRConfig(
            nixl_agent_name=AGENT,
            pool_layouts=layout.kvcr_pool_layouts(),
            operation_timeout_ms=1000,
            abandon_timeout_ms=2000,
            nixl_listen_port=0,
        ),
        KVCRBindings(
            request_pin=lambda keys: next(ids),
            poll_pin_results=lambda: [],
            release_pin=lambda h: True,
            key_adapter=KeyAdapter(layout),
        ),
        KVCRBackendConfigs(
            local_dram=LocalDramOptions(
                pools=layout.local_dram_regions(list(storage.values()))
            ),
        ),
    )
    try:
        page_fills.attach(kv, copier)
        src = [1, 2]
        hashes = [page_hash(p) for p in src]
        blocks = {
            layout.block_key(h, p.name): (p.block_label, page)
            for h, page in zip(hashes, src, strict=True)
            for p in layout.pools
        }
        fill = page_fills.new_fill(kv)
        page_fills.begin(kv, fill, blocks, lambda: None)
        end = time.monotonic() + 10
        while (results := page_fills.poll(kv, fill)) is None:
            assert time.monotonic() < end, "fill never completed"
            time.sleep(0.001)
        assert set(results.values()) == {EntryStatus.SUCCESS}
        assert len(results) == 2 * len(layout.pools)
        handles = []
        for p in layout.pools:
            keys = [layout.block_key(h, p.name) for h in hashes]
            fetched = _poll(kv, kv.fetch(keys, expected_layout=[p.block_label]))
            slots = storage[p.name].view(-1, p.block_bytes)
            for key, page in zip(keys, src, strict=True):
                entry = fetched[key]
                assert entry.status is OpEntryStatus.SUCCESS, (p.name, entry)
                ((ref,),) = [entry.descriptors]
                assert ref.label == p.block_label
                want = torch.cat([r[page] for r in rows[p.name]])
                assert torch.equal(slots[ref.element_index], want)
                handles.append(entry.release_handle)
        assert all(ok for _, ok in kv.release(handles))
    finally:
        kv.close()
        assert copier.close(5)


def test_importing_the_layout_module_does_not_import_kvcr():
    """kvcr (and NIXL) load only when kvcr objects are built, not at import."""
    code = (
        "import sys, sglang.srt.mem_cache.storage.kvcr.layout.page_layout\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('kvcr', 'nixl')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
