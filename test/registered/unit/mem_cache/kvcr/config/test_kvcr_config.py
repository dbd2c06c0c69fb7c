"""KVCRLinkerConfig: every bad value fails with one line naming the field and the fix.

The same bad values also go through SGLang's own command-line parse
(``prepare_server_args`` with the plugins loaded, in-process): each ends it with
status 2 and that one line, as ``<prog>: error: ...``, on stderr.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cpu_harness.server import REPO
from sglang.srt.mem_cache.storage.kvcr.config import linker_config as cfgmod
from sglang.srt.mem_cache.storage.kvcr.config import (
    one_line_errors,
    startup_checks,
    value_checks,
)
from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRConfigError
from sglang.srt.mem_cache.storage.kvcr.config.linker_config import (
    KVCRLinkerConfig,
)

GOOD = {"local_dram_bytes_per_worker": 1 << 26}


def test_minimal_config_parses_with_documented_defaults():
    """Only the DRAM size is required; everything else has a default."""
    cfg = KVCRLinkerConfig.from_dict(GOOD)
    assert cfg.local_dram_bytes_per_worker == 1 << 26
    assert cfg.advertise_host == "127.0.0.1"
    assert cfg.nixl_progress_thread is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.control_port = 5  # type: ignore[misc]


# Every bad value these tests feed the parser, with what its one line must say;
# the command-line test below feeds each one through SGLang's own parse too.
BAD_CONFIGS = [
    ({}, ["local_dram_bytes_per_worker", "is required", "8589934592"]),
    (
        {"local_dram_bytes": 1 << 30},
        ["local_dram_bytes", "rename it to local_dram_bytes_per_worker"],
    ),
    ({**GOOD, "dram_gb": 4}, ["unknown fields", "dram_gb", "remove"]),
    ({"local_dram_bytes_per_worker": 0}, ["local_dram_bytes_per_worker", ">= 1"]),
    ({"local_dram_bytes_per_worker": -5}, ["local_dram_bytes_per_worker", ">= 1"]),
    (
        {"local_dram_bytes_per_worker": "8G"},
        ["local_dram_bytes_per_worker", "integer"],
    ),
    (
        {"local_dram_bytes_per_worker": True},
        ["local_dram_bytes_per_worker", "integer"],
    ),
    ([1, 2], ["must be a JSON object", "list"]),
    ("not json", ["not valid JSON"]),
    ({**GOOD, "control_port": 70000}, ["control_port", "[0, 65535]"]),
    ({**GOOD, "operation_timeout_ms": 0}, ["operation_timeout_ms", "in [1, 3600000]"]),
    # Past an hour (the fuzz test also draws ints past Python's int-to-str limit,
    # which once crashed the abandon_timeout_ms message that doubles it).
    ({**GOOD, "operation_timeout_ms": 10**30}, ["operation_timeout_ms", "bits"]),
    (
        {**GOOD, "operation_timeout_ms": 1000, "abandon_timeout_ms": 1500},
        ["abandon_timeout_ms", ">= 2 x operation_timeout_ms", "2000"],
    ),
    (
        {**GOOD, "control_bind_host": "0.0.0.0"},
        ["control_advertise_host", "required"],
    ),
    ({**GOOD, "control_advertise_host": "0.0.0.0"}, ["control_advertise_host"]),
    ({**GOOD, "eviction_policy": "mru"}, ["eviction_policy", "lru"]),
    ({**GOOD, "nixl_progress_thread": "yes"}, ["nixl_progress_thread"]),
    ({**GOOD, "owner_wait_timeout_s": -1}, ["owner_wait_timeout_s"]),
    (
        {**GOOD, "peer_endpoint_allowlist": ["10.0.0.0/8:0-9"]},
        ["peer_endpoint_allowlist", "ports"],
    ),
    (
        {**GOOD, "peer_endpoint_allowlist": "10.0.0.1"},
        ["peer_endpoint_allowlist", "list"],
    ),
    (
        {**GOOD, "control_curve_secret_key_file": "/nonexistent/worker.key_secret"},
        ["control_curve_public_keys_dir", "is required", "set both or neither"],
    ),
]
BAD_CONFIG_IDS = [
    "missing-size",
    "legacy-key",
    "unknown-key",
    "zero-size",
    "negative-size",
    "string-size",
    "bool-size",
    "not-object",
    "not-json",
    "port-range",
    "zero-timeout",
    "huge-timeout",
    "abandon-too-small",
    "wildcard-bind",
    "wildcard-advertise",
    "bad-policy",
    "bad-bool",
    "bad-owner-wait",
    "bad-port-range",
    "allowlist-not-list",
    "curve-half-set",
]


def flag_text(raw: object) -> str:
    """What the flag carries for a case: its JSON text (a str case is not JSON)."""
    return raw if isinstance(raw, str) else json.dumps(raw)


@pytest.mark.parametrize(("raw", "needles"), BAD_CONFIGS, ids=BAD_CONFIG_IDS)
def test_bad_config_fails_with_one_line_naming_field_and_fix(raw, needles):
    """Each bad value raises KVCRConfigError: one line, flag and field named."""
    with pytest.raises(KVCRConfigError) as info:
        KVCRLinkerConfig.from_startup_config("kvcr", flag_text(raw))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("--unified-cache-external-linker-config")
    for needle in needles:
        assert needle in message, message


# ---- the same cases on the command line (SGLang's own parse, in-process) ----------

PROG = "sglang serve"  # the prog prepare_server_args gives its parser


def linker_flags(config_text: str | None, backend: str = "kvcr") -> list[str]:
    flags = ["--unified-cache-external-linker-backend", backend]
    if config_text is not None:
        flags += ["--unified-cache-external-linker-config", config_text]
    return ["--enable-unified-cache-external-linker", *flags]


def refused_at_parse(parse, capsys, *flags: str) -> str:
    """Parse ``flags``; assert argparse's exit status and return stderr."""
    with pytest.raises(SystemExit) as info:
        parse(*flags)
    out, err = capsys.readouterr()
    assert info.value.code == 2, err
    assert out == ""
    return err


