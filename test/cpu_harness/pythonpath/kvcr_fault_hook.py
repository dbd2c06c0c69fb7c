"""Test-only fault injection into a KVCR-linker server process; production never loads it.

With ``KVCR_TEST_FAULTS_DIR`` set, the harness's start-up shim
(``harness_import_hooks.start_up``) installs ``KVCRFaultHook``: once each target
module has run unchanged, a few of its methods are wrapped so that they fault on
demand. A test arms fault ``NAME`` by writing ``<dir>/NAME.arm`` (its text: the
fault's argument, if any); the next call of the wrapped method, in whichever process
makes it, claims the file (an atomic rename, so it fires once and in one process),
writes ``<dir>/NAME.fired`` (JSON: the thread it ran on, the pid, the argument) and
faults. Each fault is produced where the real one happens:

- ``owner_deposit``: a deposit's slot reservation (kvcr's
  ``local_dram._LocalDram._allocate_slots``, which the linker's deposits call,
  as kvcr's own fetches do) raises: an exception on the adapter's owner thread
  (the only thread that calls KVCR).
- ``progress``: one iteration of kvcr's progress loop raises kvcr's own
  ``_RemoteAgentCleanupError``, as its peer-message handlers do when NIXL's peer
  cleanup fails: the progress thread stops, and the owner thread's next
  ``poll_completed`` re-raises the error.
- ``close_hang``: ``kvcr.api.KVCR.close`` first sleeps the armed seconds: a close
  stuck past the adapter's deadline (a flush then times out on it).
- ``restore_copy``: the restorer's copy of a batch (``Restorer.copy_batch``;
  inline on the scheduler thread for CPU pools) raises.
- ``loader``: the restore loader thread (on CPU it only idles: CPU copies run
  inline) binds to its device only once this fault is armed (or once it is handed
  work, or told to stop), and ``DeviceBinding.bind_thread`` raises there, as
  ``torch.cuda.set_device`` does on a lost GPU.

Stdlib only at import (it runs in every process of a server); the patched modules
are imported by their users.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

from harness_import_hooks import ModuleHook

ENV = "KVCR_TEST_FAULTS_DIR"
FAULTS = ("owner_deposit", "progress", "close_hang", "restore_copy", "loader")
LOADER_POLL_S = 0.05
MARK = "__kvcr_fault_hook__"
_PKG = "sglang.srt.mem_cache.storage.kvcr"
_local = threading.local()


class InjectedFault(RuntimeError):
    """A fault this hook raised on purpose."""


def faults_dir() -> str:
    return os.environ.get(ENV, "")


def armed(name: str) -> bool:
    return os.path.exists(os.path.join(faults_dir(), f"{name}.arm"))


def claim(name: str) -> str | None:
    """The argument of fault ``name`` when this call claims it (it fires now),
    else None. Records where it fired in ``NAME.fired``."""
    base = faults_dir()
    arm = os.path.join(base, f"{name}.arm")
    if not base or not os.path.exists(arm):
        return None
    claimed = f"{arm}.{os.getpid()}.{threading.get_ident()}"
    try:
        os.rename(arm, claimed)  # atomic: one caller wins
    except FileNotFoundError:
        return None
    with open(claimed) as f:
        arg = f.read().strip()
    record = {
        "fault": name,
        "thread": threading.current_thread().name,
        "pid": os.getpid(),
        "arg": arg,
        "time": time.time(),
    }
    fired = os.path.join(base, f"{name}.fired")
    with open(claimed, "w") as f:
        json.dump(record, f)
    os.replace(claimed, fired)  # whole, or not there yet
    return arg


def _raising(name: str, make: Callable[[], BaseException]) -> Callable[..., Any]:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            if claim(name) is not None:
                raise make()
            return original(self, *args, **kwargs)

        return method

    return wrap


def _cleanup_error() -> BaseException:
    from kvcr.remote_fw_dram import _RemoteAgentCleanupError

    return _RemoteAgentCleanupError(
        "NIXL remote agent 'kvcr-peer' cleanup failed (injected by kvcr_fault_hook)"
    )


def _hanging_close(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def close(self: Any) -> Any:
        arg = claim("close_hang")
        if arg is not None:
            time.sleep(float(arg or 10.0))
        return original(self)

    return close


def _deferred_loader(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def loader_main(self: Any) -> Any:
        while not armed("loader") and self.jobs.empty():
            time.sleep(LOADER_POLL_S)
        _local.device_lost = claim("loader") is not None
        return original(self)

    return loader_main


def _losing_bind(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def bind_thread(self: Any) -> Any:
        if getattr(_local, "device_lost", False):
            raise InjectedFault("CUDA error: device lost (injected by kvcr_fault_hook)")
        return original(self)

    return bind_thread


def _wrap(cls: type, name: str, wrapper: Callable[[Any], Any]) -> None:
    setattr(cls, name, wrapper(getattr(cls, name)))


def _patch_api(module: types.ModuleType) -> None:
    _wrap(module.KVCR, "close", _hanging_close)


def _patch_local_dram(module: types.ModuleType) -> None:
    _wrap(
        module._LocalDram,
        "_allocate_slots",
        _raising(
            "owner_deposit",
            lambda: InjectedFault("KVCR deposit failed (injected by kvcr_fault_hook)"),
        ),
    )


def _patch_progress(module: types.ModuleType) -> None:
    _wrap(
        module._KVCRProgress, "_run_one_iteration", _raising("progress", _cleanup_error)
    )


def _patch_restore(module: types.ModuleType) -> None:
    cls = module.Restorer
    _wrap(
        cls,
        "copy_batch",
        _raising(
            "restore_copy",
            lambda: InjectedFault(
                "KVCR restore copy failed (injected by kvcr_fault_hook)"
            ),
        ),
    )
    _wrap(cls, "loader_main", _deferred_loader)


def _patch_streams(module: types.ModuleType) -> None:
    _wrap(module.DeviceBinding, "bind_thread", _losing_bind)


PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "kvcr.api": _patch_api,
    "kvcr.local_dram": _patch_local_dram,
    "kvcr.progress": _patch_progress,
    f"{_PKG}.datapath.restore": _patch_restore,
    f"{_PKG}.device.device_streams": _patch_streams,
}


def apply(name: str, module: types.ModuleType) -> bool:
    """Patch ``module`` (imported as ``name``) once; True when patched now."""
    if getattr(module, MARK, False):
        return False
    PATCHES[name](module)
    setattr(module, MARK, True)
    return True


class KVCRFaultHook(ModuleHook):
    """Finds the target modules; wraps their methods once their code has run."""

    TARGETS = frozenset(PATCHES)

    def after(self, module: types.ModuleType) -> None:
        apply(module.__name__, module)

    @classmethod
    def install(cls) -> bool:
        """Put the finder first on ``sys.meta_path`` (patching any target already
        imported); True when newly installed."""
        if not super().install():
            return False
        for name in PATCHES:
            module = sys.modules.get(name)
            if module is not None:
                apply(name, module)
        return True


install = KVCRFaultHook.install
uninstall = KVCRFaultHook.uninstall
