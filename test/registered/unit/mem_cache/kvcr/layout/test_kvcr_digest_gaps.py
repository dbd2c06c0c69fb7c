"""What the digest covers that it used to miss, and what it no longer needlessly
covers (issue 24, finding 8).

Covered now: a hub id's snapshot config (not just ``name@revision``), modeling
code beside the config (``trust_remote_code``), a decrypted config file's
content, weights one directory down, a directory without weights (never
shared), and multimodal processor configs. No longer covered: the revision tag
of weights whose content is hashed and a load format's spelling (``auto`` is the
files it reads); ``--dtype`` by what it resolves to is in test_kvcr_model_dtype.
Chat templates stay out (they only change token ids).
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from cpu_harness import tiny_model
from sglang.srt.mem_cache.storage.kvcr.layout import model_identity
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import PageLayout
from sglang.srt.mem_cache.storage.kvcr.rank_setup import kvcache_layout_identity

PAGE = 16


def _args(model_path, **kw):
    base = {
        "model_path": str(model_path),
        "revision": None,
        "load_format": "auto",
        "dtype": "auto",
        "kv_cache_dtype": "auto",
    }
    return SimpleNamespace(**{**base, **kw})


def _digest(args):
    pool = MHATokenToKVPool(
        64, PAGE, torch.bfloat16, 2, 8, 2, device="cpu", enable_memory_saver=False
    )
    identity = kvcache_layout_identity(args, 0, 1)
    return PageLayout.from_kv_pool(pool, PAGE, identity=identity).compatibility_digest


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_KVCR_CACHE_DIR", str(tmp_path / "cache"))
    return shutil.copytree(tiny_model.ensure_tiny_model(), tmp_path / "model")


def test_a_revision_tag_on_hashed_weights_keeps_the_digest(model_dir):
    assert _digest(_args(model_dir, revision="v1")) == _digest(
        _args(model_dir, revision="v2")
    )


def test_modeling_code_beside_the_config_is_covered(model_dir):
    code = model_dir / "modeling_tiny.py"
    code.write_text("ROPE_THETA = 10000\n")
    before = _digest(_args(model_dir, trust_remote_code=True))
    code.write_text("ROPE_THETA = 500000\n")
    assert _digest(_args(model_dir, trust_remote_code=True)) != before


def test_a_hub_ids_snapshot_config_is_covered(model_dir, monkeypatch):
    """A hub id resolves to its local snapshot, whose config.json is hashed."""
    monkeypatch.setattr(
        model_identity,
        "_hub_snapshot",
        lambda repo, rev: model_dir if repo == "org/tiny" else None,
    )
    before = _digest(_args("org/tiny"))
    assert _digest(_args("org/tiny")) == before  # stable: content, not chance
    config = model_dir / "config.json"
    config.write_text(config.read_text().replace("{", '{"rope_scaling": null, ', 1))
    assert _digest(_args("org/tiny")) != before


def test_a_decrypted_config_files_content_is_covered(model_dir, tmp_path):
    decrypted = tmp_path / "decrypted.json"
    decrypted.write_text('{"rope_theta": 10000}')
    before = _digest(_args(model_dir, decrypted_config_file=str(decrypted)))
    decrypted.write_text('{"rope_theta": 500000}')
    assert _digest(_args(model_dir, decrypted_config_file=str(decrypted))) != before


def test_weights_one_directory_down_are_hashed_by_content(tmp_path):
    """Identical checkpoints at two paths share; new bytes at one path do not."""
    fp = model_identity.weights_fingerprint
    dirs = [tmp_path / name for name in ("a", "b")]
    for d in dirs:
        (d / "original").mkdir(parents=True)
        (d / "original" / "consolidated.safetensors").write_bytes(b"weights")
    a, b = (str(d) for d in dirs)
    assert fp(a, "", "auto") == fp(b, "", "auto")
    (dirs[1] / "original" / "consolidated.safetensors").write_bytes(b"other!!")
    assert fp(a, "", "auto") != fp(b, "", "auto")


def test_the_drafts_quantization_is_covered(model_dir):
    draft = {
        "speculative_algorithm": "EAGLE",
        "speculative_draft_model_path": str(model_dir),
    }
    before = _digest(_args(model_dir, **draft))
    assert _digest(_args(model_dir, **draft)) == before
    quantized = _args(model_dir, **draft, speculative_draft_model_quantization="fp8")
    assert _digest(quantized) != before


def test_a_directory_without_weights_is_never_shared(tmp_path):
    empty = tmp_path / "no-weights"
    empty.mkdir()
    fp = model_identity.weights_fingerprint
    assert fp(str(empty), "", "auto") != fp(str(empty), "", "auto")


# ---- spelled differently, selecting the same: one digest ---------------------------


def test_load_format_auto_and_the_safetensors_it_reads_keep_the_digest(model_dir):
    """``auto`` over a safetensors checkpoint reads exactly what ``safetensors``
    and ``fastsafetensors`` read; ``pt`` reads other files."""
    auto = _digest(_args(model_dir, load_format="auto"))
    assert _digest(_args(model_dir, load_format="safetensors")) == auto
    assert _digest(_args(model_dir, load_format="fastsafetensors")) == auto
    assert _digest(_args(model_dir, load_format="pt")) != auto


def test_load_format_auto_over_bin_files_is_what_npcache_reads(model_dir):
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    auto = _digest(_args(model_dir, load_format="auto"))
    assert _digest(_args(model_dir, load_format="npcache")) == auto
    assert _digest(_args(model_dir, load_format="safetensors")) != auto


# ---- multimodal processor configs: covered; chat templates: not -------------------


@pytest.mark.parametrize(
    "name",
    [
        "preprocessor_config.json",
        "processor_config.json",
        "video_preprocessor_config.json",
    ],
)
def test_a_multimodal_processor_config_is_covered(model_dir, name):
    """Image and video preprocessing decide the embeddings an image's KV is
    computed from, under the same token ids."""
    processor = model_dir / name
    processor.write_text('{"image_mean": [0.5, 0.5, 0.5]}')
    before = _digest(_args(model_dir))
    processor.write_text('{"image_mean": [0.48, 0.46, 0.41]}')
    assert _digest(_args(model_dir)) != before


def test_a_chat_template_is_not_covered(model_dir):
    """A template changes which token ids a request has; the page hashes cover
    those, so identical workers with other templates still share."""
    before = _digest(_args(model_dir))
    (model_dir / "chat_template.jinja").write_text("{{ messages }}")
    (model_dir / "chat_template.json").write_text('{"chat_template": "x"}')
    assert _digest(_args(model_dir)) == before
