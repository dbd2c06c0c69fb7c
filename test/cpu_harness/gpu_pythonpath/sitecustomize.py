"""Interpreter start-up for ``gpu_check.sh`` runs on a CUDA host (found via PYTHONPATH).

The GPU host gets the Python-only ``sglang-kernel`` wheel (every ``.so`` removed: the
real ``common_ops`` is built against another torch). Its ``__init__.py`` raises
``ImportError`` when no ``common_ops`` library loads, and SGLang imports
``sgl_kernel`` names at module level under ``if _is_cuda``. So, when
``SGLANG_KVCR_PY_ONLY_SGL_KERNEL`` is set (``1``, ``true``, ``yes`` or ``on``), this
installs the project's ``sgl_kernel`` import hook
(``test/cpu_harness/pythonpath/sgl_kernel_cpu_hook.py``: ``common_ops`` becomes
``None``, the libcudart preload is skipped; torch has loaded its own CUDA runtime
already) WITHOUT setting ``SGLANG_USE_CPU_ENGINE``: SGLang keeps its CUDA paths, and
any call into a missing native op fails loudly instead of running a CPU kernel. The
serving run pairs it with torch-native fused ops, Triton attention, PyTorch sampling
and no CUDA graphs (see gpu_check.sh).

``SGLANG_USE_CPU_ENGINE`` set installs the same hook, but not the CPU harness's
SGLang patches (``sglang_cpu_patches``): a CPU run that needs them (MLA, SWA) puts
``../pythonpath`` first. Then it runs the next ``sitecustomize`` further along
``sys.path``, skipping the CPU harness one (which chains to this one when it comes
first, so each runs at most once). The code is ``harness_import_hooks.start_up``
in ``../pythonpath``, loaded from its file: this directory alone puts nothing on
``sys.path`` (the harness there holds a torchvision stand-in) unless a flag is set.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
_HARNESS = os.path.join(os.path.dirname(_HERE), "pythonpath")


def _harness_import_hooks() -> types.ModuleType:
    module = sys.modules.get("harness_import_hooks")
    if module is None:
        path = os.path.join(_HARNESS, "harness_import_hooks.py")
        spec = importlib.util.spec_from_file_location("harness_import_hooks", path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules["harness_import_hooks"] = module
        spec.loader.exec_module(module)
    return module


def _dummy_weights_hook() -> None:
    """``SGLANG_KVCR_DUMMY_WEIGHTS=fan_in``: SGLang's dummy weights become seeded
    fan-in-scaled ones (``../pythonpath/dummy_weights_hook.py``), so greedy outputs
    of a dummy-weight server tell a right KV restore from a wrong one."""
    if os.environ.get("SGLANG_KVCR_DUMMY_WEIGHTS", "").strip().lower() != "fan_in":
        return
    if _HARNESS not in sys.path:
        sys.path.append(_HARNESS)
    import dummy_weights_hook

    dummy_weights_hook.install()


def _dual_gemm_hook() -> None:
    """No ``cutlass`` on the host: SGLang's Qwen MLPs skip the CuTe DSL dual GEMM
    (``../pythonpath/dual_gemm_hook.py``); only with the Python-only kernels."""
    if os.environ.get("SGLANG_KVCR_PY_ONLY_SGL_KERNEL", "").strip().lower() not in (
        "1",
        "true",
        "yes",
        "on",
    ):
        return
    if _HARNESS not in sys.path:
        sys.path.append(_HARNESS)
    import dual_gemm_hook

    dual_gemm_hook.install()


_harness_import_hooks()
_dummy_weights_hook()
_dual_gemm_hook()
_harness_import_hooks().start_up(
    __file__,
    flags=("SGLANG_KVCR_PY_ONLY_SGL_KERNEL", "SGLANG_USE_CPU_ENGINE"),
    true=("1", "true", "yes", "on"),
    cpu_patches=False,
    skip_dirs=(_HARNESS,),
)
