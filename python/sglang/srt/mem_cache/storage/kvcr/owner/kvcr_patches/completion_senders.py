"""Completion notices accepted only from the agent a pull was sent to (kvcr 0.1.1).

kvcr's target side takes a ``write_done`` NIXL notification for any of its
in-flight pulls from any agent: ``_RemoteFWDram._poll_notifications`` reads the
values of ``get_new_notifs()`` without the sender's name, and a success marks the
pull's keys resident. Anyone holding this worker's NIXL metadata could so make
stale slots (another tenant's bytes) count as fetched pages, or make kvcr free
slots a real source is still writing. Once ``install`` ran, each source control
endpoint is bound to the NIXL agent it names in its ``target_metadata_ack`` (a
control message, so from a peer the inbound guard admitted; kvcr acks the first
metadata it gets from a target, before it writes), and a ``write_done`` for a
pull reaches kvcr only from the agent bound to the pull's endpoint. One that
arrives before its endpoint's ack (or, from another agent, after kvcr gave the
endpoint up: a source restarted there acks again) is held while its pull still
waits for its notice, as ZMQ and UCX do not order against each other: at most
``MAX_HELD_PER_PULL`` per pull, ``MAX_HELD`` in all, none longer than the
operation timeout, and never for a pull kvcr gave up on (probed or quarantined),
so no sender can fill the hold for good. Any other, or a held one whose pull
ended or stopped waiting, is dropped, counted (``dropped``) and logged once per
sender. Notices kvcr would ignore anyway (not ``write_done``, no such pull) pass
unchanged. ``install`` refuses a kvcr whose
internals are not the 0.1.1 ones.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import threading
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import kvcr_internals

logger = logging.getLogger(__name__)

MAX_HELD = 256  # notices waiting for their endpoint's ack, per KVCR
MAX_HELD_PER_PULL = 4  # a source sends one (a cancelled write: two)
MAX_BOUND = 4096  # source endpoints remembered with their agent, per KVCR
_MAX_WARNED = 256  # senders logged at WARNING; the rest at DEBUG
_ATTR = "_sglang_completion_senders"
_LOCK = threading.Lock()
_installed = False


class _Verdict(enum.Enum):
    PASS = "pass"  # to kvcr
    HOLD = "hold"  # until the pull's endpoint names its agent
    DROP = "drop"  # from an agent the pull was not sent to


@dataclasses.dataclass(slots=True, frozen=True)
class _Held:
    """A notice waiting for its pull's endpoint to name its agent."""

    sender: str
    raw: bytes
    handle: int
    since: float  # kvcr's clock


@dataclasses.dataclass(slots=True)
class SenderChecks:
    """One KVCR's bound agents, held notices and drop count (progress thread)."""

    agents: collections.OrderedDict[str, str] = dataclasses.field(
        default_factory=collections.OrderedDict
    )  # source control endpoint -> the NIXL agent it named
    # Endpoints kvcr gave up on since their agent named itself (a timeout, a
    # refusal): a restarted source there may send before its new ack lands.
    stale: set[str] = dataclasses.field(default_factory=set)
    held: collections.deque[_Held] = dataclasses.field(
        default_factory=collections.deque
    )
    dropped: int = 0
    warned: set[str] = dataclasses.field(default_factory=set)

    def bind(self, endpoint: str, agent: str) -> None:
        self.agents[endpoint] = agent
        self.agents.move_to_end(endpoint)
        self.stale.discard(endpoint)
        while len(self.agents) > MAX_BOUND:
            self.stale.discard(self.agents.popitem(last=False)[0])

    def forget(self, endpoint: str) -> None:
        """kvcr gave ``endpoint`` up: until it names its agent again, a notice
        from another agent waits instead of being dropped."""
        if endpoint in self.agents:
            self.stale.add(endpoint)

    def admit(
        self,
        progress: Any,
        fresh: dict[str, list[bytes]],
        now: float,
        timeout_s: float,
    ) -> dict[str, Any]:
        """The notices of ``fresh`` (and those held before) kvcr may see now;
        ``now`` is kvcr's clock, ``timeout_s`` its operation timeout."""
        pending: list[tuple[str, bytes, _Held | None]] = [
            (h.sender, h.raw, h) for h in self.held
        ]
        self.held.clear()
        pending += [(s, raw, None) for s, notices in fresh.items() for raw in notices]
        out: dict[str, list[bytes]] = {}
        per_pull: collections.Counter[int] = collections.Counter()
        for sender, raw, was in pending:
            verdict, handle = self._judge(progress, sender, raw, was is not None)
            if verdict is _Verdict.PASS:
                out.setdefault(sender, []).append(raw)
                continue
            since = now if was is None else was.since
            if (
                verdict is _Verdict.HOLD
                and now - since < timeout_s
                and per_pull[handle] < MAX_HELD_PER_PULL
                and len(self.held) < MAX_HELD
            ):
                per_pull[handle] += 1
                self.held.append(_Held(sender, raw, handle, since))
            else:
                self._drop(sender)
        return out

    def _judge(
        self, progress: Any, sender: str, raw: bytes, was_held: bool
    ) -> tuple[_Verdict, int]:
        payload = kvcr_internals.decode_notice(raw)
        if payload is None or payload.get("type") != "write_done":
            return _Verdict.PASS, 0
        handle = payload.get("op_handle")
        if type(handle) is not int:
            return _Verdict.PASS, 0
        op = progress._in_flight_ops.get(("target", handle))
        endpoint = getattr(op, "remote_ctrl_ep", None)
        if not isinstance(endpoint, str):
            # No such pull (any more): kvcr ignores it; one held until its pull
            # ended unaccepted is counted.
            return (_Verdict.DROP if was_held else _Verdict.PASS), handle
        bound = self.agents.get(endpoint)
        if bound == sender:
            return _Verdict.PASS, handle
        if (bound is None or endpoint in self.stale) and (
            kvcr_internals.awaits_write_done(op)
        ):
            return _Verdict.HOLD, handle
        return _Verdict.DROP, handle

    def _drop(self, sender: str) -> None:
        self.dropped += 1
        if sender not in self.warned and len(self.warned) < _MAX_WARNED:
            self.warned.add(sender)
            logger.warning(
                "KVCR dropped a completion notice from NIXL agent %r: not the agent "
                "its pull was sent to (further ones from it are only counted)",
                sender,
            )
        else:
            logger.debug("KVCR dropped a completion notice from %r", sender)


