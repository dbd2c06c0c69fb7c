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
running the installed ``__init__.py`` unchanged. Nothing here imports torch; the
finder is cheap to install at interpreter start-up (see ``sitecustomize``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

PACKAGE = "sgl_kernel"


def _no_native_ops(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``_load_architecture_specific_ops``: there is no CPU build."""
    return None


def _no_cuda_preload(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``_preload_cuda_library``: no CUDA runtime to preload."""
    return None


class _NeutralizingLoader(importlib.abc.Loader):
    """Wraps the real loader; patches ``load_utils`` before running ``__init__``."""

    def __init__(self, wrapped: importlib.abc.Loader) -> None:
        self._wrapped = wrapped

    def __getattr__(self, name: str) -> Any:
        # get_source, get_resource_reader, is_package, ...: the real loader's.
        return getattr(self._wrapped, name)

    def create_module(
        self, spec: importlib.machinery.ModuleSpec
    ) -> types.ModuleType | None:
        return self._wrapped.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system has already put ``module`` into sys.modules with its
        # ``__path__`` set from the spec, so importing the submodule resolves
        # against the installed package without running ``__init__.py``.
        load_utils: Any = importlib.import_module(f"{PACKAGE}.load_utils")
        load_utils._load_architecture_specific_ops = _no_native_ops
        load_utils._preload_cuda_library = _no_cuda_preload
        module.__sgl_kernel_cpu_hook__ = True  # type: ignore[attr-defined]
        self._wrapped.exec_module(module)


class SglKernelCpuFinder(importlib.abc.MetaPathFinder):
    """Finds the real ``sgl_kernel`` via the other finders and wraps its loader."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != PACKAGE:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, SglKernelCpuFinder):
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is None or spec.submodule_search_locations is None:
                return None  # not the package we know how to adapt; leave it alone
            spec.loader = _NeutralizingLoader(spec.loader)
            return spec
        return None


def install() -> bool:
    """Put the finder first on ``sys.meta_path``; True when newly installed.

    Must run before the first ``import sgl_kernel`` of the process; an already
    imported ``sgl_kernel`` is left as it is.
    """
    if any(isinstance(f, SglKernelCpuFinder) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, SglKernelCpuFinder())
    return True


def uninstall() -> None:
    """Remove the finder (modules already imported stay imported)."""
    sys.meta_path[:] = [
        f for f in sys.meta_path if not isinstance(f, SglKernelCpuFinder)
    ]


def is_installed() -> bool:
    return any(isinstance(f, SglKernelCpuFinder) for f in sys.meta_path)
