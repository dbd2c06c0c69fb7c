"""Interpreter start-up for ``gpu_check.sh`` runs on a CUDA host (found via PYTHONPATH).

The GPU host gets the Python-only ``sglang-kernel`` wheel (every ``.so`` removed: the
real ``common_ops`` is built against another torch). Its ``__init__.py`` raises
``ImportError`` when no ``common_ops`` library loads, and SGLang imports
``sgl_kernel`` names at module level under ``if _is_cuda``. So, when
``SGLANG_KVCR_PY_ONLY_SGL_KERNEL=1``, this installs the project's ``sgl_kernel``
import hook (``test/cpu_harness/pythonpath/sgl_kernel_cpu_hook.py``: ``common_ops``
becomes ``None``, the libcudart preload is skipped; torch has loaded its own CUDA
runtime already) WITHOUT setting ``SGLANG_USE_CPU_ENGINE``: SGLang keeps its CUDA
paths, and any call into a missing native op fails loudly instead of running a CPU
kernel. The serving run pairs it with torch-native fused ops, Triton attention,
PyTorch sampling and no CUDA graphs (see gpu_check.sh).

With ``SGLANG_USE_CPU_ENGINE=1`` it installs the same hook, as the CPU harness'
``sitecustomize`` does, so putting this directory first on ``PYTHONPATH`` never
changes a CPU run. Then it runs the next ``sitecustomize`` further along
``sys.path``, skipping the CPU harness one (which chains to this one when it comes
first, so each runs at most once).
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_CPU_PYTHONPATH = os.path.join(os.path.dirname(_HERE), "pythonpath")
_TRUE = ("1", "true", "yes", "on")


def _wanted() -> bool:
    flags = ("SGLANG_KVCR_PY_ONLY_SGL_KERNEL", "SGLANG_USE_CPU_ENGINE")
    return any(os.environ.get(f, "").strip().lower() in _TRUE for f in flags)


def _install_hook() -> None:
    if not _wanted():
        return
    if _CPU_PYTHONPATH not in sys.path:
        sys.path.append(_CPU_PYTHONPATH)
    import sgl_kernel_cpu_hook

    sgl_kernel_cpu_hook.install()


def _chain_next_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    skip = {_HERE, os.path.abspath(_CPU_PYTHONPATH)}
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) not in skip]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    if spec.origin and os.path.dirname(os.path.abspath(spec.origin)) in skip:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_install_hook()
_chain_next_sitecustomize()
