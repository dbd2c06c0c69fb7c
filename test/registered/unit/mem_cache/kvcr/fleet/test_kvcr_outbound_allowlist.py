"""The control channel dials only allowlisted endpoints, whoever names them.

A KVCR control message carries this worker's NIXL agent metadata and memory
regions to whatever endpoint kvcr sends it to, including a reply endpoint that
an admitted peer names. ``GuardedChannel.send`` therefore checks every endpoint
against the allowlist hints are checked against (host and port) before a socket
exists; a refusal is counted and nothing leaves.
"""

from __future__ import annotations

import functools
import time

import zmq

from sglang.srt.mem_cache.storage.kvcr.config.linker_config import KVCRLinkerConfig
from sglang.srt.mem_cache.storage.kvcr.fleet.control_auth import InboundGuard
from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_factory, kvcr_patches

CONFIG = {
    "local_dram_bytes_per_worker": 1 << 26,
    "control_bind_host": "127.0.0.1",
    "control_advertise_host": "127.0.0.1",
    "peer_endpoint_allowlist": ["127.0.0.1"],
}


def _guard(**overrides):
    return InboundGuard.from_config(KVCRLinkerConfig.from_dict({**CONFIG, **overrides}))


def test_the_guard_dials_only_allowlisted_hosts_and_ports():
    guard = _guard(peer_endpoint_allowlist=["127.0.0.1:7000-7009"])
    assert guard.may_dial("tcp://127.0.0.1:7003")
    assert not guard.may_dial("tcp://198.18.0.9:7003")  # another host
    assert not guard.may_dial("tcp://127.0.0.1:7010")  # outside the port range
    assert not guard.may_dial("ipc:///tmp/anything")  # not tcp://host:port
    assert guard.dial_refused == 3


def test_a_channel_sends_nothing_to_an_endpoint_off_the_allowlist():
    guard = _guard(peer_endpoint_allowlist=["127.0.0.1"])
    guarded = functools.partial(kvcr_patches.guarded_channel_class(), guard=guard)
    channel = kvcr_factory._channel_on_own_port(guarded, "127.0.0.1", "127.0.0.1")
    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)
    sink.linger = 0
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    channel.initialize()
    try:
        stranger = "tcp://198.18.0.9:5555"
        assert channel.send(stranger, b"metadata") is False
        assert stranger not in channel._outgoing  # no socket was ever made
        assert guard.dial_refused == 1
        allowed = f"tcp://127.0.0.1:{port}"
        assert channel.send(allowed, b"hello") is True
        assert sink.poll(5000), "the allowlisted peer got nothing"
        assert sink.recv() == b"hello"
    finally:
        channel.close()
        sink.close()
        ctx.term()


def test_a_name_entry_allows_dialing_the_address_it_resolves_to():
    """Peers advertise an IP; an allowlist naming their host still reaches them
    (the entry's ports apply), and nothing else that name does not cover."""
    guard = _guard(peer_endpoint_allowlist=["localhost:7000-7009"])
    guard.load()
    assert guard.may_dial("tcp://127.0.0.1:7001")
    assert not guard.may_dial("tcp://127.0.0.1:7010")
    assert not guard.may_dial("tcp://198.18.0.9:7001")


def test_the_guarded_socket_drops_an_oversized_message(monkeypatch):
    """A peer cannot make the control socket buffer an unbounded message: past
    ``MAX_CONTROL_MESSAGE_BYTES`` its connection is dropped, and a normal
    message from a new connection is still received."""
    monkeypatch.setattr(kvcr_patches, "MAX_CONTROL_MESSAGE_BYTES", 1 << 16)
    guard = _guard()
    guarded = functools.partial(kvcr_patches.guarded_channel_class(), guard=guard)
    channel = kvcr_factory._channel_on_own_port(guarded, "127.0.0.1", "127.0.0.1")
    channel.initialize()
    ctx = zmq.Context()
    try:
        for payload, expected in ((b"x" * (1 << 17), []), (b"small", [b"small"])):
            peer = ctx.socket(zmq.PUSH)
            peer.linger = 0
            peer.connect(channel.endpoint)
            peer.send(payload)
            got = []
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and not got:
                got = channel.recv()
                time.sleep(0.01)
            assert [len(m) for m in got] == [len(m) for m in expected]
            assert got == expected
            peer.close()
    finally:
        channel.close()
        ctx.destroy(linger=0)
