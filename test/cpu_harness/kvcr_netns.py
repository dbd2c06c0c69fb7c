"""Hosts as Linux network namespaces on one bridge, for multi-host tests (root only).

``Fabric`` creates, under one random suffix, a switch namespace holding a bridge and
one namespace per host, each joined to the bridge by a veth pair whose host end
(``Host.device``) carries an address from 198.18.0.0/15 (the benchmarking range:
never routed; the namespaces have no default route and no link to the root
namespace, so nothing leaves them). ``close`` kills what still runs in them,
deletes the veths, the bridge and the namespaces, and raises if any is left.
A ``Host`` runs commands in its namespace (``ip netns exec``), calls Python
functions on threads that entered it (``call``: HTTP to servers bound there), lists
its listening TCP sockets, reads its device's byte counters and throttles its
egress (tbf). ``launch_linker`` starts a CPU SGLang server with the KVCR linker on
a host, its control channel on the host's address and UCX on its device only.
``fetch_metadata`` is an outsider's attempt, with NIXL's own metadata fetch, to get
agent metadata from a list of ports (``nixl_metadata_probe.py`` in a namespace).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import re
import secrets
import select
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from cpu_harness import kvcr_servers as kvs
from cpu_harness import server as harness

T = TypeVar("T")
SUBNET = "198.18.0"  # hosts .1, .2, ...; /24 on the bridge only
CONTROL_PORT = 7000  # every host has its own port space
HTTP_PORT = 30000
# Transports a real fleet has between hosts: TCP, and the process itself.
UCX_TLS = "tcp,self"
CLONE_NEWNET = 0x40000000
CMD_TIMEOUT_S = 30.0
PROBE = Path(__file__).resolve().parent / "nixl_metadata_probe.py"
LOADED_RE = re.compile(r"Loading remote metadata for agent: (\S+)")
AGENT_RE = re.compile(r"KVCR direct linker up: agent=(\S+)")
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsError(RuntimeError):
    """A namespace, bridge or veth could not be created or removed."""


def sh(*cmd: str, timeout: float = CMD_TIMEOUT_S) -> str:
    """Run ``cmd``; its stdout, or NetnsError with its stderr."""
    try:
        proc = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(cmd)}: {exc}") from exc
    if proc.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: rc={proc.returncode} {proc.stderr.strip()}")
    return proc.stdout


def _enter_netns(path: str) -> None:
    """Move the calling thread into the network namespace bound at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclasses.dataclass
class Listener:
    """One listening TCP socket: its address, port and the owning pids."""

    address: str
    port: int
    pids: tuple[int, ...]