@pytest.mark.parametrize(("raw", "needles"), BAD_CONFIGS, ids=BAD_CONFIG_IDS)
def test_bad_config_on_the_command_line_is_one_error_line_and_status_2(
    parse_command_line, capsys, raw, needles
):
    """Each bad value ends the parse as argparse would (status 2), with exactly
    one ``<prog>: error:`` line on stderr carrying the config's own message: no
    traceback and no 470-line usage block."""
    with pytest.raises(KVCRConfigError) as info:
        KVCRLinkerConfig.from_startup_config("kvcr", flag_text(raw))
    err = refused_at_parse(parse_command_line, capsys, *linker_flags(flag_text(raw)))
    assert err == f"{PROG}: error: {info.value}\n"
    assert all(needle in err for needle in needles), err


def test_the_dynamic_route_topology_and_tree_core_refusals_are_one_line(
    parse_command_line, capsys, monkeypatch
):
    """The other refusals a launch makes from its flags end the parse the same
    way: the KVCR config under the stock dynamic backend, a parallel layout the
    linker cannot describe, and another radix tree core."""
    dynamic = {
        "linker": cfgmod.LINKER_CLASS_NAME,
        "linker_module_path": cfgmod.LINKER_MODULE_PATH,
        "linker_extra_config": {"local_dram_bytes_per_worker": 0},
    }
    flags = linker_flags(json.dumps(dynamic), backend="dynamic")
    err = refused_at_parse(parse_command_line, capsys, *flags)
    assert err.startswith(f"{PROG}: error: {cfgmod.FLAG}: field ")
    assert "'local_dram_bytes_per_worker' must be >= 1" in err
    assert err.count("\n") == 1
    good = linker_flags(json.dumps(GOOD))
    err = refused_at_parse(parse_command_line, capsys, *good, "--pp-size", "2")
    assert err.startswith(f"{PROG}: error: {cfgmod.BACKEND_FLAG} kvcr does not ")
    assert "--pp-size 2" in err and "run with --pp-size 1" in err
    assert err.count("\n") == 1
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "cpp")
    err = refused_at_parse(parse_command_line, capsys, *good)
    assert err.startswith(f"{PROG}: error: the KVCR linker needs ")
    assert "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python (got 'cpp')" in err
    assert err.count("\n") == 1


