"""Tiny model directories of the non-MHA families a CPU SGLang server runs here:
``mla`` (DeepseekV2ForCausalLM; ``mla-v3``: DeepseekV3ForCausalLM) with 2 dense
layers, hidden 64, 4 heads, kv_lora_rank 32, rope/nope/v head dims 16, no q_lora and
a factor-1 yarn RoPE (SGLang's CPU RoPE factory takes only deepseek_yarn), and
``swa`` (BeamForCausalLM: a sliding-window layer with window 64, then a
full-attention layer, dense MLPs; SGLang gives it a hybrid SWAKVPool), each with the
project's tiny tokenizer (512 ids, from ``tiny_model`` through
``qwen3_geometry_model``) and a config, for ``--load-format dummy``.
``weights=True`` also writes seeded fan-in-scaled random weights (MLA: the
transformers class's tensor names; Beam, which has none: the checkpoint names
SGLang's ``BeamForCausalLM.load_weights`` reads): SGLang's dummy weights (uniform in
+-1e-3) give uniform logits, so greedy outputs cannot tell a right KV restore from a
wrong one. On CPU with ``torch_native`` both families need SGLang 0.5.23 patched at
start-up, which the harness does (``pythonpath/sglang_cpu_patches``, installed by
its ``sitecustomize`` in every CPU server process): MLA prefill takes the absorbed
path, and SWA layers read K/V at SWA-pool slots. A directory is rebuilt only when
its recorded parameters differ; as a script: ``python
test/cpu_harness/tiny_family_models.py {mla,mla-v3,swa} DIR [--weights]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    from .qwen3_geometry_model import (
        ensure_tiny_model,
        is_current,
        special_ids,
        write_model_dir,
    )
except ImportError:  # run as a script or with this directory on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from qwen3_geometry_model import (  # type: ignore[no-redef]
        ensure_tiny_model,
        is_current,
        special_ids,
        write_model_dir,
    )

MARKER = ".tiny-family-complete"
WEIGHT_SEED = 20240611
WEIGHTS_FILE = "model.safetensors"
VOCAB = 512
HIDDEN = 64
INTERMEDIATE = 128
LAYERS = 2
HEADS = 4
MAX_POSITIONS = 4096
SWA_WINDOW = 64


class FamilyModelError(ValueError):
    """An unknown family, or a config this module cannot write weights for."""


def _common(bos: int, eos: int) -> dict[str, Any]:
    return {
        "bos_token_id": bos,
        "eos_token_id": eos,
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "use_cache": True,
        "initializer_range": 0.02,
    }


def _mla(architecture: str, model_type: str) -> Callable[[int, int], dict[str, Any]]:
    def build(bos: int, eos: int) -> dict[str, Any]:
        return {
            **_common(bos, eos),
            "architectures": [architecture],
            "model_type": model_type,
            "num_key_value_heads": HEADS,
            # Routed experts exist in the config (HF wants ints) but no layer uses
            # them: every layer index is below first_k_dense_replace.
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": LAYERS,
            "moe_layer_freq": 1,
            "routed_scaling_factor": 1.0,
            "topk_method": "greedy",
            "n_group": None,
            "topk_group": None,
            "norm_topk_prob": False,
            "scoring_func": "softmax",
            "kv_lora_rank": 32,
            "q_lora_rank": None,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rope_theta": 10000.0,
            # SGLang's CPU RoPE factory accepts only deepseek_yarn (any scaling
            # dict becomes that); factor 1 keeps it a plain rotation.
            "rope_scaling": {
                "type": "yarn",
                "rope_type": "yarn",
                "factor": 1.0,
                "original_max_position_embeddings": MAX_POSITIONS,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        }

    return build


def _swa(bos: int, eos: int) -> dict[str, Any]:
    return {
        **_common(bos, eos),
        "architectures": ["BeamForCausalLM"],
        "model_type": "beam",
        "num_key_value_heads": 2,
        "head_dim": HIDDEN // HEADS,
        "sliding_window": SWA_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "mlp_layer_types": ["dense", "dense"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": None,
        },
        "final_logit_softcapping": 30.0,
        # Unused by dense layers; BeamConfig validates them only for sparse ones.
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "moe_intermediate_size": 32,
    }


FAMILIES: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "mla": _mla("DeepseekV2ForCausalLM", "deepseek_v2"),
    "mla-v3": _mla("DeepseekV3ForCausalLM", "deepseek_v3"),
    "swa": _swa,
}


def config_dict(family: str, bos: int, eos: int) -> dict[str, Any]:
    try:
        return FAMILIES[family](bos, eos)
    except KeyError:
        raise FamilyModelError(
            f"unknown family {family!r}; choose from {sorted(FAMILIES)}"
        ) from None


def pool_page_bytes(cfg: dict[str, Any], page: int) -> dict[str, int]:
    """Bytes one page of ``cfg``'s model holds in each KVCR pool over all its
    layers (bf16), from the geometry alone: MLA ``kv`` is the latent plus RoPE
    row of every layer; Beam's ``kv`` is K and V of the full-attention layers and
    ``swa`` K and V of the sliding-window ones."""
    elem = 2 * page  # bf16 bytes per row element, times the page's rows
    if cfg["model_type"].startswith("deepseek"):
        row = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
        return {"kv": cfg["num_hidden_layers"] * row * elem}
    kv_row = 2 * cfg["num_key_value_heads"] * cfg["head_dim"]  # K and V
    kinds = cfg["layer_types"]
    full = sum(t == "full_attention" for t in kinds)
    return {
        "kv": full * kv_row * elem,
        "swa": (len(kinds) - full) * kv_row * elem,
    }


def beam_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors SGLang's ``BeamForCausalLM.load_weights`` reads for a
    dense Beam config (HF-style names: it packs ``q/k/v/gate_proj`` into
    ``qkv_gate_proj`` and ``gate/up_proj`` into ``gate_up_proj`` itself)."""
    if any(t != "dense" for t in cfg["mlp_layer_types"]):
        raise FamilyModelError("Beam weights are written for dense MLP layers only")
    hidden, vocab, inter = (
        cfg["hidden_size"],
        cfg["vocab_size"],
        cfg["intermediate_size"],
    )
    head_dim, heads = cfg["head_dim"], cfg["num_attention_heads"]
    q, kv = heads * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {
            f"{p}self_attn.q_proj.weight": (q, hidden),
            f"{p}self_attn.k_proj.weight": (kv, hidden),
            f"{p}self_attn.v_proj.weight": (kv, hidden),
            f"{p}self_attn.gate_proj.weight": (q, hidden),  # the output gate
            f"{p}self_attn.gate_bias": (heads,),
            f"{p}self_attn.o_proj.weight": (hidden, q),
            f"{p}self_attn.q_norm.weight": (head_dim,),
            f"{p}self_attn.k_norm.weight": (head_dim,),
            f"{p}mlp.gate_proj.weight": (inter, hidden),
            f"{p}mlp.up_proj.weight": (inter, hidden),
            f"{p}mlp.down_proj.weight": (hidden, inter),
        }
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            shapes[f"{p}{norm}_layernorm.weight"] = (hidden,)
    return shapes


