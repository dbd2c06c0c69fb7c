"""Shared pytest set-up: loopback-only NIXL, scratch caches, the CPU harness path.

Runs before any test module imports SGLang or kvcr. It puts the project's CPU
harness (torchvision stand-in, sgl_kernel start-up hook) on ``sys.path`` and on
``PYTHONPATH`` so spawned SGLang processes see it too, keeps UCX on ``lo``, and
points SGLang's caches at a scratch directory instead of ``~/.cache``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HARNESS_PATH = REPO / "test" / "cpu_harness" / "pythonpath"
CACHE_DIR = Path(os.environ.get("SGLANG_KVCR_CACHE_DIR", REPO / ".cache"))

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("SGLANG_KVCR_CACHE_DIR", str(CACHE_DIR))
os.environ.setdefault("SGLANG_CACHE_DIR", str(CACHE_DIR / "sglang"))
os.environ.setdefault("HF_HOME", str(CACHE_DIR / "hf"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
_pp = os.environ.get("PYTHONPATH", "")
if str(HARNESS_PATH) not in _pp.split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HARNESS_PATH), _pp) if p)
if str(HARNESS_PATH) not in sys.path:
    sys.path.insert(0, str(HARNESS_PATH))
if str(REPO / "test") not in sys.path:
    sys.path.insert(0, str(REPO / "test"))