def test_a_config_for_a_disabled_kvcr_linker_is_still_checked(
    parse_command_line, capsys
):
    """As SGLang does for ``dynamic``: a config given with the kvcr backend is
    checked even while the linker is off; no config, nothing to check."""
    flags = ["--unified-cache-external-linker-backend", "kvcr"]
    bad = [*flags, "--unified-cache-external-linker-config", "{}"]
    err = refused_at_parse(parse_command_line, capsys, *bad)
    assert "'local_dram_bytes_per_worker' is required" in err
    assert err.count("\n") == 1
    args = parse_command_line(*flags)
    assert args.unified_cache_external_linker_config is None


def test_good_configs_parse_and_other_backends_keep_argparse_errors(
    parse_command_line, capsys
):
    """A good config comes back decoded; a bad JSON value for a backend that is
    not KVCR's gets argparse's own error, usage block and all, as without the
    plugin; and nothing undecoded ever reaches ``ServerArgs``."""
    args = parse_command_line(*linker_flags(json.dumps(GOOD)))
    assert args.unified_cache_external_linker_config == GOOD
    assert args.unified_cache_external_linker_backend == "kvcr"
    for backend in ("mooncake", "dynamic"):
        err = refused_at_parse(
            parse_command_line, capsys, *linker_flags("{bad", backend=backend)
        )
        lines = err.splitlines()
        assert lines[0].startswith(f"usage: {PROG} "), lines[0]
        assert lines[-1] == (
            f"{PROG}: error: argument {cfgmod.FLAG}: invalid loads value: '{{bad'"
        )
    mooncake = parse_command_line(*linker_flags('{"a": 1}', backend="mooncake"))
    assert mooncake.unified_cache_external_linker_config == {"a": 1}


def test_dynamic_backend_reads_linker_extra_config():
    """With the stock dynamic route the KVCR settings live under linker_extra_config."""
    raw = {
        "linker": cfgmod.LINKER_CLASS_NAME,
        "linker_module_path": cfgmod.LINKER_MODULE_PATH,
        "linker_extra_config": {**GOOD, "control_port": 5555},
    }
    cfg = KVCRLinkerConfig.from_startup_config("dynamic", raw)
    assert cfg.control_port == 5555
    with pytest.raises(KVCRConfigError, match="local_dram_bytes_per_worker"):
        KVCRLinkerConfig.from_startup_config(
            "dynamic", {**raw, "linker_extra_config": {}}
        )


def test_allowlist_entries_parse_hosts_cidrs_and_port_ranges():
    """Allowlist entries accept a host or CIDR with an optional port or range."""
    cfg = KVCRLinkerConfig.from_dict(
        {
            **GOOD,
            "peer_endpoint_allowlist": ["10.0.0.0/8", "node-7:5000-5007", "[::1]:9"],
        }
    )
    assert cfg.peer_endpoint_allowlist == ("10.0.0.0/8", "node-7:5000-5007", "[::1]:9")
    assert cfgmod.parse_allowlist_entry("node-7:5000-5007")[1:] == (5000, 5007)
    assert cfgmod.parse_allowlist_entry("[::1]:9")[1:] == (9, 9)


def test_every_field_is_documented():
    """Each config field carries a non-trivial doc string (docs are generated from it)."""
    docs = cfgmod.field_docs()
    assert set(docs) == {f.name for f in dataclasses.fields(KVCRLinkerConfig)}
    assert all(len(text) > 20 for text in docs.values())


