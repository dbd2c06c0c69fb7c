"""Frozen configuration of the KVCR direct linker, parsed from the startup flag.

``--unified-cache-external-linker-config`` carries a JSON object. With
``--unified-cache-external-linker-backend kvcr`` the object *is* this config; with
the stock ``dynamic`` backend it goes under ``linker_extra_config``. Parsing rejects
unknown keys by name, refuses the legacy ``local_dram_bytes`` with a migration hint,
and checks ranges and cross-field rules: a bad value fails at startup with one line
naming the field and the fix (value checks: ``value_checks``). Nothing heavy is
imported (no torch, kvcr or nixl): SGLang's frontend validates the config while it
parses its arguments, before any worker starts.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from sglang.srt.mem_cache.storage.kvcr.config.config_rules import check
from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRConfigError
from sglang.srt.mem_cache.storage.kvcr.config.value_checks import (
    FLAG,
    config_error,
    parse_allowlist_entry,
)

__all__ = [
    "BACKEND_FLAG",
    "BACKEND_NAME",
    "FLAG",
    "LINKER_CLASS_NAME",
    "LINKER_MODULE_PATH",
    "KVCRLinkerConfig",
    "field_docs",
    "parse_allowlist_entry",
]

BACKEND_FLAG = "--unified-cache-external-linker-backend"
BACKEND_NAME = "kvcr"
LINKER_CLASS_NAME = "KVCRDirectLinker"
LINKER_MODULE_PATH = "sglang.srt.mem_cache.storage.kvcr.kvcr_direct_linker"

_MIB = 1 << 20


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KVCRLinkerConfig:
    """Validated settings of one KVCR direct linker (one per worker process)."""

    local_dram_bytes_per_worker: int = dataclasses.field(
        metadata=_doc(
            "Required. Bytes of host DRAM that KVCR owns for this worker (one "
            "server on one node), divided evenly among the attention ranks the "
            "node runs, across DP replicas; every pool gets the same page count "
            "and the unused tail is logged."
        )
    )
    control_bind_host: str = dataclasses.field(
        default="127.0.0.1",
        metadata=_doc(
            "Address the KVCR peer control channel (ZMQ) binds to. Use 0.0.0.0 "
            "only together with control_advertise_host."
        ),
    )
    control_advertise_host: str = dataclasses.field(
        default="",
        metadata=_doc(
            "Host peers are told to reach this worker at; empty means "
            "control_bind_host. Required when binding a wildcard address."
        ),
    )
    control_port: int = dataclasses.field(
        default=0,
        metadata=_doc(
            "Control port of attention rank 0; global attention rank g (DP "
            "replica d, attention-TP rank r: g = d * attn_tp_size + r) listens "
            "on control_port + g. 0 picks free ports (hints can then only name "
            "them explicitly)."
        ),
    )
    operation_timeout_ms: int = dataclasses.field(
        default=1000,
        metadata=_doc("KVCR per-operation timeout; a peer silent this long is a miss."),
    )
    abandon_timeout_ms: int = dataclasses.field(
        default=2000,
        metadata=_doc(
            "KVCR abandon window for unresolved remote operations; must be at "
            "least 2x operation_timeout_ms (a kvcr 0.1.1 rule)."
        ),
    )
    preparation_timeout_ms: int = dataclasses.field(
        default=2000,
        metadata=_doc(
            "Deadline after enqueue at which a request's preparation is declared "
            "ready with whatever pages have landed; the rest is recomputed."
        ),
    )
    local_hit_wait_ms: int = dataclasses.field(
        default=5,
        metadata=_doc(
            "How long preparing requests whose pages are all in this worker's "
            "KVCR DRAM may wait for their claims, in all per scheduler step, so "
            "they are admitted in the same pass (0: never wait; they are then "
            "admitted a pass later)."
        ),
    )
    idle_offload_wait_us: int = dataclasses.field(
        default=1000,
        metadata=_doc(
            "Longest the scheduler's idle loop blocks on each pass, when nothing "
            "waits in any queue and an offload's deposit is in flight, for its "
            "result. SGLang's idle loop spins holding Python's GIL, handing it to "
            "the linker's owner and copier threads only at the switch interval, "
            "so most of the offload would otherwise run during the next "
            "request's scheduling; blocking lets it end between requests. A "
            "request arriving meanwhile waits for the wait. 0: never block."
        ),
    )
    offload_hold_batches: int = dataclasses.field(
        default=1,
        metadata=_doc(
            "While the scheduler keeps running batches, a write-through's deposit "
            "waits for this many more batch results after the one that made the "
            "offload (at most 20 ms, checked each scheduler pass; an idle "
            "scheduler submits it after idle_offload_delay_us), so that its work, "
            "which shares Python's GIL with the scheduler, does not lengthen the "
            "step right after a prefill: that step's output gap already holds the "
            "prefill. "
            "0: submit at the next scheduler pass. Direct path only (offload_path "
            "'staged' submits from its stager)."
        ),
    )
    idle_offload_delay_us: int = dataclasses.field(
        default=10000,
        metadata=_doc(
            "On an idle scheduler, how long after its offload a write-through's "
            "deposit waits, so that its work (owner and copier threads, the GIL, "
            "a core) does not overlap the batch's output on its way to the client. "
            "The scheduler does not block; a request arriving holds the deposit "
            "as a busy scheduler does. Not with --sleep-on-idle, the Rust server "
            "or offload_hold_batches 0; at most 20 ms. 0: at the first idle pass. "
            "Direct path only."
        ),
    )
    gc_freeze_pages: int = dataclasses.field(
        default=1024,
        metadata=_doc(
            "On a fully idle scheduler pass (nothing waiting or running, no "
            "deposit or preparation in flight, no request of an SGLang session "
            "held), once this many pages were offloaded or prepared since the "
            "last time, collect garbage and then freeze the survivors (gc.freeze), "
            "so Python's full collections stop walking KVCR's per-page objects "
            "(docs: Limitations). 0: never."
        ),
    )
    prepare_chunk_pages: int = dataclasses.field(
        default=64,
        metadata=_doc("Pages per KVCR fetch issued while preparing a request."),
    )
    max_inflight_offload_bytes: int = dataclasses.field(
        default=2048 * _MIB,
        metadata=_doc(
            "Bound on offload bytes queued or in flight; beyond it offloads complete "
            "as failed (counted as backpressure) instead of queueing. One larger "
            "offload still runs when nothing else is in flight (direct path; the "
            "staged path also needs that many staging bytes). Keep it above one "
            "request's pages (a 3000-token Qwen3-0.6B prompt is 329 MiB)."
        ),
    )
    max_inflight_prepare_bytes: int = dataclasses.field(
        default=512 * _MIB,
        metadata=_doc(
            "Bound on bytes being fetched from peers for preparations (claims on "
            "pages resident here move no bytes and are not charged); beyond it "
            "preparation fetches are skipped and the pages recomputed (one larger "
            "fetch still runs when nothing else is in flight)."
        ),
    )
    max_abandoned_bytes: int = dataclasses.field(
        default=256 * _MIB,
        metadata=_doc(
            "Bound on bytes held by operations whose requests went away; beyond it "
            "new preparations are refused until KVCR resolves them. It also bounds "
            "the KVCR DRAM that failed peer fetches still hold (a hinted source "
            "that never completed or refused its write): beyond it hints are "
            "ignored (counted) until those writes resolve."
        ),
    )
    max_claimed_bytes: int = dataclasses.field(
        default=0,
        metadata=_doc(
            "Bound on the KVCR DRAM bytes that the claims of prepared requests "
            "(landed or being fetched) hold while they wait to load; beyond it a "
            "new request's preparation is refused (counted) and its pages "
            "recomputed. 0 means half of this rank's KVCR DRAM share."
        ),
    )
    max_quarantined_cores: int = dataclasses.field(
        default=1,
        metadata=_doc(
            "How many KVCR DRAM shares a worker may quarantine (a flush whose old KVCR "
            "could not prove quiescence, e.g. a dead peer's transfer, keeps its DRAM "
            "locked and allocates a fresh share). Once reached, the worker stops "
            "taking peer fetches (hints are ignored and counted); a further unclean "
            "flush past the bound gives the new KVCR one page per pool and the linker "
            "restores and stores nothing (its requests recompute; restore_disabled "
            "misses), so host memory never exceeds (max + 1) shares. Each flush asks "
            "quarantined cores whether they have proven quiescent since (a dead peer "
            "restarted): their DRAM, still locked, is then reused, and peer fetches "
            "resume once under the bound. 0 stops peer fetches for good at the first."
        ),
    )
    owner_wait_timeout_s: float = dataclasses.field(
        default=30.0,
        metadata=_doc(
            "Longest the scheduler thread waits for the adapter's owner thread on "
            "a synchronous call (startup, reset, close) before it raises."
        ),
    )
    nixl_progress_thread: bool = dataclasses.field(
        default=False,
        metadata=_doc(
            "Run NIXL's busy-polling progress thread. It costs one whole CPU core per "
            "idle KVCR; off, KVCR's own progress loop drives NIXL without spinning."
        ),
    )
    progress_idle_ms: int | None = dataclasses.field(
        default=None,
        metadata=_doc(
            "Longest an idle KVCR progress loop sleeps (kvcr itself wakes every 1 ms, "
            "taking the GIL next to the forward). This worker's own operations and "
            "a peer's control message wake it at once. 0 keeps kvcr's 1 ms loop. At "
            "most a quarter of operation_timeout_ms (kvcr stops serving peers after "
            "a longer gap). Unset (null): 100, or that quarter when it is less."
        ),
    )
    gil_switch_interval_us: int = dataclasses.field(
        default=500,
        metadata=_doc(
            "Longest the scheduler thread waits for the GIL behind the linker's "
            "threads: the scheduler process's Python switch interval is lowered "
            "to this (CPython's default is 5000 us, the largest value taken; a kvcr "
            "reservation after a prefill otherwise holds the response that long). "
            "Never raised; 0 leaves it as it is."
        ),
    )
    offload_path: str = dataclasses.field(
        default="auto",
        metadata=_doc(
            "How offloads reach KVCR DRAM: 'direct' (and 'auto') copies pool pages "
            "straight into KVCR's slots, one copy; 'staged' first copies them into a "
            "page-locked staging area (max_inflight_offload_bytes of it), a second "
            "copy, kept for comparison."
        ),
    )
    eviction_policy: str = dataclasses.field(
        default="lru",
        metadata=_doc("KVCR DRAM eviction policy: 'lru' or 'fifo'."),
    )
    accept_request_hints: bool = dataclasses.field(
        default=True,
        metadata=_doc(
            "Whether kv.fetch hints on requests (SGLang's kv_hints on /generate) "
            "are used. SGLang takes them from any client that reaches the worker: "
            "set false where clients can reach workers without a router that "
            "strips them, or where no router sends hints. Every hint is then "
            "ignored and counted as 'disabled'; local restores are unchanged."
        ),
    )
    peer_endpoint_allowlist: tuple[str, ...] = dataclasses.field(
        default=(),
        metadata=_doc(
            "Hosts or CIDRs a kv.fetch hint may name as its source, each optionally "
            "with ':port' or ':lo-hi'. Empty means this worker's advertised host. "
            "Hints naming any other endpoint are ignored and counted. The same "
            "hosts (ports do not apply), plus the advertised host, are the only "
            "addresses whose control connections this worker accepts."
        ),
    )
    control_curve_secret_key_file: str = dataclasses.field(
        default="",
        metadata=_doc(
            "This worker's CURVE secret key file (the '.key_secret' file "
            "zmq.auth.create_certificates writes). With "
            "control_curve_public_keys_dir it turns on CURVE on the control "
            "channel: peers must present a listed key, and this worker presents "
            "its own when it dials. It must belong to the server's user with mode "
            "0600 (zmq writes it 0644: chmod 600 it). Empty: no CURVE."
        ),
    )
    control_curve_public_keys_dir: str = dataclasses.field(
        default="",
        metadata=_doc(
            "Directory of the '.key' public key files of the peers allowed to "
            "connect; '<host>.key' is also the key a peer at <host> is dialed "
            "with (else this worker's own). Set with control_curve_secret_key_file."
        ),
    )

    def __post_init__(self) -> None:
        check(self)

    @property
    def idle_sleep_ms(self) -> int:
        """``progress_idle_ms``, or its default when unset (see its doc)."""
        idle = self.progress_idle_ms
        return min(100, self.operation_timeout_ms // 4) if idle is None else idle

    @property
    def advertise_host(self) -> str:
        """The host peers dial: the advertised host, else the bind host."""
        return self.control_advertise_host or self.control_bind_host

    @classmethod
    def from_dict(cls, raw: object) -> KVCRLinkerConfig:
        """Parse a decoded JSON object, rejecting unknown and legacy keys by name."""
        if not isinstance(raw, Mapping):
            raise KVCRConfigError(
                f"{FLAG}: must be a JSON object, got {type(raw).__name__}; "
                f"pass e.g. '{{\"local_dram_bytes_per_worker\": 8589934592}}'"
            )
        if "local_dram_bytes" in raw:
            raise config_error(
                "local_dram_bytes",
                "is no longer accepted; rename it to local_dram_bytes_per_worker "
                "(the value is now per worker process, split among its local ranks)",
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in raw if k not in names)
        if unknown:
            raise KVCRConfigError(
                f"{FLAG}: unknown fields: {unknown}; remove them "
                f"(known fields: {sorted(names)})"
            )
        if "local_dram_bytes_per_worker" not in raw:
            raise config_error(
                "local_dram_bytes_per_worker",
                "is required; set it to the host DRAM bytes KVCR may own per "
                "worker, e.g. 8589934592 for 8 GiB",
            )
        values = dict(raw)
        allow = values.get("peer_endpoint_allowlist")
        if isinstance(allow, list):
            values["peer_endpoint_allowlist"] = tuple(allow)
        return cls(**values)

    @classmethod
    def from_startup_config(cls, backend: str, raw: object) -> KVCRLinkerConfig:
        """Parse the flag's value for ``backend`` ('kvcr', or 'dynamic' + extra)."""
        return cls.from_dict(startup_object(backend, raw))


def startup_object(backend: str, raw: object) -> object:
    """The flag's value as the object ``from_dict`` reads: JSON text decoded,
    None as empty, the 'dynamic' backend's ``linker_extra_config``."""
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise KVCRConfigError(
                f"{FLAG}: not valid JSON ({exc}); pass a JSON object"
            ) from None
        except RecursionError:
            raise KVCRConfigError(
                f"{FLAG}: not valid JSON (nested too deeply); pass a flat JSON object"
            ) from None
    if raw is None:
        raw = {}
    if backend == "dynamic" and isinstance(raw, Mapping):
        raw = raw.get("linker_extra_config", {})
    return raw


def field_docs() -> dict[str, str]:
    """Every config field with its documentation, in declaration order."""
    return {f.name: f.metadata["doc"] for f in dataclasses.fields(KVCRLinkerConfig)}
