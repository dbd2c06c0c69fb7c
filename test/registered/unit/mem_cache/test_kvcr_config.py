"""KVCRLinkerConfig: every bad value fails with one line naming the field and the fix."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang.srt.mem_cache.storage.kvcr import config as cfgmod
from sglang.srt.mem_cache.storage.kvcr.config import KVCRLinkerConfig
from sglang.srt.mem_cache.storage.kvcr.errors import KVCRConfigError

GOOD = {"local_dram_bytes_per_worker": 1 << 26}


def test_minimal_config_parses_with_documented_defaults():
    """Only the DRAM size is required; everything else has a default."""
    cfg = KVCRLinkerConfig.from_dict(GOOD)
    assert cfg.local_dram_bytes_per_worker == 1 << 26
    assert cfg.advertise_host == "127.0.0.1"
    assert cfg.nixl_progress_thread is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.control_port = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("raw", "needles"),
    [
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
        ({**GOOD, "operation_timeout_ms": 0}, ["operation_timeout_ms", ">= 1"]),
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
    ],
    ids=[
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
        "abandon-too-small",
        "wildcard-bind",
        "wildcard-advertise",
        "bad-policy",
        "bad-bool",
        "bad-owner-wait",
        "bad-port-range",
        "allowlist-not-list",
    ],
)
def test_bad_config_fails_with_one_line_naming_field_and_fix(raw, needles):
    """Each bad value raises KVCRConfigError: one line, flag and field named."""
    with pytest.raises(KVCRConfigError) as info:
        KVCRLinkerConfig.from_startup_config(
            "kvcr", json.dumps(raw) if raw != "not json" else raw
        )
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("--unified-cache-external-linker-config")
    for needle in needles:
        assert needle in message, message


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
    """The config and plugin modules import neither kvcr nor nixl, and config only stdlib."""
    code = (
        "import sys; import sglang.srt.mem_cache.storage.kvcr.config; "
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
    tree = ast.parse(Path(cfgmod.__file__).read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert imported <= set(sys.stdlib_module_names) | {"sglang"}, imported


def test_package_module_file_is_this_repo_and_sglang_is_the_release():
    """The plugin imports from this checkout while sglang stays the installed wheel."""
    import sglang
    import sglang.srt.mem_cache.storage.kvcr as pkg

    repo = Path(__file__).resolve().parents[4]
    assert Path(pkg.__file__).resolve().is_relative_to(repo / "python")
    assert "site-packages" in Path(sglang.__file__).resolve().parts
    assert not Path(sglang.__file__).resolve().is_relative_to(repo / "python")
    from importlib.metadata import version

    assert version("sglang") == "0.5.23"


def test_docs_reference_every_config_field_with_its_default():
    """docs/kvcr_direct_linker.md has a row per field, with the class's default."""
    doc = (
        Path(__file__).resolve().parents[4] / "docs" / "kvcr_direct_linker.md"
    ).read_text()
    rows = {
        line.split("|")[1].strip().strip("`"): line.split("|")[2].strip()
        for line in doc.splitlines()
        if line.startswith("| `")
    }
    for field in dataclasses.fields(KVCRLinkerConfig):
        assert field.name in rows, f"{field.name} is undocumented"
        if field.default is dataclasses.MISSING:
            assert rows[field.name] == "required"
        else:
            assert rows[field.name] == f"`{field.default!r}`", field.name
    assert set(rows) == {f.name for f in dataclasses.fields(KVCRLinkerConfig)}
