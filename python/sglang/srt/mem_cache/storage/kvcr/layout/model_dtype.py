"""The dtype a worker's model computes in, as SGLang resolves it (the digest's ``dtype``).

``--dtype`` alone does not say which dtype a worker computes in. SGLang's
``ModelConfig`` resolves it from the checkpoint's config: ``auto`` becomes the
text model's dtype for a multimodal config (sub-config dicts included), float16
for any ``Llava*ForCausalLM``, the default of an SGLang config class, or the
config's dtype (float32 runs as float16, bfloat16 for Gemma); overrides and
decrypted config files apply. Then the model runner runs *every* dtype as
float16 on a CUDA device below sm80. :func:`served_dtype` asks the same public
``ModelConfig.from_server_args`` the scheduler and each TP worker call (for the
target and for a separate draft model) and applies the sm80 rule for the KV
pools' device. Where SGLang cannot be asked (no local checkpoint, arguments that
are not SGLang's, a config that does not load) an explicit dtype counts by its
name and ``auto`` stays ``auto``: such a worker shares less, never wrongly.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sglang.srt.mem_cache.storage.kvcr.layout.model_identity import local_checkpoint

logger = logging.getLogger(__name__)

# SGLang's dtype names (``--dtype``) and the torch dtypes they select.
_NAMES = {
    "half": "float16",
    "float16": "float16",
    "float": "float32",
    "float32": "float32",
    "bfloat16": "bfloat16",
}
_TORCH_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
}


def below_sm80(device: Any) -> bool:
    """Whether the model runner on ``device`` runs every dtype as float16 (a CUDA
    device of compute capability below 8.0); asks CUDA only where it is there."""
    if device is None or torch.device(device).type != "cuda":
        return False
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(torch.device(device))[0] < 8


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def _resolved(server_args: Any, draft: bool) -> str | None:
    """The dtype SGLang's ``ModelConfig`` resolves for the target (or the draft)
    model; None where it cannot be asked or does not answer."""
    names = (
        ("speculative_draft_model_path", "speculative_draft_model_revision")
        if draft
        else ("model_path", "revision")
    )
    path, revision = (_text(getattr(server_args, name, None)) for name in names)
    if local_checkpoint(path, revision) is None:
        return None  # asking would reach out for files: never from here
    try:
        from sglang.srt.configs.model_config import ModelConfig

        if draft:
            config = ModelConfig.from_server_args(
                server_args,
                model_path=path,
                model_revision=revision or None,
                is_draft_model=True,
            )
        else:
            config = ModelConfig.from_server_args(server_args)
        return _TORCH_NAMES.get(config.dtype)
    except Exception as e:  # not SGLang's arguments, or a config SGLang refuses
        logger.info(
            "KVCR digest: SGLang's model dtype for %s not known (%s: %s); "
            "--dtype counts as given",
            path,
            type(e).__name__,
            e,
        )
        return None


def _model(server_args: Any, draft: bool) -> str:
    requested = _text(getattr(server_args, "dtype", None)).lower() or "auto"
    return _resolved(server_args, draft) or _NAMES.get(requested, requested)


def served_dtype(server_args: Any, device: Any = None) -> str:
    """The dtype the worker's model (and separate draft model) computes in, on
    the device its KV pools are on (see the module docstring)."""
    if below_sm80(device):
        return "float16"  # the model runner's fallback: every dtype, every model
    dtype = _model(server_args, draft=False)
    if _text(getattr(server_args, "speculative_draft_model_path", None)):
        dtype += ";draft=" + _model(server_args, draft=True)
    return dtype
