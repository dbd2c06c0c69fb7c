"""Import the pip-installed ``sgl_kernel`` on a CPU-only machine (this project's code).

``sglang-kernel`` 0.4.10 ships only CUDA builds of its native ``common_ops`` library,
and its ``__init__.py`` loads that library (and preloads CUDA runtime libraries) at
import time, which fails without a GPU. With ``SGLANG_USE_CPU_ENGINE=1`` SGLang
still imports pure-Python names from the package (``scalar_type``, the
``*_cpu`` wrappers), so a CPU server needs ``import sgl_kernel`` to succeed.

This module adapts the installed package at runtime, touching no file on disk:
a meta-path finder intercepts the import of ``sgl_kernel`` and, once the package
module is registered, replaces ``sgl_kernel.load_utils._load_architecture_specific_ops``
(so ``common_ops`` becomes ``None``) and ``_preload_cuda_library`` (a no-op) before
running the installed ``__init__.py`` unchanged (a ``harness_import_hooks.ModuleHook``).
Nothing here imports torch; the finder is cheap to install at interpreter start-up
(see ``sitecustomize``).
"""

from __future__ import annotations

import importlib
import types
from typing import Any

from harness_import_hooks import ModuleHook

PACKAGE = "sgl_kernel"


def _no_native_ops(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``_load_architecture_specific_ops``: there is no CPU build."""
    return None


def _no_cuda_preload(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``_preload_cuda_library``: no CUDA runtime to preload."""
    return None


class SglKernelCpuFinder(ModuleHook):
    """Finds the real ``sgl_kernel`` package; patches ``load_utils`` before its
    ``__init__`` runs."""

    TARGETS = frozenset({PACKAGE})
    PACKAGES_ONLY = True  # not the package we know how to adapt: leave it alone

    def before(self, module: types.ModuleType) -> None:
        # ``module`` is in sys.modules with its ``__path__`` set from the spec, so
        # the submodule resolves against the installed package without running
        # ``__init__.py``.
        load_utils: Any = importlib.import_module(f"{PACKAGE}.load_utils")
        load_utils._load_architecture_specific_ops = _no_native_ops
        load_utils._preload_cuda_library = _no_cuda_preload
        module.__sgl_kernel_cpu_hook__ = True  # type: ignore[attr-defined]


# Must run before the first ``import sgl_kernel`` of the process; an already
# imported ``sgl_kernel`` is left as it is.
install = SglKernelCpuFinder.install
uninstall = SglKernelCpuFinder.uninstall
is_installed = SglKernelCpuFinder.is_installed
