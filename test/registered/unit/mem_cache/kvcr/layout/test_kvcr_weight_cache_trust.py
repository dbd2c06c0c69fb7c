"""The weight-hash cache is trusted only when no one but this user could write it.

A page's digest covers the checkpoint's content hash, cached across starts in
``SGLANG_KVCR_CACHE_DIR``. A cache another user could write would let them pair
this worker's weights with any digest they like (another model's pages admitted
as this one's); such a cache is ignored and the weights are hashed again. It is
written only into a directory only this user can write, through a fresh
``mkstemp`` file: never through a name someone else could have planted.
"""

from __future__ import annotations

import hashlib
import json
import os

from sglang.srt.mem_cache.storage.kvcr.layout import weight_hash_cache


def _setup(tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("SGLANG_KVCR_CACHE_DIR", str(cache_dir))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"real weights " * 100)
    real = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert weight_hash_cache.full_sha256(weights) == real  # computed and cached
    cache = cache_dir / "weight_sha256.json"
    forged = dict.fromkeys(json.loads(cache.read_text()), "f" * 64)
    cache.write_text(json.dumps(forged))
    return weights, real, cache


def test_the_cache_is_written_private_and_read_back(tmp_path, monkeypatch):
    weights, _, cache = _setup(tmp_path, monkeypatch)
    assert cache.stat().st_mode & 0o077 == 0
    assert cache.parent.stat().st_mode & 0o077 == 0
    # Private: what it holds is believed (the forged entry stands for the file).
    assert weight_hash_cache.full_sha256(weights) == "f" * 64


def test_a_cache_others_may_write_is_ignored(tmp_path, monkeypatch):
    weights, real, cache = _setup(tmp_path, monkeypatch)
    os.chmod(cache, 0o666)
    assert weight_hash_cache.full_sha256(weights) == real


def test_a_cache_in_a_directory_others_may_write_is_ignored(tmp_path, monkeypatch):
    weights, real, cache = _setup(tmp_path, monkeypatch)
    os.chmod(cache.parent, 0o777)
    assert weight_hash_cache.full_sha256(weights) == real


def test_a_directory_others_may_write_gets_no_cache_written(tmp_path, monkeypatch):
    """Hashing works, but nothing is written where it could not be trusted."""
    weights, real, cache = _setup(tmp_path, monkeypatch)
    cache.unlink()
    os.chmod(cache.parent, 0o777)
    assert weight_hash_cache.full_sha256(weights) == real
    assert os.listdir(cache.parent) == []


def test_a_directory_of_another_user_gets_no_cache_written(tmp_path, monkeypatch):
    """The directory's owner is not this process's user (as the check sees it)."""
    weights, real, cache = _setup(tmp_path, monkeypatch)
    cache.unlink()
    me = os.geteuid()
    monkeypatch.setattr(weight_hash_cache.os, "geteuid", lambda: me + 1)
    assert weight_hash_cache.full_sha256(weights) == real
    assert os.listdir(cache.parent) == []


def test_the_cache_is_never_written_through_a_planted_name(tmp_path, monkeypatch):
    """A link at the temporary name a writer could predict (the old pid-named
    one) is not followed: the file it points at stays untouched, and the cache
    lands as a private file of its own."""
    weights, _, cache = _setup(tmp_path, monkeypatch)
    cache.unlink()
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    for name in (f"weight_sha256.{os.getpid()}.tmp", "weight_sha256.tmp"):
        (cache.parent / name).symlink_to(victim)
    weight_hash_cache.full_sha256(weights)
    assert victim.read_text() == "untouched"
    assert not cache.is_symlink() and cache.stat().st_mode & 0o077 == 0
    assert json.loads(cache.read_text())  # the hash was cached