def transformers_shapes(out: Path) -> dict[str, tuple[int, ...]]:
    """The state-dict shapes of ``out``'s transformers class (built on meta)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(out))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return {name: tuple(p.shape) for name, p in model.state_dict().items()}


def write_weights(out: Path) -> None:
    """Seeded random weights for ``out``'s config (Beam: ``beam_shapes``; else by
    its transformers class): 1-D tensors (norms, Beam's gate bias) 1, embeddings
    N(0, 1), the LM head N(0, 4/fan_in), every other matrix N(0, 1/fan_in), so
    activations stay O(1) and greedy logits have clear gaps."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((out / "config.json").read_text())
    beam = cfg["architectures"] == ["BeamForCausalLM"]
    shapes = beam_shapes(cfg) if beam else transformers_shapes(out)
    gen = torch.Generator(device="cpu").manual_seed(WEIGHT_SEED)
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if len(shape) == 1:
            t = torch.ones(shape)
        elif "embed_tokens" in name:
            t = torch.randn(shape, generator=gen)
        else:
            scale = (2.0 if name.startswith("lm_head") else 1.0) * shape[-1] ** -0.5
            t = torch.randn(shape, generator=gen) * scale
        weights[name] = t.to(torch.bfloat16).contiguous()
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})


def ensure_family_model(
    family: str, path: str | os.PathLike[str], *, weights: bool = False
) -> Path:
    """Build (or reuse) ``family``'s directory at ``path``."""
    target = Path(path).expanduser().absolute()
    tiny = ensure_tiny_model()
    bos, eos = special_ids(tiny)
    cfg = config_dict(family, bos, eos)
    params = {"family": family, "weights": weights, "config": cfg}
    if is_current(target, params, MARKER):
        return target
    fill = write_weights if weights else None
    return write_model_dir(target, cfg, params, marker=MARKER, fill=fill)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build a tiny model dir of one family.")
    p.add_argument("family", choices=sorted(FAMILIES))
    p.add_argument("path")
    p.add_argument("--weights", action="store_true", help="seeded random weights")
    args = p.parse_args(argv)
    out = ensure_family_model(args.family, args.path, weights=args.weights)
    cfg = json.loads((out / "config.json").read_text())
    print(f"{out} {cfg['architectures'][0]} weights={(out / WEIGHTS_FILE).is_file()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
