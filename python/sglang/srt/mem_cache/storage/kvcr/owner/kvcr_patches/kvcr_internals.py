"""The kvcr 0.1.1 internals this package's peer patches wrap, checked before use.

``completion_senders``, ``probe_fences`` and ``unresolved_fills`` each wrap a
private part of kvcr (the target's notices and acks, the source's probe fences,
the core's discarded fills). Each asks this module for the class it patches:
the installed kvcr must be 0.1.1 and the class must have the methods, with the
parameters, and the fields they rely on, else ``KVCRInternalsChanged`` names
what differs and KVCR does not start (a patch silently not applied would leave
the hole it closes open).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

KVCR_VERSION = "0.1.1"

_decode: Callable[[bytes], dict[str, Any] | None] | None = None


class KVCRInternalsChanged(RuntimeError):
    """The installed kvcr is not the one whose internals these patches wrap."""


def _require(what: str, ok: bool) -> None:
    if not ok:
        from importlib.metadata import version

        raise KVCRInternalsChanged(
            f"kvcr {version('kvcr')} is installed, and {what}: this plugin's peer "
            f"checks patch kvcr {KVCR_VERSION}'s internals; pip install "
            f"kvcr=={KVCR_VERSION}"
        )


def _require_version() -> None:
    from importlib.metadata import version

    _require(f"it is not {KVCR_VERSION}", version("kvcr") == KVCR_VERSION)


def _require_method(cls: Any, name: str, params: Iterable[str]) -> None:
    fn = getattr(cls, name, None)
    ok = callable(fn) and list(inspect.signature(fn).parameters) == list(params)
    _require(f"{cls.__name__}.{name}({', '.join(params)}) differs", ok)


def _require_fields(cls: Any, names: Iterable[str]) -> None:
    fields = getattr(cls, "__dataclass_fields__", {})
    missing = [n for n in names if n not in fields]
    _require(f"{cls.__name__} lacks fields {missing}", not missing)


def require_empty_dict(value: Any, name: str) -> None:
    """``value`` must be the empty ``dict`` kvcr 0.1.1 starts ``name`` with."""
    _require(f"{name} does not start as an empty dict", type(value) is dict)
    _require(f"{name} does not start empty", not value)


def remote_backend_class() -> Any:
    """kvcr's ``_RemoteFWDram``, with what ``completion_senders`` wraps."""
    global _decode
    _require_version()
    from kvcr import remote_fw_dram

    cls = remote_fw_dram._RemoteFWDram
    _require_method(cls, "_poll_notifications", ("self", "progress"))
    _require_method(cls, "_handle_target_metadata_ack", ("self", "progress", "payload"))
    _require_method(cls, "_invalidate_control_peer", ("self", "endpoint"))
    _require_fields(
        remote_fw_dram._TargetPullOp, ("remote_ctrl_ep", "op_id", "state", "deadline")
    )
    _require(
        "remote_fw_dram has no WAITING_WRITE_DONE pull state",
        hasattr(
            getattr(remote_fw_dram, "_TargetPullState", None), "WAITING_WRITE_DONE"
        ),
    )
    decode = getattr(remote_fw_dram, "_decode_notif", None)
    _require("remote_fw_dram has no _decode_notif", callable(decode))
    _decode = decode
    return cls


def awaits_write_done(op: Any) -> bool:
    """Whether kvcr's target pull ``op`` still waits for its source's notice
    (not yet given up on: no probe, no quarantine)."""
    from kvcr import remote_fw_dram

    return op.state is remote_fw_dram._TargetPullState.WAITING_WRITE_DONE


def decode_notice(raw: bytes) -> dict[str, Any] | None:
    """A KVCR NIXL notice's payload as kvcr decodes it (None: not kvcr's)."""
    assert _decode is not None, "remote_backend_class() runs first"
    return _decode(raw)


def dangling_ops_classes() -> tuple[Any, Any]:
    """kvcr's ``_DanglingOps`` and ``_SourceWriteStatus`` (``probe_fences``)."""
    _require_version()
    from kvcr import dangling_ops

    cls = dangling_ops._DanglingOps
    _require_method(cls, "__init__", ("self", "backend"))
    _require_method(cls, "handle_probe", ("self", "progress", "payload"))
    status = dangling_ops._SourceWriteStatus
    _require_fields(status, ("submitted", "cancel_requested"))
    return cls, status


def core_class() -> Any:
    """kvcr's ``_KVCRCore``, with what ``unresolved_fills`` wraps."""
    _require_version()
    from kvcr import core, local_dram

    cls = core._KVCRCore
    _require_method(cls, "_discard_local_dram_fill", ("self", "keys"))
    _require_method(cls, "_complete_local_dram_fill", ("self", "keys", "success"))
    _require(
        "local_dram has no DISCARDING fill state",
        hasattr(getattr(local_dram, "_LocalDramState", None), "DISCARDING"),
    )
    _require_fields(local_dram._LocalDramResidency, ("slots", "state"))
    return cls


def progress_class() -> Any:
    """kvcr's ``_KVCRProgress``, with what ``owner_wake`` wraps."""
    _require_version()
    from kvcr import progress

    cls = progress._KVCRProgress
    _require_method(cls, "_publish_completed", ("self", "limit"))
    _require_method(cls, "_close_progress_ops", ("self",))
    _require_method(cls, "take_completed", ("self",))
    return cls
