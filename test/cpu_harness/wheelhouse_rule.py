"""What the GPU wheelhouse carries: only what the GPU host lacks.

``device_packages.txt`` (beside ``gpu_check.sh``) lists the packages the GPU host
already has. A wheel of one of them is left behind: a second copy on
``PYTHONPATH`` would shadow the host's own build (another pytest loading the
host's pytest plugins, another torch without the host's CUDA). Names compare as
PEP 503 normalizes them (``Typing_Extensions`` is ``typing-extensions``); a
wheel's project is the part of its file name before the first ``-``.

``build_wheelhouse.sh`` runs ``prune DIR BEHIND``: moves the host's packages out
of the wheelhouse into ``BEHIND`` (outside it: what lies in the wheelhouse's
folder travels) and prints every wheel it keeps with its size and the total. ``gpu_check.sh`` runs ``split WHEEL...`` before installing:
the wheels to install, one a line, and ``refusing NAME`` lines for the others.
``check DIR`` exits 1 when the wheelhouse holds a host package.

    python test/cpu_harness/wheelhouse_rule.py prune DIR BEHIND
    python test/cpu_harness/wheelhouse_rule.py check DIR
    python test/cpu_harness/wheelhouse_rule.py split WHEEL...
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

DEVICE_PACKAGES = (
    Path(__file__).resolve().parents[1]
    / "manual"
    / "kvcr_direct_linker"
    / "device_packages.txt"
)


def normalize(name: str) -> str:
    """A project name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project_of(wheel: str | Path) -> str:
    """The normalized project of a wheel file name (``nvidia_nccl_cu13-2.28...``)."""
    return normalize(Path(wheel).name.split("-", 1)[0])


def device_packages(path: Path = DEVICE_PACKAGES) -> dict[str, str]:
    """The host's packages: normalized name -> version ('' when not known)."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[normalize(name)] = version.strip()
    return out


def split(
    wheels: Iterable[str | Path], host: dict[str, str]
) -> tuple[list[Path], list[Path]]:
    """(wheels the host lacks, wheels of packages it has), in the given order."""
    carried: list[Path] = []
    left: list[Path] = []
    for wheel in map(Path, wheels):
        (left if project_of(wheel) in host else carried).append(wheel)
    return carried, left


def mib(nbytes: int) -> str:
    return f"{nbytes / 1048576:.2f} MiB"


def prune(directory: Path, behind: Path, host: dict[str, str]) -> list[Path]:
    """Move the host's packages from ``directory`` to ``behind``; the wheels kept."""
    carried, left = split(sorted(directory.glob("*.whl")), host)
    if left:
        behind.mkdir(parents=True, exist_ok=True)
        for wheel in left:
            shutil.move(str(wheel), behind / wheel.name)
            print(f"left behind (the host has {project_of(wheel)}): {wheel.name}")
    return carried


def listing(wheels: list[Path]) -> str:
    """One line per wheel with its size, largest first, then the total."""
    sized = sorted(((w.stat().st_size, w.name) for w in wheels), reverse=True)
    lines = [f"{mib(size):>12}  {name}" for size, name in sized]
    total = sum(size for size, _ in sized)
    lines.append(f"{mib(total):>12}  total, {len(sized)} wheels")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("prune", "check", "split"):
        print(__doc__.split("\n\n")[-1], file=sys.stderr)
        return 2
    host = device_packages()
    if argv[0] == "split":
        carried, left = split(argv[1:], host)
        for wheel in left:
            print(f"refusing {wheel.name}: the host has {project_of(wheel)}")
        for wheel in carried:
            print(wheel)
        return 0
    directory = Path(argv[1])
    if argv[0] == "prune":
        if len(argv) != 3:
            print("prune needs DIR BEHIND", file=sys.stderr)
            return 2
        print(listing(prune(directory, Path(argv[2]), host)))
        return 0
    _, left = split(sorted(directory.glob("*.whl")), host)
    for wheel in left:
        print(f"the host has {project_of(wheel)}: {wheel.name}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
