"""NIXL's own metadata fetch, as an outsider would use it (run by ``kvcr_netns``).

One JSON argument. ``{"targets": [[ip, port], ...], "names": [...], "wait": s,
"final": s}``: a NIXL agent with its listener on (NIXL needs one to receive
fetched metadata) calls ``fetch_remote_metadata`` against each target in turn,
printing ``PROBE ip:port`` to stderr first (NIXL logs each metadata load there,
at TRACE, naming the agent), waits ``wait`` seconds after each and ``final`` after
the last, then prints ``RESULT`` and a JSON object: ``check_remote_metadata`` for
each of ``names``. ``{"serve": name,
"port": p}``: an agent ``name`` with its metadata listener on port ``p`` (what
kvcr asks NIXL for), printing ``READY``, until stdin closes or 600 s pass.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time


def _stderr(line: str) -> None:
    os.write(2, (line + "\n").encode())  # unbuffered, in order with NIXL's own log


def serve(name: str, port: int) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(
        name, nixl_agent_config(enable_listen_thread=True, listen_port=port)
    )
    print("READY", flush=True)
    select.select([sys.stdin], [], [], 600.0)
    del agent


def fetch(
    targets: list[list[object]], names: list[str], wait: float, final: float
) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(
        f"outsider-{os.getpid()}",
        nixl_agent_config(enable_listen_thread=True, listen_port=0),
    )
    for ip, port in targets:
        _stderr(f"PROBE {ip}:{port}")
        try:
            agent.fetch_remote_metadata("kvcr", str(ip), int(port))  # type: ignore[call-overload]
        except Exception as exc:  # a refused fetch may raise: that is a result
            _stderr(f"fetch {ip}:{port} raised {type(exc).__name__}: {exc}")
        time.sleep(wait)
    time.sleep(final)
    _stderr("PROBE done")
    print(
        "RESULT " + json.dumps({n: bool(agent.check_remote_metadata(n)) for n in names})
    )
    sys.stdout.flush()


def main() -> None:
    spec = json.loads(sys.argv[1])
    if "serve" in spec:
        serve(spec["serve"], int(spec["port"]))
    else:
        fetch(spec["targets"], spec["names"], float(spec["wait"]), float(spec["final"]))


if __name__ == "__main__":
    main()
