"""A bound on the outgoing control sockets of kvcr 0.1.1's control channel.

kvcr's ``ZmqPeerControlChannel`` keeps one PUSH socket per endpoint it ever sent
to (``_outgoing``), for the life of the KVCR; every hint naming a new endpoint,
and every reply endpoint a peer names, adds one (a socket where nothing listens
keeps reconnecting). ``GuardedChannel.send`` calls ``make_room`` first: the
endpoint becomes the most recently used, and before a new one is dialed the
least recently used sockets beyond ``MAX_OUTGOING`` are closed (``linger`` 0:
what they still queue is dropped, as kvcr drops a send whose queue is full;
operation deadlines turn that into a miss, and the next send dials again).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

MAX_OUTGOING = 256


def make_room(outgoing: dict[str, Any], endpoint: str) -> None:
    """Mark ``endpoint`` used now in ``outgoing`` (endpoint -> socket, oldest use
    first) and, when it has no socket yet, close the least recently used ones
    until one more fits under ``MAX_OUTGOING``."""
    sock = outgoing.pop(endpoint, None)
    if sock is not None:
        outgoing[endpoint] = sock  # dicts keep insertion order: now the newest
        return
    while outgoing and len(outgoing) >= MAX_OUTGOING:
        oldest = next(iter(outgoing))
        outgoing.pop(oldest).close()
        logger.debug("KVCR control: closed the idle socket to %s", oldest)