class _CheckedAgent:
    """The NIXL agent as ``_poll_notifications`` sees it: checked notices."""

    __slots__ = ("_checks", "_kvcr", "_progress")

    def __init__(self, progress: Any, checks: SenderChecks, kvcr: Any) -> None:
        self._progress, self._checks, self._kvcr = progress, checks, kvcr

    def get_new_notifs(self) -> dict[str, Any]:
        fresh = self._progress.nixl_agent.get_new_notifs()
        timeout_s = self._kvcr.config.operation_timeout_ms / 1000
        return self._checks.admit(self._progress, fresh, self._kvcr._clock(), timeout_s)


class _CheckedProgress:
    """What kvcr 0.1.1's ``_poll_notifications`` reads of progress: its agent."""

    __slots__ = ("nixl_agent",)

    def __init__(self, agent: _CheckedAgent) -> None:
        self.nixl_agent = agent


def checks_of(backend: Any) -> SenderChecks:
    """The checks of one kvcr ``_RemoteFWDram`` (made on first use)."""
    checks = backend.__dict__.get(_ATTR)
    if checks is None:
        checks = backend.__dict__[_ATTR] = SenderChecks()
    return checks


def dropped(kv: Any) -> int:
    """Completion notices ``kv`` (a ``kvcr.KVCR``) dropped so far."""
    backend = getattr(getattr(kv, "_core", None), "_remote_fw_dram", None)
    checks = getattr(backend, "__dict__", {}).get(_ATTR)
    return 0 if checks is None else int(checks.dropped)


def install() -> None:
    """Check kvcr's pulls and acks once per process; raises
    ``kvcr_internals.KVCRInternalsChanged`` when kvcr is not 0.1.1."""
    global _installed
    with _LOCK:
        if _installed:
            return
        backend = kvcr_internals.remote_backend_class()
        original_poll = backend._poll_notifications
        original_ack = backend._handle_target_metadata_ack
        original_invalidate = backend._invalidate_control_peer

        def poll_notifications(self: Any, progress: Any) -> Any:
            agent = _CheckedAgent(progress, checks_of(self), self._kvcr)
            return original_poll(self, _CheckedProgress(agent))

        def handle_ack(self: Any, progress: Any, payload: dict[str, Any]) -> None:
            original_ack(self, progress, payload)
            endpoint = payload.get("sender_control_endpoint")
            agent = payload.get("target_agent")  # kvcr puts its own name there
            if (
                endpoint
                and agent
                and isinstance(endpoint, str)
                and isinstance(agent, str)
            ):
                checks_of(self).bind(endpoint, agent)

        def invalidate(self: Any, endpoint: str) -> None:
            original_invalidate(self, endpoint)
            checks_of(self).forget(endpoint)

        backend._poll_notifications = poll_notifications
        backend._handle_target_metadata_ack = handle_ack
        backend._invalidate_control_peer = invalidate
        _installed = True
