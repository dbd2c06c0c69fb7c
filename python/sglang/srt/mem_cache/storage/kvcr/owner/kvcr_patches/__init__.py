"""Every use of kvcr 0.1.1's private names, in one place (as integration.py is
for SGLang's).

- Idle pacing of ``kvcr-progress`` (``idle_wait``): an idle progress loop blocks
  on its control socket and a wake descriptor, up to ``progress_idle_ms``,
  instead of running Python every millisecond next to the forward.
- NIXL's busy-polling progress thread on or off (``nixl_progress_thread``), and
  NIXL's metadata listener always off: kvcr offers no switch, so its
  ``nixl_agent_config`` is wrapped once (``nixl_agent_settings``). kvcr starts the
  listener (``enable_listen_thread=True``), which NIXL binds on every address and
  which answers agent metadata to, loads metadata from and disconnects peers for
  anyone who reaches it; kvcr never uses it (metadata travels in its control
  messages), so it is turned off, with the thread-safe sync mode NIXL would have
  derived from the listener kept explicitly.
- The inbound check on kvcr's ``ZmqPeerControlChannel`` (``guarded_channel_class``,
  see control_auth): a subclass that swaps kvcr's unchecked PULL socket for one
  guarded by a ZAP handler, and dials peers with the guard's options, keeping
  at most ``outgoing_sockets.MAX_OUTGOING`` outgoing sockets.
- Whether kvcr answered a fetch within the call (``fetch_answered``: pages
  resident here), so its progress loop need not be woken for it; and such a
  fetch's claims taken in one pass instead (``local_claims``).
- Whether a KVCR whose close failed has since become quiescent
  (``core_is_quiescent``: kvcr exposes it on its core only), and how many
  residency claims a KVCR holds (``public_claims``, for shutdown checks).
- Whether a resilience event means this KVCR must be restarted
  (``needs_restart``): after a source-progress gap kvcr turns the worker's source
  writes off "until restart" and says so only in the error's text
  (``kvcr/dangling_ops.py``, ``check_source_progress``); ``restart_hint`` adds
  what an operator can do about such a gap.

Modules beside this one each patch one more part of kvcr, among them
``owner_wake`` (the progress loop wakes the owner thread when it hands it work),
``completion_senders`` (a pull's completion only from the agent it was sent to),
``probe_fences`` (bounded write-probe fences), ``unresolved_fills`` (DRAM held by
failed fetches, counted), ``page_fills`` with ``batched_slots`` (the linker's
own deposits through kvcr's fill path) and ``outgoing_sockets``; ``kvcr_internals`` checks the
internals the first three wrap.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches.idle_wait import (
    configure as configure,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches.idle_wait import (
    pace as pace,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches.idle_wait import (
    wake as wake,
)

logger = logging.getLogger(__name__)

_PROGRESS_LOCK = threading.Lock()
_progress_enabled = True
_progress_patched = False


class nixl_agent_settings:
    """Build a KVCR with NIXL's busy-polling progress thread on or off and its
    metadata listener off; the lock makes the setting per construction."""

    def __init__(self, progress_thread: bool) -> None:
        self._enabled = progress_thread

    def __enter__(self) -> None:
        global _progress_enabled, _progress_patched
        _PROGRESS_LOCK.acquire()
        try:
            if not _progress_patched:
                _wrap_nixl_agent_config()
                _progress_patched = True
        except BaseException:
            _PROGRESS_LOCK.release()
            raise
        _progress_enabled = self._enabled

    def __exit__(self, *exc: object) -> None:
        _PROGRESS_LOCK.release()


def _wrap_nixl_agent_config() -> None:
    from nixl._api import nixl_thread_sync_t

    import kvcr.progress as progress

    original = getattr(progress, "nixl_agent_config", None)
    if original is None:  # kvcr changed how it builds its agent: refuse to guess
        raise RuntimeError(
            "kvcr.progress.nixl_agent_config not found: this plugin supports "
            "kvcr==0.1.1 only (it turns NIXL's metadata listener off there)"
        )

    def config(*args: Any, **kwargs: Any) -> Any:
        return original(
            *args,
            **{
                **kwargs,
                "enable_prog_thread": _progress_enabled,
                "enable_listen_thread": False,
                # What NIXL derives from a listener; kept without one.
                "sync_mode": nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            },
        )

    progress.nixl_agent_config = config


def core_is_quiescent(kv: Any) -> bool:
    """Whether native progress can no longer touch ``kv``'s backend resources."""
    return bool(kv._core.is_quiescent())


# kvcr 0.1.1's words when a stalled source turns new source writes off for good.
_SOURCE_WRITES_OFF = "new source writes disabled until restart"


def needs_restart(exc: BaseException) -> bool:
    """Whether kvcr reported, through its resilience callback, a state only a new
    KVCR leaves (this worker's source writes are off until restart)."""
    return _SOURCE_WRITES_OFF in str(exc)


_PROGRESS_STALLED = "source progress stalled"


def restart_hint(exc: BaseException) -> str:
    """The fix for the restart ``exc`` asks for, when its text says the cause: a
    progress loop that went ``operation_timeout_ms`` without running was starved
    of CPU (measured: idle SGLang schedulers each spin a core); '' otherwise."""
    if _PROGRESS_STALLED not in str(exc):
        return ""
    return (
        " (kvcr's progress loop did not poll for that long; most likely the "
        "host's cores are oversubscribed: idle SGLang schedulers each spin a "
        "core unless started with --sleep-on-idle; or raise operation_timeout_ms)"
    )


