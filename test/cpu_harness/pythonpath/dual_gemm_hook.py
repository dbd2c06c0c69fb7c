"""GPU hosts without NVIDIA's CuTe DSL (``cutlass``): SGLang's dense MLP stays unfused.

On CUDA, SGLang 0.5.23's ``DualGemm`` (``sglang.srt.layers.dual_gemm``, built by
every Qwen2/Qwen3 MLP) imports ``sglang.kernels.ops.gemm.cutedsl_dual_gemm`` to
choose its mode, and that module imports ``cutlass`` at the top: without the
package the model cannot even be built. The mode it would choose only selects an
optional fused small-batch kernel (``can_run`` is False when the mode is None,
and the MLP runs its plain projections). ``gpu_check.sh``'s host has no
``cutlass``, so this hook makes ``_select_mode`` return None there; with
``cutlass`` installed it changes nothing. Installed by the GPU start-up shim.
"""

from __future__ import annotations

import importlib.util
import types

from harness_import_hooks import ModuleHook


def cutlass_missing() -> bool:
    return importlib.util.find_spec("cutlass") is None


class DualGemmHook(ModuleHook):
    TARGETS = frozenset({"sglang.srt.layers.dual_gemm"})

    def after(self, module: types.ModuleType) -> None:
        module.DualGemm._select_mode = _no_fused_mode


def _no_fused_mode(self: object, gate_up_proj: object, hidden_size: int) -> None:
    return None


def install() -> bool:
    """Install the hook when ``cutlass`` is missing; whether it is installed."""
    if not cutlass_missing():
        return False
    DualGemmHook.install()
    return True
