"""Optional request-preparation hooks a linker may implement, with no-op defaults.

SGLang 0.5.23's ``UnifiedCacheLinker`` has no way to see a request before its
``lookup``. These hooks add one: the scheduler hands the request's device-uncached
tail to ``prepare_request`` at enqueue (unless ``tail_may_hit`` says its first
page cannot start a hit and no hint came), polls ``preparation_ready`` (MIN-reduced
across the attention group) before admitting it, tells ``note_admission`` what each
gate pass held back or let through, and reports the end of the request
through ``release_request`` (abort) and ``finish_request`` (every release), and
announces weight updates through ``weights_changing``; a fully idle scheduler
pass calls ``scheduler_idle`` (the linker may block there briefly). Linkers
that do not subclass ``PreparationHooks`` are driven exactly as before: the
integration reads every hook with ``getattr`` and these defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class PreparationHandle:
    """One attempt of one request: what ``preparation_ready`` is asked about.
    ``str()`` is the request id KVCR sees (unique per attempt)."""

    rid: str
    attempt_id: int = 0

    def __str__(self) -> str:
        return f"{self.rid}#{self.attempt_id}"


@dataclasses.dataclass(frozen=True, slots=True)
class LinkerRequestContext:
    """What a linker learns about a request when it is enqueued."""

    rid: str
    attempt_id: int = 0
    kv_hints: Any = None  # sglang KvHintsEnvelope, a plain dict, or None
    # Per tail page, the hashes workers publish for it in KV events when they
    # differ from its storage hash (a namespaced request); () otherwise.
    event_hashes: tuple[frozenset[int], ...] = ()

    @property
    def handle(self) -> PreparationHandle:
        """Identity of this attempt; a retried request gets a new one."""
        return PreparationHandle(self.rid, self.attempt_id)


class PreparationHooks:
    """Default (no-op) implementations of the optional linker hooks."""

    prepares_requests: bool = False
    publishes_external_events: bool = False

    def tail_may_hit(self, rid: str, first_page_hash: str) -> bool:
        """Whether preparing ``rid`` (no hint) can find anything when its
        device-uncached tail starts with this page; False skips hashing the
        rest of the tail and ``prepare_request`` at enqueue."""
        return True

    def prepare_request(self, ctx: LinkerRequestContext, transfers: list[Any]) -> Any:
        """Start making the tail ready; returns a handle for ``preparation_ready``."""
        return None

    def preparation_ready(self, handle: Any) -> bool:
        """True when the request may be admitted (done, or past its deadline)."""
        return True

    def note_admission(self, rids: list[str], ready: list[bool]) -> None:
        """One gate pass over the waiting queue: ``ready[i]`` admits ``rids[i]``."""

    def release_request(self, rid: str) -> None:
        """The request was aborted before it ran: drop everything held for it."""

    def finish_request(self, rid: str) -> None:
        """The request released its KV (finish, abort or retract)."""

    def take_removed_page_hashes(self) -> list[str]:
        """Page hashes whose external copy was evicted since the last call."""
        return []

    def scheduler_idle(
        self, sleeps: bool = False, holds_sessions: Callable[[], bool] | None = None
    ) -> None:
        """The scheduler is fully idle (no batch, nothing waiting), before
        SGLang's idle work: the linker may block here briefly, bounded, for its
        own background work. ``sleeps``: the server's idle loop then blocks until a
        request comes or up to 1 s (``--sleep-on-idle``, the Rust server), so a
        later idle pass may be that far off; the same on every rank.
        ``holds_sessions``: asked before the linker freezes the heap, whether
        SGLang holds requests of a session (cyclic garbage later: then nothing
        is frozen); None: it holds none."""

    def lookup_groups(self, groups: int) -> None:
        """How many process groups ``lookup``'s restorable lengths are intersected
        over (SGLang's MIN across the attention group); 0 on a single attention
        rank, where only the longest counts. Told once, when the linker is bound."""

    def batch_result_started(self) -> None:
        """The scheduler starts processing a batch's result (its write-through
        offloads come from inside it)."""

    def batch_done(self) -> None:
        """The scheduler processed a batch's result (its output is out)."""

    def weights_changing(
        self, source: str, model_path: str | None = None, load_format: str | None = None
    ) -> None:
        """The served weights are being replaced (a disk update names its path)."""


class VerdictsPerRequest:
    """``finish_layer_wise_loading`` from ``finish_layer_wise_loading_by_request``
    (the per-request verdicts the integration's ``finish_loads`` hook reads)."""

    def finish_layer_wise_loading_by_request(
        self, counter_index: int
    ) -> dict[str, bool]:
        raise NotImplementedError

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        """The base contract: True only when every load of the batch landed."""
        return all(self.finish_layer_wise_loading_by_request(counter_index).values())


HOOK_NAMES = (
    "prepares_requests",
    "publishes_external_events",
    "tail_may_hit",
    "prepare_request",
    "preparation_ready",
    "note_admission",
    "release_request",
    "finish_request",
    "take_removed_page_hashes",
    "scheduler_idle",
    "lookup_groups",
    "batch_result_started",
    "batch_done",
    "weights_changing",
)


def linker_hook(linker: object, name: str) -> Any:
    """The linker's hook ``name``, or the no-op default when it has none."""
    if name not in HOOK_NAMES:
        raise AttributeError(name)
    default = getattr(PreparationHooks, name)
    value = getattr(linker, name, default)
    if callable(default) and value is default:
        return default.__get__(linker)
    return value


def cache_linker_of(tree_cache: Any) -> Any:
    """The linker behind ``tree_cache``'s linker wrapper, or None (no cache, or
    a cache without an external linker)."""
    wrapper = getattr(tree_cache, "linker", None)
    return None if wrapper is None else wrapper.cache_linker


def preparing_linker_of(tree_cache: Any) -> Any:
    """``cache_linker_of(tree_cache)`` when it prepares requests (a KVCR linker),
    else None."""
    backend = cache_linker_of(tree_cache)
    if backend is None or not linker_hook(backend, "prepares_requests"):
        return None
    return backend


def merge_held(original: list[Any], held: list[Any], after: list[Any]) -> list[Any]:
    """Put held requests back in their original positions; new arrivals go last."""
    held_ids = {id(r) for r in held}
    after_ids = {id(r) for r in after}
    original_ids = {id(r) for r in original}
    merged = [r for r in original if id(r) in held_ids or id(r) in after_ids]
    merged.extend(r for r in after if id(r) not in original_ids)
    return merged
