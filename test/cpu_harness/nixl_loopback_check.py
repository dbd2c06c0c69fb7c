"""NIXL UCX DRAM loopback WRITE smoke check (stdlib + nixl only: no torch, no numpy).

One NIXL agent with ``backends=["UCX"]`` registers two host buffers (ctypes), writes
the first into the second through its own UCX endpoint (loopback) and checks that
the transfer reaches ``DONE`` with equal bytes. Used by ``gpu_check.sh`` (env stage)
and as a quick local check of a wheelhouse install on another Python:

    UCX_NET_DEVICES=lo python3 test/cpu_harness/nixl_loopback_check.py [--mib N]

Prints one line per step and ``NIXL_LOOPBACK PASS ...`` last; exits 1 on failure.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time


def loopback_write(size: int, timeout_s: float = 30.0) -> dict[str, object]:
    from nixl._api import nixl_agent, nixl_agent_config

    src = (ctypes.c_ubyte * size)()
    dst = (ctypes.c_ubyte * size)()
    pattern = bytes((i * 7 + 3) & 0xFF for i in range(251))
    payload = (pattern * (size // len(pattern) + 1))[:size]
    ctypes.memmove(src, payload, size)
    s, d = ctypes.addressof(src), ctypes.addressof(dst)
    name = f"gpu-check-loopback-{os.getpid()}"
    agent = nixl_agent(
        name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    )
    plugins = sorted(agent.get_plugin_list())
    regs = agent.register_memory([(s, size, 0, ""), (d, size, 0, "")], "DRAM")
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(s, size, 0)], "DRAM")
    remote = agent.prep_xfer_dlist(name, [(d, size, 0)], "DRAM")
    handle = agent.make_prepped_xfer("WRITE", local, [0], remote, [0])
    t0 = time.perf_counter()
    state = agent.transfer(handle)
    deadline = time.monotonic() + timeout_s
    while state not in ("DONE", "ERR"):
        if time.monotonic() >= deadline:
            # Leave the memory registered: a transfer may still touch it.
            raise TimeoutError(f"loopback WRITE not done after {timeout_s} s")
        state = agent.check_xfer_state(handle)
    elapsed = time.perf_counter() - t0
    equal = bytes(dst) == payload
    agent.release_xfer_handle(handle)
    agent.release_dlist_handle(local)
    agent.release_dlist_handle(remote)
    agent.deregister_memory(regs)
    return {
        "plugins": plugins,
        "state": state,
        "equal": equal,
        "bytes": size,
        "seconds": elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1, help="buffer size in MiB")
    p.add_argument("--timeout-s", type=float, default=30.0)
    args = p.parse_args(argv)
    import nixl

    print(f"nixl from {os.path.dirname(nixl.__file__)}", flush=True)
    try:
        result = loopback_write(args.mib << 20, args.timeout_s)
    except Exception as exc:
        print(f"NIXL_LOOPBACK FAIL {type(exc).__name__}: {exc}", flush=True)
        return 1
    ok = result["state"] == "DONE" and result["equal"]
    verdict = "PASS" if ok else "FAIL"
    print(
        f"NIXL_LOOPBACK {verdict} plugins={result['plugins']} state={result['state']} "
        f"equal={result['equal']} bytes={result['bytes']} "
        f"us={float(result['seconds']) * 1e6:.0f}",  # type: ignore[arg-type]
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
