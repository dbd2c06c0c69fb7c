"""A weightless model directory with Qwen3-0.6B's geometry, for ``--load-format dummy``.

The GPU check has no model hub, so it serves a directory that only *describes*
Qwen3-0.6B: ``config.json`` (Qwen3ForCausalLM, 28 layers, hidden 1024, 16 heads,
8 KV heads, head_dim 128, intermediate 3072, vocab 151936, bf16, rope theta 1e6,
max_position_embeddings 40960, tied embeddings) and ``generation_config.json``,
plus the tokenizer of the project's tiny offline model (``tiny_model.py``: 512
ids, all below the vocab, so every id it produces is valid for this model). SGLang
started with ``--load-format dummy`` fills the weights with random values, which
is all a KV-cache benchmark needs: the KV geometry, and so the bytes per page,
match the real model. Outputs are meaningless.

``--layers/--hidden/...`` scale the geometry down for a CPU dry run (the vocab is
kept, so the serving bench's random prompt ids stay valid). The directory is
rebuilt only when its recorded parameters differ. Needs ``transformers`` (and,
to build the tiny tokenizer the first time, ``tokenizers`` + ``torch`` +
``safetensors``), all present on the GPU host.

    python test/cpu_harness/qwen3_geometry_model.py DIR [--layers 2 --hidden 64 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    from .tiny_model import TOKENIZER_FILES, ensure_tiny_model
except ImportError:  # run as a script or with this directory on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tiny_model import TOKENIZER_FILES, ensure_tiny_model  # type: ignore[no-redef]

MARKER = ".qwen3-geometry-complete"
QWEN3_0_6B: dict[str, Any] = {
    "num_hidden_layers": 28,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
}


def config_dict(geometry: dict[str, Any], bos: int, eos: int) -> dict[str, Any]:
    g = {**QWEN3_0_6B, **geometry}
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "head_dim": g["head_dim"],
        "hidden_act": "silu",
        "hidden_size": g["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": g["intermediate_size"],
        "max_position_embeddings": g["max_position_embeddings"],
        "max_window_layers": g["num_hidden_layers"],
        "num_attention_heads": g["num_attention_heads"],
        "num_hidden_layers": g["num_hidden_layers"],
        "num_key_value_heads": g["num_key_value_heads"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": g["vocab_size"],
    }


def special_ids(tok_dir: Path) -> tuple[int, int]:
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"]
    return int(vocab["<s>"]), int(vocab["</s>"])


def is_current(path: Path, params: dict[str, Any], marker: str = MARKER) -> bool:
    """Whether ``path`` is a complete directory built from ``params``."""
    done = path / marker
    if not done.is_file() or not (path / "config.json").is_file():
        return False
    try:
        return json.loads(done.read_text()).get("params") == params
    except ValueError:
        return False


def write_model_dir(
    target: Path,
    cfg: dict[str, Any],
    params: dict[str, Any],
    *,
    marker: str = MARKER,
    fill: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``target`` whole or not at all: the tiny tokenizer, ``config.json``
    (``cfg``), a greedy ``generation_config.json``, whatever ``fill`` adds (such
    as weights), and the marker recording ``params``; built in a sibling
    temporary directory and renamed into place."""
    tiny = ensure_tiny_model()
    bos, eos = special_ids(tiny)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
    try:
        for name in TOKENIZER_FILES:
            shutil.copyfile(tiny / name, tmp / name)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if fill is not None:
            fill(tmp)
        (tmp / marker).write_text(json.dumps({"params": params}) + "\n")
        os.chmod(tmp, 0o755)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_qwen3_geometry_model(path: str | os.PathLike[str], **geometry: int) -> Path:
    """Build (or reuse) the directory at ``path``; ``geometry`` overrides fields."""
    unknown = set(geometry) - set(QWEN3_0_6B)
    if unknown:
        raise ValueError(f"unknown geometry fields {sorted(unknown)}")
    target = Path(path).expanduser().absolute()
    params = {**QWEN3_0_6B, **geometry}
    if is_current(target, params):
        return target
    tiny = ensure_tiny_model()
    bos, eos = special_ids(tiny)
    tok_vocab = len(json.loads((tiny / "tokenizer.json").read_text())["model"]["vocab"])
    if tok_vocab > params["vocab_size"]:
        raise ValueError(
            f"tokenizer has {tok_vocab} ids > vocab {params['vocab_size']}"
        )
    return write_model_dir(target, config_dict(params, bos, eos), params)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    for field in QWEN3_0_6B:
        flag = {
            "num_hidden_layers": "layers",
            "hidden_size": "hidden",
            "num_attention_heads": "heads",
            "num_key_value_heads": "kv-heads",
            "head_dim": "head-dim",
            "intermediate_size": "intermediate",
            "vocab_size": "vocab",
            "max_position_embeddings": "max-positions",
        }[field]
        p.add_argument(f"--{flag}", dest=field, type=int, default=None)
    args = vars(p.parse_args(argv))
    path = args.pop("path")
    geometry = {k: v for k, v in args.items() if v is not None}
    for k, v in geometry.items():
        if v < 1:
            p.error(f"{k} must be >= 1")
    out = ensure_qwen3_geometry_model(path, **geometry)
    # Validate with transformers, as SGLang will read it.
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    print(
        f"{out} {cfg.architectures[0]} layers={cfg.num_hidden_layers} "
        f"hidden={cfg.hidden_size} heads={cfg.num_attention_heads}/"
        f"{cfg.num_key_value_heads} head_dim={cfg.head_dim} vocab={cfg.vocab_size} "
        f"tokenizer_ids={len(tok)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
