"""The SHA-256 of weight files, cached across starts by file identity.

A page's digest covers the checkpoint's content (``model_identity``); hashing
every weight byte on each start is slow, so :func:`full_sha256` keeps each file's
hash in ``weight_sha256.json`` under ``SGLANG_KVCR_CACHE_DIR`` (default
``~/.cache/sglang-kvcr``), keyed by path, device, inode, size and mtime. Whoever
can write that file can pair these weights with any digest (another model's pages
admitted as this one's), so it is read only when this user owns it and its
directory and no one else may write either, and written only into such a
directory, through a fresh ``mkstemp`` file renamed into place (no name that
another writer, or a link planted in advance, shares). Otherwise the weights are
hashed again, with one warning per cache path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

_READ_BYTES = 8 << 20
_DISTRUSTED: set[str] = set()  # caches already warned about


def full_sha256(path: Path) -> str:
    """The SHA-256 of every byte of ``path``, from the cache when it is trusted."""
    st = path.stat()
    key = f"{path}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"
    cache = load()
    if key in cache:
        return cache[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            h.update(chunk)
    cache[key] = digest = h.hexdigest()
    save(cache)
    return digest


def cache_path() -> Path:
    root = os.environ.get("SGLANG_KVCR_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "sglang-kvcr"
    )
    return Path(root) / "weight_sha256.json"


def load() -> dict[str, str]:
    """The cached hashes, when only this user can have written them; else none."""
    path = cache_path()
    try:
        if not (private(path) and private(path.parent)):
            _distrust(path)
            return {}
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def save(cache: dict[str, str]) -> None:
    """Write ``cache`` into a private directory (else nothing), atomically."""
    path = cache_path()
    try:  # best effort: a read-only home only costs a re-read next start
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not private(path.parent):
            _distrust(path)  # nothing written there could be trusted next start
            return
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:  # mkstemp: mode 0600, O_EXCL
                json.dump(cache, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def private(path: Path) -> bool:
    """Owned by this process's user and writable by no one else."""
    st = path.stat()
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _distrust(path: Path) -> None:
    if str(path) not in _DISTRUSTED:
        _DISTRUSTED.add(str(path))
        logger.warning(
            "KVCR: not using weight-hash cache %s: it or its directory is not "
            "owned by this user or is writable by others (chmod go-w, or set "
            "SGLANG_KVCR_CACHE_DIR)",
            path,
        )
