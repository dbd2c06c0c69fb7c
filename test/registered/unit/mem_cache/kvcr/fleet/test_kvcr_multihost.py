"""Multi-host, for real: CPU SGLang linker servers in separate Linux network
namespaces joined by a bridge (``cpu_harness.kvcr_netns``; addresses from
198.18.0.0/15, never routed; UCX on each host's veth over TCP only).

Hosts A and B are on each other's ``peer_endpoint_allowlist``; host C is not on
A's. With the allowlist, and again with CURVE keys, a prefix computed on A is
fetched by B through a ``kv.fetch@1.0`` hint naming A, and the bytes cross the
bridge. C, sending the same hint, gets no page (A counts the refused connection),
and NIXL's own metadata fetch from C against every TCP port A's processes listen
on loads no agent metadata (a NIXL listener on B, fetched the same way last, is
the positive control). A killed while B fetches from it: B answers by recompute
within a bound and holds no claims after.

Needs root and iproute2: where namespaces cannot be created the tests fail with the
reason. Opt-in marker ``netns`` (about 7 minutes on 2 cores, outside ``make
test``'s budget): ``make faults`` runs it, or ``pytest -m netns <this file>``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq.auth

from cpu_harness import kvcr_netns as kn
from cpu_harness import kvcr_servers as kvs
from cpu_harness import tiny_model
from cpu_harness.kvcr_pages import fetch_hint, wait_until
from kvcr_drivers.validate import kvcr_metrics, page_hashes

pytestmark = [pytest.mark.netns, pytest.mark.server, pytest.mark.slow, pytest.mark.kvcr]

PROMPT_LEN = 256
ALIGNED = (PROMPT_LEN - 1) // kvs.PAGE * kvs.PAGE
PAGE_BYTES = 4096  # tiny Llama: 2 layers x (K, V) x 2 KV heads x dim 16 x bf16 x 16
READY_S = 600.0
DECOY_PORT = 7999
# Send buffers this small keep a transfer in the sender's memory, so a killed
# sender's transfer stops at once (the kernel would send queued bytes on).
SMALL_SNDBUF = "4096 4096 4096"
THROTTLE_KBIT = 128  # 16 kB/s: the killed transfer's 60 kB take seconds
KILL_AFTER_BYTES = 3 * PAGE_BYTES
# A peer's operations time out after 30 s, so only the preparation deadline (5 s)
# can answer B within ANSWER_BOUND_S (room for a CPU prefill on a busy box); the
# killed fetch's claims resolve by the operation timeout, within CLAIMS_BOUND_S.
TIMEOUTS = {
    "operation_timeout_ms": 30_000,
    "abandon_timeout_ms": 60_000,
    "preparation_timeout_ms": 5_000,
}
ANSWER_BOUND_S = 20.0
CLAIMS_BOUND_S = 90.0


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]


def hint(source: kn.HostServer, ids: list[int]) -> dict[str, Any]:
    return fetch_hint(source.endpoint, page_hashes(ids, kvs.PAGE))


def metric(server: kn.HostServer, name: str) -> float:
    return kvcr_metrics(server.metrics_text()).get(name, 0.0)


def allow(*hosts: kn.Host) -> dict[str, Any]:
    """Timeouts, and an allowlist of ``hosts``' control ports."""
    return {
        **TIMEOUTS,
        "peer_endpoint_allowlist": [f"{h.ip}:{kn.CONTROL_PORT}" for h in hosts],
    }


def start(servers: list[kn.HostServer]) -> list[kn.HostServer]:
    try:
        for s in servers:
            s.wait_ready(READY_S)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


@pytest.fixture(scope="module")
def fabric() -> Iterator[kn.Fabric]:
    fab = kn.Fabric(["a", "b", "c"])
    try:
        fab.__enter__()  # removes what it made if it fails
        for host in fab.hosts.values():
            host.sysctl("net.ipv4.tcp_wmem", SMALL_SNDBUF)
    except (kn.NetnsError, OSError) as exc:
        fab.close()
        reason = f"cannot set up network namespaces, bridge and veths here: {exc}"
        pytest.fail(reason, pytrace=False)
    try:
        yield fab
    finally:
        fab.close()  # raises if a namespace is left
    assert not set(fab.namespaces()) & set(kn.leftover_namespaces())


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_model.ensure_tiny_model()


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("multihost")