def test_config_module_imports_nothing_heavy():
    """The config and plugin modules import neither kvcr nor nixl, and the config
    and startup-error modules only the stdlib."""
    code = (
        "import sys; import sglang.srt.mem_cache.storage.kvcr.config.linker_config; "
        "import sglang.srt.mem_cache.storage.kvcr.plugin; "
        "print(','.join(m for m in ('kvcr','nixl') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == ""
    for module in (cfgmod, value_checks, one_line_errors, startup_checks):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {
            (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(
                "."
            )[0]
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        }
        assert imported <= set(sys.stdlib_module_names) | {"sglang"}, imported


def test_package_module_file_is_this_repo_and_sglang_is_the_release():
    """The plugin imports from this checkout while sglang stays the installed wheel."""
    import sglang
    import sglang.srt.mem_cache.storage.kvcr as pkg

    repo = REPO
    assert Path(pkg.__file__).resolve().is_relative_to(repo / "python")
    assert "site-packages" in Path(sglang.__file__).resolve().parts
    assert not Path(sglang.__file__).resolve().is_relative_to(repo / "python")
    from importlib.metadata import version

    assert version("sglang") == "0.5.23"


def test_docs_reference_every_config_field_with_its_default():
    """docs/kvcr_direct_linker.md has a row per field, with the class's default,
    in its configuration reference (other tables of the page are not read)."""
    doc = (REPO / "docs" / "kvcr_direct_linker.md").read_text()
    heading = "## Configuration reference\n"
    assert heading in doc
    section = doc.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = {
        line.split("|")[1].strip().strip("`"): line.split("|")[2].strip()
        for line in section.splitlines()
        if line.startswith("| `")
    }
    for field in dataclasses.fields(KVCRLinkerConfig):
        assert field.name in rows, f"{field.name} is undocumented"
        if field.default is dataclasses.MISSING:
            assert rows[field.name] == "required"
        else:
            assert rows[field.name] == f"`{field.default!r}`", field.name
    assert set(rows) == {f.name for f in dataclasses.fields(KVCRLinkerConfig)}


def test_an_idle_progress_sleep_near_the_operation_timeout_is_refused():
    """kvcr turns source writes off when its progress loop sleeps as long as an
    operation's timeout: the idle sleep must stay well under it."""
    ok = KVCRLinkerConfig.from_dict(
        {**GOOD, "progress_idle_ms": 250, "operation_timeout_ms": 1000}
    )
    assert ok.progress_idle_ms == 250
    for idle, timeout in ((600, 500), (1000, 1000), (251, 1000)):
        with pytest.raises(KVCRConfigError, match="progress_idle_ms"):
            KVCRLinkerConfig.from_dict(
                {**GOOD, "progress_idle_ms": idle, "operation_timeout_ms": timeout}
            )


def test_an_unset_idle_progress_sleep_is_100_ms_or_a_quarter_of_the_timeout():
    """Unset (or null), the idle sleep follows the operation timeout: never over a
    quarter of it, never over 100 ms, and again after a replace; a value given is
    taken as given."""

    def config(timeout: int, **more: object) -> KVCRLinkerConfig:
        return KVCRLinkerConfig.from_dict(
            {
                **GOOD,
                "operation_timeout_ms": timeout,
                "abandon_timeout_ms": 2 * timeout,
                **more,
            }
        )

    derived = {
        timeout: config(timeout).idle_sleep_ms
        for timeout in (1, 3, 4, 300, 399, 400, 1000, 10_000)
    }
    assert derived == {
        1: 0,
        3: 0,
        4: 1,
        300: 75,
        399: 99,
        400: 100,
        1000: 100,
        10_000: 100,
    }
    assert config(300).progress_idle_ms is None  # unset stays unset
    assert config(1000, progress_idle_ms=None).idle_sleep_ms == 100
    assert config(1000, progress_idle_ms=7).idle_sleep_ms == 7
    shorter = dataclasses.replace(
        config(1000), operation_timeout_ms=200, abandon_timeout_ms=400
    )
    assert shorter.idle_sleep_ms == 50
    # A bad timeout is named as the bad value, not the sleep derived from it.
    for timeout in ("1000", 1.5, True, 0):
        with pytest.raises(KVCRConfigError, match="operation_timeout_ms"):
            KVCRLinkerConfig.from_dict({**GOOD, "operation_timeout_ms": timeout})


def test_gil_switch_interval_is_zero_or_a_sane_bound():
    assert KVCRLinkerConfig.from_dict(GOOD).gil_switch_interval_us == 500
    for value in (0, 50, 5000):
        cfg = KVCRLinkerConfig.from_dict({**GOOD, "gil_switch_interval_us": value})
        assert cfg.gil_switch_interval_us == value
    for bad in (-1, 1, 49, 5001, 0.5, True, "500"):
        with pytest.raises(KVCRConfigError, match="gil_switch_interval_us"):
            KVCRLinkerConfig.from_dict({**GOOD, "gil_switch_interval_us": bad})
