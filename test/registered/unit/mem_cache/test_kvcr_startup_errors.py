"""Startup failures of a real KVCR come back as one typed, one-line error with the fix.

Each fault is produced for real where the CPU allows it: a control port someone
else holds (through the linker's own constructor), a NIXL that finds no UCX
plugin, and a UCX that cannot start without ``tcp`` (both in a child process,
since NIXL reads its plugin directory and UCX its settings once per process).
The one fault a CPU cannot produce, UCX failing to register GPU memory on a host
without GPUDirect RDMA, is injected in NIXL's native ``registerMem`` binding, with
the status real NIXL raises for it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang.srt.mem_cache.storage.kvcr import kvcr_adapter
from sglang.srt.mem_cache.storage.kvcr.errors import KVCRUnavailableError
from sglang.srt.mem_cache.storage.kvcr.kvcr_adapter import (
    AdapterLimits,
    KVCRAdapter,
    make_kvcr_factory,
)

pytestmark = pytest.mark.kvcr

HERE = Path(__file__).resolve().parent
BLOCK = 4096
STARTUP_TIMEOUT_S = 30.0  # the adapter's own bounded wait for KVCR to start
CHILD_TIMEOUT_S = 180.0  # a child imports torch + kvcr on 2 loaded cores
# What UCX logs (not raises) when it cannot register GPU memory without GPUDirect.
UCX_IBV_REG_MR_LOG = (
    "ib_md.c:293  UCX  ERROR ibv_reg_mr(address=0x7f3a00000000, length=2097152, "
    "access=0xf) failed: Bad address"
)


class _IntKeys:
    def encode(self, key: object) -> bytes:
        return bytes(key)  # type: ignore[arg-type]

    def decode(self, key: bytes) -> int:
        return int.from_bytes(key[:8], "big")


def start_adapter(name: str, framework_mem_type: str = "DRAM") -> KVCRAdapter:
    """A real KVCR through the production factory, over small CPU tensors."""
    from kvcr.types import RegionDescriptor

    fw = torch.zeros(4, BLOCK, dtype=torch.uint8)
    store = torch.zeros(4 * BLOCK, dtype=torch.uint8)
    factory = make_kvcr_factory(
        agent_name=name,
        pool_layouts=[("kv", BLOCK)],
        framework_regions=[
            RegionDescriptor(
                mem_type=framework_mem_type,
                addr=fw.data_ptr(),
                size=BLOCK,
                count=fw.shape[0],
                label="kv",
            )
        ],
        local_dram_pools=[("kv", store.data_ptr(), store.numel())],
        key_adapter=_IntKeys(),
        control_bind_host="127.0.0.1",
        control_advertise_host="127.0.0.1",
        control_port=0,
        operation_timeout_ms=1000,
        abandon_timeout_ms=2000,
        eviction_policy="lru",
        nixl_progress_thread=False,
    )
    limits = AdapterLimits(1 << 20, 1 << 20, wait_timeout_s=STARTUP_TIMEOUT_S)
    return KVCRAdapter(factory, limits, name=name)


def child_main() -> None:
    """Start one KVCR in this (child) process and print how it went."""
    try:
        start_adapter("startup-child").close()
        result: dict[str, Any] = {"error": None}
    except Exception as exc:
        result = {"error": type(exc).__name__, "message": str(exc)}
    result["threads"] = sorted(
        t.name for t in threading.enumerate() if t.name.startswith("kvcr-owner")
    )
    print("RESULT", json.dumps(result), flush=True)


def run_child(env_overrides: dict[str, str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    env.update(env_overrides)
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); "
        "import test_kvcr_startup_errors as t; t.child_main()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"child printed no RESULT (rc={proc.returncode}):\n{proc.stderr}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def nixl_plugin_dir() -> Path:
    """The directory NIXL loads its backend plugins from by default."""
    import nixl._api

    package = nixl._api.__name__.split(".")[0]  # e.g. nixl_cu13
    site = Path(sys.modules[package].__file__).resolve().parent.parent
    return site / f".{package}.mesonpy.libs" / "plugins"


def assert_one_line(message: str) -> None:
    assert "\n" not in message, message


# ---- control port ----------------------------------------------------------------


@pytest.fixture(scope="module")
def plugin_loaded() -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()


@pytest.mark.usefixtures("plugin_loaded")
def test_control_port_in_use_is_refused_naming_control_port_and_the_fix():
    """A linker whose control_port another process listens on fails to start, saying
    which field to change and how."""
    from cpu_harness import kvcr_stack

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        stack = kvcr_stack.build_cache(
            {
                "local_dram_bytes_per_worker": 1 << 20,
                "control_port": port,
                "owner_wait_timeout_s": STARTUP_TIMEOUT_S,
            }
        )
        with pytest.raises(KVCRUnavailableError) as info:
            kvcr_stack.create_linker(stack)
    message = str(info.value)
    assert_one_line(message)
    assert message.startswith("KVCR failed to start: ")
    assert "Address already in use" in message and str(port) in message
    assert "control_port (+ attention rank) is already in use" in message
    assert "set control_port to 0" in message


# ---- NIXL / UCX, for real in a child process ----------------------------------------


def _only_posix_plugin(tmp_path: Path) -> dict[str, str]:
    posix = nixl_plugin_dir() / "libplugin_POSIX.so"
    if not posix.exists():
        pytest.skip(f"no NIXL POSIX plugin at {posix}")
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / posix.name).symlink_to(posix)
    return {"NIXL_PLUGIN_DIR": str(plugins)}


def _no_plugins(tmp_path: Path) -> dict[str, str]:
    return {"NIXL_PLUGIN_DIR": str(tmp_path)}


def _ucx_without_tcp(tmp_path: Path) -> dict[str, str]:
    return {"UCX_TLS": "sm,self"}


@pytest.mark.parametrize(
    ("environment", "status", "remedy"),
    [
        (_only_posix_plugin, "NIXL_ERR_NOT_FOUND", kvcr_adapter._REMEDY_NO_UCX),
        (_no_plugins, "No plugins available for NIXL", kvcr_adapter._REMEDY_NO_UCX),
        (_ucx_without_tcp, "NIXL_ERR_BACKEND", kvcr_adapter._REMEDY_UCX_START),
    ],
    ids=["ucx-plugin-missing", "no-nixl-plugins", "ucx-tls-without-tcp"],
)
def test_nixl_without_a_working_ucx_backend_is_refused_with_the_setting_to_fix(
    tmp_path, environment, status, remedy
):
    """A real NIXL with no UCX plugin, or a UCX that cannot start, fails KVCR startup
    with NIXL's status and the environment variable that fixes it."""
    result = run_child(environment(tmp_path))
    assert result["error"] == "KVCRUnavailableError", result
    message = result["message"]
    assert_one_line(message)
    assert message.startswith(f"KVCR failed to start: {status}")
    assert message.endswith(remedy)
    assert result["threads"] == []


