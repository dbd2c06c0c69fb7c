"""What the harness's interpreter start-up shims share (this project's own code).

``ModuleHook``: a meta-path finder for a few named modules. It finds each through
the other finders on ``sys.meta_path`` and wraps the real loader, so that
``before(module)`` runs ahead of the module's own, unchanged code and
``after(module)`` once it has run; no file on disk changes. ``sgl_kernel_cpu_hook``
(``sgl_kernel`` without its native library) and ``sglang_cpu_patches`` (SGLang's
CPU attention for MLA and SWA) are the two hooks.

``start_up``: the whole body of both ``sitecustomize`` files, this directory's (CPU
runs) and ``../gpu_pythonpath``'s (``gpu_check.sh`` on a CUDA host). When one of its
flags is set it installs the ``sgl_kernel`` hook, and the SGLang CPU patches too
where asked; with ``KVCR_TEST_FAULTS_DIR`` set (fault-injection tests only) it
installs ``kvcr_fault_hook`` as well; then, because a ``sitecustomize`` on
``PYTHONPATH`` hides any other one, it runs the next ``sitecustomize`` further
along ``sys.path``, skipping the shims' own directories (so each shim runs at
most once).

Stdlib only, no torch: it runs at the start of every process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

HARNESS_DIR = os.path.dirname(os.path.abspath(__file__))
FAULTS_ENV = "KVCR_TEST_FAULTS_DIR"  # kvcr_fault_hook's switch (tests only)


class _HookedLoader(importlib.abc.Loader):
    """The real loader of a hooked module, with the hook's steps around its code."""

    def __init__(self, wrapped: importlib.abc.Loader, hook: ModuleHook) -> None:
        self._wrapped = wrapped
        self._hook = hook

    def __getattr__(self, name: str) -> Any:
        # get_source, get_resource_reader, is_package, ...: the real loader's.
        return getattr(self._wrapped, name)

    def create_module(
        self, spec: importlib.machinery.ModuleSpec
    ) -> types.ModuleType | None:
        return self._wrapped.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system has already put ``module`` into sys.modules (a
        # package with its ``__path__``), so ``before`` may import its submodules.
        self._hook.before(module)
        self._wrapped.exec_module(module)
        self._hook.after(module)


class ModuleHook(importlib.abc.MetaPathFinder):
    """Wraps the loaders of the modules named in ``TARGETS`` (see the module
    docstring); ``PACKAGES_ONLY`` leaves a target that is not a package alone."""

    TARGETS: ClassVar[frozenset[str]] = frozenset()
    PACKAGES_ONLY: ClassVar[bool] = False

    def before(self, module: types.ModuleType) -> None:
        """Runs on the new module ahead of its own code."""

    def after(self, module: types.ModuleType) -> None:
        """Runs on the module once its own code has run."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.TARGETS:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, type(self)):
                continue
            find = getattr(finder, "find_spec", None)
            spec = None if find is None else find(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is None or (
                self.PACKAGES_ONLY and spec.submodule_search_locations is None
            ):
                return None  # not a module this hook knows how to adapt
            spec.loader = _HookedLoader(spec.loader, self)
            return spec
        return None

    @classmethod
    def is_installed(cls) -> bool:
        return any(isinstance(f, cls) for f in sys.meta_path)

    @classmethod
    def install(cls) -> bool:
        """Put the finder first on ``sys.meta_path``; True when newly installed.
        Only imports after this are hooked."""
        if cls.is_installed():
            return False
        sys.meta_path.insert(0, cls())
        return True

    @classmethod
    def uninstall(cls) -> None:
        """Remove the finder (modules already imported stay as they are)."""
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, cls)]


def flag_set(names: Iterable[str], true: Iterable[str]) -> bool:
    """Whether any of the environment variables ``names`` holds one of ``true``."""
    values = set(true)
    return any(os.environ.get(n, "").strip().lower() in values for n in names)


def install_hooks(*, cpu_patches: bool) -> None:
    """The ``sgl_kernel`` hook, after the SGLang CPU patches when ``cpu_patches``
    (so its finder stays first on ``sys.meta_path``). Puts this directory on
    ``sys.path`` (at the end) if it is not there yet."""
    if HARNESS_DIR not in {os.path.abspath(p or os.curdir) for p in sys.path}:
        sys.path.append(HARNESS_DIR)
    import sgl_kernel_cpu_hook

    if cpu_patches:
        import sglang_cpu_patches

        sglang_cpu_patches.install()
    sgl_kernel_cpu_hook.install()


def install_fault_hook() -> None:
    """Tests only (``FAULTS_ENV`` names the directory a test arms faults in): the
    KVCR fault hook (``kvcr_fault_hook``)."""
    if HARNESS_DIR not in {os.path.abspath(p or os.curdir) for p in sys.path}:
        sys.path.append(HARNESS_DIR)
    import kvcr_fault_hook

    kvcr_fault_hook.install()


def chain_next_sitecustomize(skip_dirs: Iterable[str]) -> None:
    """Run the first ``sitecustomize`` on ``sys.path`` outside ``skip_dirs``."""
    skip = {os.path.abspath(d) for d in skip_dirs}
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) not in skip]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    if spec.origin and os.path.dirname(os.path.abspath(spec.origin)) in skip:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def start_up(
    shim_file: str,
    *,
    flags: Sequence[str],
    true: Sequence[str],
    cpu_patches: bool,
    skip_dirs: Iterable[str] = (),
) -> None:
    """A ``sitecustomize``'s body: the hooks when a flag is set, then the next
    ``sitecustomize`` outside the shim's directory and ``skip_dirs``."""
    if flag_set(flags, true):
        install_hooks(cpu_patches=cpu_patches)
    if os.environ.get(FAULTS_ENV):
        install_fault_hook()
    chain_next_sitecustomize([os.path.dirname(os.path.abspath(shim_file)), *skip_dirs])
