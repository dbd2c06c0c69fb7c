"""The residency mirror, driven by plain ``InventoryChange`` values (no NIXL).

A real ``PageLayout`` over a real CPU pool (with a sidecar draft pool, so a page
has two objects): added keys make a page whole only when every pool holds it; an
eviction in any pool removes the page and reports its hash once; foreign keys are
ignored; a flush under new weights starts empty and parses only the new keys.
"""

from __future__ import annotations

from cpu_harness.kvcr_pages import PAGE, make_pool
from sglang.srt.mem_cache.storage.kvcr.layout import page_layout, pool_layout
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import InventoryChange
from sglang.srt.mem_cache.storage.kvcr.requests.residency import Residency


def _layout(checkpoint: str = "a") -> page_layout.PageLayout:
    identity = pool_layout.ModelIdentity(checkpoint, "", "d", tp_rank=0, tp_size=1)
    return page_layout.PageLayout.from_kv_pool(
        make_pool("cpu"), PAGE, identity=identity, draft_pool=make_pool("cpu")
    )


def test_a_page_is_whole_only_in_every_pool_and_evictions_report_it_once():
    layout = _layout()
    pools = layout.pools
    assert len(pools) == 2  # kv and draft
    res = Residency(layout)
    keys = {(h, p.name): layout.block_key(h, p.name) for h in "ab" for p in pools}
    res.on_inventory(InventoryChange((keys["a", pools[0].name],), removed=False))
    assert not res.holds("a", pools) and res.holds("a", pools[:1])
    assert res.on_inventory(InventoryChange(tuple(keys.values()), removed=False)) == 0
    assert res.holds("a", pools) and res.holds("b", pools) and len(res) == 4
    # The draft object of "a" and a foreign key are evicted together.
    change = InventoryChange((keys["a", pools[1].name], b"not-ours"), removed=True)
    assert res.on_inventory(change) == 1
    assert not res.holds("a", pools) and res.holds("b", pools)
    assert res.take_removed() == ["a"] and res.take_removed() == []
    assert res.parse_key(b"not-ours") is None
    assert res.parse_key(keys["b", pools[1].name]) == ("b", pools[1].name)


def test_a_flush_under_new_weights_starts_empty_and_knows_only_new_keys():
    old, new = _layout("a"), _layout("b")
    res = Residency(old)
    key = old.block_key("a", old.pools[0].name)
    res.on_inventory(InventoryChange((key,), removed=False))
    res.on_inventory(InventoryChange((old.block_key("z", old.pools[0].name),), True))
    res.reset(new)
    assert len(res) == 0 and res.take_removed() == []
    assert res.parse_key(key) is None  # an old-weights key is foreign now
    assert res.parse_key(new.block_key("a", new.pools[0].name)) is not None
