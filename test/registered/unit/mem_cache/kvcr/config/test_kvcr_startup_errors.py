"""Startup failures of a real KVCR come back as one typed, one-line error with the fix.

Each fault is produced for real where the CPU allows it: a control port someone
else holds (through the linker's own constructor), a NIXL that finds no UCX
plugin, and a UCX that cannot start without ``tcp`` (both in a child process,
since NIXL reads its plugin directory and UCX its settings once per process).
The one fault loopback cannot produce, UCX failing to register KVCR's host DRAM
for RDMA (a locked-memory limit), is injected in NIXL's native ``registerMem``
binding, with the status real NIXL raises for it.
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

from cpu_harness import kvcr_stack
from cpu_harness.server import REPO
from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRUnavailableError
from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_factory
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_adapter import KVCRAdapter
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import AdapterLimits

pytestmark = pytest.mark.kvcr

TEST_DIR = REPO / "test"
BLOCK = 4096
STARTUP_TIMEOUT_S = 30.0  # the adapter's own bounded wait for KVCR to start
CHILD_TIMEOUT_S = 180.0  # a child imports torch + kvcr on 2 loaded cores
# What UCX logs (not raises) when it cannot register GPU memory without GPUDirect.
UCX_IBV_REG_MR_LOG = (
    "ib_md.c:293  UCX  ERROR ibv_reg_mr(address=0x7f3a00000000, length=2097152, "
    "access=0xf) failed: Bad address"
)


def start_adapter(name: str) -> KVCRAdapter:
    """A real KVCR through the production factory, over small CPU tensors."""
    store = torch.zeros(4 * BLOCK, dtype=torch.uint8)
    factory = kvcr_stack.small_kvcr_factory(
        name, store, BLOCK, operation_timeout_ms=1000
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
    """Run ``child_main`` in a fresh interpreter (this file as a script)."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    env.update(env_overrides)
    # The child imports cpu_harness, as this module does (conftest puts test/ on
    # this process's sys.path only).
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(TEST_DIR), env.get("PYTHONPATH", "")) if p
    )
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
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


REMEDIES = (
    kvcr_factory._REMEDY_PORT,
    kvcr_factory._REMEDY_NO_UCX,
    kvcr_factory._REMEDY_REGISTRATION,
    kvcr_factory._REMEDY_UCX_START,
)


def split_startup_error(message: str) -> tuple[str, str]:
    """(what failed, the remedy appended to it: one of REMEDIES, or '')."""
    prefix = "KVCR failed to start: "
    assert message.startswith(prefix), message
    for remedy in REMEDIES:
        if message.endswith(remedy):
            return message[len(prefix) : -len(remedy)], remedy
    return message[len(prefix) :], ""


# ---- control port ----------------------------------------------------------------


@pytest.mark.usefixtures("plugin_hooks")
def test_control_port_in_use_is_refused_naming_control_port_and_the_fix():
    """A linker whose control_port another process listens on fails to start, saying
    which field to change and how."""
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
    cause, remedy = split_startup_error(message)
    # What only the real bind failure produces: the OS error and the taken port.
    assert "Address already in use" in cause and str(port) in cause, cause
    assert remedy == kvcr_factory._REMEDY_PORT


# ---- NIXL / UCX, for real in a child process ----------------------------------------


def _only_posix_plugin(tmp_path: Path) -> dict[str, str]:
    posix = nixl_plugin_dir() / "libplugin_POSIX.so"
    assert posix.exists(), f"nixl==1.5.0 ships its POSIX plugin; none at {posix}"
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
        (_only_posix_plugin, "NIXL_ERR_NOT_FOUND", kvcr_factory._REMEDY_NO_UCX),
        (_no_plugins, "No plugins available for NIXL", kvcr_factory._REMEDY_NO_UCX),
        (_ucx_without_tcp, "NIXL_ERR_BACKEND", kvcr_factory._REMEDY_UCX_START),
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
    cause, chosen = split_startup_error(message)
    assert cause.startswith(status), cause  # NIXL's own status, from the child
    assert chosen == remedy
    assert result["threads"] == []