def moved_since(server: kn.HostServer, before: dict[str, float]) -> dict[str, float]:
    """How far each ``sglang:kvcr_`` series moved since ``before``."""
    after = kvcr_metrics(server.metrics_text())
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in {*after, *before}}


def peer_reuse(a: kn.HostServer, b: kn.HostServer, ids: list[int]) -> dict[str, Any]:
    """A computes ``ids``; B, hinted at A, restores them over the bridge with the
    output of a recompute, and its peer-fetch counters move."""
    control = a.computed(ids)
    before = kvcr_metrics(b.metrics_text())
    sent = a.host.tx_bytes()
    output, external = b.run(ids, kv_hints=hint(a, ids))
    sent = a.host.tx_bytes() - sent
    assert external >= 0.9 * ALIGNED, (external, b.handle.log_tail())
    assert output == control
    pages = external // kvs.PAGE
    moved: dict[str, float] = {}

    def counted() -> bool:  # the metrics are published at most once a second
        moved.update(moved_since(b, before))
        return (
            moved.get("prepare_wait_seconds_count", 0) >= 1
            and moved.get("hit_pages_total", 0) >= pages
        )

    wait_until(counted, timeout=30, poll_s=0.5, what="B's peer-fetch counters")
    assert moved["hints_accepted_total"] == 1, moved
    assert moved["prepare_wait_seconds_count"] == 1, moved
    assert moved["restored_bytes_total"] >= pages * PAGE_BYTES, moved
    assert sent >= pages * PAGE_BYTES, sent  # it crossed the bridge: UCX over TCP
    assert b.recompute(ids) == output
    return {"restored_tokens": external, "a_sent_bytes": sent}


def test_peer_reuse_across_hosts_with_curve_keys(fabric, model, work, record_property):
    """CURVE on the control channel (and the allowlist): B still restores A's
    prefix through the hint, keys checked both ways."""
    a_host, b_host = fabric.hosts["a"], fabric.hosts["b"]
    keys = work / "keys"
    keys.mkdir()
    pub, sec = {}, {}
    for h in (a_host, b_host):
        pub[h.label], sec[h.label] = zmq.auth.create_certificates(keys, h.label)
        Path(sec[h.label]).chmod(0o600)

    def curve(me: kn.Host, peer: kn.Host) -> dict[str, Any]:
        trusted = keys / f"trusted-{me.label}"
        trusted.mkdir()
        (trusted / f"{peer.ip}.key").write_bytes(Path(pub[peer.label]).read_bytes())
        return {
            **allow(a_host, b_host),
            "control_curve_secret_key_file": sec[me.label],
            "control_curve_public_keys_dir": str(trusted),
        }

    servers = start(
        [
            kn.launch_linker(a_host, "curve-a", model, work, curve(a_host, b_host)),
            kn.launch_linker(b_host, "curve-b", model, work, curve(b_host, a_host)),
        ]
    )
    a, b = servers
    try:
        for key, value in peer_reuse(a, b, prompt(1)).items():
            record_property(key, value)
        assert metric(a, "inbound_refused_total") == 0
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def fleet(fabric, model, work) -> Iterator[dict[str, kn.HostServer]]:
    """A and B allow each other; C allows (dials) A, A does not allow C."""
    a_host, b_host, c_host = (fabric.hosts[x] for x in "abc")
    servers = start(
        [
            kn.launch_linker(a_host, "a", model, work, allow(a_host, b_host)),
            kn.launch_linker(b_host, "b", model, work, allow(a_host, b_host)),
            kn.launch_linker(c_host, "c", model, work, allow(a_host)),
        ]
    )
    try:
        yield dict(zip("abc", servers, strict=True))
    finally:
        for s in servers:
            s.stop()


def test_peer_reuse_across_hosts_with_the_allowlist(fleet, record_property):
    for key, value in peer_reuse(fleet["a"], fleet["b"], prompt(2)).items():
        record_property(key, value)


