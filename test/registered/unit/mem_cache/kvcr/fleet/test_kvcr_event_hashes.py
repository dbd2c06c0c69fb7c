"""Hints a router builds from published KV events match the request's pages.

The oracle is SGLang's own ``KVCacheEventRecorder``: it publishes ``BlockStored``
for a two-node radix path, in the default and the dynamo format, for plain,
salted, ``extra_key`` and LoRA requests; every hash it publishes for the tail
pages must be one ``published_aliases`` accepts for the same page, and no hash of
another salt may be.
"""

from __future__ import annotations

import random
from array import array
from types import SimpleNamespace

import pytest
from sglang.srt.disaggregation.kv_events import BlockStored
from sglang.srt.mem_cache.events import KVCacheEventRecorder, KvEventLoraNames
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str

from sglang.srt.mem_cache.storage.kvcr.fleet.event_hashes import published_aliases
from sglang.srt.mem_cache.storage.kvcr.fleet.router_hint import FetchHint
from sglang.srt.mem_cache.storage.kvcr.fleet.router_hint import (
    hinted_pages as _hinted_pages,
)
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import page_hash_to_u64

PAGE = 4
HEAD_PAGES, TAIL_PAGES = 2, 3
LORA_ID = "0123456789abcdef0123456789abcdef"  # Req appends the adapter id

KINDS = {
    "salted": {"cache_salt": "tenant-a"},
    "extra_key": {"extra_key": "conversation-7"},
    "salted_extra_key": {"extra_key": "conversation-7", "cache_salt": "tenant-a"},
    "lora": {"extra_key": "x" + LORA_ID, "lora": True},
    "salted_lora": {"extra_key": LORA_ID, "cache_salt": "tenant-b", "lora": True},
}


def _key(tokens: list[int], extra_key=None, cache_salt=None) -> RadixKey:
    return RadixKey(array("q", tokens), extra_key, cache_salt=cache_salt)


def _published(tokens, *, dynamo, extra_key=None, cache_salt=None, lora=False):
    """The unsigned hashes SGLang publishes for the tail node's pages."""
    names = KvEventLoraNames()
    if lora:
        names.register(SimpleNamespace(extra_key=extra_key, lora_id=LORA_ID), "ad")
    recorder = KVCacheEventRecorder(
        enabled=True, page_size=PAGE, dynamo_format=dynamo, lora_names=names
    )
    root = SimpleNamespace(key=_key([]), parent=None, hash_value=[])
    root.event_hash_value = None
    split = HEAD_PAGES * PAGE
    head = SimpleNamespace(
        key=_key(tokens[:split], extra_key, cache_salt),
        parent=root,
        hash_value=None,
        event_hash_value=None,
    )
    tail = SimpleNamespace(
        key=_key(tokens[split:], extra_key, cache_salt),
        parent=head,
        hash_value=None,
        event_hash_value=None,
    )
    recorder.record_store(head)
    recorder.take()
    recorder.record_store(tail)
    hashes = [
        h for e in recorder.take() if isinstance(e, BlockStored) for h in e.block_hashes
    ]
    assert len(hashes) == TAIL_PAGES
    return [h & ((1 << 64) - 1) for h in hashes]


def _tokens(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range((HEAD_PAGES + TAIL_PAGES) * PAGE)]


@pytest.mark.parametrize("dynamo", [False, True], ids=["default", "dynamo"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_published_tail_hash_is_accepted_for_its_own_page(kind, dynamo):
    spec = dict(KINDS[kind])
    lora = spec.pop("lora", False)
    tokens = _tokens(1)
    published = _published(tokens, dynamo=dynamo, lora=lora, **spec)
    key = _key(tokens, spec.get("extra_key"), spec.get("cache_salt"))
    aliases = published_aliases(key, HEAD_PAGES * PAGE, TAIL_PAGES, PAGE)
    assert len(aliases) == TAIL_PAGES
    for i, value in enumerate(published):
        assert value in aliases[i], (kind, dynamo, i)
        # A page's alias never names another page of the request.
        assert all(value not in aliases[j] for j in range(TAIL_PAGES) if j != i)


def test_a_plain_request_publishes_its_storage_hashes():
    tokens = _tokens(2)
    published = _published(tokens, dynamo=True)
    storage = get_storage_hash_str(_key(tokens), None, page_size=PAGE)
    assert published == [page_hash_to_u64(h) for h in storage[HEAD_PAGES:]]
    assert published_aliases(_key(tokens), HEAD_PAGES * PAGE, TAIL_PAGES, PAGE) == ()


@pytest.mark.parametrize("dynamo", [False, True], ids=["default", "dynamo"])
def test_hashes_published_for_one_salt_name_nothing_for_another(dynamo):
    tokens = _tokens(3)
    published = _published(tokens, dynamo=dynamo, cache_salt="tenant-a")
    other = _key(tokens, cache_salt="tenant-b")
    storage = get_storage_hash_str(other, None, page_size=PAGE)[HEAD_PAGES:]
    aliases = published_aliases(other, HEAD_PAGES * PAGE, TAIL_PAGES, PAGE)
    hint = FetchHint("tcp://127.0.0.1:1", tuple(published))
    assert _hinted_pages(hint, list(storage), aliases) == frozenset()
    own = _key(tokens, cache_salt="tenant-a")
    own_storage = get_storage_hash_str(own, None, page_size=PAGE)[HEAD_PAGES:]
    own_aliases = published_aliases(own, HEAD_PAGES * PAGE, TAIL_PAGES, PAGE)
    assert _hinted_pages(hint, list(own_storage), own_aliases) == set(own_storage)


def test_a_tail_that_is_not_whole_pages_is_refused():
    key = _key(_tokens(4), cache_salt="s")
    with pytest.raises(ValueError, match="whole pages"):
        published_aliases(key, PAGE + 1, 1, PAGE)
    with pytest.raises(ValueError, match="whole pages"):
        published_aliases(key, HEAD_PAGES * PAGE, TAIL_PAGES + 1, PAGE)
