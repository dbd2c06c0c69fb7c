"""The block hashes a worker publishes in its KV events, for a request's pages.

A KV-aware router learns page hashes from the ``BlockStored`` events workers
publish, and names them in a ``kv.fetch`` hint. For a plain request those are the
page storage hashes the linker keys pages by; for a request with ``cache_salt``,
``extra_key`` or a LoRA adapter SGLang publishes other values: a token chain seeded
by the salt only (``compute_node_event_hash_values``), then namespaced by a seed
over ``extra_key`` and ``cache_salt`` (``namespaced_block_hash``), which of the two
depending on the publisher's format (dynamo or not) and on whether ``extra_key``
names a LoRA adapter. ``published_aliases`` returns, per page of a request's tail,
every value a worker in any of those formats publishes for it, as unsigned 64-bit
ints. Matching a hint against all of them is safe: a hint only says which pages to
try, and what is fetched is always this request's own namespaced storage keys, which
a peer holds only if it computed them in the same namespace.
"""

from __future__ import annotations

import hashlib
from typing import Any

_U64 = (1 << 64) - 1


def published_aliases(
    key: Any, tail_start: int, tail_pages: int, page_size: int
) -> tuple[frozenset[int], ...]:
    """Per tail page, the unsigned hashes workers publish for it in KV events.

    ``key`` is the request's radix key (the view the tree hashes: bigram for
    EAGLE), ``tail_start`` the token offset of the tail's first page. Empty when
    the request has no namespace: then the published hash is the storage hash.
    """
    from sglang.srt.disaggregation.kv_events import (
        kv_event_namespace_seed,
        namespaced_block_hash,
    )
    from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

    extra_key = getattr(key, "extra_key", None)
    cache_salt = getattr(key, "cache_salt", None)
    if (extra_key is None and cache_salt is None) or tail_pages <= 0:
        return ()
    end = tail_start + tail_pages * page_size
    if tail_start % page_size or end > len(key):
        raise ValueError(
            f"tail [{tail_start}, {end}) is not whole pages of a {len(key)}-token key"
        )
    # The legacy event chain: tokens from the sequence head, seeded by the salt.
    prior = (
        None
        if cache_salt is None
        else hashlib.sha256(
            b"sglang-cache-salt-v1\0" + cache_salt.encode("utf-8")
        ).hexdigest()
    )
    chain = get_hash_str(key[:end], prior, page_size=page_size)
    assert isinstance(chain, list)
    # Seeds: the dynamo format's (extra_key, salt); the default format's
    # (extra_key, none) for a LoRA adapter; and no seed for anything else.
    seeds = {
        None,
        kv_event_namespace_seed(extra_key=extra_key, cache_salt=None),
        kv_event_namespace_seed(extra_key=extra_key, cache_salt=cache_salt),
    }
    first = tail_start // page_size
    return tuple(
        frozenset(
            namespaced_block_hash(hash_str_to_int64(page), namespace_seed=seed) & _U64
            for seed in seeds
        )
        for page in chain[first : first + tail_pages]
    )
