"""Turn a request's ``kv_hints`` into a validated ``kv.fetch`` hint for KVCR.

``req.kv_hints`` (a ``KvHintsEnvelope`` struct, a dict of its shape, or a list of them
of which the first counts) is read by attribute or key without importing SGLang. The
first ``kv.fetch`` action of major version 1 is used (a minor version only adds
fields; unknown payload keys are ignored). Its ``tcp://host:port`` source is shifted
by this rank's attention-TP offset (routers name rank 0) and checked against the peer
allowlist without DNS; its hashes (signed or unsigned 64-bit ints, or 16-hex-digit
page-hash prefixes) become unsigned ints. Parsing never raises: a bad hint is
ignored, counted per reason, logged at DEBUG and at most once a minute per reason at
WARNING.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.config import linker_config as kvcr_config
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import page_hash_to_u64

logger = logging.getLogger(__name__)

WARNING_INTERVAL_S = 60.0
_U64 = (1 << 64) - 1
_VERSION = re.compile(r"1(?:\.[0-9]{1,6})?")  # kv.fetch versions accepted: 1, 1.x
_HEX16 = re.compile(r"(?:0[xX])?([0-9a-fA-F]{16})")
_IPV4 = re.compile(r"[0-9.]+")
_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_MISSING: Any = object()


class HintRejection(enum.Enum):
    """Why a present ``kv.fetch`` hint was ignored (no hint at all is not one)."""

    MALFORMED_ENVELOPE = "malformed_envelope"
    MALFORMED_PAYLOAD = "malformed_payload"
    UNSUPPORTED_MODE = "unsupported_mode"
    BAD_ENDPOINT = "bad_endpoint"
    PORT_OUT_OF_RANGE = "port_out_of_range"
    ENDPOINT_NOT_ALLOWED = "endpoint_not_allowed"
    EMPTY_HASHES = "empty_hashes"
    TOO_MANY_HASHES = "too_many_hashes"
    BAD_HASH = "bad_hash"
    DISABLED = "disabled"  # accept_request_hints is false


_R = HintRejection


@dataclass(frozen=True, slots=True)
class FetchHint:
    """A validated hint: fetch these pages from this peer endpoint (of this rank)."""

    source_endpoint: str
    block_hashes: tuple[int, ...]

    def to_kvcr_envelope(self) -> dict[str, Any]:
        """The envelope ``KVCR.submit_hint`` accepts for this hint."""
        payload = {
            "source_control_endpoint": self.source_endpoint,
            "block_hashes": list(self.block_hashes),
            "mode": "copy",
        }
        action: dict[str, Any] = {"action_type": "kv.fetch", "action_version": "1.0"}
        action["payload"] = payload
        return {"protocol_version": "0.1", "actions": [action]}


@dataclass(slots=True)
class HintStats:
    """Counters of one parser: accepted hints, rejections by reason, skipped actions."""

    rejected: dict[HintRejection, int] = field(
        default_factory=lambda: dict.fromkeys(HintRejection, 0)
    )
    accepted: int = 0
    ignored_other_actions: int = 0

    def as_dict(self) -> dict[str, int]:
        """Flat ``{name: count}``; rejections appear as ``rejected_<reason>``."""
        out = {"accepted": self.accepted}
        out["ignored_other_actions"] = self.ignored_other_actions
        out.update({f"rejected_{r.value}": n for r, n in self.rejected.items()})
        return out


class EndpointAllowlist:
    """Peers a hint may name: IP networks, or host names (exact), with port ranges."""

    __slots__ = ("_rules",)

    def __init__(self, entries: Iterable[str], default_host: str) -> None:
        """Parse ``entries`` (config syntax); none means ``default_host``, any port."""
        texts = list(entries) or [default_host]
        self._rules = tuple(map(kvcr_config.parse_allowlist_entry, texts))

    @classmethod
    def from_config(cls, config: kvcr_config.KVCRLinkerConfig) -> EndpointAllowlist:
        """``config.peer_endpoint_allowlist``, defaulting to its advertised host."""
        return cls(config.peer_endpoint_allowlist, config.advertise_host)

    def allows_endpoint(self, endpoint: str) -> bool:
        """Whether ``tcp://host:port`` is allowed (False when it is not one)."""
        parsed = split_endpoint(endpoint)
        return parsed is not None and self.allows(*parsed)

    def allows(self, host: str, port: int) -> bool:
        """Whether ``host`` (IP, optionally bracketed, or name) and ``port`` match."""
        name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        targets = [target for target, lo, hi in self._rules if lo <= port <= hi]
        try:
            addr = ipaddress.ip_address(name)
        except ValueError:  # a host name only ever matches a name entry, exactly
            return name.lower() in targets
        return any(addr in net for net in targets if not isinstance(net, str))


