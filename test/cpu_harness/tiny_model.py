"""A tiny random-weight Llama checkpoint + tokenizer, built offline and reproducibly.

Used by the CPU server tests: SGLang needs an HF-format model directory, and no
such model is available offline. ``ensure_tiny_model()`` builds one into a cache
directory (default ``$SGLANG_KVCR_CACHE_DIR/tiny-llama-v1``) only when it is
missing. The build is deterministic: a ByteLevel BPE tokenizer trained from the
corpus below, and weights drawn from a seeded ``torch.Generator``, so two builds
give byte-identical ``model.safetensors`` and ``tokenizer.json``. Nothing binary
is committed; the directory is always generated.

The model: LlamaForCausalLM, 2 layers, hidden 64, 4 attention heads / 2 KV heads
(head_dim 16), intermediate 128, bfloat16, max_position_embeddings 4096 (so
prompts of 1-2k tokens work). Outputs are gibberish, but greedy decoding is
deterministic.

Run ``python test/cpu_harness/tiny_model.py [DIR]`` to build it by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

BUILD_NAME = "tiny-llama-v1"
MARKER = ".tiny-model-complete"
SEED = 20240611
VOCAB_SIZE = 512
HIDDEN = 64
INTERMEDIATE = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
MAX_POSITIONS = 4096
DTYPE = "bfloat16"
SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")
WEIGHT_FILES = ("model.safetensors",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny test model for a CPU server.",
    "A cache stores pages of keys and values so that a repeated prefix is not "
    "computed twice.",
    "When the device pool is full, the oldest pages are written to host memory "
    "and read back later.",
    "Every request has an id, a prompt, a number of new tokens and a sampling "
    "temperature.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 1024 4096 65536.",
    "Letters: abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.",
    "Punctuation: ( ) [ ] { } < > , . ; : ! ? ' \" - _ + = * / \\ | @ # $ % ^ & ~",
    "Once upon a time there was a small server that answered every question "
    "with the same polite nonsense.",
    "Rivers flow to the sea, mountains rise to the sky, and the scheduler "
    "waits for the next batch.",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.",
    "January February March April May June July August September October "
    "November December",
    "def main():\n    return sum(range(10))\n",
    '{"key": "value", "list": [1, 2, 3], "ok": true}',
)


def default_path() -> Path:
    """``$SGLANG_KVCR_CACHE_DIR/tiny-llama-v1`` (the cache dir defaults to .cache)."""
    cache = os.environ.get("SGLANG_KVCR_CACHE_DIR")
    base = Path(cache) if cache else Path(__file__).resolve().parents[2] / ".cache"
    return base / BUILD_NAME


def is_complete(path: Path) -> bool:
    path = Path(path)
    return (path / MARKER).is_file() and all(
        (path / name).is_file()
        for name in (*WEIGHT_FILES, *TOKENIZER_FILES, "config.json")
    )


def ensure_tiny_model(path: str | os.PathLike[str] | None = None) -> Path:
    """Return the tiny model directory, building it first when it is missing.

    The build goes to a temporary sibling directory that is renamed into place
    once complete (the marker file is written last), so a reader never sees a
    half-written model and concurrent builders cannot corrupt each other.
    """
    target = Path(path) if path is not None else default_path()
    target = target.expanduser().absolute()
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not is_complete(target):
        # A left-over without a marker (never produced by this function, whose
        # rename is atomic): move it aside, then delete it.
        stale = Path(
            tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent)
        )
        os.replace(target, stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target):  # someone else's finished build is fine
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if not is_complete(target):
        raise RuntimeError(f"tiny model build at {target} is incomplete")
    return target


def build(out: str | os.PathLike[str]) -> Path:
    """Write tokenizer, config and weights into ``out`` (created if needed)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(out)
    _write_config(out, tokenizer)
    _write_weights(out, vocab_size=len(tokenizer))
    digest = hashlib.sha256()
    for name in (*WEIGHT_FILES, *TOKENIZER_FILES, "config.json"):
        digest.update(name.encode())
        digest.update((out / name).read_bytes())
    (out / MARKER).write_text(
        json.dumps({"build": BUILD_NAME, "seed": SEED, "sha256": digest.hexdigest()})
        + "\n"
    )
    for item in out.iterdir():
        if item.is_file():
            os.chmod(item, 0o644)
    return out


def _build_tokenizer(out: Path) -> Any:  # a transformers PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 20, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=MAX_POSITIONS,
    )
    hf_tok.save_pretrained(str(out))
    return hf_tok


def _write_config(out: Path, tokenizer: Any) -> None:
    from transformers import GenerationConfig, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        dtype=DTYPE,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(str(out))
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    ).save_pretrained(str(out))


def _write_weights(out: Path, *, vocab_size: int) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator(device="cpu").manual_seed(SEED)
    dtype = getattr(torch, DTYPE)
    head_dim = HIDDEN // HEADS

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen, dtype=torch.float32) * std).to(
            dtype
        )

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    # Fan-in scaled weights keep activations O(1), so greedy logits have clear
    # gaps and decoding does not flip on rounding differences between kernels.
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(vocab_size, HIDDEN, 1.0)
    }
    s_in, s_mid = HIDDEN**-0.5, INTERMEDIATE**-0.5
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones(HIDDEN)
        w[p + "self_attn.q_proj.weight"] = normal(HEADS * head_dim, HIDDEN, s_in)
        w[p + "self_attn.k_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN, s_in)
        w[p + "self_attn.v_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN, s_in)
        w[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * head_dim, s_in)
        w[p + "post_attention_layernorm.weight"] = ones(HIDDEN)
        w[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN, s_in)
        w[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN, s_in)
        w[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE, s_mid)
    w["model.norm.weight"] = ones(HIDDEN)
    w["lm_head.weight"] = normal(vocab_size, HIDDEN, 2.0 * s_in)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})


def main(argv: list[str]) -> int:
    path = ensure_tiny_model(argv[1] if len(argv) > 1 else None)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
