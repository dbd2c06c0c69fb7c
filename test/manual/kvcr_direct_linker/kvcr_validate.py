"""End-to-end validation of the KVCR direct linker on real SGLang servers.

Launches a no-linker control server and two KVCR-linker servers (A and B), then:
``local_round_trip`` (A serves a prompt, filler traffic evicts it from the device,
the replay is restored from KVCR), ``flush_clears_residency`` (after
``/flush_cache`` the replay is a clean miss), ``peer_reuse`` (B gets a
``kv.fetch@1.0`` hint naming A's endpoint and the prompt's page hashes), and the
``no_hint_control``, ``stale_hint_control`` and ``dead_peer_control`` checks. Every
replay is compared with the control server by greedy output ids and by served
cached tokens (device and external). On CPU with the default model it also runs
``mla_round_trip`` and ``swa_round_trip``: a tiny seeded-weight DeepSeek-V2 (MLA)
and Beam (FULL+SWA) linker server each evict and replay a prompt, restored from
KVCR with the output and logprobs of a recompute. Writes a JSON report; its path is printed on
the last line as ``REPORT <path>``. Exits non-zero when any check fails.

CPU (default): the project's tiny offline model. GPU: ``--device cuda --model-path
Qwen/Qwen3-0.6B --page-size 64 --prompt-len 3000``. The checks live in
``test/kvcr_drivers/validate.py``.
"""

from __future__ import annotations

import argparse
import sys

import _paths  # noqa: F401  (the repository's test/ on sys.path)

from kvcr_drivers import cli
from kvcr_drivers.bench.serving import add_server_options, check_server_options
from kvcr_drivers.validate import CHECKS, Driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_options(p, prompt_len=512, output_len=8)
    cli.add_run_options(p)
    p.add_argument(
        "--port-base",
        type=int,
        default=0,
        help="HTTP ports base..base+2 and control ports base+10.. "
        "(default: free ports)",
    )
    p.add_argument(
        "--dram-bytes",
        type=int,
        default=256 << 20,
        help="local_dram_bytes_per_worker for the linker servers",
    )
    p.add_argument(
        "--checks",
        default="",
        help=f"comma-separated subset of {','.join(CHECKS)} (default: all)",
    )
    args = p.parse_args(argv)
    cli.comma_list(p, "--checks", args.checks, CHECKS)
    check_server_options(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    return Driver(parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
