"""Who may talk to this worker's KVCR control channel (ZAP address check, CURVE).

kvcr 0.1.1's ``ZmqPeerControlChannel`` serves any peer that reaches its port, and
page keys follow from token ids, so any host that can connect could pull pages.
``make_kvcr_factory`` therefore builds the channel from ``GuardedChannel`` (the
subclass of kvcr's channel lives with the other kvcr patches, kvcr_patches): its
PULL socket lives on a private ZMQ context whose ZAP handler (pyzmq's
``ThreadAuthenticator``) accepts a connection only from an address of the
effective allowlist (the advertised host plus ``peer_endpoint_allowlist``, parsed
by the same parser; ports do not apply inbound, a peer's source port is
ephemeral) and, with CURVE configured, only with a client key from
``control_curve_public_keys_dir``. With CURVE on, this worker's own outgoing
connections present its key pair and expect the peer's server key
``<host>.key`` from that directory (else this worker's own public key: one key
pair shared by all workers). Outgoing connections leave from the bind host when
that is one IP address, so a peer sees the address it would itself dial. A
refused connection never reaches kvcr; it is counted (``inbound_refused``) and
logged at WARNING once per peer address. Outbound, this worker dials only
endpoints of the same allowlist with its ports (what hints are checked against),
whoever names them: a peer's reply endpoint elsewhere gets nothing. A peer speaking no CURVE to a CURVE
worker fails ZMQ's greeting before ZAP runs, so it is refused but not counted.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import threading
from collections.abc import Iterable
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.config import linker_config as kvcr_config
from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRUnavailableError
from sglang.srt.mem_cache.storage.kvcr.fleet.router_hint import (
    EndpointAllowlist,
    split_endpoint,
)

logger = logging.getLogger(__name__)

ZAP_DOMAIN = "kvcr-control"
_MAX_WARNED = 1024  # distinct peer addresses logged at WARNING; the rest at DEBUG

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class ControlAuthError(KVCRUnavailableError):
    """The control channel's inbound check could not be installed (KVCR fails to
    start rather than serve peers unchecked)."""


class InboundGuard:
    """The inbound policy of one worker rank and its refusal counter.

    Thread-safe: the ZAP thread decides and counts, the scheduler reads ``refused``.
    """

    def __init__(
        self,
        entries: Iterable[str],
        *,
        source_host: str = "",
        secret_key_file: str = "",
        public_keys_dir: str = "",
        outbound: EndpointAllowlist | None = None,
    ) -> None:
        """``entries``: allowlist entries (config syntax, ports ignored);
        ``outbound``: the endpoints this worker may dial (None: any)."""
        self._outbound = outbound
        self._networks: list[ipaddress._BaseNetwork] = []
        self._names: list[str] = []
        self._name_ports: list[tuple[str, int, int]] = []
        for entry in entries:
            target, lo, hi = kvcr_config.parse_allowlist_entry(entry)
            if isinstance(target, str):
                self._names.append(target)
                self._name_ports.append((target, lo, hi))
            else:
                self._networks.append(target)
        self._resolved: frozenset[_Address] = frozenset()
        # Name entries' addresses with their ports: a peer advertising an IP is
        # dialed when a name entry resolves to it.
        self._resolved_ports: tuple[tuple[_Address, int, int], ...] = ()
        self.source_host = _source_host(source_host)
        self.curve = bool(secret_key_file and public_keys_dir)
        self._secret_key_file = secret_key_file
        self._public_keys_dir = public_keys_dir
        self._public = self._secret = b""
        self._client_keys: frozenset[bytes] = frozenset()
        self._lock = threading.Lock()
        self._refused = 0
        self._dial_refused = 0
        self._warned: set[str] = set()

    @classmethod
    def from_config(cls, cfg: kvcr_config.KVCRLinkerConfig) -> InboundGuard:
        """The effective allowlist of ``cfg``: its advertised host plus the
        ``peer_endpoint_allowlist`` entries, and its CURVE keys if any."""
        return cls(
            (cfg.advertise_host, *cfg.peer_endpoint_allowlist),
            source_host=cfg.control_bind_host,
            secret_key_file=cfg.control_curve_secret_key_file,
            public_keys_dir=cfg.control_curve_public_keys_dir,
            outbound=EndpointAllowlist.from_config(cfg),
        )

    @property
    def refused(self) -> int:
        """Inbound control connections refused so far."""
        with self._lock:
            return self._refused

    def load(self) -> None:
        """Resolve host-name entries and read the CURVE keys (at channel start)."""
        import zmq.auth

        addresses: set[_Address] = set()
        with_ports: list[tuple[_Address, int, int]] = []
        for name, lo, hi in self._name_ports:
            try:
                infos = _resolve(name, _RESOLVE_TIMEOUT_S)
            except OSError as exc:
                logger.warning(
                    "KVCR control allowlist host %s does not resolve (%s); no "
                    "connection from it is accepted",
                    name,
                    exc,
                )
                continue
            for info in infos:
                addr = _address(str(info[4][0]))
                if addr is not None:
                    addresses.add(addr)
                    with_ports.append((addr, lo, hi))
        self._resolved = frozenset(addresses)
        self._resolved_ports = tuple(with_ports)
        if not self.curve:
            return
        try:
            public, secret = zmq.auth.load_certificate(self._secret_key_file)
            keys = zmq.auth.load_certificates(self._public_keys_dir)
        except (OSError, ValueError) as exc:
            raise ControlAuthError(
                f"KVCR control CURVE keys could not be read ({exc}); check "
                f"control_curve_secret_key_file and control_curve_public_keys_dir"
            ) from exc
        if not secret:
            raise ControlAuthError(
                f"{self._secret_key_file!r} holds no CURVE secret key; set "
                f"control_curve_secret_key_file to a '.key_secret' file"
            )
        self._public, self._secret = public, secret
        self._client_keys = frozenset(keys)

    def allows(self, address: str, mechanism: bytes, credentials: list[bytes]) -> bool:
        """Decide one ZAP request; a refusal is counted and logged."""
        addr = _address(address)
        if addr is None or not (
            addr in self._resolved or any(addr in net for net in self._networks)
        ):
            return self._refuse(address, "address not allowed")
        if self.curve:
            if mechanism != b"CURVE" or len(credentials) != 1:
                return self._refuse(address, "no CURVE key")
            from zmq.utils import z85

            if z85.encode(credentials[0]) not in self._client_keys:
                return self._refuse(address, "CURVE key not allowed")
        return True

    def may_dial(self, endpoint: str) -> bool:
        """Whether this worker may connect to ``endpoint``: the allowlist hints
        are checked against (host and port), so a peer's message cannot make it
        send its NIXL metadata anywhere else; a refusal is counted and logged."""
        if self._outbound is None or self._outbound.allows_endpoint(endpoint):
            return True
        host, port = split_endpoint(endpoint) or ("", 0)
        addr = _address(host.strip("[]")) if host else None
        if addr is not None and any(
            addr == a and lo <= port <= hi for a, lo, hi in self._resolved_ports
        ):
            return True
        level = (
            logging.WARNING if self._count(endpoint, inbound=False) else logging.DEBUG
        )
        logger.log(
            level, "KVCR control: not dialing %s (not on the allowlist)", endpoint
        )
        return False

    @property
    def dial_refused(self) -> int:
        """Outbound control connections refused so far."""
        with self._lock:
            return self._dial_refused

    def _count(self, peer: str, inbound: bool) -> bool:
        """Count one refusal; whether it is the first for ``peer`` (warned once)."""
        with self._lock:
            if inbound:
                self._refused += 1
            else:
                self._dial_refused += 1
            first = peer not in self._warned and len(self._warned) < _MAX_WARNED
            if first:
                self._warned.add(peer)
            return first

    def _refuse(self, address: str, reason: str) -> bool:
        if self._count(address, inbound=True):
            logger.warning(
                "KVCR control channel refused a connection from %s (%s); further "
                "refusals from it are counted as inbound_refused",
                address,
                reason,
            )
        else:
            logger.debug("KVCR control refused %s (%s)", address, reason)
        return False

    def server_options(self, sock: Any) -> None:
        """Set the listening socket's ZAP domain and CURVE server key (pre-bind)."""
        import zmq

        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        # Without a handler answering, refuse instead of letting everyone in.
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        if self.curve:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret)

    def client_endpoint(self, endpoint: str) -> str:
        """``endpoint``, leaving from ``source_host`` when there is one."""
        if not self.source_host or not endpoint.startswith("tcp://"):
            return endpoint
        return f"tcp://{self.source_host}:0;{endpoint[len('tcp://') :]}"

    def client_options(self, sock: Any, endpoint: str) -> None:
        """Present this worker's CURVE key pair to the peer at ``endpoint``."""
        import zmq

        if not self.curve:
            return
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self._public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self._server_key(endpoint))

    def _server_key(self, endpoint: str) -> bytes:
        import zmq.auth

        host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
        # Only an address or a plain host name names a key file (a hint's
        # endpoint must not steer the path out of the keys directory).
        if not _SAFE_HOST.fullmatch(host):
            return self._public
        path = os.path.join(self._public_keys_dir, f"{host}.key")
        if os.path.isfile(path):
            try:
                return zmq.auth.load_certificate(path)[0]
            except (OSError, ValueError) as exc:
                logger.warning("KVCR control key %s is unreadable: %s", path, exc)
        return self._public


