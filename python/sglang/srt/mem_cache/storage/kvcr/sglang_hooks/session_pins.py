"""Whether SGLang holds requests of a session: the one state of an idle
scheduler known to become cyclic garbage later.

A session's requests point at their ``Session`` (``req.session``), which points
back at them through its turn nodes (``req_nodes``; each turn's node is also its
parent's child). SGLang 0.5.23 leaves ``req.session`` set when a non-streaming
session closes, so a closed session is cyclic garbage once nothing outside it
holds it, and a heap frozen meanwhile (``owner.idle_freeze``) would never free
it. ``holds_sessions`` is true while a session is open
(``session_controller.sessions``) and while the overlap loop still pins a
request that has one (``batch_record_buf``: its last two batches and a snapshot
of their fields, kept until two more batches ran). Unknown counts as held.
"""

from __future__ import annotations

from typing import Any


def holds_sessions(scheduler: Any) -> bool:
    """Open sessions, or a pinned request of a session (see the module docstring)."""
    controller = getattr(scheduler, "session_controller", None)
    if controller is None or getattr(controller, "sessions", True):
        return True
    for entry in getattr(scheduler, "batch_record_buf", None) or ():
        if any(_reaches_session_req(held) for held in entry or ()):
            return True
    return False


def _reaches_session_req(held: Any) -> bool:
    """``held`` (a pinned batch, its field snapshot or an extra reference) lists
    a request with a session: the batch's ``reqs``, or a list in the snapshot."""
    values = held if isinstance(held, list) else [getattr(held, "reqs", None)]
    return any(
        isinstance(value, list)
        and any(getattr(req, "session", None) is not None for req in value)
        for value in values
    )