# ---- KVCR DRAM registration refused by UCX (injected) -------------------------------


def test_dram_registration_failure_names_the_memlock_and_ucx_fixes(monkeypatch):
    """UCX failing ibv_reg_mr on KVCR's host DRAM (a locked-memory limit on an
    RDMA host) fails startup with the fixes named. Only KVCR's own DRAM is
    registered: the pools never are (the linker copies pages itself).

    Injected: loopback UCX registers any host memory. NIXL's native agent is
    replaced by a subclass whose ``registerMem`` fails for DRAM exactly as the
    real one does (UCX logs the ibv_reg_mr line; NIXL raises
    ``nixlBackendError('NIXL_ERR_BACKEND')``); everything above the binding runs
    for real.
    """
    import nixl._api

    bindings = nixl._api.nixlBind
    dram_attempts: list[int] = []

    class NoLockedMemoryAgent(bindings.nixlAgent):
        def registerMem(self, descs: Any, backends: Any) -> Any:
            if descs.getType() == bindings.DRAM_SEG:
                dram_attempts.append(descs.descCount())
                print(UCX_IBV_REG_MR_LOG, file=sys.stderr)
                raise bindings.nixlBackendError("NIXL_ERR_BACKEND")
            return super().registerMem(descs, backends)

    monkeypatch.setattr(bindings, "nixlAgent", NoLockedMemoryAgent)
    with pytest.raises(KVCRUnavailableError) as info:
        start_adapter("startup-no-memlock")
    assert dram_attempts, "KVCR never tried to register its DRAM"
    message = str(info.value)
    assert_one_line(message)
    # The cause is the binding's own error, raised inside nixl's register_memory:
    # that call site, not the status text, is what selects the registration remedy.
    chain: list[BaseException] = []
    link = info.value.__cause__
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    raised = [e for e in chain if isinstance(e, bindings.nixlBackendError)]
    assert raised, chain
    assert "register_memory" in kvcr_factory._nixl_calls(raised[0])
    cause, remedy = split_startup_error(message)
    assert cause == "NIXL_ERR_BACKEND"
    assert remedy == kvcr_factory._REMEDY_REGISTRATION


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
        (RuntimeError("[Errno 98] Address already in use"), kvcr_factory._REMEDY_PORT),
        (
            RuntimeError(UCX_IBV_REG_MR_LOG.split("ERROR ")[1]),
            kvcr_factory._REMEDY_REGISTRATION,
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
    assert kvcr_factory.startup_remedy(exc) == remedy


@pytest.mark.parametrize(
    ("exc", "names"),
    [
        (RuntimeError("[Errno 98] Address already in use"), ["control_port"]),
        (RuntimeError("No plugins available for NIXL"), ["NIXL_PLUGIN_DIR"]),
        (
            RuntimeError(UCX_IBV_REG_MR_LOG.split("ERROR ")[1]),
            ["ulimit -l", "local_dram_bytes_per_worker", "UCX_TLS"],
        ),
        (RuntimeError("no DRAM for you"), []),
    ],
    ids=["port", "no-ucx", "registration", "unknown"],
)
def test_a_failed_start_is_one_line_with_the_cause_then_the_fix(exc, names):
    """Through the adapter's own startup path (a factory that raises): one line,
    the failure's own text, then the remedy naming what to change (none for a
    failure nobody knows the fix of)."""

    def failing(callbacks: Any) -> Any:
        raise exc

    with pytest.raises(KVCRUnavailableError) as info:
        KVCRAdapter(failing, AdapterLimits(1, 1, STARTUP_TIMEOUT_S), name="fails")
    message = str(info.value)
    assert_one_line(message)
    cause, remedy = split_startup_error(message)
    assert cause == str(exc)
    assert remedy == kvcr_factory.startup_remedy(exc)
    assert bool(remedy) == bool(names)
    assert all(name in remedy for name in names), remedy
    assert info.value.__cause__ is exc


if __name__ == "__main__":  # run_child: one KVCR start in a fresh interpreter
    child_main()
