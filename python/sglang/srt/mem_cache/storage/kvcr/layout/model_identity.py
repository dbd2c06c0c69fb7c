"""The model identity a KVCR page's compatibility digest covers (no SGLang imports).

Two workers may share a page only when the page's KV bytes would be the same on
both. :func:`model_identity` reads what decides those bytes from the server
arguments: the checkpoint's *content* (not its path), the model config, the
revision, the draft model, and the settings that change the KV (weight
quantization, config overrides, KV scales, dtypes, the load format). Settings are
compared by what they select, not how they are spelled: ``--dtype`` is the
dtype the model computes in (resolved by SGLang, ``model_dtype``, and passed in),
and a load format by the weight files it reads (``auto`` over safetensors files
is ``safetensors``). Geometry (KV dtype, page size, spans, shard) is added by
``PageLayout``.

A local checkpoint directory (or single weight file) is fingerprinted by content:
``config.json``, the quantization and multimodal processor configs (image and
video preprocessing decide the embeddings an image's KV is computed from) and
``trust_remote_code`` modeling code in full; for every top-level weight file its
name, size, and the SHA-256 of its bytes (the name a Hugging Face cache blob
already carries, else hashed once and cached across starts by
``weight_hash_cache``). A hub id is resolved to the local snapshot SGLang loaded
(never downloaded); when none is found, or the load format does not read the
files (remote instances, IPC, caches), the worker gets a version no other worker
has. ``--load-format dummy`` weights are random: their fingerprint is the load
format, never the files. Tokenizer files and chat templates are left out: they
decide which token ids a request has, and pages are keyed by those ids already.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import uuid
from pathlib import Path
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.layout import weight_hash_cache

logger = logging.getLogger(__name__)

# Small files read in full: what the model runs under, and how weights are split.
CONFIG_FILES = ("config.json",)
_EXTRA_CONFIG_FILES = (
    "hf_quant_config.json",
    "quantize_config.json",
    "quant_config.json",
    "params.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack")
_INDEX_SUFFIX = ".index.json"
# Load formats that read the checkpoint's files (their content is the weights).
FILE_LOAD_FORMATS = frozenset(
    {
        "auto",
        "pt",
        "safetensors",
        "npcache",
        "fastsafetensors",
        "gguf",
        "bitsandbytes",
        "sharded_state",
        "mistral",
        "layered",
    }
)
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")
# Server arguments that change KV bytes (beyond the pool geometry), hashed by value.
_SETTINGS = (
    "kv_cache_dtype",
    "quantization",
    "modelopt_quant",
    "modelopt_checkpoint_restore_path",
    "rl_quant_profile",
    "speculative_draft_model_revision",
    "speculative_draft_model_quantization",
    "context_length",  # an override may rescale RoPE
)
# Server arguments naming a file whose content replaces the model's config.
_CONFIG_FILE_SETTINGS = ("decrypted_config_file", "decrypted_draft_config_file")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def _file_fingerprint(path: Path) -> str:
    """Content fingerprint of one weight file: the SHA-256 a Hugging Face cache
    blob is named by, else the SHA-256 of every byte (cached by file identity,
    so a restart does not read the weights again)."""
    size = path.stat().st_size
    target = path.resolve()
    if path.is_symlink() and _SHA256_NAME.fullmatch(target.name):
        return f"{size}:sha256:{target.name}"  # an HF cache blob: named by content
    return f"{size}:sha256:{weight_hash_cache.full_sha256(target)}"


def _hub_snapshot(repo_id: str, revision: str) -> Path | None:
    """The local snapshot SGLang loaded ``repo_id`` from (Hugging Face cache),
    without touching the network; None when there is none."""
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id, revision=revision or None, local_files_only=True
        )
    except Exception:  # not cached, not a hub id, or no huggingface_hub
        return None
    return Path(local) if local and Path(local).is_dir() else None


def local_checkpoint(model_path: str, revision: str) -> Path | None:
    """The local files SGLang reads for ``model_path``: the path itself, or a hub
    id's local snapshot; None when there is neither."""
    path = Path(os.path.expanduser(model_path)) if model_path else None
    if path is not None and not path.exists():
        path = _hub_snapshot(model_path, revision)  # the files SGLang read
    return path


