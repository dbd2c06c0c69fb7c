"""Seeded, fan-in-scaled weights for ``--load-format dummy`` (test harness only).

SGLang's dummy loader fills every weight uniformly in +-1e-3, norms included, so
the logits come out uniform and a greedy output cannot tell a right KV restore
from a wrong one. With ``SGLANG_KVCR_DUMMY_WEIGHTS=fan_in`` in a server's
environment the harness start-up shim (``../gpu_pythonpath/sitecustomize.py``)
installs this hook: once ``sglang.srt.model_loader.loader`` has run, its
``initialize_dummy_weights`` is ``fan_in_weights``, which gives the weights the
tiny family models' checkpoints have (``tiny_family_models.write_weights``): 1-D
tensors (norms, biases) 1, embeddings N(0, 1), the LM head N(0, 4/fan_in), every
other tensor N(0, 1/fan_in) with the fan-in its last dimension; FP8-style scales
keep SGLang's 1.0. Each tensor draws from a generator seeded with the seed and a
CRC of its name, so every process of a run (and the control) gets the same
weights. Production code never loads this module; it imports no torch at start-up.
"""

from __future__ import annotations

import types
import zlib
from typing import Any

from harness_import_hooks import ModuleHook

ENV = "SGLANG_KVCR_DUMMY_WEIGHTS"
LOADER = "sglang.srt.model_loader.loader"


def fan_in_weights(
    model: Any, low: float = -1e-3, high: float = 1e-3, seed: int = 1234
) -> None:
    """``initialize_dummy_weights``'s signature; ``low``/``high`` are ignored."""
    import torch

    for name, param in model.state_dict().items():
        if not torch.is_floating_point(param):
            continue
        if name.endswith(("weight_scale_inv", "weight_scale_2")) or param.dim() < 2:
            param.data.fill_(1.0)
            continue
        gen = torch.Generator(device=param.device)
        gen.manual_seed(seed + zlib.crc32(name.encode()))
        if "embed_tokens" in name:
            std = 1.0
        else:
            std = (2.0 if "lm_head" in name else 1.0) * param.shape[-1] ** -0.5
        values = torch.randn(param.shape, generator=gen, device=param.device)
        param.data.copy_((values * std).to(param.dtype))


class DummyWeightsHook(ModuleHook):
    """Swaps the loader module's dummy initializer once its code has run."""

    TARGETS = frozenset({LOADER})

    def after(self, module: types.ModuleType) -> None:
        module.initialize_dummy_weights = fan_in_weights


install = DummyWeightsHook.install
