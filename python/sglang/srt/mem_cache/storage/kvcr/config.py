"""Frozen configuration of the KVCR direct linker, parsed from the startup flag.

``--unified-cache-external-linker-config`` carries a JSON object. With
``--unified-cache-external-linker-backend kvcr`` the object *is* this config; with
the stock ``dynamic`` backend it goes under ``linker_extra_config``. Parsing rejects
unknown keys by name, refuses the legacy ``local_dram_bytes`` with a migration hint,
and checks ranges and cross-field rules, so a bad value fails at startup with one
line that names the field and the fix. This module imports nothing heavy (no torch,
kvcr or nixl): SGLang's frontend validates the config before any worker starts.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
from collections.abc import Mapping
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.errors import KVCRConfigError

FLAG = "--unified-cache-external-linker-config"
BACKEND_FLAG = "--unified-cache-external-linker-backend"
BACKEND_NAME = "kvcr"
LINKER_CLASS_NAME = "KVCRDirectLinker"
LINKER_MODULE_PATH = "sglang.srt.mem_cache.storage.kvcr.kvcr_direct_linker"

_MIB = 1 << 20
_EVICTION_POLICIES = ("lru", "fifo")
_OFFLOAD_PATHS = ("auto", "staged", "direct")


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
            "new preparations are refused until KVCR resolves them."
        ),
    )
    max_quarantined_cores: int = dataclasses.field(
        default=1,
        metadata=_doc(
            "How many KVCR DRAM shares a worker may quarantine (a flush whose old "
            "KVCR could not prove quiescence, e.g. a dead peer's transfer, keeps "
            "its DRAM locked and allocates a fresh share). Once reached, the "
            "worker stops taking peer fetches (hints are ignored and counted); a "
            "further unclean flush past the bound gives the new KVCR one page per "
            "pool and the linker restores and stores nothing (its requests "
            "recompute; restore_disabled misses), so host memory never exceeds "
            "(max + 1) shares. Each flush asks quarantined cores "
            "whether they have proven quiescent since (a dead peer restarted): "
            "their DRAM, still locked, is then reused, and peer fetches resume "
            "once under the bound. 0 stops peer fetches for good at the first."
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
    progress_idle_ms: int = dataclasses.field(
        default=20,
        metadata=_doc(
            "Longest an idle KVCR progress loop sleeps (kvcr itself wakes every 1 ms, "
            "taking the GIL next to the forward). This worker's own operations wake "
            "it at once; a peer's first request to a worker idle for 50 ms may wait "
            "this long. 0 keeps kvcr's 1 ms loop."
        ),
    )
    offload_path: str = dataclasses.field(
        default="auto",
        metadata=_doc(
            "How offloads reach KVCR: 'staged' copies pages into a page-locked host "
            "staging area (max_inflight_offload_bytes of it) and deposits from there; "
            "'direct' lets KVCR read the pool itself; 'auto' stages GPU pools only."
        ),
    )
    eviction_policy: str = dataclasses.field(
        default="lru",
        metadata=_doc("KVCR DRAM eviction policy: 'lru' or 'fifo'."),
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
            "its own when it dials. Empty: no CURVE."
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
        _require_int(self, "local_dram_bytes_per_worker", minimum=1)
        _require_int(self, "control_port", minimum=0, maximum=65535)
        for name in (
            "operation_timeout_ms",
            "abandon_timeout_ms",
            "preparation_timeout_ms",
            "prepare_chunk_pages",
            "max_inflight_offload_bytes",
            "max_inflight_prepare_bytes",
            "max_abandoned_bytes",
        ):
            _require_int(self, name, minimum=1)
        if isinstance(self.owner_wait_timeout_s, bool) or not isinstance(
            self.owner_wait_timeout_s, (int, float)
        ):
            raise _error("owner_wait_timeout_s", "must be a number of seconds")
        if not 0 < self.owner_wait_timeout_s <= 3600:
            raise _error("owner_wait_timeout_s", "must be in (0, 3600] seconds")
        if not isinstance(self.nixl_progress_thread, bool):
            raise _error("nixl_progress_thread", "must be true or false")
        _require_int(self, "progress_idle_ms", minimum=0, maximum=1000)
        _require_int(self, "max_quarantined_cores", minimum=0, maximum=64)
        if self.offload_path not in _OFFLOAD_PATHS:
            raise _error("offload_path", f"must be one of {list(_OFFLOAD_PATHS)}")
        if self.eviction_policy not in _EVICTION_POLICIES:
            raise _error(
                "eviction_policy", f"must be one of {list(_EVICTION_POLICIES)}"
            )
        if self.abandon_timeout_ms < 2 * self.operation_timeout_ms:
            raise _error(
                "abandon_timeout_ms",
                f"must be >= 2 x operation_timeout_ms "
                f"({2 * self.operation_timeout_ms}); raise it or lower "
                f"operation_timeout_ms",
            )
        for name in ("control_bind_host", "control_advertise_host"):
            value = getattr(self, name)
            if (
                not isinstance(value, str)
                or any(c.isspace() for c in value)
                or not value.isprintable()
            ):
                raise _error(
                    name,
                    "must be a host name or IP address without spaces or "
                    "control characters",
                )
        if not self.control_bind_host:
            raise _error("control_bind_host", "must not be empty")
        if _is_wildcard(self.control_bind_host) and not self.control_advertise_host:
            raise _error(
                "control_advertise_host",
                f"is required when control_bind_host is {self.control_bind_host!r}; "
                f"set it to the address peers should dial",
            )
        if _is_wildcard(self.control_advertise_host):
            raise _error(
                "control_advertise_host", "must be a reachable address, not a wildcard"
            )
        allow = self.peer_endpoint_allowlist
        if not isinstance(allow, tuple) or not all(isinstance(e, str) for e in allow):
            raise _error("peer_endpoint_allowlist", "must be a list of strings")
        for entry in allow:
            parse_allowlist_entry(entry)
        _check_curve_fields(self)

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
            raise _error(
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
            raise _error(
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
        if isinstance(raw, (str, bytes)):
            try:
                raw = json.loads(raw)
            except ValueError as exc:
                raise KVCRConfigError(
                    f"{FLAG}: not valid JSON ({exc}); pass a JSON object"
                ) from None
            except RecursionError:
                raise KVCRConfigError(
                    f"{FLAG}: not valid JSON (nested too deeply); pass a flat "
                    f"JSON object"
                ) from None
        if raw is None:
            raw = {}
        if backend == "dynamic" and isinstance(raw, Mapping):
            raw = raw.get("linker_extra_config", {})
        return cls.from_dict(raw)


def field_docs() -> dict[str, str]:
    """Every config field with its documentation, in declaration order."""
    return {f.name: f.metadata["doc"] for f in dataclasses.fields(KVCRLinkerConfig)}


def parse_allowlist_entry(entry: str) -> tuple[ipaddress._BaseNetwork | str, int, int]:
    """Parse ``host|cidr[:port|:lo-hi]`` into (network or host name, lo, hi)."""
    text = entry.strip()
    port_lo, port_hi = 0, 65535
    host = text
    if text.startswith("["):  # [v6]:port or [v6/len]:port
        host, bracket, rest = text[1:].partition("]")
        if rest.startswith(":"):
            port_lo, port_hi = _parse_ports(entry, rest[1:])
        elif rest or not bracket:
            # Anything else after ']' (e.g. '[fd00::]/64:7000') would otherwise be
            # dropped silently, and with it the entry's port restriction.
            raise _error(
                "peer_endpoint_allowlist",
                f"entry {entry!r} must be '[address or CIDR]' optionally followed "
                f"by ':port' or ':lo-hi', e.g. '[fd00::/64]:7000'",
            )
    elif text.count(":") == 1:
        host, _, ports = text.partition(":")
        port_lo, port_hi = _parse_ports(entry, ports)
    if not host:
        raise _error("peer_endpoint_allowlist", f"entry {entry!r} has no host")
    try:
        return ipaddress.ip_network(host, strict=False), port_lo, port_hi
    except ValueError:
        if any(c.isspace() or c in "/[]" for c in host):
            raise _error(
                "peer_endpoint_allowlist", f"entry {entry!r} is not a host or CIDR"
            ) from None
        return host.lower(), port_lo, port_hi


def _parse_ports(entry: str, text: str) -> tuple[int, int]:
    lo_text, _, hi_text = text.partition("-")
    try:
        lo = int(lo_text)
        hi = int(hi_text) if hi_text else lo
    except ValueError:
        raise _error(
            "peer_endpoint_allowlist", f"entry {entry!r} has a bad port range"
        ) from None
    if not 0 < lo <= hi <= 65535:
        raise _error(
            "peer_endpoint_allowlist", f"entry {entry!r} ports must be in 1..65535"
        )
    return lo, hi


_SECRET_FIELD = "control_curve_secret_key_file"
_KEYS_FIELD = "control_curve_public_keys_dir"
_MAKE_KEYS = "make keys with zmq.auth.create_certificates(dir, name)"


def _check_curve_fields(cfg: KVCRLinkerConfig) -> None:
    """Both CURVE fields or neither; a readable secret key file; a key directory."""
    secret, keys = cfg.control_curve_secret_key_file, cfg.control_curve_public_keys_dir
    for name, value in ((_SECRET_FIELD, secret), (_KEYS_FIELD, keys)):
        if not isinstance(value, str) or not value.isprintable():
            raise _error(name, "must be a path string")
    if not secret and not keys:
        return
    if not secret or not keys:
        missing = _SECRET_FIELD if not secret else _KEYS_FIELD
        present = _KEYS_FIELD if not secret else _SECRET_FIELD
        raise _error(missing, f"is required when {present} is set; set both or neither")
    if not os.path.isfile(secret) or not os.access(secret, os.R_OK):
        raise _error(
            _SECRET_FIELD,
            f"{secret!r} is not a readable file; point it at this worker's "
            f"'.key_secret' file ({_MAKE_KEYS})",
        )
    found = _curve_keys(_SECRET_FIELD, secret)
    if not _is_z85_key(found.get("secret-key")) or not _is_z85_key(
        found.get("public-key")
    ):
        raise _error(
            _SECRET_FIELD,
            f"{secret!r} holds no valid CURVE secret key (the '.key' file is "
            f"the public half); use the '.key_secret' file ({_MAKE_KEYS})",
        )
    if not os.path.isdir(keys) or not os.access(keys, os.R_OK | os.X_OK):
        raise _error(
            _KEYS_FIELD,
            f"{keys!r} is not a readable directory; put the peers' '.key' public "
            f"key files in one ({_MAKE_KEYS})",
        )
    names = sorted(n for n in os.listdir(keys) if n.endswith(".key"))
    if not names:
        raise _error(
            _KEYS_FIELD, f"{keys!r} holds no '.key' public key files; {_MAKE_KEYS}"
        )
    for name in names:
        path = os.path.join(keys, name)
        if not _is_z85_key(_curve_keys(_KEYS_FIELD, path).get("public-key")):
            raise _error(
                _KEYS_FIELD, f"{path!r} holds no valid CURVE public key; {_MAKE_KEYS}"
            )


def _curve_keys(field: str, path: str) -> dict[str, str]:
    """The ``public-key``/``secret-key`` values of a ZeroMQ certificate file, read
    as pyzmq's ``load_certificate`` does (stdlib only: no pyzmq here)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read(1 << 16).splitlines()
    except OSError as exc:
        raise _error(field, f"{path!r} cannot be read ({exc.strerror})") from None
    found: dict[str, str] = {}
    for line in lines:
        name, eq, value = line.strip().partition("=")
        if eq and name.strip() in ("public-key", "secret-key"):
            found[name.strip()] = value.strip(" \t'\"")
    return found


_Z85 = (
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    ".-:+=^!/*?&<>()[]{}@%$#"
)


def _is_z85_key(key: str | None) -> bool:
    """A 40-character Z85 text that decodes to a 32-byte CURVE key."""
    if not isinstance(key, str) or len(key) != 40 or any(c not in _Z85 for c in key):
        return False
    for i in range(0, 40, 5):
        value = 0
        for c in key[i : i + 5]:
            value = value * 85 + _Z85.index(c)
        if value >= 1 << 32:
            return False
    return True


def _is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "*")


def _require_int(
    cfg: KVCRLinkerConfig, name: str, *, minimum: int, maximum: int | None = None
) -> None:
    value: Any = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(name, f"must be an integer, got {_show(value)}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise _error(name, f"must be {bound}, got {_show(value)}")


def _show(value: object) -> str:
    """A short one-line rendering of a bad value for an error message.

    ``repr`` of an int past Python's str-conversion digit limit (or a container
    holding one) raises ValueError, which must not escape the config parser.
    """
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def _error(name: str, problem: str) -> KVCRConfigError:
    return KVCRConfigError(f"{FLAG}: field '{name}' {problem}")