def weights_fingerprint(model_path: str, revision: str, load_format: str) -> str:
    """What the weights loaded from ``model_path`` with ``load_format`` are."""
    if load_format == "dummy":
        return "dummy"  # random init, seeded identically: the files do not matter
    if load_format not in FILE_LOAD_FORMATS:
        # Weights from another process, a remote instance or a cache: nothing
        # here says what they are, so this worker shares with no other.
        return f"{load_format}:{new_weights_version()}"
    path = local_checkpoint(model_path, revision)
    if path is None:
        return f"unknown:{new_weights_version()}"  # never guess from a name
    if path.is_file():
        return "file:" + _file_fingerprint(path)
    parts: list[list[str]] = []
    for item in sorted(path.iterdir(), key=lambda p: p.name):
        if not item.is_file():
            continue
        if item.name.endswith(_INDEX_SUFFIX):
            parts.append([item.name, _sha(item.read_bytes())])
        elif item.name.endswith(WEIGHT_SUFFIXES):
            parts.append([item.name, _file_fingerprint(item)])
    if not parts:  # weights one level down (e.g. ``original/``)
        for sub in sorted(path.iterdir(), key=lambda p: p.name):
            if sub.is_dir():
                parts += [
                    [f"{sub.name}/{item.name}", _file_fingerprint(item)]
                    for item in sorted(sub.iterdir(), key=lambda p: p.name)
                    if item.is_file() and item.name.endswith(WEIGHT_SUFFIXES)
                ]
    if not parts:  # no weights found: a name says nothing of them, never share
        return f"unknown:{new_weights_version()}"
    return "dir:" + _sha(json.dumps(parts).encode())


def config_fingerprint(model_path: str, revision: str) -> str:
    """The model config, quantization config files and modeling code
    (``trust_remote_code``'s ``*.py``) under ``model_path``, or in the local
    Hugging Face snapshot of a hub id."""
    path = local_checkpoint(model_path, revision)
    if path is None or not path.is_dir():
        return f"path:{model_path}@{revision}"
    code = sorted(p.name for p in path.glob("*.py") if p.is_file())
    parts = [
        [name, _sha((path / name).read_bytes())]
        for name in (*CONFIG_FILES, *_EXTRA_CONFIG_FILES, *code)
        if (path / name).is_file()
    ]
    return _sha(json.dumps(parts).encode())


def _overrides(text: Any) -> str:
    """``json_model_override_args`` in canonical form ({} and "" are equal)."""
    if not text:
        return ""
    try:
        parsed = json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return str(text)
    return "" if parsed == {} else json.dumps(parsed, sort_keys=True, default=str)


def _file_or_text(value: Any) -> str:
    """A small file's content hash where ``value`` names one, else the text."""
    text = _text(value)
    if text and os.path.isfile(text):
        with open(text, "rb") as f:
            return "sha256:" + _sha(f.read())
    return text


# Load formats of SGLang's default loader by the weight files they read: the
# same files read by either gives the same weights.
_READS = {
    "safetensors": "safetensors",
    "fastsafetensors": "safetensors",
    "npcache": "bin",  # the .bin files (cached as numpy)
}


def files_read(load_format: str, model_path: str, revision: str) -> str:
    """``load_format`` as the weight files it reads: ``auto`` reads a
    checkpoint's ``*.safetensors`` when it has any, else its ``*.bin``."""
    load_format = load_format or "auto"
    if load_format != "auto":
        return _READS.get(load_format, load_format)
    path = local_checkpoint(model_path, revision)
    if path is None or not path.is_dir():
        return load_format
    for pattern, reads in (("*.safetensors", "safetensors"), ("*.bin", "bin")):
        if any(p.is_file() for p in path.glob(pattern)):
            return reads
    return load_format


def model_settings(server_args: Any, dtype: str) -> tuple[tuple[str, str], ...]:
    """Server arguments that change KV bytes, as sorted ``(name, value)`` pairs;
    ``dtype`` is the dtype the model computes in (``model_dtype.served_dtype``)."""
    values = {name: _text(getattr(server_args, name, None)) for name in _SETTINGS}
    values["dtype"] = dtype
    values["json_model_override_args"] = _overrides(
        getattr(server_args, "json_model_override_args", None)
    )
    values["quantization_param_path"] = _file_or_text(
        getattr(server_args, "quantization_param_path", None)
    )
    for name in _CONFIG_FILE_SETTINGS:
        values[name] = _file_or_text(getattr(server_args, name, None))
    values["load_format"] = files_read(
        _text(getattr(server_args, "load_format", None)),
        _text(getattr(server_args, "model_path", None)),
        _text(getattr(server_args, "revision", None)),
    )
    draft_format = _text(getattr(server_args, "speculative_draft_load_format", None))
    values["speculative_draft_load_format"] = draft_format and files_read(
        draft_format,
        _text(getattr(server_args, "speculative_draft_model_path", None)),
        _text(getattr(server_args, "speculative_draft_model_revision", None)),
    )
    values["lora_adapters"] = lora_identity(getattr(server_args, "lora_paths", None))
    return tuple(sorted(values.items()))


