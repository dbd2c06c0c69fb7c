"""Hostile-input fuzzing of the two parsers that read untrusted text.

``RouterHintParser.parse`` reads ``req.kv_hints`` from any client; it must never
raise, and whatever it accepts must name an allowlisted endpoint (checked here by
an oracle written independently of the parser). ``KVCRLinkerConfig.
from_startup_config`` reads the startup flag; the only exception it may raise is
``KVCRConfigError``, with one line that names the flag. Inputs range from random
JSON-like values and text to near-valid envelopes and configs, objects whose every
method raises, self-containing lists and deeply nested JSON.

``KVCR_FUZZ_EXAMPLES`` sets the examples per target (default 300, as in ``make
test``; ``make faults`` runs 10,000). With ``KVCR_FUZZ_REPORT=<path>`` each test
appends ``{"target", "examples", "failures", "accepted"}`` (inputs the parser
accepted) as a JSON line to that file.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRConfigError
from sglang.srt.mem_cache.storage.kvcr.config.linker_config import (
    FLAG,
    KVCRLinkerConfig,
    field_docs,
)
from sglang.srt.mem_cache.storage.kvcr.fleet.router_hint import (
    EndpointAllowlist,
    FetchHint,
    HintRejection,
    RouterHintParser,
)

FUZZ_EXAMPLES = int(os.environ.get("KVCR_FUZZ_EXAMPLES", "300"))
REPORT = os.environ.get("KVCR_FUZZ_REPORT", "")
U64 = (1 << 64) - 1
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY",
    str(Path(os.environ.get("SGLANG_KVCR_CACHE_DIR", ".cache")) / "hypothesis"),
)
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)


class Counter:
    """Counts example runs and failing runs of one target; reports on request."""

    def __init__(self, target: str) -> None:
        self.target, self.examples, self.failures = target, 0, 0
        self.accepted = 0  # runs whose check returned True (an accepted input)

    def run(self, check: Any, *args: Any) -> None:
        self.examples += 1
        try:
            accepted = check(*args)
        except BaseException:
            self.failures += 1
            raise
        self.accepted += accepted is True

    def write(self) -> None:
        if REPORT:
            line = {"target": self.target, "examples": self.examples}
            line["failures"] = self.failures
            line["accepted"] = self.accepted
            with open(REPORT, "a") as fh:
                fh.write(json.dumps(line) + "\n")


# ---- hostile values --------------------------------------------------------------


class _Boom(Exception):
    pass


class Hostile:
    """Every protocol method raises (repr excepted, so reports stay readable)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # introspection (copy, pickle, hypothesis)
            raise AttributeError(name)
        raise _Boom(name)

    def __getitem__(self, key: Any) -> Any:
        raise _Boom("getitem")

    def __iter__(self) -> Iterator[Any]:
        raise _Boom("iter")

    def __len__(self) -> int:
        raise _Boom("len")

    def __eq__(self, other: object) -> bool:
        raise _Boom("eq")

    def __hash__(self) -> int:
        raise _Boom("hash")

    def __bool__(self) -> bool:
        raise _Boom("bool")

    def __index__(self) -> int:
        raise _Boom("index")

    def __str__(self) -> str:
        raise _Boom("str")

    def __repr__(self) -> str:
        return "Hostile()"


class HostileMapping(Mapping):
    """A Mapping whose lookups raise."""

    def __getitem__(self, key: Any) -> Any:
        raise _Boom("mapping getitem")

    def get(self, key: Any, default: Any = None) -> Any:
        raise _Boom("mapping get")

    def __iter__(self) -> Iterator[Any]:
        return iter(["actions", "payload"])

    def __len__(self) -> int:
        return 2

    def __repr__(self) -> str:
        return "HostileMapping()"