# ---- GPU memory registration without GPUDirect RDMA (injected) -----------------------


def test_gpu_registration_failure_names_ucx_tls_and_nvidia_peermem(monkeypatch):
    """UCX failing ibv_reg_mr on GPU memory (no GPUDirect RDMA) fails startup with
    both fixes named.

    Injected: a CPU has no GPU memory to register. NIXL's native agent is replaced by
    a subclass whose ``registerMem`` fails for VRAM exactly as the real one does
    (UCX logs the ibv_reg_mr line; NIXL raises ``nixlBackendError('NIXL_ERR_BACKEND')``);
    DRAM registrations and everything above the binding run for real.
    """
    import nixl._api

    bindings = nixl._api.nixlBind
    vram_attempts: list[int] = []

    class NoGpuDirectAgent(bindings.nixlAgent):
        def registerMem(self, descs: Any, backends: Any) -> Any:
            if descs.getType() == bindings.VRAM_SEG:
                vram_attempts.append(descs.descCount())
                print(UCX_IBV_REG_MR_LOG, file=sys.stderr)
                raise bindings.nixlBackendError("NIXL_ERR_BACKEND")
            return super().registerMem(descs, backends)

    monkeypatch.setattr(bindings, "nixlAgent", NoGpuDirectAgent)
    with pytest.raises(KVCRUnavailableError) as info:
        start_adapter("startup-no-gpudirect", framework_mem_type="VRAM")
    assert vram_attempts, "KVCR never tried to register the GPU region"
    message = str(info.value)
    assert_one_line(message)
    assert message.startswith("KVCR failed to start: NIXL_ERR_BACKEND; ")
    assert "ibv_reg_mr: Bad address" in message
    assert "load nvidia_peermem" in message
    assert "UCX_TLS=tcp,cuda_copy,cuda_ipc" in message


# ---- the matcher itself ------------------------------------------------------------


def _raise(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def register_memory(exc: BaseException) -> BaseException:
    """Not nixl's: a function of the same name elsewhere must not count."""
    return _raise(exc)


@pytest.mark.parametrize(
    ("exc", "remedy"),
    [
        (RuntimeError("[Errno 98] Address already in use"), kvcr_adapter._REMEDY_PORT),
        (
            RuntimeError(UCX_IBV_REG_MR_LOG.split("ERROR ")[1]),
            kvcr_adapter._REMEDY_GPUDIRECT,
        ),
        (OSError(14, "Bad address"), ""),
        (RuntimeError("mmap failed: Bad address"), ""),
        (register_memory(RuntimeError("NIXL_ERR_BACKEND")), ""),
        (register_memory(RuntimeError("NIXL_ERR_NOT_FOUND")), ""),
        (RuntimeError("UCX config file not found"), ""),
        (RuntimeError("KVCR NIXL listen port is not configured"), ""),
        (ValueError("at least one DRAM backend must be configured"), ""),
    ],
    ids=[
        "port-in-use",
        "ucx-ibv-reg-mr-text",
        "bad-address-errno",
        "bad-address-elsewhere",
        "backend-status-outside-nixl",
        "not-found-status-outside-nixl",
        "ucx-not-found-text",
        "kvcr-config",
        "kvcr-validation",
    ],
)
def test_remedy_matches_only_the_failures_it_knows(exc, remedy):
    """Each remedy fires on its own failure only; anything else gets none."""
    assert kvcr_adapter._startup_remedy(exc) == remedy


@pytest.mark.parametrize(
    ("remedy", "names"),
    [
        (kvcr_adapter._REMEDY_PORT, ["control_port"]),
        (kvcr_adapter._REMEDY_NO_UCX, ["NIXL_PLUGIN_DIR", "nixl==1.5.0"]),
        (kvcr_adapter._REMEDY_GPUDIRECT, ["nvidia_peermem", "UCX_TLS"]),
        (kvcr_adapter._REMEDY_UCX_START, ["UCX_TLS", "UCX_NET_DEVICES"]),
    ],
    ids=["port", "no-ucx", "gpudirect", "ucx-start"],
)
def test_every_remedy_is_one_line_naming_the_setting(remedy, names):
    """A remedy is one clause appended to the error, naming what to change."""
    assert remedy.startswith("; ") and "\n" not in remedy
    assert all(name in remedy for name in names)
