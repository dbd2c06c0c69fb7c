"""RouterHintParser: a kv.fetch hint becomes a FetchHint, or is ignored and counted."""

from __future__ import annotations

import ast
import logging
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sglang.srt.managers.kv_hints import KvHintAction, KvHintsEnvelope

from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRConfigError
from sglang.srt.mem_cache.storage.kvcr.config.linker_config import KVCRLinkerConfig
from sglang.srt.mem_cache.storage.kvcr.fleet import router_hint
from sglang.srt.mem_cache.storage.kvcr.fleet.router_hint import (
    EndpointAllowlist,
    FetchHint,
    HintRejection,
    HintStats,
    RouterHintParser,
)
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import page_hash_to_u64

U64 = (1 << 64) - 1
ENDPOINT = "tcp://127.0.0.1:43149"
FUZZ_EXAMPLES = int(os.environ.get("KVCR_FUZZ_EXAMPLES", "300"))
# Hypothesis' caches and example database go under the ignored scratch dir, not ./
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY",
    str(Path(os.environ.get("SGLANG_KVCR_CACHE_DIR", ".cache")) / "hypothesis"),
)


def fetch_payload(**overrides):
    payload = {"source_control_endpoint": ENDPOINT, "block_hashes": [1, 2, 3]}
    payload.update(overrides)
    return payload


def dict_envelope(*actions):
    return {"protocol_version": "0.1", "message_id": "m-1", "actions": list(actions)}


def dict_action(payload, action_type="kv.fetch", version="1.0", action_id="a-1"):
    return {
        "action_id": action_id,
        "action_type": action_type,
        "action_version": version,
        "payload": payload,
    }


def envelope_with(payload):
    return dict_envelope(dict_action(payload))


def make_parser(entries=(), default_host="127.0.0.1", rank_offset=0, **kwargs):
    return RouterHintParser(
        EndpointAllowlist(entries, default_host), rank_offset=rank_offset, **kwargs
    )


def rejections(parser):
    return {r: n for r, n in parser.stats.rejected.items() if n}


def test_typed_struct_and_dict_envelopes_give_the_same_fetch_hint():
    """SGLang's msgspec envelope (attribute access) and a dict (key access) agree."""
    payload = fetch_payload(block_hashes=[7, -1, "0x00000000000000ff"])
    struct = KvHintsEnvelope(
        protocol_version="0.1",
        message_id="m-1",
        actions=[
            KvHintAction(
                action_id="a-1",
                action_type="kv.fetch",
                action_version="1.0",
                payload=payload,
            )
        ],
    )
    parser = make_parser()
    from_struct = parser.parse(struct)
    from_dict = parser.parse(envelope_with(payload))
    from_list = parser.parse([struct, None])
    expected = FetchHint(ENDPOINT, (7, U64, 0xFF))
    assert from_struct == from_dict == from_list == expected
    assert parser.stats.accepted == 3
    assert not rejections(parser)


@pytest.mark.parametrize(
    "kv_hints",
    [None, [], dict_envelope(), {"protocol_version": "0.1", "message_id": "m"}],
    ids=["none", "empty-list", "no-actions", "actions-key-absent"],
)
def test_absent_hint_returns_none_without_counting_a_rejection(kv_hints):
    """No hint is not a rejection: nothing is counted or logged as ignored."""
    parser = make_parser()
    assert parser.parse(kv_hints) is None
    assert not rejections(parser)
    assert parser.stats.accepted == 0


def test_other_actions_are_skipped_and_the_first_kv_fetch_is_used():
    """Foreign actions and other kv.fetch majors are counted; the first fit wins."""
    envelope = dict_envelope(
        dict_action({"x": 1}, action_type="kv.prefetch"),
        dict_action(fetch_payload(block_hashes=[9]), version="2.0"),
        "not-an-action",
        dict_action(fetch_payload(block_hashes=[1])),
        dict_action(fetch_payload(block_hashes=[2])),
    )
    parser = make_parser()
    assert parser.parse(envelope) == FetchHint(ENDPOINT, (1,))
    assert parser.stats.ignored_other_actions == 3
    assert parser.stats.accepted == 1


@pytest.mark.parametrize(
    ("version", "accepted"),
    [
        ("1.0", True),
        ("1", True),
        ("1.7", True),
        ("2.0", False),
        ("10.0", False),
        ("1.0-rc1", False),
        ("", False),
        (1.0, False),
    ],
    ids=["1.0", "1", "minor-1.7", "major-2", "major-10", "suffix", "empty", "float"],
)
def test_kv_fetch_is_used_only_for_major_version_one(version, accepted):
    """Minor versions only add fields, so 1.x is read; any other version is skipped."""
    parser = make_parser()
    hint = parser.parse(dict_envelope(dict_action(fetch_payload(), version=version)))
    assert (hint is not None) is accepted
    assert parser.stats.ignored_other_actions == (0 if accepted else 1)