class _Reject(Exception):
    def __init__(self, reason: HintRejection, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class RouterHintParser:
    """Parses ``req.kv_hints`` into this rank's ``FetchHint``; never raises."""

    def __init__(
        self,
        allowlist: EndpointAllowlist,
        rank_offset: int,
        max_hashes: int = 65536,
        enabled: bool = True,
    ) -> None:
        """``rank_offset``: this rank's attention-TP offset (it listens at port+r);
        ``enabled`` False ignores every hint (``accept_request_hints``)."""
        if type(rank_offset) is not int or not 0 <= rank_offset < 65535:
            raise ValueError(f"rank_offset must be in [0, 65535), got {rank_offset!r}")
        if type(max_hashes) is not int or max_hashes < 1:
            raise ValueError(f"max_hashes must be a positive int, got {max_hashes!r}")
        self._allowlist, self._offset, self._max = allowlist, rank_offset, max_hashes
        self._enabled = enabled
        self._last_warning: dict[HintRejection, float] = {}
        self.stats = HintStats()

    @classmethod
    def from_config(
        cls, config: kvcr_config.KVCRLinkerConfig, rank_offset: int
    ) -> RouterHintParser:
        """The parser of a rank at ``rank_offset`` under ``config``'s allowlist
        and ``accept_request_hints``."""
        allowlist = EndpointAllowlist.from_config(config)
        return cls(allowlist, rank_offset, enabled=config.accept_request_hints)

    def parse(self, kv_hints: object) -> FetchHint | None:
        """The request's usable fetch hint, or None (absent, or ignored and counted)."""
        if not self._enabled and kv_hints is not None:
            self._reject(_R.DISABLED, "accept_request_hints is false")
            return None
        try:
            hint = self._parse(kv_hints)
        except _Reject as rej:
            self._reject(rej.reason, rej.detail)
            return None
        except Exception as exc:  # whatever the input does, never fail the request
            self._reject(_R.MALFORMED_ENVELOPE, type(exc).__name__)
            return None
        if hint is not None:
            self.stats.accepted += 1
            logger.debug("kv.fetch hint accepted: %s", hint.source_endpoint)
        return hint

    def _parse(self, kv_hints: object) -> FetchHint | None:
        envelope = kv_hints
        if isinstance(envelope, list | tuple):
            envelope = envelope[0] if envelope else None
        if envelope is None:
            return None
        actions = _get(envelope, "actions", _R.MALFORMED_ENVELOPE)
        if actions is _MISSING and isinstance(envelope, Mapping):
            actions = []  # the struct's default
        if not isinstance(actions, list | tuple):
            raise _Reject(_R.MALFORMED_ENVELOPE, "actions is not a list")
        for action in actions:
            kind = _str(_get(action, "action_type", _R.MALFORMED_ENVELOPE))
            version = _str(_get(action, "action_version", _R.MALFORMED_ENVELOPE))
            if kind == "kv.fetch" and _VERSION.fullmatch(version):
                payload = _get(action, "payload", _R.MALFORMED_PAYLOAD)
                return self._parse_payload(payload)
            self.stats.ignored_other_actions += 1
        return None

    def _parse_payload(self, payload: object) -> FetchHint:
        if not isinstance(payload, Mapping):
            raise _Reject(_R.MALFORMED_PAYLOAD, "payload is not a dict")
        mode, no_retain = _str(payload.get("mode", "copy")), payload.get("no_retain")
        if mode != "copy" or (no_retain is not None and no_retain is not False):
            raise _Reject(_R.UNSUPPORTED_MODE, "only 'copy' is supported")
        host, port = _parse_endpoint(payload.get("source_control_endpoint"))
        port += self._offset
        if port > 65535:
            raise _Reject(_R.PORT_OUT_OF_RANGE, f"{host}:{port}")
        if not self._allowlist.allows(host, port):
            raise _Reject(_R.ENDPOINT_NOT_ALLOWED, f"{host}:{port}")
        raw = payload.get("block_hashes")
        if not isinstance(raw, list | tuple):
            raise _Reject(_R.MALFORMED_PAYLOAD, "block_hashes is not a list")
        if not raw:
            raise _Reject(_R.EMPTY_HASHES, "block_hashes is empty")
        if len(raw) > self._max:
            raise _Reject(_R.TOO_MANY_HASHES, f"{len(raw)} block_hashes")
        hashes = tuple(map(_hash_to_u64, raw))
        if -1 in hashes:
            raise _Reject(_R.BAD_HASH, f"block_hashes[{hashes.index(-1)}]")
        return FetchHint(f"tcp://{host}:{port}", hashes)

    def _reject(self, reason: HintRejection, detail: str) -> None:
        count = self.stats.rejected[reason] = self.stats.rejected[reason] + 1
        now, last = time.monotonic(), self._last_warning.get(reason)
        if last is None or now - last >= WARNING_INTERVAL_S:
            self._last_warning[reason] = now
            msg = "Ignoring kv.fetch hints (%s): %d so far, latest: %s"
            logger.warning(msg, reason.value, count, detail)
        else:
            logger.debug("Ignoring kv.fetch hint (%s): %s", reason.value, detail)


def _get(obj: object, name: str, reason: HintRejection) -> Any:
    """``obj[name]`` of a mapping, else ``obj.name``; ``_MISSING`` when absent."""
    try:
        if isinstance(obj, Mapping):
            return obj.get(name, _MISSING)
        return getattr(obj, name, _MISSING)
    except Exception as exc:
        raise _Reject(reason, f"reading {name} raised {type(exc).__name__}") from None


def _parse_endpoint(value: object) -> tuple[str, int]:
    """``tcp://host:port`` -> (dialable host, port); IPv6 hosts come back bracketed."""
    text = _str(value)
    v6 = text.startswith("tcp://[")
    name, _, port = text[7 if v6 else 6 :].partition("]:" if v6 else ":")
    host = _host(name, v6) if text.startswith("tcp://") and len(text) < 300 else ""
    if not host or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise _Reject(_R.BAD_ENDPOINT, f"not tcp://host:port: {text[:80]!r}")
    return host, int(port)


def split_endpoint(endpoint: object) -> tuple[str, int] | None:
    """``tcp://host:port`` -> (host, port) in canonical form; None when not one."""
    try:
        return _parse_endpoint(endpoint)
    except _Reject:
        return None


def _str(value: object) -> str:
    """``value`` as an exact ``str`` (no subclass method runs); "" if not a str."""
    return str.__str__(value) if isinstance(value, str) else ""


def _host(text: str, v6: bool) -> str:
    """The canonical form of an endpoint host; "" when it is not a usable one."""
    try:
        if v6 or _IPV4.fullmatch(text):
            addr = ipaddress.IPv6Address(text) if v6 else ipaddress.IPv4Address(text)
            # A zone id ('fe80::1%eth0') is free text that would reach KVCR, ZMQ
            # and the logs verbatim; peers are named by address alone.
            if addr.is_unspecified or (v6 and "%" in text):
                return ""
            return f"[{addr}]" if v6 else str(addr)
    except ValueError:
        return ""
    labels = text.lower().split(".")
    ok = text.isascii() and len(text) < 254 and not labels[-1].isdigit()
    return ".".join(labels) if ok and all(map(_LABEL.fullmatch, labels)) else ""


def _hash_to_u64(item: object) -> int:
    """The unsigned 64-bit value of one hint hash; -1 when it is not one."""
    if isinstance(item, int) and not isinstance(item, bool):
        value = int.__index__(item)
        return value & _U64 if -(1 << 63) <= value < (1 << 64) else -1
    match = _HEX16.fullmatch(item) if isinstance(item, str) else None
    return int(match.group(1), 16) if match else -1


def hinted_pages(
    hint: FetchHint | None,
    page_hashes: list[str],
    event_hashes: tuple[frozenset[int], ...],
) -> frozenset[str]:
    """The tail pages ``hint`` names: by storage hash, or by any hash a worker
    publishes for the page in its KV events (a namespaced request's)."""
    if hint is None:
        return frozenset()
    named = set(hint.block_hashes)
    return frozenset(
        page_hash
        for i, page_hash in enumerate(page_hashes)
        if page_hash_to_u64(page_hash) in named
        or (i < len(event_hashes) and not named.isdisjoint(event_hashes[i]))
    )


@dataclass(frozen=True, slots=True)
class RequestHint:
    """What one request's hint means here: the peer to fetch from (None: no
    usable hint) and the tail pages it names."""

    hint: FetchHint | None
    pages: frozenset[str]

    def envelope(self, page_hashes: list[str]) -> dict[str, Any] | None:
        """The envelope for KVCR: KVCR matches a hint against its keys' storage
        hashes, so the named pages go by those, whatever the router named them by."""
        if self.hint is None or not self.pages:
            return None
        named = tuple(page_hash_to_u64(h) for h in page_hashes if h in self.pages)
        return FetchHint(self.hint.source_endpoint, named).to_kvcr_envelope()


def request_hint(
    parser: RouterHintParser,
    ctx: Any,
    page_hashes: list[str],
    own_endpoints: frozenset[str],
    peer_fetches_off: bool,
    multi_node: bool,
    stats: Any,
    fills_unresolved: bool = False,
) -> RequestHint:
    """``ctx``'s hint for this rank. A hint naming this very worker (any of
    ``own_endpoints``, normalized) is local residency, never a NIXL transfer to
    itself; none is taken while peer fetches are off (``max_quarantined_cores``),
    while failed peer fetches still hold too much DRAM (``fills_unresolved``)
    or when the server's attention ranks span nodes (a hint names one host).
    Each is counted in ``stats``."""
    hint = parser.parse(ctx.kv_hints) if ctx.kv_hints is not None else None
    # The parser returns the endpoint in canonical form already.
    if hint is not None and hint.source_endpoint in own_endpoints:
        stats.hints_self += 1
        hint = None
    elif hint is not None and multi_node:
        stats.hints_multinode_off += 1
        hint = None
    elif hint is not None and peer_fetches_off:
        stats.hints_quarantine_off += 1
        hint = None
    elif hint is not None and fills_unresolved:
        stats.hints_unresolved_off += 1
        hint = None
    return RequestHint(hint, hinted_pages(hint, page_hashes, ctx.event_hashes))


def normalize_endpoint(endpoint: str) -> str:
    """``tcp://host:port`` in the canonical form hints are parsed into; the text
    unchanged when it is not one."""
    try:
        host, port = _parse_endpoint(endpoint)
    except _Reject:
        return endpoint
    return f"tcp://{host}:{port}"


def own_endpoints(advertised: str, hosts: Iterable[str]) -> frozenset[str]:
    """Every spelling of this rank's endpoint a router may use: the advertised
    one and the same port on each of ``hosts`` (bind and advertise hosts; no
    name is resolved), normalized (host names case-folded, addresses canonical)."""
    port = advertised.rpartition(":")[2]
    names = {normalize_endpoint(advertised)}
    for host in hosts:
        if host and host not in ("0.0.0.0", "::"):
            wrapped = f"[{host}]" if ":" in host else host
            names.add(normalize_endpoint(f"tcp://{wrapped}:{port}"))
    return frozenset(names)
