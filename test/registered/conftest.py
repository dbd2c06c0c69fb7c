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


import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

# Markers whose tests run only when ``-m`` names them (their own make targets).
OPT_IN = ("install", "interop", "netns", "server_faults", "scenario")


def pytest_collection_modifyitems(config, items):
    """Deselect (never skip) ``gpu`` tests where torch sees no CUDA device, so a
    CPU run reports no skips; ``gpu_check.sh`` runs them on a GPU host. ``OPT_IN``
    tests are deselected unless the ``-m`` expression names their marker."""
    markexpr = config.getoption("markexpr") or ""
    for name in OPT_IN:
        if name not in markexpr:
            out = [item for item in items if item.get_closest_marker(name)]
            if out:
                config.hook.pytest_deselected(items=out)
                items[:] = [item for item in items if not item.get_closest_marker(name)]
    import torch

    if torch.cuda.is_available():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


_OURS = ("kvcr",)  # owner, loader, stager threads and KVCR's own progress thread


def _kvcr_threads() -> set[threading.Thread]:
    return {
        t
        for t in threading.enumerate()
        if t.is_alive() and t.name.lower().startswith(_OURS)
    }


@pytest.fixture(autouse=True)
def no_leaked_kvcr_threads(request):
    """Fail any test that leaves a KVCR instance or one of our threads alive."""
    before = _kvcr_threads()
    yield
    if request.node.get_closest_marker("leaks_kvcr"):
        return
    deadline = time.monotonic() + 10.0
    leaked = _kvcr_threads() - before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = {t for t in leaked if t.is_alive()}
    assert not leaked, f"test left KVCR threads alive: {sorted(t.name for t in leaked)}"


@pytest.fixture(autouse=True)
def switch_interval_restored():
    """A linker built in this process lowers its GIL switch interval
    (``gil_switch_interval_us``); each test starts from the interval before it."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)
