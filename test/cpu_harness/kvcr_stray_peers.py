"""Peers that misbehave for real, for the peer-trust tests. Test support only.

``Hole`` is a control endpoint that accepts a worker's control messages (real
ZMQ, on 127.0.0.1, so on the default allowlist) and never answers on its own: a
hinted source that accepts ``start_write`` and never completes it. It can also
speak as a peer: ``say`` pushes a msgpack control message to a worker's control
endpoint. ``NixlSender`` is a real NIXL agent (UCX on loopback) that loaded a
worker's agent metadata (what a ``start_write`` carries) and sends it KVCR
``write_done`` notices, as a source, or a stranger, would.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import zmq

from cpu_harness.kvcr_pages import wait_until


class Hole:
    """A control endpoint that takes messages and answers nothing by itself."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sink = self._ctx.socket(zmq.PULL)
        self._sink.linger = 0
        port = self._sink.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seen: list[dict[str, Any]] = []
        self._out: dict[str, Any] = {}

    def wait(self, kind: str, timeout: float = 10.0) -> dict[str, Any]:
        """The first message of type ``kind`` received (waiting up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for message in self.seen:
                if message.get("type") == kind:
                    return message
            if self._sink.poll(50):
                self.seen.append(msgspec.msgpack.decode(self._sink.recv()))
        raise AssertionError(f"no {kind} reached {self.endpoint} in {timeout} s")

    def count(self, kind: str, at_least: int, timeout: float = 10.0) -> int:
        """How many messages of type ``kind`` arrived, once ``at_least`` did or
        ``timeout`` passed (then the number so far)."""
        deadline = time.monotonic() + timeout
        while True:
            n = sum(m.get("type") == kind for m in self.seen)
            if n >= at_least or time.monotonic() >= deadline:
                return n
            if self._sink.poll(50):
                self.seen.append(msgspec.msgpack.decode(self._sink.recv()))

    def say(self, endpoint: str, payload: dict[str, Any]) -> None:
        """Push one control message to ``endpoint`` (from 127.0.0.1)."""
        sock = self._out.get(endpoint)
        if sock is None:
            sock = self._out[endpoint] = self._ctx.socket(zmq.PUSH)
            sock.linger = 1000
            sock.connect(endpoint)
        sock.send(msgspec.msgpack.encode(payload))

    def ack(self, endpoint: str, agent: str) -> None:
        """Answer like a source: this endpoint's NIXL agent is ``agent``."""
        self.say(
            endpoint,
            {
                "type": "target_metadata_ack",
                "sender_control_endpoint": self.endpoint,
                "sender_incarnation": "stray" * 6,
                "target_agent": agent,
            },
        )

    def close(self) -> None:
        for sock in self._out.values():
            sock.close()
        self._sink.close()
        self._ctx.destroy(linger=0)


def write_done(start_write: dict[str, Any], success: bool = True) -> bytes:
    """The KVCR notice completing ``start_write``'s pull (every key written)."""
    payload: dict[str, Any] = {
        "type": "write_done",
        "op_handle": start_write["op_handle"],
        "success": success,
    }
    if success:
        payload["completed_indices"] = list(range(len(start_write["keys"])))
    return b"KVCR:" + msgspec.msgpack.encode(payload)


class NixlSender:
    """A NIXL agent named ``role``-<pid> (or exactly ``name``: NIXL believes
    whatever name a sender gives itself) that loaded a worker's ``metadata``."""

    def __init__(self, role: str, metadata: bytes, name: str | None = None) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name or f"{role}-{os.getpid()}-{time.monotonic_ns()}"
        config = nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]
        )
        self._agent = nixl_agent(self.name, config)
        peer = self._agent.add_remote_agent(metadata)
        self._peer = peer.decode() if isinstance(peer, bytes) else peer

    def send(self, notice: bytes) -> None:
        self._agent.send_notif(self._peer, notice)
        self.pump()

    def pump(self) -> None:
        """Progress this agent's UCX worker (no progress thread runs)."""
        self._agent.get_new_notifs()


def settle(
    predicate: Any, senders: list[NixlSender], timeout: float, what: str
) -> None:
    """``wait_until`` that keeps the senders' UCX workers progressing."""

    def check() -> bool:
        for sender in senders:
            sender.pump()
        return bool(predicate())

    wait_until(check, timeout=timeout, what=what, poll_s=0.02)