class SneakyStr(str):
    """A str subclass whose methods lie; the parser must read the plain value."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 0

    def startswith(self, *args: Any) -> bool:  # type: ignore[override]
        return True

    def lower(self) -> str:
        return "127.0.0.1"

    def __str__(self) -> str:
        return "tcp://127.0.0.1:1"


class RaisingList(list):
    def __iter__(self) -> Iterator[Any]:
        raise _Boom("list iter")


def self_containing() -> list[Any]:
    box: list[Any] = []
    box.append(box)
    return box


# Custom objects go through builds(): hypothesis hashes sampled_from elements.
WEIRD = (
    st.sampled_from(
        [
            float("nan"),
            float("inf"),
            b"tcp://127.0.0.1:1",
            True,
            "tcp://",
            "tcp://:",
            "tcp://[::]:1",
            "tcp://0.0.0.0:1",
        ]
    )
    | st.builds(pow, st.sampled_from([10, -10]), st.integers(300, 400))
    | st.builds(Hostile)
    | st.builds(HostileMapping)
    | st.builds(SneakyStr, st.sampled_from(["tcp://10.9.9.9:1", "kv.fetch", "1.0"]))
    | st.builds(RaisingList, st.just([1, 2]))
    | st.builds(bytearray, st.binary(max_size=4))
    | st.builds(object)
    | st.builds(self_containing)
)
PLAIN_LEAF = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 80), max_value=1 << 80)
    | st.floats()
    | st.text(max_size=40)
)
PLAIN_JSON = st.recursive(
    PLAIN_LEAF,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=8,
)
LEAF = PLAIN_LEAF | st.binary(max_size=16) | WEIRD
JSON = st.recursive(
    LEAF,
    lambda inner: st.lists(inner, max_size=4)
    | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=12) | st.just("actions"), inner, max_size=4),
    max_leaves=8,
)

# ---- near-valid hints around a restrictive allowlist -------------------------------

ALLOWLIST = (
    "10.1.0.0/16:5000-5009",
    "[fd00::/64]:7000",
    "peer.example:6000-6001",
    "127.0.0.1:4000",
)
HOSTS = st.sampled_from(
    [
        "10.1.2.3",
        "10.1.255.255",
        "10.2.0.1",
        "010.1.0.1",
        "10.1.0.1.",
        " 10.1.0.1",
        "10.1.0.1 ",
        "10.1",
        "[fd00::1]",
        "[FD00::1]",
        "[fd00:0:0:1::1]",
        "[::ffff:10.1.0.1]",
        "[fd00::1%eth0]",
        "fd00::1",
        "peer.example",
        "PEER.Example",
        "peer.example.",
        "peer.example.evil",
        "evil.peer.example",
        "peer-example",
        "\u0440eer.example",  # a Cyrillic er for the p
        "peer.example\x00",
        "127.0.0.1",
        "127.1",
        "0x7f000001",
        "2130706433",
        "localhost",
        "[::1]",
        "0.0.0.0",
        "",
        "*",
    ]
) | st.text(max_size=12)
PORTS = st.integers(min_value=-2, max_value=70000).map(str) | st.sampled_from(
    [
        "4000",
        "5000",
        "5009",
        "5010",
        "6001",
        "6002",
        "7000",
        "05000",
        "+5000",
        " 5000",
        "5000 ",
        "5_000",
        "\u0665\u0660\u0660\u0660",
        "",
        "0x1388",
    ]
)
ENDPOINTS = st.builds(
    lambda scheme, host, port, sep: f"{scheme}{host}{sep}{port}",
    st.sampled_from(["tcp://", "tcp://", "TCP://", "udp://", "tcp:/", ""]),
    HOSTS,
    PORTS,
    st.sampled_from([":", ":", "]:", "::"]),
)
HEX = st.builds(
    lambda prefix, value, width: prefix + format(value, f"0{width}x"),
    st.sampled_from(["", "", "0x", "0X"]),
    st.integers(min_value=0, max_value=(1 << 72) - 1),
    st.sampled_from([16, 16, 15, 17]),
)
HASHES = st.lists(
    st.integers(min_value=-(1 << 64), max_value=1 << 65)
    | HEX
    | st.sampled_from([True, 1.0, "", "g" * 16, None]),
    min_size=0,
    max_size=4,
)
PAYLOADS = st.fixed_dictionaries(
    {"source_control_endpoint": ENDPOINTS, "block_hashes": HASHES},
    optional={
        "mode": st.sampled_from(["copy", "copy", "move", "", None]),
        "no_retain": st.sampled_from([False, True, None, 0, "false"]),
    },
)
# Near-valid actions (cheap to draw: the oracle test runs these only).
ACTIONS = st.fixed_dictionaries(
    {
        "action_type": st.sampled_from(
            ["kv.fetch", "kv.fetch", "KV.FETCH", "kv.store"]
        ),
        "action_version": st.sampled_from(["1.0", "1", "1.9", "2.0", "1.0.0", " 1.0"]),
        "payload": PAYLOADS,
    }
)
# Actions with hostile values anywhere.
WILD_ACTIONS = st.fixed_dictionaries(
    {
        "action_type": st.sampled_from(["kv.fetch", "kv.fetch", "kv.store"]) | LEAF,
        "action_version": st.sampled_from(["1.0", "1", "2.0"]) | LEAF,
        "payload": PAYLOADS | JSON,
    }
)
ENVELOPE_DICTS = st.fixed_dictionaries(
    {"actions": st.lists(ACTIONS | WILD_ACTIONS | LEAF, max_size=3) | LEAF},
    optional={"protocol_version": LEAF, "message_id": LEAF},
)
ENVELOPE_OBJECTS = ENVELOPE_DICTS.map(
    lambda env: SimpleNamespace(
        actions=[
            SimpleNamespace(**a) if isinstance(a, dict) else a for a in env["actions"]
        ]
        if type(env["actions"]) is list
        else env["actions"]
    )
)
# Actions the allowlist should accept (most of them, before the rank offset is
# added): without these the oracle below would only ever see rejections.
ALLOWED_ENDPOINTS = (
    st.builds(
        "tcp://10.1.{}.{}:{}".format,
        st.integers(0, 255),
        st.integers(0, 255),
        st.integers(5000, 5009),
    )
    | st.builds("tcp://[fd00::{:x}]:7000".format, st.integers(0, 0xFFFF))
    | st.builds("tcp://peer.example:{}".format, st.integers(6000, 6001))
    | st.just("tcp://127.0.0.1:4000")
)
VALID_HASHES = st.lists(
    st.integers(min_value=-(1 << 63), max_value=U64)
    | st.builds(
        lambda prefix, value: prefix + format(value, "016x"),
        st.sampled_from(["", "0x", "0X"]),
        st.integers(min_value=0, max_value=U64),
    ),
    min_size=1,
    max_size=4,
)
ALLOWED_ACTIONS = st.fixed_dictionaries(
    {
        "action_type": st.just("kv.fetch"),
        "action_version": st.sampled_from(["1.0", "1", "1.9"]),
        "payload": st.fixed_dictionaries(
            {
                "source_control_endpoint": ALLOWED_ENDPOINTS,
                "block_hashes": VALID_HASHES,
            },
            optional={"mode": st.just("copy"), "no_retain": st.just(False)},
        ),
    }
)
# At least this share of the allowlist oracle's examples must be accepted hints.
ACCEPTED_FLOOR = 0.25
HINT_INPUTS = (
    JSON
    | ENVELOPE_DICTS
    | ENVELOPE_OBJECTS
    | st.lists(ENVELOPE_DICTS | LEAF, max_size=2)
    | st.tuples(ENVELOPE_DICTS)
)


def _oracle_allows(host: str, port: int) -> bool:
    """Independent of the parser: is ``host:port`` inside ALLOWLIST?"""
    if host.startswith("[") and host.endswith("]"):
        try:
            addr6 = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return port == 7000 and addr6 in ipaddress.IPv6Network("fd00::/64")
    if re.fullmatch(r"[0-9]+(\.[0-9]+){3}", host):
        try:
            addr4 = ipaddress.IPv4Address(host)
        except ValueError:
            return False
        return (
            addr4 in ipaddress.IPv4Network("10.1.0.0/16") and 5000 <= port <= 5009
        ) or (str(addr4) == "127.0.0.1" and port == 4000)
    return host == "peer.example" and 6000 <= port <= 6001


def _plain(value: Any) -> str:
    return str.__str__(value) if isinstance(value, str) else ""


def _dumps(value: Any) -> str:
    """JSON text of a generated value; values json cannot encode become '{}'."""
    try:
        return json.dumps(value, default=repr)
    except (ValueError, TypeError, RecursionError):
        return "{}"


def _expected_hashes(raw: Any) -> tuple[int, ...] | None:
    """The u64 values a well-formed ``block_hashes`` list stands for, else None."""
    if not isinstance(raw, list | tuple) or not raw:
        return None
    out = []
    for item in raw:
        if type(item) is int and -(1 << 63) <= item <= U64:
            out.append(item & U64)
        elif type(item) is str and re.fullmatch(r"(0[xX])?[0-9a-fA-F]{16}", item):
            out.append(int(item[-16:], 16))
        else:
            return None
    return tuple(out)


HOSTILE_COUNT = Counter("RouterHintParser.parse (hostile input)")
ALLOWLIST_COUNT = Counter("RouterHintParser.parse (allowlist oracle)")
CONFIG_COUNT = Counter("KVCRLinkerConfig.from_startup_config")


def _check_hostile(kv_hints: Any, rank_offset: int) -> bool:
    parser = RouterHintParser(
        EndpointAllowlist(["0.0.0.0/0", "::/0", "peer.example"], "127.0.0.1"),
        rank_offset=rank_offset,
    )
    hint = parser.parse(kv_hints)  # must not raise, whatever kv_hints is
    counted = sum(parser.stats.rejected.values()) + parser.stats.accepted
    assert counted <= 1, parser.stats
    assert hint is None or isinstance(hint, FetchHint)
    if hint is not None:
        assert parser.stats.accepted == 1
        assert re.fullmatch(
            r"tcp://(\[[0-9a-f:.]+\]|[a-z0-9.\-]+):[0-9]{1,5}", hint.source_endpoint
        )
        assert 0 < int(hint.source_endpoint.rsplit(":", 1)[1]) <= 65535
        assert hint.block_hashes and all(0 <= h <= U64 for h in hint.block_hashes)
    return hint is not None


def _check_allowlist(envelope: Any, rank_offset: int) -> bool:
    """True when the parser accepted the hint (then checked against the oracle)."""
    parser = RouterHintParser(
        EndpointAllowlist(ALLOWLIST, "127.0.0.1"), rank_offset=rank_offset
    )
    hint = parser.parse(envelope)
    if hint is None:
        return False
    host, _, port = hint.source_endpoint[len("tcp://") :].rpartition(":")
    assert _oracle_allows(host, int(port)), hint.source_endpoint
    payload = next(
        a["payload"]
        for a in envelope["actions"]
        if _plain(a.get("action_type")) == "kv.fetch"
        and re.fullmatch(r"1(\.[0-9]{1,6})?", _plain(a.get("action_version")))
    )
    given_port = int(_plain(payload["source_control_endpoint"]).rsplit(":", 1)[1])
    assert int(port) == given_port + rank_offset
    assert hint.block_hashes == _expected_hashes(payload["block_hashes"])
    return True


@FUZZ
@given(HINT_INPUTS, st.integers(min_value=0, max_value=7))
def test_hint_parser_never_raises_on_hostile_input(kv_hints, rank_offset):
    """Any value at all yields None or a well-formed FetchHint, counted at most once."""
    HOSTILE_COUNT.run(_check_hostile, kv_hints, rank_offset)


@FUZZ
@given(
    st.fixed_dictionaries(
        {"actions": st.lists(ALLOWED_ACTIONS | ACTIONS, min_size=1, max_size=2)},
        optional={"protocol_version": st.just("1.0")},
    ),
    st.integers(min_value=0, max_value=3),
)
def _allowlist_examples(envelope, rank_offset):
    ALLOWLIST_COUNT.run(_check_allowlist, envelope, rank_offset)


def test_hint_parser_accepts_only_allowlisted_endpoints():
    """An accepted hint names an allowlisted host and port (rank-shifted) and the
    exact hashes given; anything else is rejected. Enough of the examples must be
    accepted for the oracle to have judged something."""
    examples, accepted = ALLOWLIST_COUNT.examples, ALLOWLIST_COUNT.accepted
    _allowlist_examples()
    examples = ALLOWLIST_COUNT.examples - examples
    accepted = ALLOWLIST_COUNT.accepted - accepted
    assert examples >= FUZZ_EXAMPLES, examples
    assert accepted >= ACCEPTED_FLOOR * examples, (
        f"only {accepted} of {examples} examples were accepted hints"
    )


# ---- config parser -------------------------------------------------------------

FIELDS = list(field_docs())
CONFIG_VALUES = (
    st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.sampled_from([0, 1, 1000, 2000, 65535, 65536, 10**5000, -(10**5000)])
    | st.floats()
    | st.booleans()
    | st.none()
    | st.text(max_size=30)
    | st.sampled_from(
        [
            "lru",
            "fifo",
            "auto",
            "staged",
            "direct",
            "0.0.0.0",
            "::",
            "*",
            "127.0.0.1",
            "a b",
            "h\x00st",
            "10.0.0.0/8:1-2",
            "[::1]:5",
            "x:0",
            "x:9-1",
            "x:1-99999",
        ]
    )
    | st.lists(
        st.text(max_size=20)
        | st.sampled_from(["10.0.0.0/8", "[fd00::1]:7-9", "h:1-2", "[", ":", "a/b"])
        | st.integers(),
        max_size=3,
    )
    | PLAIN_JSON
)
CONFIG_DICTS = st.dictionaries(
    st.sampled_from([*FIELDS, "local_dram_bytes", "linker_extra_config", "bogus"])
    | st.text(max_size=10),
    CONFIG_VALUES,
    max_size=6,
).map(lambda d: {"local_dram_bytes_per_worker": 1 << 20, **d} if len(d) % 2 else d)
CONFIG_INPUTS = (
    CONFIG_DICTS
    | CONFIG_DICTS.map(lambda d: {"linker_extra_config": d})
    | CONFIG_DICTS.map(lambda d: _dumps(d))
    | st.builds(
        lambda d, cut: _dumps(d)[:cut],
        CONFIG_DICTS,
        st.integers(min_value=0, max_value=200),
    )
    | CONFIG_DICTS.map(lambda d: _dumps(d).encode())
    | st.integers(min_value=1, max_value=200_000).map(lambda n: "[" * n)
    | st.integers(min_value=1, max_value=200_000).map(lambda n: '{"a":' * n)
    | st.binary(max_size=40)
    | st.text(max_size=60)
    | PLAIN_JSON
)


def _check_config(backend: str, raw: Any) -> bool:
    try:
        config = KVCRLinkerConfig.from_startup_config(backend, raw)
    except KVCRConfigError as exc:
        message = str(exc)
        assert message.startswith(FLAG), message[:200]
        assert "\n" not in message, message[:200]
        assert len(message) < 4000, len(message)
        return False
    assert isinstance(config, KVCRLinkerConfig)
    assert config.local_dram_bytes_per_worker >= 1
    assert config.abandon_timeout_ms >= 2 * config.operation_timeout_ms
    assert 0 <= config.control_port <= 65535
    return True


@FUZZ
@given(
    st.sampled_from(["kvcr", "dynamic", "mooncake", ""]) | st.text(max_size=8),
    CONFIG_INPUTS,
)
def test_config_parser_raises_only_the_one_line_config_error(backend, raw):
    """Whatever the flag holds, parsing returns a valid config or raises one
    KVCRConfigError line naming the flag; nothing else escapes."""
    CONFIG_COUNT.run(_check_config, backend, raw)


def test_deeply_nested_json_is_a_config_error_not_a_recursion_error():
    """The fuzzer's first find, pinned: json.loads recursion is reported as the flag."""
    for text in ("[" * 200_000, '{"a":' * 200_000):
        try:
            KVCRLinkerConfig.from_startup_config("kvcr", text)
        except KVCRConfigError as exc:
            assert "\n" not in str(exc) and str(exc).startswith(FLAG)
        else:
            raise AssertionError("nested JSON parsed as a config")