def _negative_page_hash():
    from sglang.srt.mem_cache import utils

    for start in range(64):
        (page,) = utils.get_storage_hash_str(list(range(start, start + 16)), None, 16)
        if utils.hash_str_to_int64(page) < 0:
            return page, utils.hash_str_to_int64(page)
    pytest.fail("no sglang page hash with the top bit set in 64 tries")


def test_signed_unsigned_and_hex_hashes_of_a_real_page_map_to_one_value():
    """Router int64, uint64 and hex-prefix forms of one SGLang page hash agree."""
    page, signed = _negative_page_hash()
    unsigned = page_hash_to_u64(page)
    assert unsigned == signed & U64 and unsigned >= 1 << 63
    forms = [signed, unsigned, page[:16], "0x" + page[:16].upper()]
    hint = make_parser().parse(envelope_with(fetch_payload(block_hashes=forms)))
    assert hint is not None
    assert hint.block_hashes == (unsigned,) * 4


def test_page_hash_to_u64_matches_sglang_for_positive_hashes_and_rejects_junk():
    """Below 2**63 the unsigned form equals SGLang's value; junk raises ValueError."""
    from sglang.srt.mem_cache import utils

    for page in utils.get_storage_hash_str(list(range(64)), None, 16):
        assert page_hash_to_u64(page) == utils.hash_str_to_int64(page) & U64
    for junk in ["", "abc", "zz" * 16, "0x" + "0" * 16, None]:
        with pytest.raises(ValueError):
            page_hash_to_u64(junk)


@pytest.mark.parametrize(
    ("rank_offset", "endpoint", "expected"),
    [
        (0, "tcp://127.0.0.1:43149", "tcp://127.0.0.1:43149"),
        (1, "tcp://127.0.0.1:43149", "tcp://127.0.0.1:43150"),
        (7, "tcp://127.0.0.1:65528", "tcp://127.0.0.1:65535"),
        (3, "tcp://[::1]:5000", "tcp://[::1]:5003"),
        (2, "tcp://Peer-0.Example.com:80", "tcp://peer-0.example.com:82"),
    ],
    ids=["rank0", "rank1", "rank7-at-limit", "ipv6-rank3", "hostname-rank2"],
)
def test_endpoint_port_is_realigned_by_the_rank_offset(rank_offset, endpoint, expected):
    """A router names rank 0's port; rank r dials port + r on the same host."""
    parser = make_parser(
        ["127.0.0.1", "::1", "peer-0.example.com"], rank_offset=rank_offset
    )
    hint = parser.parse(envelope_with(fetch_payload(source_control_endpoint=endpoint)))
    assert hint == FetchHint(expected, (1, 2, 3))


def test_realigned_port_past_65535_is_rejected_and_counted():
    """Port 65535 on rank 1 would be 65536: the hint is ignored, not wrapped."""
    parser = make_parser(rank_offset=1)
    payload = fetch_payload(source_control_endpoint="tcp://127.0.0.1:65535")
    assert parser.parse(envelope_with(payload)) is None
    assert rejections(parser) == {HintRejection.PORT_OUT_OF_RANGE: 1}


@pytest.mark.parametrize(
    ("entries", "host", "port", "allowed"),
    [
        (["10.0.0.0/8"], "10.1.2.3", 5000, True),
        (["10.0.0.0/8"], "11.1.2.3", 5000, False),
        (["fd00::/8"], "[fd00::1]", 5000, True),
        (["fd00::/8"], "10.1.2.3", 5000, False),
        (["Peer.Example.com"], "PEER.example.COM", 5000, True),
        (["peer.example.com"], "other.example.com", 5000, False),
        (["peer.example.com"], "sub.peer.example.com", 5000, False),
        (["10.0.0.0/8:5000-5007"], "10.0.0.1", 5007, True),
        (["10.0.0.0/8:5000-5007"], "10.0.0.1", 5008, False),
        (["10.0.0.1:6000"], "10.0.0.1", 6000, True),
        (["10.0.0.1:6000"], "10.0.0.1", 6001, False),
        (["[::1]:7000-7001"], "::1", 7001, True),
        ([], "127.0.0.1", 43149, True),
        ([], "127.0.0.2", 43149, False),
        (["localhost"], "127.0.0.1", 80, False),
        (["10.0.0.1"], "localhost", 80, False),
    ],
    ids=[
        "cidr4-in",
        "cidr4-out",
        "cidr6-in",
        "cidr6-vs-v4",
        "host-case-insensitive",
        "other-host",
        "no-suffix-match",
        "range-top",
        "range-past",
        "single-port",
        "single-port-other",
        "bracketed-v6-range",
        "default-own-host",
        "default-other-host",
        "no-dns-name-vs-ip",
        "no-dns-ip-vs-name",
    ],
)
def test_allowlist_matches_networks_names_and_port_ranges(entries, host, port, allowed):
    """CIDRs contain IPs, names match exactly (any case), and nothing is resolved."""
    assert EndpointAllowlist(entries, "127.0.0.1").allows(host, port) is allowed


