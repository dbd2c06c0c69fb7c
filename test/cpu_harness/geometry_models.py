"""Weightless model directories of the three geometries ``gpu_check.sh`` serves.

Each is a ``config.json`` plus the project's tiny tokenizer (ids below every vocab
here), served with ``--load-format dummy``; what matters to the KVCR linker is the
KV geometry, so the bytes per page equal the real model's:

* ``qwen3``: Qwen3-0.6B (``qwen3_geometry_model``): MHA, 28 layers, 8 KV heads of 128;
* ``mla``: DeepSeek-V2-Lite's attention: 27 layers of MLA with kv_lora_rank 512 and
  a 64-wide RoPE part (one 576-element row per token and layer), 16 heads, hidden
  2048, yarn RoPE. Its MoE layers are dense here (``first_k_dense_replace`` = the
  layer count): the routed experts need ``sgl_kernel``'s native ops, which the GPU
  host's Python-only build lacks, and they do not touch the KV cache;
* ``swa``: a sliding-window model (SGLang's ``BeamForCausalLM``, hybrid SWA pool):
  24 layers alternating sliding-window (window 512) and full attention, 8 KV heads
  of 128, hidden 1024.

``scale="dry-run"`` gives the CPU dry run's scaled-down versions of the same
architectures (the tiny family models' geometry, ``tiny_family_models``), which
the CPU harness's SGLang patches can serve. Directories are rebuilt only when
their recorded parameters differ.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cpu_harness import qwen3_geometry_model as qwen3
from cpu_harness import tiny_family_models as families

KINDS = ("qwen3", "mla", "swa")
SCALES = ("full", "dry-run")
MARKER = ".geometry-complete"

QWEN3_DRY_RUN = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 8192,
}
DEEPSEEK_V2_LITE = {
    "num_hidden_layers": 27,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 102400,
    "max_position_embeddings": 163840,
    "first_k_dense_replace": 27,  # every layer dense: see the module docstring
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
}
SWA_LAYERS = 24
SWA_FULL = {
    "num_hidden_layers": SWA_LAYERS,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "sliding_window": 512,
    "layer_types": ["sliding_attention", "full_attention"] * (SWA_LAYERS // 2),
    "mlp_layer_types": ["dense"] * SWA_LAYERS,
}


def config_for(kind: str, scale: str) -> dict[str, Any]:
    """The ``config.json`` of ``kind`` at ``scale`` (see the module docstring)."""
    if kind not in KINDS or scale not in SCALES:
        raise ValueError(f"no geometry {kind!r} at scale {scale!r}")
    bos, eos = qwen3.special_ids(qwen3.ensure_tiny_model())
    if kind == "qwen3":
        geometry = {} if scale == "full" else QWEN3_DRY_RUN
        return qwen3.config_dict({**qwen3.QWEN3_0_6B, **geometry}, bos, eos)
    cfg = families.config_dict(kind, bos, eos)
    if scale == "full":
        cfg.update(DEEPSEEK_V2_LITE if kind == "mla" else SWA_FULL)
    return cfg


def ensure_geometry_model(kind: str, scale: str, root: str | os.PathLike[str]) -> Path:
    """``root/<kind>-<scale>``, built (or reused) for ``--load-format dummy``."""
    cfg = config_for(kind, scale)
    target = Path(root).expanduser().absolute() / f"{kind}-{scale}"
    if qwen3.is_current(target, cfg, marker=MARKER):
        return target
    return qwen3.write_model_dir(target, cfg, cfg, marker=MARKER)


def kv_page_bytes(cfg: dict[str, Any], page: int) -> dict[str, int]:
    """Bytes one page holds in each KVCR pool over all layers (bf16)."""
    if cfg["model_type"] == "qwen3":
        row = 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
        return {"kv": cfg["num_hidden_layers"] * row * 2 * page}
    return families.pool_page_bytes(cfg, page)