def lora_identity(lora_paths: Any) -> str:
    """The content of every adapter given at start-up (``--lora-paths``).

    Their ids are derived from name and path alone, identical on every worker,
    and a request's pages are keyed by that id: two workers with different
    weights under one adapter name and path must not share. (Adapters loaded at
    run time get random ids and never share.)"""
    if not lora_paths:
        return ""
    items = lora_paths.items() if isinstance(lora_paths, dict) else lora_paths
    adapters = []
    for item in items:
        if isinstance(item, tuple):
            name, path = item
        elif isinstance(item, dict):
            name, path = item.get("lora_name"), item.get("lora_path")
        elif isinstance(item, str):
            name, _, path = item.partition("=") if "=" in item else (item, "", item)
        else:  # a LoRARef
            name, path = (
                getattr(item, "lora_name", None),
                getattr(item, "lora_path", None),
            )
        path = _text(path)
        config = Path(os.path.expanduser(path)) / "adapter_config.json"
        adapters.append(
            [
                _text(name),
                weights_fingerprint(path, "", "auto"),
                _sha(config.read_bytes()) if config.is_file() else "",
            ]
        )
    return _sha(json.dumps(sorted(adapters)).encode())


def draft_identity(server_args: Any) -> str:
    """The speculative draft's weights (empty without speculative decoding)."""
    algorithm = _text(getattr(server_args, "speculative_algorithm", None))
    draft = _text(getattr(server_args, "speculative_draft_model_path", None))
    if not draft:
        return f"{algorithm}:target" if algorithm else ""
    revision = _text(getattr(server_args, "speculative_draft_model_revision", None))
    load_format = _text(getattr(server_args, "speculative_draft_load_format", None))
    weights = weights_fingerprint(draft, revision, load_format or "auto")
    config = config_fingerprint(draft, revision)
    return f"{algorithm}:{weights}:{config}"


def model_identity_fields(server_args: Any, dtype: str) -> dict[str, Any]:
    """``ModelIdentity`` keyword arguments (all but the shard) for ``server_args``,
    whose model computes in ``dtype`` (``model_dtype.served_dtype``)."""
    model_path = _text(getattr(server_args, "model_path", None))
    revision = _text(getattr(server_args, "revision", None))
    load_format = _text(getattr(server_args, "load_format", None)) or "auto"
    checkpoint = weights_fingerprint(model_path, revision, load_format)
    config = config_fingerprint(model_path, revision)
    if checkpoint.startswith(("dir:", "file:")):
        revision = ""  # the content decides: a tag on the same files changes nothing
    return {
        "checkpoint": checkpoint,
        "config": config,
        "revision": revision,
        "draft": draft_identity(server_args),
        "settings": model_settings(server_args, dtype),
    }


def new_weights_version() -> str:
    """A version no other worker has: weights replaced in memory are unknowable."""
    return "mem:" + uuid.uuid4().hex


class WeightsTracker:
    """The identity pages are keyed by, through in-place weight updates.

    ``changing`` records the identity of the weights now being served: the
    checkpoint's content for a disk update of a local checkpoint without a draft
    model, else a version no other worker has. Until ``take_pending`` (the flush
    that re-keys KVCR) every page is refused: ``pending`` is true.
    """

    def __init__(self, identity: Any, load_format: str) -> None:
        self.identity = identity
        self._pending: Any = None
        self._load_format = load_format

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def changing(self, model_path: str | None, load_format: str | None) -> None:
        import dataclasses
        import os

        identity = self._pending or self.identity
        if model_path is not None and os.path.exists(model_path) and not identity.draft:
            checkpoint = weights_fingerprint(
                model_path, identity.revision, load_format or self._load_format
            )
            identity = dataclasses.replace(
                identity, checkpoint=checkpoint, weights_version=""
            )
        else:
            identity = dataclasses.replace(
                identity, weights_version=new_weights_version()
            )
        self._pending = identity

    def take_pending(self) -> Any:
        """The new identity (now current), or None when nothing changed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.identity = pending
        return pending