_RESOLVE_TIMEOUT_S = 5.0


def _resolve(name: str, timeout_s: float) -> list[Any]:
    """``getaddrinfo`` with a deadline (it has none of its own): a resolver that
    hangs makes the name unresolvable, so nobody by that name gets in."""
    done: list[Any] = []
    failed: list[OSError] = []

    def lookup() -> None:
        try:
            done.extend(socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP))
        except OSError as exc:
            failed.append(exc)

    worker = threading.Thread(target=lookup, name="kvcr-allowlist-dns", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise OSError(f"no answer within {timeout_s:.0f} s")
    if failed:
        raise failed[0]
    return done


def _address(text: str) -> _Address | None:
    """A ZAP peer address (IPv4-mapped IPv6 counts as IPv4); None if not an IP."""
    try:
        addr = ipaddress.ip_address(text.strip("[]").partition("%")[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def _source_host(bind_host: str) -> str:
    """The address outgoing connections leave from: the bind host when it is one
    IP address (bracketed for IPv6), else none (the kernel picks)."""
    try:
        addr = ipaddress.ip_address(bind_host)
    except ValueError:
        return ""
    if addr.is_unspecified:
        return ""
    return f"[{addr}]" if addr.version == 6 else str(addr)


def _zap_handler_class() -> type:
    from zmq.auth.thread import ThreadAuthenticator

    class ZapHandler(ThreadAuthenticator):
        """pyzmq's ZAP thread, deciding by an ``InboundGuard``; never raises."""

        guard: InboundGuard

        async def handle_zap_message(self, msg: list[bytes]) -> None:
            try:
                self._decide(msg)
            except Exception:  # the ZAP thread must live on: a dead one stalls
                logger.exception("KVCR control ZAP handler failed on a request")

        def _decide(self, msg: list[bytes]) -> None:
            if len(msg) < 6:
                if len(msg) >= 2:
                    self._send_zap_reply(msg[1], b"400", b"Not enough frames")
                return
            request_id, domain, address, mechanism = msg[1], msg[2], msg[3], msg[5]
            try:
                ok = domain == ZAP_DOMAIN.encode() and self.guard.allows(
                    address.decode("ascii", "replace"), mechanism, list(msg[6:])
                )
            except Exception:  # a failing check refuses
                logger.exception("KVCR control ZAP check failed; refusing")
                ok = False
            if ok:
                self._send_zap_reply(request_id, b"200", b"OK", "kvcr-peer")
            else:
                self._send_zap_reply(request_id, b"400", b"Not allowed")

    return ZapHandler


_SAFE_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.:-]*[A-Za-z0-9])?")
_STOP_TIMEOUT_S = 5.0


def _stop_authenticator(auth: Any, ctx: Any) -> None:
    """Stop a ZAP thread and destroy its context, bounded: pyzmq's ``stop()``
    waits forever on a thread that already died, so it is called only on a live
    one, from a helper thread joined with a deadline."""
    try:
        if auth is not None and auth.is_alive():
            stopper = threading.Thread(
                target=auth.stop, name="kvcr-zap-stop", daemon=True
            )
            stopper.start()
            stopper.join(_STOP_TIMEOUT_S)
            if stopper.is_alive():
                logger.error("KVCR control ZAP thread did not stop in time")
    finally:
        if ctx is not None:
            ctx.destroy(linger=0)
