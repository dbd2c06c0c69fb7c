"""What the driver command lines in ``test/manual/kvcr_direct_linker`` share.

``add_run_options``: the report path, the seed and the server start-up deadline
(every driver); ``work_dir`` is the directory the report and the servers' logs go
to. ``add_itl_options`` / ``check_itl_options``: the decode-ITL workload's rounds,
output length, background concurrency and pacing (``kvcr_bench.py`` and
``kvcr_microbench.py``). ``comma_list``: a ``--flag a,b`` subset of known names,
refused naming the unknown ones.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from cpu_harness import server as harness


def add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--report", default="", help="report path (default under .cache)")
    p.add_argument("--seed", type=int, default=0)


def work_dir(args: argparse.Namespace, name: str) -> Path:
    """The ``--report`` file's directory, else ``.cache/<name>``; created."""
    work = Path(args.report).parent if args.report else harness.cache_dir() / name
    work.mkdir(parents=True, exist_ok=True)
    return work


def add_itl_options(
    p: argparse.ArgumentParser, *, rounds: int, rounds_help: str
) -> None:
    p.add_argument("--itl-rounds", type=int, default=rounds, help=rounds_help)
    p.add_argument("--itl-output-len", type=int, default=96)
    p.add_argument(
        "--itl-concurrency",
        type=int,
        default=2,
        help="most background prompts in flight at once",
    )
    p.add_argument(
        "--itl-every-tokens",
        type=int,
        default=16,
        help="one background prompt when the decode starts and after every this "
        "many of its output tokens",
    )


def check_itl_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag, value, least in (
        ("--itl-rounds", args.itl_rounds, 1),
        ("--itl-output-len", args.itl_output_len, 8),
        ("--itl-concurrency", args.itl_concurrency, 1),
        ("--itl-every-tokens", args.itl_every_tokens, 1),
    ):
        if value < least:
            p.error(f"{flag} must be >= {least}")


def comma_list(
    p: argparse.ArgumentParser, flag: str, text: str, choices: Sequence[str]
) -> list[str]:
    """The names in ``text`` (comma-separated), in ``choices`` order; any other
    name ends the program with a usage error naming ``flag``."""
    chosen = {c for c in text.split(",") if c}
    unknown = sorted(chosen - set(choices))
    if unknown:
        p.error(f"{flag}: unknown {unknown}; choose from {list(choices)}")
    return [c for c in choices if c in chosen]