def test_huge_integers_are_a_config_error_naming_the_field():
    """Python ints past the str-conversion limit (Engine kwargs) are still one line."""
    for name in ("local_dram_bytes_per_worker", "control_port", "operation_timeout_ms"):
        raw = {"local_dram_bytes_per_worker": 1, name: -(10**5000)}
        try:
            KVCRLinkerConfig.from_startup_config("kvcr", raw)
        except KVCRConfigError as exc:
            assert f"'{name}'" in str(exc) and "\n" not in str(exc)
        else:
            raise AssertionError(f"{name}=-10**5000 accepted")


def test_ipv6_zone_id_in_a_hint_endpoint_is_rejected():
    """'[fd00::1%eth0]' parsed as an address and its free-text zone went to KVCR."""
    parser = RouterHintParser(EndpointAllowlist(["::/0"], "127.0.0.1"), rank_offset=0)
    for host in ("fd00::1%eth0", "fe80::1%1", "fd00::1%a\nb"):
        payload = {
            "source_control_endpoint": f"tcp://[{host}]:5000",
            "block_hashes": [1],
        }
        action = {
            "action_type": "kv.fetch",
            "action_version": "1.0",
            "payload": payload,
        }
        assert parser.parse({"actions": [action]}) is None
    assert parser.stats.rejected[HintRejection.BAD_ENDPOINT] == 3


