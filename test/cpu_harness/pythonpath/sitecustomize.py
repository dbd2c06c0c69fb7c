"""Interpreter start-up for CPU SGLang runs in this project (found via PYTHONPATH).

With ``SGLANG_USE_CPU_ENGINE=1`` (``1`` or ``true``, as SGLang reads it) it installs
the ``sgl_kernel`` CPU import hook (``sgl_kernel_cpu_hook``) and the harness's
SGLang CPU patches (``sglang_cpu_patches``: the torch_native MLA handler and
SWA-layer reads) in every process, including SGLang's spawned scheduler and
detokenizer, before anything can import their targets. Otherwise it does nothing.
Then it runs the next ``sitecustomize`` found further along ``sys.path``, if there
is one. The code is ``harness_import_hooks.start_up``, shared with
``../gpu_pythonpath/sitecustomize.py``; it stays light (no torch import).
"""

from __future__ import annotations

import harness_import_hooks

harness_import_hooks.start_up(
    __file__, flags=("SGLANG_USE_CPU_ENGINE",), true=("1", "true"), cpu_patches=True
)
