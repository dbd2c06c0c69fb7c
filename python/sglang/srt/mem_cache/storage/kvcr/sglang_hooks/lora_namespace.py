"""Keep a LoRA request's radix namespace apart from a base request's.

SGLang joins a request's ``extra_key`` and its adapter's ``lora_id`` into one string
(``(extra_key or "") + lora_id``, and ``lora_id`` is a deterministic uuid5), so a
base-model request sent with ``extra_key=<lora_id>`` lands in that adapter's
namespace: the same tree nodes, the same storage page hashes and so the same KVCR
keys, which persist and reach peers. While a preparing (KVCR) linker serves, every
LoRA request's ``extra_key`` becomes a :class:`LoraExtraKey` before SGLang keys
anything by it: the same text, so every hash SGLang computes over that text (its KV
events, and so what a router matches) is unchanged, but equal only to a key of the
same adapter, so the tree keeps the namespaces apart; and its storage chain is
seeded by :func:`storage_seed`, a digest over the joined key, the ``lora_id`` and
the ``cache_salt`` as separate length-prefixed parts (the request's own
``extra_key`` is the joined key less the ``lora_id``), so its pages get KVCR keys no
base request can produce. Base and plain requests keep SGLang's seed and hashes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    preparing_linker_of,
)

SEED_TAG = b"sglang-kvcr-lora-namespace-v1"


class LoraExtraKey(str):
    """SGLang's joined ``extra_key`` text, tagged with the adapter it was joined
    with: equal (and hashed) only with the same text and the same ``lora_id``."""

    lora_id: str

    def __new__(cls, text: str, lora_id: str) -> LoraExtraKey:
        key = super().__new__(cls, text)
        key.lora_id = lora_id
        return key

    def __getnewargs__(self) -> tuple[str, str]:  # type: ignore[override]
        return (str(self), self.lora_id)

    def __eq__(self, other: object) -> bool:
        # A plain str on the left defers to this subclass method (Python's rule
        # for a right operand whose type subclasses the left's).
        if isinstance(other, LoraExtraKey):
            return str.__eq__(self, other) and self.lora_id == other.lora_id
        return False if isinstance(other, str) else NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash((SEED_TAG, str(self), self.lora_id))

    def __repr__(self) -> str:
        return f"LoraExtraKey({str(self)!r}, lora_id={self.lora_id!r})"


def storage_seed(extra_key: LoraExtraKey, cache_salt: str | None) -> str:
    """The storage chain seed of a LoRA request: SHA-256 under its own tag over
    the joined key, the ``lora_id`` and the salt, each with a presence byte and
    its UTF-8 length, so no two (key, adapter, salt) triples share a seed."""
    digest = hashlib.sha256(SEED_TAG)
    for part in (str(extra_key), extra_key.lora_id, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def separate(req: Any) -> None:
    """Tag ``req``'s joined ``extra_key`` with its ``lora_id`` (LoRA requests only)."""
    lora_id = getattr(req, "lora_id", None)
    extra_key = getattr(req, "extra_key", None)
    if lora_id is None or extra_key is None or isinstance(extra_key, LoraExtraKey):
        return
    req.extra_key = LoraExtraKey(extra_key, str(lora_id))


def around_record_lora_name(
    original: Callable[..., Any], scheduler: Any, req: Any, *args: Any, **kw: Any
) -> Any:
    """SGLang names a request's LoRA namespace by its final ``extra_key`` here
    (after any elastic-EP suffix), before the request reaches the tree: tag it
    first, when the cache's linker is a preparing (KVCR) one."""
    if preparing_linker_of(getattr(scheduler, "tree_cache", None)) is not None:
        separate(req)
    return original(scheduler, req, *args, **kw)


def around_storage_seed(original: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """SGLang's ``storage_namespace_seed(extra_key, cache_salt)``, but
    :func:`storage_seed` for a tagged LoRA key."""
    named = dict(zip(("extra_key", "cache_salt"), args, strict=False), **kw)
    extra_key = named.get("extra_key")
    if isinstance(extra_key, LoraExtraKey):
        return storage_seed(extra_key, named.get("cache_salt"))
    return original(*args, **kw)