def test_a_host_off_the_allowlist_gets_no_page(fleet):
    """C's well-formed fetch (its hint accepted, A dialed) is refused and
    counted by A; C recomputes."""
    a, c = fleet["a"], fleet["c"]
    ids = prompt(3)
    control = a.computed(ids)
    refused = metric(a, "inbound_refused_total")
    output, external = c.run(ids, kv_hints=hint(a, ids))
    assert external == 0, c.handle.log_tail()
    assert output == control
    c_metrics = kvcr_metrics(c.metrics_text())
    assert c_metrics.get("hints_accepted_total") == 1, c_metrics  # C did ask A
    assert c_metrics.get("hit_pages_total", 0) == 0, c_metrics
    wait_until(
        lambda: metric(a, "inbound_refused_total") > refused,
        timeout=30,
        poll_s=0.5,
        what="A counted C's refused connection",
    )


def test_a_host_off_the_allowlist_gets_no_agent_metadata_from_any_port(
    fabric, fleet, record_property
):
    """NIXL's own metadata fetch from C against every TCP port A's processes
    listen on loads nothing; the same fetch of a NIXL listener on B does."""
    a, c_host = fleet["a"], fabric.hosts["c"]
    listeners = a.host.listening()
    ports = sorted({lst.port for lst in listeners})
    on_device = {lst.port for lst in listeners if lst.address == a.host.ip}
    assert kn.CONTROL_PORT in on_device, listeners
    assert len(on_device) >= 2, listeners  # the control port and UCX's sockets
    agents = a.agents()
    assert agents, a.handle.log_tail()
    decoy_name = f"decoy-{fabric.suffix}"
    b_host = fabric.hosts["b"]
    decoy = kn.decoy_listener(b_host, DECOY_PORT, decoy_name)
    try:
        probe = kn.fetch_metadata(
            c_host,
            [(a.host.ip, p) for p in ports] + [(b_host.ip, DECOY_PORT)],
            [*agents, decoy_name],
        )
    finally:
        assert decoy.stdin is not None
        decoy.stdin.close()
        decoy.wait(30)
    record_property("ports_tried", ",".join(map(str, ports)))
    assert probe.checked[decoy_name], probe.output[-4000:]  # the fetch works
    assert probe.loaded == {decoy_name}, (probe.by_target, listeners)
    assert not any(probe.checked[n] for n in agents), probe.checked


def test_a_peer_killed_mid_transfer(fleet, record_property):
    """SIGKILL A while B's fetch is on the wire: B answers with the output of a
    recompute within a bound, and holds no claims or fetch bytes after."""
    a, b = fleet["a"], fleet["b"]
    ids = prompt(4)
    control = a.computed(ids)
    a.host.throttle(THROTTLE_KBIT)
    try:
        sent = a.host.tx_bytes()
        started = time.monotonic()
        pending = b.start_run(ids, kv_hints=hint(a, ids))
        wait_until(
            lambda: pending.done() or a.host.tx_bytes() - sent >= KILL_AFTER_BYTES,
            timeout=60,
            poll_s=0.05,
            what="A's transfer to B on the wire",
        )
        on_wire = a.host.tx_bytes() - sent
        assert not pending.done(), "B finished before A was killed"
        a.kill()
        killed = time.monotonic()
        output, external = pending.result(ANSWER_BOUND_S)
        answered = time.monotonic()
    finally:
        a.host.unthrottle()
    record_property("on_wire_bytes_at_kill", on_wire)
    record_property("restored_tokens", external)
    record_property("kill_to_answer_s", round(answered - killed, 2))
    record_property("request_s", round(answered - started, 2))
    assert output == control
    assert external < ALIGNED, (external, on_wire)  # the transfer was cut short
    assert answered - killed < ANSWER_BOUND_S, (started, killed, answered)
    settled = {
        "claims_held": 0.0,
        "abandoned_bytes": 0.0,
        "inflight_bytes{op=prepare}": 0.0,
    }
    waited = wait_until(
        lambda: {k: metric(b, k) for k in settled} == settled,
        timeout=CLAIMS_BOUND_S,
        poll_s=1.0,
        what="B holds no claims or fetch bytes",
    )
    record_property("claims_released_s", round(waited, 1))
    assert b.recompute(ids) == control  # B keeps serving
