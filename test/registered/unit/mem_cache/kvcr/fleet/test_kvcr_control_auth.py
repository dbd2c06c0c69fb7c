"""Who may pull pages from a worker: the control channel's ZAP address check and
CURVE keys, over real kvcr 0.1.1 + NIXL on loopback (Linux routes all of 127/8
on lo, so a peer bound on 127.0.0.2 is a different address on the same host)."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import zmq.auth

from cpu_harness.kvcr_pages import (
    PAGE_BYTES,
    fetch_hint,
    fill_random,
    hashes_for,
    kv_transfer,
    make_linker,
    make_pool,
    offload_and_commit,
    wait_until,
)
from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRConfigError
from sglang.srt.mem_cache.storage.kvcr.config.linker_config import KVCRLinkerConfig
from sglang.srt.mem_cache.storage.kvcr.fleet.control_auth import InboundGuard
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)

AUTH_LOGGER = "sglang.srt.mem_cache.storage.kvcr.fleet.control_auth"
# Short timeouts: a refused peer's fetch must end (as a miss) quickly.
FAST = {
    "local_dram_bytes_per_worker": 16 * PAGE_BYTES,
    "operation_timeout_ms": 1000,
    "abandon_timeout_ms": 2000,
    "preparation_timeout_ms": 1500,
}


def refused(linker):
    line = linker.stats_line()
    return int(line.split("inbound_refused=")[1].split()[0])


@pytest.fixture
def source():
    """A worker on 127.0.0.1 holding pages 1-2 under hashes ``source.hashes``."""
    made = []

    def start(**overrides):
        pool = make_pool("cpu")
        lk = make_linker(pool, **FAST, **overrides)
        made.append(lk)
        fill_random(pool, [1, 2], seed=7)
        lk.hashes = hashes_for(2, "held")
        assert offload_and_commit(lk, lk.hashes, [1, 2], "cpu") is True
        return lk

    yield start
    for lk in reversed(made):
        lk.close()


def pull(source, peer, rid):
    """What ``peer`` may restore of ``source``'s pages after a hinted preparation."""
    ctx = LinkerRequestContext(rid, 0, fetch_hint(source.endpoint, source.hashes))
    handle = peer.prepare_request(ctx, kv_transfer(source.hashes))
    wait_until(lambda: peer.preparation_ready(handle), what=f"{rid} prepared")
    return peer.lookup(rid, kv_transfer(source.hashes))


def make_keys(tmp_path, name):
    public, secret = zmq.auth.create_certificates(tmp_path, name)
    os.chmod(secret, 0o600)  # what the config requires of a secret key file
    return public, secret


def key_dir(tmp_path, name, **as_host):
    """A public-key directory holding ``{file stem: public key file}``."""
    directory = tmp_path / name
    directory.mkdir()
    for stem, public in as_host.items():
        shutil.copy(public, directory / f"{stem}.key")
    return str(directory)


def curve(tmp_path, name, secret, trusted):
    """CURVE linker options: ``secret`` as this worker's key, and a key directory
    (``<name>_dir``) trusting the public key file ``trusted`` as 127.0.0.1."""
    return {
        "control_curve_secret_key_file": secret,
        "control_curve_public_keys_dir": key_dir(
            tmp_path, f"{name}_dir", **{"127.0.0.1": trusted}
        ),
    }


# ---- real kvcr + NIXL over loopback -------------------------------------------------