def test_bracketed_allowlist_entry_never_drops_its_port_restriction():
    """'[fd00::]/64:7000' used to parse as fd00::/128 on every port; now refused."""
    for entry in ("[fd00::]/64:7000", "[::1]junk:80", "[::1", "[::1]/8"):
        raw = {"local_dram_bytes_per_worker": 1, "peer_endpoint_allowlist": [entry]}
        try:
            KVCRLinkerConfig.from_startup_config("kvcr", raw)
        except KVCRConfigError as exc:
            assert "peer_endpoint_allowlist" in str(exc) and "\n" not in str(exc)
        else:
            raise AssertionError(f"{entry!r} accepted")
    parsed = EndpointAllowlist(["[fd00::/64]:7000"], "127.0.0.1")
    assert parsed.allows("[fd00::5]", 7000)
    assert not parsed.allows("[fd00::5]", 7001)
    assert not parsed.allows("[fd01::5]", 7000)


def test_control_characters_in_hosts_are_refused_at_parse_time():
    """A NUL or newline in a host would fail later inside ZMQ; refuse it up front."""
    for name in ("control_bind_host", "control_advertise_host"):
        raw = {"local_dram_bytes_per_worker": 1, name: "host\x00name"}
        try:
            KVCRLinkerConfig.from_startup_config("kvcr", raw)
        except KVCRConfigError as exc:
            assert f"'{name}'" in str(exc)
        else:
            raise AssertionError(f"{name} with a NUL accepted")


def teardown_module(module: Any) -> None:
    for counter in (HOSTILE_COUNT, ALLOWLIST_COUNT, CONFIG_COUNT):
        if counter.examples:
            counter.write()


if __name__ == "__main__":  # pragma: no cover - run through pytest
    sys.exit("run with pytest")


def test_the_fault_driver_fuzzes_this_module():
    """``make faults`` runs its fuzz part over this file: the path it names is it."""
    from kvcr_drivers.faults import fuzz

    assert fuzz.FUZZ_TESTS.resolve() == Path(__file__).resolve()
