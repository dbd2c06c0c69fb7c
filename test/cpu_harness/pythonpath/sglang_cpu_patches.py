"""Test-harness-only start-up patches that let SGLang 0.5.23's CPU server (``--device
cpu --attention-backend torch_native``) serve the MLA and FULL+SWA model families
correctly; production code never loads this module, and no SGLang file on disk is
changed. A meta-path finder intercepts the import of two SGLang modules and, after
each has run unchanged, patches it: (1) ``sglang.srt.models.deepseek_common.
attention_backend_handler``: SGLang's DeepSeek attention registry has no
``torch_native`` handler, so DeepSeek (V2/V3 MLA) layers fall back to the triton
handler, whose MHA prefill reads the MLA pool's latent rows as if they were K/V; the
patch registers a ``torch_native`` handler that always takes the absorbed MLA
forward (it touches no other backend, and only models dispatching through that
registry see it); (2) ``sglang.srt.layers.attention.torch_native_backend``:
``TorchNativeAttnBackend`` reads a sliding-window layer's K/V from the SWA buffer
at full-pool ``req_to_token`` slots (wrong rows, and an index error once a prompt
outgrows the SWA pool); the patch makes ``forward_extend`` / ``forward_decode``
read SWA layers at the pool's ``full_to_swa_index_mapping`` of those slots, leaving
full-attention layers and non-SWA pools as they were. Installed from
``sitecustomize`` when ``SGLANG_USE_CPU_ENGINE=1`` (a ``harness_import_hooks.ModuleHook``);
nothing here imports torch.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

from harness_import_hooks import ModuleHook

logger = logging.getLogger(__name__)

DEEPSEEK_HANDLERS = "sglang.srt.models.deepseek_common.attention_backend_handler"
TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend"
BACKEND = "torch_native"
MARK = "__sglang_cpu_patches__"


def patch_deepseek_handlers(module: types.ModuleType) -> None:
    """Register the ``torch_native`` DeepSeek handler: the absorbed MLA forward."""
    mla = module.AttnForwardMethod.MLA

    def handle_attention_torch_native(attn: Any, forward_batch: Any) -> Any:
        return mla

    module.AttentionBackendRegistry.register(BACKEND, handle_attention_torch_native)


class SwaRows:
    """Stands in for the request-to-token pool while a SWA layer runs: the same
    table, translated to SWA-pool slots."""

    __slots__ = ("req_to_token",)

    def __init__(self, req_to_token: Any) -> None:
        self.req_to_token = req_to_token


def swa_layer(backend: Any, layer: Any) -> bool:
    """Whether ``layer`` keeps its K/V in ``backend``'s SWA buffer."""
    if not backend.use_sliding_window_kv_pool:
        return False
    return bool(backend.token_to_kv_pool.layers_mapping[layer.layer_id][1])


def read_swa_slots(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` with a SWA layer's ``req_to_token`` reads at SWA-pool slots."""

    @functools.wraps(forward)
    def wrapper(
        self: Any, q: Any, k: Any, v: Any, layer: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if not swa_layer(self, layer):
            return forward(self, q, k, v, layer, *args, **kwargs)
        full = self.req_to_token_pool
        table = self.token_to_kv_pool.translate_loc_from_full_to_swa(
            full.req_to_token.long()
        )
        self.req_to_token_pool = SwaRows(table)
        try:
            return forward(self, q, k, v, layer, *args, **kwargs)
        finally:
            self.req_to_token_pool = full

    return wrapper


def patch_torch_native(module: types.ModuleType) -> None:
    """Make ``TorchNativeAttnBackend`` read SWA layers at SWA-pool slots."""
    cls = module.TorchNativeAttnBackend
    cls.forward_extend = read_swa_slots(cls.forward_extend)
    cls.forward_decode = read_swa_slots(cls.forward_decode)


PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    DEEPSEEK_HANDLERS: patch_deepseek_handlers,
    TORCH_NATIVE: patch_torch_native,
}


def apply(name: str, module: types.ModuleType) -> bool:
    """Patch ``module`` (imported as ``name``) once; True when patched now."""
    if getattr(module, MARK, False):
        return False
    PATCHES[name](module)
    setattr(module, MARK, True)
    logger.debug("sglang_cpu_patches: patched %s", name)
    return True


class SglangCpuPatchFinder(ModuleHook):
    """Finds the two target modules; patches each once its own code has run."""

    TARGETS = frozenset(PATCHES)

    def after(self, module: types.ModuleType) -> None:
        apply(module.__name__, module)

    @classmethod
    def install(cls) -> bool:
        """Put the finder first on ``sys.meta_path``, patching any target already
        imported; True when newly installed."""
        if not super().install():
            return False
        for name in PATCHES:
            module = sys.modules.get(name)
            if module is not None:
                apply(name, module)
        return True


install = SglangCpuPatchFinder.install
uninstall = SglangCpuPatchFinder.uninstall
is_installed = SglangCpuPatchFinder.is_installed