def test_allowlist_defaults_to_the_configs_advertised_host():
    """An empty config allowlist admits only the worker's own advertised host."""
    cfg = KVCRLinkerConfig.from_dict(
        {"local_dram_bytes_per_worker": 1 << 20, "control_advertise_host": "node-3"}
    )
    allow = EndpointAllowlist.from_config(cfg)
    assert allow.allows("NODE-3", 1) and not allow.allows("127.0.0.1", 1)
    with pytest.raises(KVCRConfigError):
        EndpointAllowlist(["10.0.0.0/8:0-9"], "127.0.0.1")


def test_endpoint_outside_the_allowlist_is_ignored_and_counted():
    """A hint naming another host is never used, and counted as not allowed."""
    parser = make_parser()
    payload = fetch_payload(source_control_endpoint="tcp://10.9.9.9:43149")
    assert parser.parse(envelope_with(payload)) is None
    assert rejections(parser) == {HintRejection.ENDPOINT_NOT_ALLOWED: 1}


class _RaisingGetattr:
    def __getattr__(self, name):
        raise RuntimeError(f"no {name}")


class _RaisingGetattribute:
    def __getattribute__(self, name):
        raise KeyError(name)


class _RaisingMapping(dict):
    def get(self, key, default=None):
        raise RuntimeError("boom")


class _EvilStr(str):
    def startswith(self, *args):
        raise RuntimeError("boom")

    def __eq__(self, other):
        raise RuntimeError("boom")

    __hash__ = str.__hash__


def _nested(depth):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


R = HintRejection
MALFORMED = [
    ("string-envelope", "kv.fetch", R.MALFORMED_ENVELOPE),
    ("int-envelope", 5, R.MALFORMED_ENVELOPE),
    ("nested-lists", _nested(10_000), R.MALFORMED_ENVELOPE),
    ("actions-not-list", {"actions": {"a": 1}}, R.MALFORMED_ENVELOPE),
    ("getattr-raises", _RaisingGetattr(), R.MALFORMED_ENVELOPE),
    ("getattribute-raises", _RaisingGetattribute(), R.MALFORMED_ENVELOPE),
    ("mapping-get-raises", _RaisingMapping(actions=[]), R.MALFORMED_ENVELOPE),
    ("payload-not-dict", envelope_with([ENDPOINT, [1]]), R.MALFORMED_PAYLOAD),
    (
        "payload-missing",
        dict_envelope({"action_type": "kv.fetch", "action_version": "1.0"}),
        R.MALFORMED_PAYLOAD,
    ),
    (
        "hashes-missing",
        envelope_with({"source_control_endpoint": ENDPOINT}),
        R.MALFORMED_PAYLOAD,
    ),
    (
        "hashes-not-list",
        envelope_with(fetch_payload(block_hashes=7)),
        R.MALFORMED_PAYLOAD,
    ),
    (
        "hashes-nested-garbage",
        envelope_with(fetch_payload(block_hashes=[_nested(50)])),
        R.BAD_HASH,
    ),
    ("mode-move", envelope_with(fetch_payload(mode="move")), R.UNSUPPORTED_MODE),
    ("no-retain", envelope_with(fetch_payload(no_retain=True)), R.UNSUPPORTED_MODE),
    ("endpoint-missing", envelope_with({"block_hashes": [1]}), R.BAD_ENDPOINT),
    (
        "endpoint-udp",
        envelope_with(fetch_payload(source_control_endpoint="udp://127.0.0.1:1")),
        R.BAD_ENDPOINT,
    ),
    (
        "endpoint-port-0",
        envelope_with(fetch_payload(source_control_endpoint="tcp://127.0.0.1:0")),
        R.BAD_ENDPOINT,
    ),
    (
        "endpoint-port-65536",
        envelope_with(fetch_payload(source_control_endpoint="tcp://127.0.0.1:65536")),
        R.BAD_ENDPOINT,
    ),
    (
        "endpoint-no-port",
        envelope_with(fetch_payload(source_control_endpoint="tcp://127.0.0.1")),
        R.BAD_ENDPOINT,
    ),
    (
        "endpoint-path",
        envelope_with(fetch_payload(source_control_endpoint="tcp://127.0.0.1:1/x")),
        R.BAD_ENDPOINT,
    ),
    (
        "endpoint-bad-ipv4",
        envelope_with(fetch_payload(source_control_endpoint="tcp://127.0.0.256:1")),
        R.BAD_ENDPOINT,
    ),
    (
        "endpoint-bare-ipv6",
        envelope_with(fetch_payload(source_control_endpoint="tcp://::1:1")),
        R.BAD_ENDPOINT,
    ),
    (
        "endpoint-wildcard",
        envelope_with(fetch_payload(source_control_endpoint="tcp://0.0.0.0:1")),
        R.BAD_ENDPOINT,
    ),
    (
        "endpoint-not-str",
        envelope_with(fetch_payload(source_control_endpoint=["tcp://"])),
        R.BAD_ENDPOINT,
    ),
    ("hashes-empty", envelope_with(fetch_payload(block_hashes=[])), R.EMPTY_HASHES),
    (
        "hashes-too-many",
        envelope_with(fetch_payload(block_hashes=[1] * 9)),
        R.TOO_MANY_HASHES,
    ),
    ("hash-bool", envelope_with(fetch_payload(block_hashes=[1, True])), R.BAD_HASH),
    ("hash-2**64", envelope_with(fetch_payload(block_hashes=[1 << 64])), R.BAD_HASH),
    (
        "hash-below-int64",
        envelope_with(fetch_payload(block_hashes=[-(1 << 63) - 1])),
        R.BAD_HASH,
    ),
    ("hash-float", envelope_with(fetch_payload(block_hashes=[1.0])), R.BAD_HASH),
    ("hash-short-hex", envelope_with(fetch_payload(block_hashes=["0xff"])), R.BAD_HASH),
    (
        "hash-hex-with-underscore",
        envelope_with(fetch_payload(block_hashes=["0000_0000_0000_0"])),
        R.BAD_HASH,
    ),
    (
        "hash-full-sha256",
        envelope_with(fetch_payload(block_hashes=["ab" * 32])),
        R.BAD_HASH,
    ),
    ("hash-none", envelope_with(fetch_payload(block_hashes=[None])), R.BAD_HASH),
]