@dataclasses.dataclass
class Host:
    """One namespace on the fabric."""

    label: str
    netns: str
    ip: str
    device: str
    _pool: ThreadPoolExecutor | None = None

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def sh(self, *cmd: str, timeout: float = CMD_TIMEOUT_S) -> str:
        return sh(*self.prefix(), *cmd, timeout=timeout)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """``fn(*args)`` started on a thread inside this namespace (sockets it
        opens are this host's)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=4,
                thread_name_prefix=f"netns-{self.label}",
                initializer=_enter_netns,
                initargs=(f"/run/netns/{self.netns}",),
            )
        return self._pool.submit(fn, *args)

    def call(self, fn: Callable[..., T], *args: Any, timeout: float = 600.0) -> T:
        """``submit`` and wait, bounded by ``timeout``."""
        return self.submit(fn, *args).result(timeout)

    def sysctl(self, key: str, value: str) -> None:
        self.sh("sysctl", "-q", "-w", f"{key}={value}")

    def listening(self) -> list[Listener]:
        """Every listening TCP socket in this namespace (``ss -ltnp``)."""
        found = []
        for line in self.sh("ss", "-ltnpH").splitlines():
            cols = line.split()
            if len(cols) < 4:
                continue
            address, port = cols[3].rsplit(":", 1)
            pids = tuple(int(p) for p in re.findall(r"pid=(\d+)", line))
            found.append(Listener(address.strip("[]"), int(port), pids))
        return found

    def tx_bytes(self) -> int:
        """Bytes this host's device has sent."""
        info = json.loads(
            sh("ip", "-n", self.netns, "-s", "-j", "link", "show", "dev", self.device)
        )
        return int(info[0]["stats64"]["tx"]["bytes"])

    def throttle(self, kbit: int) -> None:
        """Limit this host's egress to ``kbit`` kbit/s (queued, not dropped)."""
        self.sh(
            "tc", "qdisc", "replace", "dev", self.device, "root", "tbf",
            "rate", f"{kbit}kbit", "burst", "4kb", "limit", "4mb",
        )  # fmt: skip

    def unthrottle(self) -> None:
        with contextlib.suppress(NetnsError):
            self.sh("tc", "qdisc", "del", "dev", self.device, "root")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class Fabric:
    """Hosts ``labels`` on one bridge; a context manager that always cleans up."""

    def __init__(self, labels: Sequence[str]) -> None:
        self.suffix = secrets.token_hex(3)
        self.switch = f"kvcr-{self.suffix}-sw"
        self.hosts = {
            label: Host(label, f"kvcr-{self.suffix}-{label}", f"{SUBNET}.{i}", "kv0")
            for i, label in enumerate(labels, start=1)
        }
        self._created: list[str] = []

    def namespaces(self) -> list[str]:
        return [self.switch, *(h.netns for h in self.hosts.values())]

    def __enter__(self) -> Fabric:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _port(self, host: Host) -> str:
        return f"kv{self.suffix}{host.label}"[:15]

    def _create(self) -> None:
        for ns in self.namespaces():
            sh("ip", "netns", "add", ns)
            self._created.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts.values():
            port = self._port(host)
            sh(
                "ip", "link", "add", "name", host.device, "netns", host.netns,
                "type", "veth", "peer", "name", port, "netns", self.switch,
            )  # fmt: skip
            sh("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            sh(
                "ip",
                "-n",
                host.netns,
                "addr",
                "add",
                f"{host.ip}/24",
                "dev",
                host.device,
            )
            sh("ip", "-n", host.netns, "link", "set", host.device, "up")
            inode = os.stat(f"/run/netns/{host.netns}").st_ino
            seen = host.call(lambda: os.stat("/proc/thread-self/ns/net").st_ino)
            if seen != inode:
                raise NetnsError(f"a thread could not enter {host.netns}")

    def _kill_inside(self, ns: str) -> None:
        """SIGKILL what still runs in ``ns`` (only this fabric's processes can)."""
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                pids = [int(p) for p in sh("ip", "netns", "pids", ns).split()]
            except NetnsError:
                return
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    def close(self) -> None:
        """Kill, unlink, delete; raises NetnsError if a namespace is left."""
        problems = []
        for host in self.hosts.values():
            host.close()
        for ns in reversed(self._created):
            self._kill_inside(ns)
        for host in self.hosts.values():
            if host.netns in self._created:
                with contextlib.suppress(NetnsError):  # gone with a failed create
                    sh("ip", "-n", host.netns, "link", "del", host.device)
        if self.switch in self._created:
            with contextlib.suppress(NetnsError):
                sh("ip", "-n", self.switch, "link", "del", "br0")
        for ns in reversed(self._created):
            try:
                sh("ip", "netns", "del", ns)
            except NetnsError as exc:
                problems.append(str(exc))
        self._created = []
        left = [ns for ns in self.namespaces() if ns in leftover_namespaces()]
        if left or problems:
            raise NetnsError(f"namespaces left behind: {left} {problems}")


def leftover_namespaces() -> list[str]:
    """Every namespace ``ip netns list`` shows."""
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line]


