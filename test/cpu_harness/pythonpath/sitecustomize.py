"""Interpreter start-up for CPU SGLang runs in this project (found via PYTHONPATH).

With ``SGLANG_USE_CPU_ENGINE=1`` it installs the ``sgl_kernel`` CPU import hook
(``sgl_kernel_cpu_hook``) and the harness's SGLang CPU patches
(``sglang_cpu_patches``: the torch_native MLA handler and SWA-layer reads) in every
process, including SGLang's spawned scheduler and detokenizer, before anything can
import their targets. Otherwise it does nothing. It stays light (no torch import)
and, because a ``sitecustomize`` on ``PYTHONPATH`` hides any other one, it runs the
next ``sitecustomize`` found further along ``sys.path``, if there is one.
"""

from __future__ import annotations

import os
import sys


def _install_cpu_hook() -> None:
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "").strip().lower() not in ("1", "true"):
        return
    import sgl_kernel_cpu_hook
    import sglang_cpu_patches

    sglang_cpu_patches.install()
    sgl_kernel_cpu_hook.install()  # after: its finder stays first on sys.meta_path


def _chain_next_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_install_cpu_hook()
_chain_next_sitecustomize()