@pytest.mark.kvcr
def test_peer_at_an_address_outside_the_allowlist_gets_no_pages(source, caplog):
    """A peer connecting from 127.0.0.2 is refused, counted and logged once; a
    peer on the allowed 127.0.0.1 still hits the same pages."""
    caplog.set_level(logging.WARNING, logger=AUTH_LOGGER)
    a = source()  # default allowlist: its advertised host, 127.0.0.1
    outsider = make_linker(
        make_pool("cpu"),
        **FAST,
        control_bind_host="127.0.0.2",
        peer_endpoint_allowlist=["127.0.0.1"],  # so it may dial a at all
    )
    try:
        assert pull(a, outsider, "out") == []
        assert outsider.stats.hit_pages == 0
        wait_until(lambda: refused(a) >= 1, what="refusal counted")
    finally:
        outsider.close()
    warnings = [r for r in caplog.records if "127.0.0.2" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    before = refused(a)
    insider = make_linker(make_pool("cpu"), **FAST)
    try:
        assert pull(a, insider, "in") == [1, 2]
    finally:
        insider.close()
    assert refused(a) == before


@pytest.mark.kvcr
def test_with_curve_only_a_peer_holding_an_allowed_key_hits(source, tmp_path):
    """CURVE on: a peer whose key is not in the source's key directory gets
    nothing and is counted; a keyed peer hits (and is dialed back with its key)."""
    a_pub, a_sec = make_keys(tmp_path, "a")
    b_pub, b_sec = make_keys(tmp_path, "b")
    _, c_sec = make_keys(tmp_path, "c")
    a = source(**curve(tmp_path, "a", a_sec, b_pub))
    stranger = make_linker(
        make_pool("cpu"), **FAST, **curve(tmp_path, "c", c_sec, a_pub)
    )
    try:
        assert pull(a, stranger, "stranger") == []
        wait_until(lambda: refused(a) >= 1, what="unknown key counted")
    finally:
        stranger.close()
    before = refused(a)
    keyed = make_linker(make_pool("cpu"), **FAST, **curve(tmp_path, "b", b_sec, a_pub))
    try:
        assert pull(a, keyed, "keyed") == [1, 2]
        assert refused(keyed) == 0
    finally:
        keyed.close()
    assert refused(a) == before


# ---- the guard and the config, without kvcr -----------------------------------------


def test_guard_matches_cidrs_names_and_mapped_addresses_and_warns_once(caplog):
    """Entries use the peer_endpoint_allowlist grammar; ports do not apply."""
    caplog.set_level(logging.WARNING, logger=AUTH_LOGGER)
    guard = InboundGuard(["10.1.0.0/16:7000", "localhost", "[fd00::1]:1-2"])
    guard.load()
    assert guard.allows("10.1.2.3", b"NULL", [])
    assert guard.allows("::ffff:10.1.0.9", b"NULL", [])
    assert guard.allows("127.0.0.1", b"NULL", [])  # localhost resolves here
    assert guard.allows("fd00::1", b"NULL", [])
    assert not guard.allows("10.2.0.1", b"NULL", [])
    assert not guard.allows("10.2.0.1", b"NULL", [])
    assert not guard.allows("not-an-ip", b"NULL", [])
    assert guard.refused == 3
    assert len([r for r in caplog.records if "10.2.0.1" in r.getMessage()]) == 1


def test_a_hanging_resolver_makes_the_name_unresolvable_within_a_deadline(
    monkeypatch, caplog
):
    """getaddrinfo has no deadline of its own: a name whose lookup hangs is
    treated as unresolvable after the guard's, and its peers are refused."""
    import threading
    import time

    from sglang.srt.mem_cache.storage.kvcr.fleet import control_auth

    release = threading.Event()
    real = control_auth.socket.getaddrinfo

    def hanging(name, *args, **kwargs):
        if name == "slow.example":
            release.wait(30)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(control_auth.socket, "getaddrinfo", hanging)
    monkeypatch.setattr(control_auth, "_RESOLVE_TIMEOUT_S", 0.3)
    caplog.set_level(logging.WARNING, logger=AUTH_LOGGER)
    guard = InboundGuard(["slow.example", "127.0.0.1"])
    started = time.monotonic()
    guard.load()
    release.set()
    assert time.monotonic() - started < 5
    assert any("slow.example" in r.getMessage() for r in caplog.records)
    assert guard.allows("127.0.0.1", b"NULL", [])


def test_guard_with_curve_refuses_missing_and_unknown_keys(tmp_path):
    a_pub, a_sec = make_keys(tmp_path, "a")
    b_pub, _ = make_keys(tmp_path, "b")
    guard = InboundGuard(
        ["127.0.0.1"],
        secret_key_file=a_sec,
        public_keys_dir=key_dir(tmp_path, "d", b=b_pub),
    )
    guard.load()
    from zmq.utils import z85

    b_raw = z85.decode(zmq.auth.load_certificate(b_pub)[0])
    a_raw = z85.decode(zmq.auth.load_certificate(a_pub)[0])
    assert guard.allows("127.0.0.1", b"CURVE", [b_raw])
    assert not guard.allows("127.0.0.1", b"CURVE", [a_raw])
    assert not guard.allows("127.0.0.1", b"NULL", [])
    assert not guard.allows("127.0.0.2", b"CURVE", [b_raw])
    assert guard.refused == 3


def test_outgoing_connections_leave_from_a_specific_bind_host():
    assert (
        InboundGuard([], source_host="127.0.0.2").client_endpoint("tcp://h:1")
        == "tcp://127.0.0.2:0;h:1"
    )
    assert InboundGuard([], source_host="0.0.0.0").client_endpoint("tcp://h:1") == (
        "tcp://h:1"
    )


def _config(**fields):
    return KVCRLinkerConfig.from_dict({"local_dram_bytes_per_worker": 1, **fields})


def test_curve_config_is_validated_naming_the_field_and_the_fix(tmp_path):
    pub, sec = make_keys(tmp_path, "w")
    good = key_dir(tmp_path, "keys", peer=pub)
    cfg = _config(control_curve_secret_key_file=sec, control_curve_public_keys_dir=good)
    assert cfg.control_curve_public_keys_dir == good
    empty = tmp_path / "empty"
    empty.mkdir()
    garbage = tmp_path / "garbage.key_secret"
    garbage.write_text("not a certificate\n")
    garbage.chmod(0o600)
    public_half = tmp_path / "public_half.key_secret"
    shutil.copy(pub, public_half)
    public_half.chmod(0o600)
    bad_dir = key_dir(tmp_path, "bad")
    (tmp_path / "bad" / "x.key").write_text("nothing here\n")
    cases = [
        ({"control_curve_secret_key_file": sec}, "control_curve_public_keys_dir"),
        ({"control_curve_public_keys_dir": good}, "control_curve_secret_key_file"),
        (
            {
                "control_curve_secret_key_file": str(tmp_path / "missing"),
                "control_curve_public_keys_dir": good,
            },
            "control_curve_secret_key_file",
        ),
        (  # the public half given as the secret key
            {
                "control_curve_secret_key_file": str(public_half),
                "control_curve_public_keys_dir": good,
            },
            "control_curve_secret_key_file",
        ),
        (
            {
                "control_curve_secret_key_file": str(garbage),
                "control_curve_public_keys_dir": good,
            },
            "control_curve_secret_key_file",
        ),
        (
            {
                "control_curve_secret_key_file": sec,
                "control_curve_public_keys_dir": str(empty),
            },
            "control_curve_public_keys_dir",
        ),
        (
            {
                "control_curve_secret_key_file": sec,
                "control_curve_public_keys_dir": sec,
            },
            "control_curve_public_keys_dir",
        ),
        (
            {
                "control_curve_secret_key_file": sec,
                "control_curve_public_keys_dir": bad_dir,
            },
            "control_curve_public_keys_dir",
        ),
    ]
    for fields, name in cases:
        with pytest.raises(KVCRConfigError, match=f"field '{name}'"):
            _config(**fields)


def test_a_secret_key_others_can_read_or_own_is_refused(tmp_path, monkeypatch):
    """Whoever can read this worker's secret key can pose as it to every peer."""
    from sglang.srt.mem_cache.storage.kvcr.config import value_checks

    pub, sec = make_keys(tmp_path, "w")
    keys = key_dir(tmp_path, "keys", peer=pub)
    fields = {
        "control_curve_secret_key_file": sec,
        "control_curve_public_keys_dir": keys,
    }
    _config(**fields)  # 0600 and ours: accepted
    os.chmod(sec, 0o640)
    with pytest.raises(KVCRConfigError, match=r"mode 640\); chmod 600 it"):
        _config(**fields)
    os.chmod(sec, 0o600)
    monkeypatch.setattr(value_checks.os, "geteuid", lambda: os.stat(sec).st_uid + 1)
    with pytest.raises(KVCRConfigError, match="not this worker's user"):
        _config(**fields)
