"""Unpack wheels into a target directory: ``pip install --no-deps --target`` without pip.

``gpu_check.sh`` uses it only when the host's interpreter has no pip. Each wheel is
unzipped into TARGET; a ``<name>.data/purelib`` or ``platlib`` tree is merged into
TARGET (``scripts``/``headers``/``data`` are skipped: nothing here runs them). File
modes stored in the archive (executable bits of bundled libraries) are kept.

    python unpack_wheels.py TARGET WHEEL...
"""

from __future__ import annotations

import os
import shutil
import sys
import zipfile


def unpack(wheel: str, target: str) -> int:
    count = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            parts = name.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                name = "/".join(parts[2:])
            if not name or name.endswith("/"):
                continue
            dest = os.path.join(target, *name.split("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with zf.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(dest, mode)
            count += 1
    return count


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    target = argv[1]
    os.makedirs(target, exist_ok=True)
    for wheel in argv[2:]:
        print(f"{os.path.basename(wheel)}: {unpack(wheel, target)} files", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