@pytest.mark.parametrize(
    ("kv_hints", "reason"),
    [pytest.param(value, reason, id=name) for name, value, reason in MALFORMED],
)
def test_each_malformed_hint_is_ignored_and_counted_without_raising(kv_hints, reason):
    """Bad input returns None and bumps exactly one rejection counter."""
    parser = make_parser(max_hashes=8)
    assert parser.parse(kv_hints) is None
    counted = rejections(parser)
    assert counted == {reason: 1} and parser.stats.accepted == 0


def test_str_subclass_endpoint_is_read_as_its_plain_value():
    """A str subclass's overridden methods never run; its plain text is parsed."""
    hint = make_parser().parse(
        envelope_with(fetch_payload(source_control_endpoint=_EvilStr(ENDPOINT)))
    )
    assert hint == FetchHint(ENDPOINT, (1, 2, 3))


def test_parser_rejects_bad_construction_arguments():
    """Bad rank offsets or hash caps are programming errors and raise at once."""
    allow = EndpointAllowlist([], "127.0.0.1")
    for kwargs in (
        {"rank_offset": -1},
        {"rank_offset": 65535},
        {"rank_offset": True},
        {"rank_offset": 0, "max_hashes": 0},
    ):
        with pytest.raises(ValueError):
            RouterHintParser(allow, **kwargs)


def test_stats_as_dict_names_every_counter():
    """as_dict is flat: accepted, ignored_other_actions, and one key per reason."""
    stats = HintStats()
    stats.rejected[HintRejection.BAD_HASH] += 2
    flat = stats.as_dict()
    assert flat["rejected_bad_hash"] == 2 and flat["accepted"] == 0
    assert len(flat) == 2 + len(HintRejection)


def test_warning_is_rate_limited_per_reason(monkeypatch, caplog):
    """One WARNING per reason per minute; repeats within it go to DEBUG."""
    clock = [1000.0]
    monkeypatch.setattr(router_hint.time, "monotonic", lambda: clock[0])
    parser = make_parser()
    bad_hash = envelope_with(fetch_payload(block_hashes=[None]))
    caplog.set_level(logging.DEBUG, logger=router_hint.__name__)

    def warnings():
        return [r for r in caplog.records if r.levelno == logging.WARNING]

    parser.parse(bad_hash)
    parser.parse(bad_hash)
    parser.parse(envelope_with([]))
    assert len(warnings()) == 2
    clock[0] += router_hint.WARNING_INTERVAL_S
    parser.parse(bad_hash)
    assert len(warnings()) == 3
    assert "2 so far" not in warnings()[-1].getMessage()
    assert "3 so far" in warnings()[-1].getMessage()