def public_claims(kv: Any) -> int:
    """Residency claims ``kv`` holds for its framework."""
    return len(kv._core._local_dram._public_claims)


def fetch_answered(kv: Any, handle: Any) -> bool:
    """Whether ``kv`` answered fetch ``handle`` within the call (every page
    claimed here or failed: kvcr's progress loop has nothing of it to run). An
    unknown shape of kvcr's state says no (the loop is woken as for any fetch)."""
    local = getattr(getattr(kv, "_core", None), "_local_dram", None)
    pending = getattr(local, "_pending_residency_ops", None)
    return isinstance(pending, dict) and ("fetch", handle) not in pending


def unresolved_operations(kv: Any) -> int:
    """Operations ``kv``'s progress thread still owns (a pull from a dead peer
    stays one until a probe proves the peer will never write): a KVCR closed
    with any cannot prove it quiescent."""
    return len(kv._core._progress._in_flight_ops)


_GUARDED: type | None = None
_GUARDED_LOCK = threading.Lock()
# kvcr's control messages carry keys, slot descriptors and, once per peer, NIXL
# agent metadata: kilobytes to a few MiB.
MAX_CONTROL_MESSAGE_BYTES = 64 << 20


def guarded_channel_class() -> type:
    """kvcr's ``ZmqPeerControlChannel`` with the inbound check (built once)."""
    global _GUARDED
    with _GUARDED_LOCK:
        if _GUARDED is None:
            _GUARDED = _build_guarded_channel_class()
        return _GUARDED


def _build_guarded_channel_class() -> type:
    import zmq

    from kvcr.control_channels import ZmqPeerControlChannel
    from sglang.srt.mem_cache.storage.kvcr.fleet.control_auth import (
        ControlAuthError,
        InboundGuard,
        _stop_authenticator,
        _zap_handler_class,
    )
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import outgoing_sockets

    for name in ("initialize", "send", "close", "adopt_listener"):
        if not callable(getattr(ZmqPeerControlChannel, name, None)):
            raise ControlAuthError(
                f"kvcr's ZmqPeerControlChannel has no {name}() (not kvcr 0.1.1?); "
                f"the control channel's inbound check cannot be installed"
            )
    zap_handler = _zap_handler_class()

    class GuardedChannel(ZmqPeerControlChannel):
        """A control channel that checks who connects (see the module docstring)."""

        # kvcr's attributes (kvcr ships no type information).
        _listener: socket.socket | None
        _ctx: Any
        _socket: Any
        _outgoing: dict[str, Any]

        def __init__(
            self,
            bind_host: str,
            bind_port: int,
            advertise_host: str,
            *,
            guard: InboundGuard,
        ) -> None:
            super().__init__(bind_host, bind_port, advertise_host)
            self._guard = guard
            self._auth: Any = None

        def initialize(self) -> None:
            self._guard.load()
            super().initialize()  # kvcr's own socket: bound, but nobody reads it
            self._swap_in_guarded_socket()

        def _swap_in_guarded_socket(self) -> None:
            """Replace kvcr's unchecked PULL socket with one on a private context
            whose ZAP handler checks every peer. Security options only apply at
            bind, so the new socket binds again onto the same reserved listener
            (a second descriptor of it); kvcr's socket is closed unread, and a
            peer that had connected to it reconnects through the check."""
            ctx = zmq.Context()
            try:
                auth = zap_handler(ctx)
                auth.guard = self._guard
                auth.start()
            except BaseException as exc:
                ctx.destroy(linger=0)
                raise ControlAuthError(
                    f"KVCR control ZAP handler failed to start: {exc}"
                ) from exc
            listener = self._listener
            if listener is None:  # kvcr's initialize() always reserves one
                _stop_authenticator(auth, ctx)
                raise ControlAuthError("kvcr reserved no control listener")
            guarded = ctx.socket(zmq.PULL)
            guarded.linger = 0
            # A peer's message larger than any kvcr control message drops its
            # connection instead of being buffered whole.
            guarded.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE_BYTES)
            descriptor = None
            try:
                self._guard.server_options(guarded)
                descriptor = os.dup(listener.fileno())
                guarded.setsockopt(zmq.USE_FD, descriptor)
                guarded.bind(self._bind_endpoint)
            except BaseException:
                if descriptor is not None:  # not adopted: still ours to close
                    os.close(descriptor)
                guarded.close()
                _stop_authenticator(auth, ctx)
                raise
            unchecked, self._socket = self._socket, guarded
            unchecked.close()
            self._ctx, self._auth = ctx, auth

        def send(self, endpoint: str, message: bytes) -> bool:
            if not self._guard.may_dial(endpoint):  # before any socket exists
                return False
            outgoing_sockets.make_room(self._outgoing, endpoint)
            # Dial with our options first; kvcr's send then finds the socket.
            fresh = self._ctx is not None and endpoint not in self._outgoing
            if fresh and not self._dial(endpoint):
                return False
            return bool(super().send(endpoint, message))

        def _dial(self, endpoint: str) -> bool:
            peer = self._ctx.socket(zmq.PUSH)
            peer.linger = 0
            try:
                self._guard.client_options(peer, endpoint)
                peer.connect(self._guard.client_endpoint(endpoint))
            except zmq.ZMQError as exc:
                logger.warning("KVCR control: cannot dial %s (%s)", endpoint, exc)
                peer.close()
                return False
            self._outgoing[endpoint] = peer
            return True

        def close(self) -> None:
            try:
                super().close()
            finally:
                auth, self._auth = self._auth, None
                ctx, self._ctx = self._ctx, None
                _stop_authenticator(auth, ctx)

    return GuardedChannel
