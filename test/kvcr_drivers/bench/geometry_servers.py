"""KVCR-linker servers of the GPU check's model geometries (``kvcr_warmup.py`` and
``kvcr_family_bench.py``).

``launch`` starts, without waiting, one SGLang server with the KVCR linker on a
``geometry_models`` directory (``qwen3``, ``mla``, ``swa``; ``full`` on the GPU,
``dry-run`` scaled down on CPU) with ``--load-format dummy`` and the harness's
fan-in-scaled dummy weights (``SGLANG_KVCR_DUMMY_WEIGHTS=fan_in``: greedy outputs
then tell a right KV restore from a wrong one). Its device pool holds four prompts
(as ``kvcr_servers.launch_linker``'s), and the handle carries what
``kvcr_servers.family_round_trip`` reads (``family``, ``model_config``). Its ports
(HTTP, KVCR control) are ones no other server of this process was given.

``prepare(kinds, scale)`` builds the model directories first, in one thread.
``start(launch, timeout_s)``: a server from ``launch()`` once ready; launched again
(new ports) once when its HTTP port was taken between being picked and bound, as
happens on a host shared with other runs; stopped when it does not come up.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cpu_harness import geometry_models, kvcr_servers
from cpu_harness import server as harness
from kvcr_drivers.bench.serving import kvcr_linker_config, prefill_chunk, server_env

DUMMY_ENV = {"SGLANG_KVCR_DUMMY_WEIGHTS": "fan_in"}
GIB = 1 << 30
FAMILY_PAGE = kvcr_servers.PAGE  # what family_round_trip's checks count in
BIND_CLASH = "address already in use"


class PortClash(RuntimeError):
    """Another process bound the server's port before the server did."""


def wait_ready(server: Any, timeout_s: float) -> float:
    """Seconds from launch to ready; ``PortClash`` as soon as the log shows the
    port was taken (the server would otherwise idle until its own warm-up fails)."""
    deadline = time.monotonic() + timeout_s
    while True:
        step = min(5.0, max(0.5, deadline - time.monotonic()))
        try:
            return float(server.wait_ready(step))
        except harness.ServerStartError:
            log = server.log_text()
            # a failed bind: a new port, not another wait on this one
            if BIND_CLASH in log or harness.BIND_FAILED in log:
                raise PortClash(f"port {server.port} was taken") from None
            if server.process.poll() is not None:
                raise
            if time.monotonic() >= deadline:  # named by the whole wait, not a step
                raise harness.ServerStartError(
                    f"server not ready within {timeout_s:.0f}s\n"
                    f"--- log tail ---\n{server.log_tail()}"
                ) from None


def prepare(kinds: Sequence[str], scale: str) -> None:
    """Build every ``kind``'s model directory now, in this thread, before servers
    are launched from threads at once: transformers' lazy imports are not safe
    from several threads (the first H200 run's sliding-window build failed with
    "cannot import name 'PreTrainedTokenizerFast'" while two others built)."""
    root = harness.cache_dir() / "gpu_check_models"
    for kind in kinds:
        try:
            geometry_models.ensure_geometry_model(kind, scale, root)
        except Exception as exc:  # its launch tries again and reports it per model
            print(f"[geometry] {kind}: model directory not built here: {exc!r}")


def start(launch: Callable[[], Any], timeout_s: float) -> Any:
    """A ready server from ``launch()`` (see the module docstring)."""
    for attempt in (1, 2):
        server = launch()
        try:
            wait_ready(server, timeout_s)
            return server
        except PortClash:
            server.stop()
            if attempt == 2:
                raise
        except BaseException:
            server.stop()
            raise
    raise AssertionError("unreachable")


def dram_bytes(device: str, scale: str) -> int:
    """KVCR DRAM per server: room for the seed prompt and every filler."""
    return 4 * GIB if (device == "cuda" and scale == "full") else 256 << 20


def launch(
    kind: str,
    *,
    scale: str,
    device: str,
    work: Path,
    prompt_len: int,
    page: int = FAMILY_PAGE,
    server_args: Sequence[str] = (),
    linker_config: dict[str, Any] | None = None,
) -> Any:
    """A ``kind`` server with the KVCR linker, started without waiting."""
    root = harness.cache_dir() / "gpu_check_models"
    model = geometry_models.ensure_geometry_model(kind, scale, root)
    control_port = harness.free_port()
    config = {
        **kvcr_linker_config(dram_bytes(device, scale), 10000, linker_config or {}),
        "control_port": control_port,
    }
    args = [
        "--page-size",
        str(page),
        "--max-total-tokens",
        str(4 * prompt_len),
        "--max-running-requests",
        "4",
        "--chunked-prefill-size",
        str(prefill_chunk(prompt_len, page)),
        "--load-format",
        "dummy",
        *(["--device", "cuda"] if device == "cuda" else []),
        *server_args,
        *harness.kvcr_linker_args(config),
    ]
    env = {**(server_env(device) or {}), **DUMMY_ENV}
    handle = harness.launch_server(
        args,
        model_path=model,
        port=harness.free_port(),
        log_path=work / f"{kind}.log",
        env=env,
        wait=False,
    )
    handle.endpoint = f"tcp://127.0.0.1:{control_port}"
    handle.family = kind
    handle.model_config = json.loads((model / "config.json").read_text())
    return handle
