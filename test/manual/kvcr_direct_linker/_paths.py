"""Makes the drivers' modules importable when a script here runs by path.

``python test/manual/kvcr_direct_linker/X.py`` puts only this directory on
``sys.path``; the scripts import ``_paths`` first, which adds the repository's
``test/`` (``kvcr_drivers``, ``cpu_harness``) in front and the CPU harness
start-up directory (torchvision stand-in, ``sgl_kernel`` hook) at the end, where
it cannot shadow a host's own packages. It also keeps NIXL on loopback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
_TEST = str(REPO / "test")
_HARNESS = str(REPO / "test" / "cpu_harness" / "pythonpath")

if _TEST not in sys.path:
    sys.path.insert(0, _TEST)
if _HARNESS not in sys.path:
    sys.path.append(_HARNESS)
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