def test_kvcr_own_hint_parser_accepts_the_envelope_we_build():
    """Round trip: kvcr's own parser reads our envelope back unchanged."""
    from kvcr import hint_parser

    hint = FetchHint("tcp://127.0.0.1:43150", (0, 1, U64, 1 << 63))
    parsed = hint_parser._KVFetchHint.from_hint(hint.to_kvcr_envelope())
    assert parsed.source_endpoint == hint.source_endpoint
    assert parsed.block_hashes == frozenset(hint.block_hashes)


def test_module_imports_only_the_stdlib_and_this_package():
    """Nothing heavy at import: no torch, kvcr, nixl or SGLang modules beyond ours."""
    tree = ast.parse(Path(router_hint.__file__).read_text())
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    ours = {m for m in imported if m.startswith("sglang.srt.mem_cache.storage.kvcr")}
    stdlib = {m for m in imported if m.split(".")[0] in sys.stdlib_module_names}
    assert imported == ours | stdlib, imported - ours - stdlib


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats()
    | st.text(max_size=24),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=24,
)
NEAR = JSON | st.sampled_from(
    [
        "kv.fetch",
        "1.0",
        "1.3",
        "copy",
        "tcp://127.0.0.1:5000",
        "tcp://[::1]:65535",
        "tcp://host.example:1",
        "0x" + "f" * 16,
        "a" * 16,
    ]
)
GOOD_HASHES = st.lists(
    st.integers(-(1 << 63), U64)
    | st.from_regex(r"(0x)?[0-9a-fA-F]{16}", fullmatch=True),
    min_size=1,
    max_size=6,
)
GOOD_PAYLOADS = st.fixed_dictionaries(
    {
        "source_control_endpoint": st.sampled_from(
            ["tcp://10.0.0.1:5000", "tcp://[fd00::2]:65000", "tcp://host.example:80"]
        ),
        "block_hashes": GOOD_HASHES,
    },
    optional={"mode": st.just("copy"), "unknown_key": JSON},
)
PAYLOADS = GOOD_PAYLOADS | st.fixed_dictionaries(
    {},
    optional={
        "source_control_endpoint": NEAR,
        "block_hashes": st.lists(NEAR | st.integers(-(1 << 64), 1 << 65), max_size=6)
        | NEAR,
        "mode": NEAR,
        "no_retain": NEAR,
    },
)
ACTIONS = st.fixed_dictionaries(
    {
        "action_type": st.just("kv.fetch") | NEAR,
        "action_version": st.just("1.0") | NEAR,
    },
    optional={"payload": PAYLOADS | NEAR, "action_id": NEAR},
)
GOOD_ACTIONS = st.fixed_dictionaries(
    {
        "action_type": st.just("kv.fetch"),
        "action_version": st.sampled_from(["1.0", "1", "1.2"]),
        "payload": PAYLOADS,
    },
    optional={"action_id": NEAR},
)
ENVELOPES = st.fixed_dictionaries(
    {"actions": st.lists(GOOD_ACTIONS | ACTIONS | NEAR, max_size=3)},
    optional={"protocol_version": NEAR, "message_id": NEAR},
) | st.fixed_dictionaries({}, optional={"protocol_version": NEAR, "actions": NEAR})
HINT_INPUTS = JSON | ENVELOPES | st.lists(ENVELOPES, max_size=2)


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(HINT_INPUTS, st.integers(min_value=0, max_value=7))
def test_arbitrary_json_like_input_never_raises(kv_hints, rank_offset):
    """Any JSON-like kv_hints yields None or a well-formed FetchHint, counted once."""
    parser = make_parser(["0.0.0.0/0", "::/0", "host.example"], rank_offset=rank_offset)
    hint = parser.parse(kv_hints)
    counted = sum(parser.stats.rejected.values()) + parser.stats.accepted
    assert counted <= 1
    event("accepted" if hint else "ignored" if counted else "absent")
    if hint is not None:
        assert parser.stats.accepted == 1
        assert hint.source_endpoint.startswith("tcp://")
        assert hint.block_hashes and all(0 <= h <= U64 for h in hint.block_hashes)
        assert int(hint.source_endpoint.rsplit(":", 1)[1]) <= 65535
