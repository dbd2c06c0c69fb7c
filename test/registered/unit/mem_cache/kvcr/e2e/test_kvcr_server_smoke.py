"""CPU server smoke tests of the kvcr linker backend (real ``sglang.launch_server``).

One server with the tiny random-weight Llama and the kvcr external linker is
shared by the tests that need a live server; the last of them stops it and checks
the shutdown. The bad-config launch is a second, short-lived process. The
hierarchical-cache refusal is checked in-process through the same argument
parsing and resolution a launch runs (``load_plugins`` then
``prepare_server_args`` then ``resolve_once``), which is much faster than a launch.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpu_harness.server import (
    REPO,
    ServerHandle,
    kvcr_linker_args,
    launch_server,
    python_executable,
    run_to_exit,
    server_env,
)

pytestmark = pytest.mark.server

KVCR_CONFIG = {"local_dram_bytes_per_worker": 64 * 1024 * 1024}
# A small device pool (still room for the 1500-token prompt) so filler traffic
# evicts a prompt from the device and only KVCR can serve its replay.
PAGE = 16
POOL_TOKENS = 2048
PROMPT_LEN = 256
VOCAB = 300  # token ids the tiny model knows
HELP_TIMEOUT_S = 120
STARTUP_TIMEOUT_S = 180
SHUTDOWN_BOUND_S = 30.0
BAD_CONFIG_BOUND_S = 120.0


@pytest.fixture(scope="module")
def kvcr_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerHandle]:
    log = tmp_path_factory.mktemp("kvcr-server") / "server.log"
    handle = launch_server(
        [
            "--page-size",
            str(PAGE),
            "--max-total-tokens",
            str(POOL_TOKENS),
            *kvcr_linker_args(KVCR_CONFIG),
        ],
        model_path=tiny_model,
        log_path=log,
        startup_timeout=STARTUP_TIMEOUT_S,
    )
    print(f"kvcr CPU server ready in {handle.startup_s:.1f}s (log: {log})")
    try:
        yield handle
    finally:
        handle.stop(SHUTDOWN_BOUND_S)


def test_launch_server_help_lists_kvcr_backend() -> None:
    proc = subprocess.run(
        [python_executable(), "-m", "sglang.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT_S,
        env=server_env(),
        cwd=str(REPO),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    match = re.search(
        r"--unified-cache-external-linker-backend\s+\{([^}]*)\}", proc.stdout
    )
    assert match, "backend flag with a choice list not found in --help output"
    choices = [c.strip() for c in match.group(1).split(",")]
    assert "kvcr" in choices
    assert {"mooncake", "mori", "dynamic"} <= set(choices)  # stock choices kept


def test_kvcr_server_generates_expected_tokens(kvcr_server: ServerHandle) -> None:
    """A replay evicted from the device comes back from KVCR with the same greedy
    tokens as the prompt's first, uncached run."""
    info = kvcr_server.get("/server_info").json()
    assert info["enable_unified_cache_external_linker"] is True
    assert info["unified_cache_external_linker_backend"] == "kvcr"
    assert info["unified_cache_external_linker_config"] == KVCR_CONFIG
    assert info["device"] == "cpu"
    # The scheduler built the plugin's linker (not just accepted the flags).
    assert "KVCR direct linker up" in kvcr_server.log_text(), kvcr_server.log_tail()

    rng = random.Random(13)
    prompt = [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]
    # The control: the first run of the prompt, computed from scratch (greedy).
    control = kvcr_server.generate(input_ids=prompt, max_new_tokens=8)
    assert control["meta_info"]["cached_tokens"] == 0, control["meta_info"]
    assert len(control["output_ids"]) == 8
    assert control["meta_info"]["completion_tokens"] == 8
    assert control["meta_info"]["finish_reason"]["type"] == "length"

    # Unrelated prompts fill the device pool twice over: the prompt's pages leave
    # the device, and only their KVCR copies remain.
    for _ in range(2 * POOL_TOKENS // PROMPT_LEN + 2):
        filler = [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]
        kvcr_server.generate(input_ids=filler, max_new_tokens=1)
    replay = kvcr_server.generate(input_ids=prompt, max_new_tokens=8)
    details = replay["meta_info"].get("cached_tokens_details") or {}
    aligned = (PROMPT_LEN - 1) // PAGE * PAGE  # full pages SGLang may reuse
    assert replay["output_ids"] == control["output_ids"]
    assert details.get("device", 0) == 0, details  # not the device radix cache
    assert details.get("host", 0) >= 0.9 * aligned, details  # restored from KVCR


def test_kvcr_server_accepts_long_prompt(kvcr_server: ServerHandle) -> None:
    prompt = [3 + (i * 37) % 500 for i in range(1500)]
    out = kvcr_server.generate(input_ids=prompt, max_new_tokens=4, timeout=120)
    assert out["meta_info"]["prompt_tokens"] == 1500
    assert len(out["output_ids"]) == 4


def test_kvcr_server_shuts_down_cleanly(kvcr_server: ServerHandle) -> None:
    assert kvcr_server.alive()
    elapsed = kvcr_server.stop(SHUTDOWN_BOUND_S)
    print(f"kvcr CPU server shutdown took {elapsed:.1f}s, rc={kvcr_server.returncode}")
    assert kvcr_server.returncode == 0, kvcr_server.log_tail()
    assert not kvcr_server.killed, f"needed SIGKILL\n{kvcr_server.log_tail()}"
    assert not kvcr_server.group_terminated, "children outlived the launcher"
    assert elapsed < SHUTDOWN_BOUND_S
    log = kvcr_server.log_text()
    assert "SIGTERM received" in log, kvcr_server.log_tail()  # graceful drain ran
    shutdown_log = log.rsplit("SIGTERM received", 1)[1]
    assert "crashed with exit code" not in shutdown_log, kvcr_server.log_tail()
    assert "Traceback" not in shutdown_log, kvcr_server.log_tail()
    with pytest.raises(ProcessLookupError):
        os.killpg(kvcr_server.pgid, 0)  # no scheduler/detokenizer left behind


def test_bad_kvcr_config_fails_startup_naming_field(
    tiny_model: Path, tmp_path: Path
) -> None:
    from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRConfigError
    from sglang.srt.mem_cache.storage.kvcr.config.linker_config import KVCRLinkerConfig

    bad = {"local_dram_bytes": 1}
    with pytest.raises(KVCRConfigError) as excinfo:
        KVCRLinkerConfig.from_startup_config("kvcr", json.dumps(bad))
    expected = str(excinfo.value)
    assert "local_dram_bytes_per_worker" in expected

    t0 = time.monotonic()
    rc, elapsed, log = run_to_exit(
        kvcr_linker_args(bad),
        model_path=tiny_model,
        log_path=tmp_path / "bad-config.log",
        timeout=BAD_CONFIG_BOUND_S,
    )
    print(f"bad-config launch exited rc={rc} after {elapsed:.1f}s")
    assert rc is not None, f"still running after {BAD_CONFIG_BOUND_S}s\n{log[-4000:]}"
    assert rc != 0
    assert time.monotonic() - t0 < BAD_CONFIG_BOUND_S + 15
    assert expected in log, log[-4000:]
    assert "Uvicorn running" not in log


def test_hierarchical_cache_refused_with_kvcr_linker(tiny_model: Path) -> None:
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    argv = [
        "--model-path",
        str(tiny_model),
        "--device",
        "cpu",
        *kvcr_linker_args(KVCR_CONFIG),
    ]
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))  # prepare_server_args resets logging
    try:
        accepted = prepare_server_args(argv)
        accepted.resolve_once()  # control: the same flags without hicache resolve
        assert accepted.unified_cache_external_linker_backend == "kvcr"
        assert accepted.unified_cache_external_linker_config == KVCR_CONFIG

        refused = prepare_server_args([*argv, "--enable-hierarchical-cache"])
        with pytest.raises(ValueError, match="mutually exclusive") as excinfo:
            refused.resolve_once()
        assert "--enable-hierarchical-cache" in str(excinfo.value)
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
