"""The main job of the KVCR direct linker, on real SGLang servers you can watch.

Boots a no-linker control server and two KVCR-linker servers (A and B) at once,
then runs, one phase at a time and with a progress line as each starts and ends
(seconds since the start):

- ``local_round_trip``: A computes a prompt, filler traffic evicts it from the
  device, the replay is restored from A's KVCR DRAM;
- ``flush_clears_residency``: after ``/flush_cache`` the replay is a clean miss;
- ``peer_reuse``: B gets a ``kv.fetch@1.0`` hint naming A and restores the prompt
  from A's DRAM over NIXL;
- ``no_hint_control``, ``stale_hint_control``, ``dead_peer_control``: B without a
  hint, with hashes A never stored, with a peer nobody listens on: clean misses.

Every output is compared with the control server's; the table at the end says
PASS/FAIL per check, then the ``sglang:kvcr_*`` metrics each linker moved. About
2-3 minutes on 2 CPU cores once ``.venv`` exists. ``make validate``
(``kvcr_validate.py``) adds the MLA and sliding-window family round trips.
Options are ``kvcr_validate.py``'s; ``--checks`` picks a subset.
"""

from __future__ import annotations

import sys

import _paths  # noqa: F401  (the repository's test/ on sys.path)
import kvcr_validate

from kvcr_drivers.validate import BASE_CHECKS, Driver


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--checks" or a.startswith("--checks=") for a in argv):
        argv += ["--checks", ",".join(BASE_CHECKS)]
    args = kvcr_validate.parse_args(argv)
    args.progress_tag = "demo"
    print(__doc__.split("\n\n")[0], flush=True)
    return Driver(args).main()


if __name__ == "__main__":
    sys.exit(main())
