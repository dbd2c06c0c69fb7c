"""Launch a real SGLang server on CPU for tests (stdlib + requests only).

``launch_server()`` starts ``python -m sglang.launch_server`` in its own process
group with the environment a CPU run needs (``SGLANG_USE_CPU_ENGINE=1``, the
harness directory on ``PYTHONPATH`` for the torchvision stand-in and the
``sgl_kernel`` start-up hook, loopback UCX, quiet NIXL, scratch ``HOME`` and
caches), logs to a file, and waits for ``/health_generate`` with a deadline. It
fails with the log tail when the process dies or the deadline passes.
``running_server()`` is the context-manager form; on exit it sends SIGTERM (to the
launcher, then to any group member left over), waits a bounded time, then
SIGKILLs the whole group, and records the shutdown time on the handle.

Defaults: tiny model from ``tiny_model.ensure_tiny_model()``, ``--device cpu
--attention-backend torch_native --host 127.0.0.1 --port <free port>
--max-total-tokens 16384`` (keeps the KV pool small; an explicit
``--max-total-tokens`` or ``--mem-fraction-static`` in ``extra_args`` replaces it).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

try:
    from .tiny_model import ensure_tiny_model
except ImportError:  # loaded as a top-level module with this directory on sys.path
    from tiny_model import ensure_tiny_model  # type: ignore[no-redef]

HARNESS_DIR = Path(__file__).resolve().parent
PYTHONPATH_DIR = HARNESS_DIR / "pythonpath"
REPO = HARNESS_DIR.parents[1]
DEFAULT_STARTUP_TIMEOUT_S = 180.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_MAX_TOTAL_TOKENS = 16384
READY_PATH = "/health_generate"
LEFTOVER_GRACE_S = 5.0
# uvicorn's line when the HTTP port is taken (the server's processes stay up)
BIND_FAILED = "error while attempting to bind on address"


class ServerStartError(RuntimeError):
    """The server died or did not become healthy before its deadline."""


# Ports handed out here lie below the kernel's ephemeral range (32768+ by
# default): a port-0 bind there, and every outgoing connection of another server
# (ZMQ, NIXL, HTTP clients), may take a port between our check and the server's
# bind, as a fresh-clone run saw (control_port "Address already in use"). They
# also lie below SGLang's own pick for a port a child binds later (its NCCL/gloo
# port, ``get_free_port_below_ephemeral``: 22000-29999), which a server starting
# beside ours could take before ours binds (a fresh-clone run saw an HTTP port
# "already in use" with two workers starting). And no window is handed out twice
# while its first taker may still be starting (``_HELD_S``): tests pick several
# ports (events, control, HTTP) before any server binds one.
_PORTS = random.Random()
_LOW, _HIGH = 10000, 22000
SPAN = 4  # a port and the next ones (control_port + attention rank) all free
_HELD_S = 900.0
_HANDED: dict[int, float] = {}  # first port of a window -> time.monotonic() handed
_HANDED_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port (and the ``SPAN - 1`` after it) free a moment ago, outside the
    ephemeral range and SGLang's own range so no other socket is given it
    meanwhile, overlapping no window this process handed out in the last
    ``_HELD_S``."""
    with _HANDED_LOCK:
        now = time.monotonic()
        for old in [p for p, t in _HANDED.items() if now - t > _HELD_S]:
            del _HANDED[old]
        for _ in range(200):
            port = _PORTS.randrange(_LOW, _HIGH - SPAN)
            if any(abs(port - p) < SPAN for p in _HANDED):
                continue
            if all(_bindable(host, p) for p in range(port, port + SPAN)):
                _HANDED[port] = now
                return port
    raise RuntimeError(f"no free TCP port in [{_LOW}, {_HIGH}) on {host}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def cache_dir() -> Path:
    value = os.environ.get("SGLANG_KVCR_CACHE_DIR")
    return Path(value) if value else REPO / ".cache"


def python_executable() -> str:
    """The interpreter servers run under: ``$SGLANG_KVCR_SERVER_PYTHON`` when set
    (``gpu_check.sh``: its own interpreter, such as the emulated GPU host's), else
    the project's .venv's when present, else this one."""
    chosen = os.environ.get("SGLANG_KVCR_SERVER_PYTHON")
    if chosen:
        return chosen
    venv_python = REPO / ".venv" / "bin" / "python"
    return str(venv_python) if venv_python.exists() else sys.executable


def server_env(
    scratch: str | os.PathLike[str] | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment for a CPU SGLang server process (inherits os.environ);
    ``extra`` overrides it, except that a ``PYTHONPATH`` there goes right after
    the harness's start-up directory."""
    home = Path(scratch) if scratch is not None else cache_dir() / "server-home"
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    parts = [str(PYTHONPATH_DIR)] + [
        p
        for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and p != str(PYTHONPATH_DIR)
    ]
    env.update(
        {
            "SGLANG_USE_CPU_ENGINE": "1",
            "PYTHONPATH": os.pathsep.join(parts),
            "UCX_NET_DEVICES": "lo",
            "NIXL_LOG_LEVEL": "WARN",
            "HOME": str(home),
            "SGLANG_CACHE_DIR": str(home / "sglang"),
            "HF_HOME": str(home / "hf"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if extra:
        extra = dict(extra)
        more = extra.pop("PYTHONPATH", "")
        env.update(extra)
        if more:  # right after the harness's directory, ahead of inherited ones
            env["PYTHONPATH"] = os.pathsep.join([parts[0], more, *parts[1:]])
    return env


def server_command(
    model_path: str | os.PathLike[str],
    port: int,
    extra_args: Sequence[str] = (),
    host: str = "127.0.0.1",
) -> list[str]:
    """The ``python -m sglang.launch_server`` argv for a CPU run."""
    extra = [str(a) for a in extra_args]
    cmd = [
        python_executable(),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--host",
        host,
        "--port",
        str(port),
    ]
    sizing = ("--max-total-tokens", "--mem-fraction-static")
    if not any(a.split("=", 1)[0] in sizing for a in extra):
        cmd += ["--max-total-tokens", str(DEFAULT_MAX_TOTAL_TOKENS)]
    return cmd + extra


def kvcr_linker_args(config: Mapping[str, Any] | str) -> list[str]:
    """Flags that select the kvcr external linker with ``config`` (dict or JSON)."""
    text = config if isinstance(config, str) else json.dumps(dict(config))
    return [
        "--enable-unified-cache-external-linker",
        "--unified-cache-external-linker-backend",
        "kvcr",
        "--unified-cache-external-linker-config",
        text,
    ]


def tail(path: str | os.PathLike[str], lines: int = 60) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        return f"<no log: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a foreign reuse of the pgid
        return False
    return True


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


@dataclass
class ServerHandle:
    """A launched server process group; see ``launch_server``."""

    process: subprocess.Popen[bytes]
    port: int
    host: str
    log_path: Path
    command: list[str]
    started_at: float
    startup_s: float | None = None
    shutdown_s: float | None = None
    killed: bool = False
    group_terminated: bool = False
    _log_file: Any = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pgid(self) -> int:
        return self.process.pid  # start_new_session=True: the leader's pid is the pgid

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return tail(self.log_path, lines)

    # --- HTTP helpers -------------------------------------------------------
    def get(self, path: str, timeout: float = 30.0) -> requests.Response:
        return requests.get(self.base_url + path, timeout=timeout)

    def post(
        self, path: str, payload: Any = None, timeout: float = 60.0
    ) -> requests.Response:
        return requests.post(self.base_url + path, json=payload, timeout=timeout)

    def generate(
        self,
        text: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        max_new_tokens: int = 8,
        ignore_eos: bool = True,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float = 60.0,
        **extra: Any,
    ) -> dict[str, Any]:
        """POST /generate; the JSON reply.

        Greedy (temperature 0) unless ``sampling_params`` overrides it. ``ignore_eos``
        defaults to True: a random-weight model may emit EOS at any step, and tests
        want exactly ``max_new_tokens`` output tokens.
        """
        if (text is None) == (input_ids is None):
            raise ValueError("pass exactly one of text or input_ids")
        params: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": ignore_eos,
        }
        params.update(sampling_params or {})
        payload: dict[str, Any] = {"sampling_params": params, **extra}
        if text is not None:
            payload["text"] = text
        else:
            payload["input_ids"] = [int(t) for t in input_ids]  # type: ignore[union-attr]
        resp = self.post("/generate", payload, timeout=timeout)
        if resp.status_code != 200:
            raise RuntimeError(
                f"/generate returned {resp.status_code}: {resp.text[:2000]}\n"
                f"--- server log tail ---\n{self.log_tail()}"
            )
        return resp.json()

    def flush_cache(self, timeout: float = 30.0) -> requests.Response:
        return self.post("/flush_cache", None, timeout=timeout)

    # --- lifecycle ----------------------------------------------------------
    def wait_ready(self, timeout: float = DEFAULT_STARTUP_TIMEOUT_S) -> float:
        """Poll until ``/health_generate`` answers 200; returns seconds since launch."""
        deadline = time.monotonic() + timeout
        while True:
            rc = self.process.poll()
            if rc is not None:
                raise ServerStartError(
                    f"server exited with rc={rc} before becoming ready\n"
                    f"command: {self.command}\n--- log tail ({self.log_path}) ---\n"
                    f"{self.log_tail()}"
                )
            if BIND_FAILED in self.log_tail(200):
                # uvicorn logs it and the processes stay up: fail now, not at
                # the deadline.
                raise ServerStartError(
                    f"server could not bind its HTTP port {self.port}\n"
                    f"command: {self.command}\n--- log tail ({self.log_path}) ---\n"
                    f"{self.log_tail()}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServerStartError(
                    f"server not ready within {timeout:.0f}s\ncommand: {self.command}\n"
                    f"--- log tail ({self.log_path}) ---\n{self.log_tail()}"
                )
            try:
                resp = requests.get(
                    self.base_url + READY_PATH, timeout=max(1.0, min(20.0, remaining))
                )
                if resp.status_code == 200:
                    self.startup_s = time.monotonic() - self.started_at
                    return self.startup_s
            except requests.RequestException:
                pass
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def stop(self, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> float:
        """Shut the server down; bounded by ``timeout``, then SIGKILL.

        SIGTERM goes to the launcher first: SGLang then drains and tears down
        its scheduler and detokenizer itself. (A SIGTERM to the whole group at
        once kills the scheduler under the launcher, which takes SGLang's crash
        path: "scheduler crashed", SIGQUIT, a 5 s diagnostics sleep.) Members
        still alive ``LEFTOVER_GRACE_S`` after the launcher exited get SIGTERM as
        a group; whatever is left at the deadline gets SIGKILL (``killed``).

        Returns (and stores in ``shutdown_s``) the seconds until the launcher was
        reaped and no member of its process group was left. Idempotent.
        """
        if self.shutdown_s is not None:
            return self.shutdown_s
        t0 = time.monotonic()
        pgid = self.pgid
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
        deadline = t0 + timeout
        leader_exit: float | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if not _group_alive(pgid):
                    break
                now = time.monotonic()
                leader_exit = leader_exit if leader_exit is not None else now
                if not self.group_terminated and now - leader_exit > LEFTOVER_GRACE_S:
                    self.group_terminated = True
                    _signal_group(pgid, signal.SIGTERM)
            time.sleep(0.1)
        else:
            self.killed = True
            _signal_group(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
            kill_deadline = time.monotonic() + 10
            while _group_alive(pgid) and time.monotonic() < kill_deadline:
                time.sleep(0.1)
        self.shutdown_s = time.monotonic() - t0
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return self.shutdown_s


def launch_server(
    extra_args: Sequence[str] = (),
    *,
    model_path: str | os.PathLike[str] | None = None,
    port: int | None = None,
    host: str = "127.0.0.1",
    log_path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    scratch: str | os.PathLike[str] | None = None,
    wait: bool = True,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
    command_prefix: Sequence[str] = (),
) -> ServerHandle:
    """Start a CPU SGLang server; with ``wait`` (default) block until it is ready.

    ``command_prefix`` goes before the command and must exec it in place (e.g.
    ``ip netns exec <ns>``), so the handle's process is still the server's
    launcher. On a failed start the process group is torn down before
    ``ServerStartError`` (carrying the log tail) is raised.
    """
    if model_path is None:
        model_path = ensure_tiny_model()
    port = port or free_port(host)
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"sglang-cpu-{port}-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [*command_prefix, *server_command(model_path, port, extra_args, host=host)]
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed by ServerHandle.stop
    log_file.write(("$ " + " ".join(cmd) + "\n").encode())
    log_file.flush()
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=server_env(scratch, env),
        cwd=str(REPO),
        start_new_session=True,
    )
    handle = ServerHandle(
        process=proc,
        port=port,
        host=host,
        log_path=log_path,
        command=cmd,
        started_at=started,
        _log_file=log_file,
    )
    if wait:
        try:
            handle.wait_ready(startup_timeout)
        except BaseException:
            handle.stop()
            raise
    return handle


@contextlib.contextmanager
def running_server(
    extra_args: Sequence[str] = (),
    *,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    **kwargs: Any,
) -> Iterator[ServerHandle]:
    """``launch_server`` as a context manager; always stops the group on exit."""
    handle = launch_server(extra_args, **kwargs)
    try:
        yield handle
    finally:
        handle.stop(shutdown_timeout)


def run_to_exit(
    extra_args: Sequence[str] = (),
    *,
    timeout: float = 120.0,
    model_path: str | os.PathLike[str] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> tuple[int | None, float, str]:
    """Launch a server that is expected to exit on its own (e.g. a bad flag).

    Returns ``(returncode, seconds, log text)``. If it is still running after
    ``timeout`` the group is killed and ``returncode`` is None.
    """
    handle = launch_server(
        extra_args, model_path=model_path, log_path=log_path, wait=False, **kwargs
    )
    try:
        handle.process.wait(timeout=timeout)
        rc: int | None = handle.process.returncode
    except subprocess.TimeoutExpired:
        rc = None
    elapsed = time.monotonic() - handle.started_at
    handle.stop(timeout=10)
    return rc, elapsed, handle.log_text()