@dataclasses.dataclass
class HostServer:
    """A KVCR-linker server running on ``host`` (HTTP on its loopback)."""

    host: Host
    handle: harness.ServerHandle
    endpoint: str

    def wait_ready(self, timeout: float) -> float:
        return self.host.call(self.handle.wait_ready, timeout, timeout=timeout + 30)

    def run(self, ids: list[int], **extra: Any) -> tuple[list[int], int]:
        """(output ids, tokens restored from external KVCR pages)."""
        return self.host.call(lambda: kvs.run(self.handle, ids, **extra))

    def start_run(self, ids: list[int], **extra: Any) -> Future[tuple[list[int], int]]:
        """``run`` started in the background."""
        return self.host.submit(lambda: kvs.run(self.handle, ids, **extra))

    def computed(self, ids: list[int]) -> list[int]:
        return self.host.call(lambda: kvs.computed_on(self.handle, ids))

    def recompute(self, ids: list[int]) -> list[int]:
        return self.host.call(lambda: kvs.recompute(self.handle, ids))

    def metrics_text(self) -> str:
        return self.host.call(lambda: self.handle.get("/metrics", timeout=30).text)

    def agents(self) -> list[str]:
        """The NIXL agent names this server's KVCR incarnations logged."""
        return AGENT_RE.findall(self.handle.log_text())

    def kill(self) -> None:
        """SIGKILL the whole server (process group) at once, no shutdown."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.handle.pgid, signal.SIGKILL)

    def stop(self) -> None:
        self.handle.stop()


def launch_linker(
    host: Host,
    name: str,
    model: Path,
    work: Path,
    config: dict[str, Any],
    *,
    prompt_len: int = 256,
) -> HostServer:
    """A KVCR-linker server on ``host`` with metrics on, started without waiting:
    control channel bound and advertised on the host's address, UCX on its device."""
    cfg = {
        **kvs.DEFAULT_CONFIG,
        "control_bind_host": host.ip,
        "control_advertise_host": host.ip,
        "control_port": CONTROL_PORT,
        **config,
    }
    args = [
        "--page-size", str(kvs.PAGE),
        "--max-total-tokens", str(4 * prompt_len),
        "--max-running-requests", "4",
        "--enable-metrics",
        *harness.kvcr_linker_args(cfg),
    ]  # fmt: skip
    handle = harness.launch_server(
        args,
        model_path=model,
        port=HTTP_PORT,
        log_path=work / f"{name}.log",
        env={"UCX_NET_DEVICES": host.device, "UCX_TLS": UCX_TLS},
        scratch=work / f"{name}-home",
        wait=False,
        command_prefix=host.prefix(),
    )
    return HostServer(host, handle, f"tcp://{host.ip}:{CONTROL_PORT}")


@dataclasses.dataclass
class MetadataProbe:
    """What an outsider's NIXL agent loaded, by target and in all."""

    loaded: set[str]  # agent names NIXL logged loading metadata for
    by_target: dict[str, list[str]]  # "ip:port" -> names loaded while trying it
    checked: dict[str, bool]  # check_remote_metadata of the names asked about
    output: str


def fetch_metadata(
    host: Host,
    targets: Sequence[tuple[str, int]],
    names: Sequence[str],
    *,
    per_target_s: float = 0.5,
    final_s: float = 5.0,
    timeout: float = 120.0,
) -> MetadataProbe:
    """From ``host``, NIXL's ``fetch_remote_metadata`` against every target in turn
    (``per_target_s`` apart, ``final_s`` after the last), then
    ``check_remote_metadata`` for ``names``; NIXL's own log says what it loaded
    (any name). Runs in its own process, bounded by ``timeout``."""
    spec = json.dumps(
        {
            "targets": [list(t) for t in targets],
            "names": list(names),
            "wait": per_target_s,
            "final": final_s,
        }
    )
    env = {
        **os.environ,
        "UCX_NET_DEVICES": host.device,
        "UCX_TLS": UCX_TLS,
        "NIXL_LOG_LEVEL": "TRACE",  # the "Loading remote metadata" line
    }
    proc = subprocess.run(
        [*host.prefix(), harness.python_executable(), str(PROBE), spec],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    output = proc.stdout + proc.stderr
    by_target: dict[str, list[str]] = {}
    current = "before"
    for line in output.splitlines():
        if line.startswith("PROBE "):
            current = line.split()[1]
        for name in LOADED_RE.findall(line):
            by_target.setdefault(current, []).append(name)
    results = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise RuntimeError(
            f"metadata probe failed rc={proc.returncode}:\n{output[-4000:]}"
        )
    checked = json.loads(results[-1][len("RESULT ") :])
    loaded = {n for names_ in by_target.values() for n in names_}
    return MetadataProbe(loaded, by_target, checked, output)


def decoy_listener(
    host: Host, port: int, name: str, start_s: float = 60.0
) -> subprocess.Popen[str]:
    """A NIXL agent ``name`` with its metadata listener on ``port`` of ``host``:
    the probe's positive control. Stops when its stdin closes."""
    env = {**os.environ, "UCX_NET_DEVICES": host.device, "UCX_TLS": UCX_TLS}
    spec = json.dumps({"serve": name, "port": port})
    proc = subprocess.Popen(
        [*host.prefix(), harness.python_executable(), str(PROBE), spec],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], start_s)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != "READY":
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"decoy listener not ready within {start_s} s: {line!r}")
    return proc
