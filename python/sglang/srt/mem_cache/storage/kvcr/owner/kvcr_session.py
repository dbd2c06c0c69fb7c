"""One rank's KVCR incarnations: start, re-key and restart the owner-thread adapter.

A linker runs one KVCR at a time. A flush closes it and starts the next one with a
fresh NIXL agent name (peers, and this process, may still remember the previous
one), the DRAM regions the quarantine handed back and, after a weight update, a key
adapter for the new digest. ``KVCRSession`` owns what that takes: the factory
arguments, the adapter limits, the agent name, the endpoints a router may use to
name this rank, and the hand-over of DRAM from one incarnation to the next
(``quarantine.KVCRDram``). The linker submits and releases through it and never builds a
factory itself. A KVCR that failed (``failed``) is replaced by ``restart``; an old
one whose close raises or times out, at a flush or a restart, is closed uncleanly
(its DRAM quarantined), never an error for the caller.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import secrets
import socket
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRAdapterFailed
from sglang.srt.mem_cache.storage.kvcr.config.linker_config import KVCRLinkerConfig
from sglang.srt.mem_cache.storage.kvcr.fleet.router_hint import own_endpoints
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import KeyAdapter, PageLayout
from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_factory
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_adapter import KVCRAdapter
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import (
    AdapterLimits,
    AdapterStats,
    ClaimId,
    Deposit,
    DiscardHint,
    Fetch,
    Release,
)
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_factory import make_kvcr_factory
from sglang.srt.mem_cache.storage.kvcr.owner.quarantine import KVCRDram

if TYPE_CHECKING:
    from sglang.srt.mem_cache.storage.kvcr.layout.rank_placement import RankPlacement

logger = logging.getLogger(__name__)

_INCARNATIONS = itertools.count(1)
# AdapterStats fields that only grow: summed over incarnations (the rest are the
# running adapter's in-flight bytes and peaks).
_COUNTERS = (
    "deposits",
    "fetches",
    "refused_offload",
    "refused_prepare",
    "claims_released",
    "resilience_events",
    "dropped_notices",
)


class KVCRSession:
    """The running KVCR incarnation of one rank and how to start the next."""

    __slots__ = (
        "_dram",
        "_dram_ready",
        "_factory_args",
        "_hosts",
        "_label",
        "_limits",
        "_old_clean",
        "_retired",
        "_stale",
        "adapter",
        "agent",
        "own_endpoints",
    )

    def __init__(
        self,
        config: KVCRLinkerConfig,
        dram: KVCRDram,
        factory_args: dict[str, Any],
        label: str,
    ) -> None:
        self._dram = dram
        self._factory_args = factory_args
        self._label = label
        self._hosts = (config.control_bind_host, config.advertise_host)
        self._limits = AdapterLimits(
            max_inflight_offload_bytes=config.max_inflight_offload_bytes,
            max_inflight_prepare_bytes=config.max_inflight_prepare_bytes,
            wait_timeout_s=config.owner_wait_timeout_s,
        )
        self.agent = ""
        self.own_endpoints: frozenset[str] = frozenset()
        self._retired = AdapterStats()  # counts of the incarnations flushed
        # Retiring an incarnation is three steps (close, DRAM hand-over, start);
        # a failed step is redone by the next attempt, the finished ones are not.
        self._stale = False  # the adapter is closed; no next one runs yet
        self._old_clean = False  # whether that close proved its KVCR quiescent
        self._dram_ready = False  # the next one's DRAM is handed over
        self.adapter = self._start()

    @classmethod
    def for_rank(
        cls,
        config: KVCRLinkerConfig,
        placement: RankPlacement,
        layout: PageLayout,
        dram: KVCRDram,
        local_copier: Any = None,
    ) -> KVCRSession:
        """The first incarnation of ``placement``'s KVCR over ``dram``, its
        deposits filled by ``local_copier``."""
        port = placement.control_port(config.control_port)
        args = kvcr_factory.factory_args(layout, config, port, dram, local_copier)
        return cls(config, dram, args, placement.label())

    def log_up(self, placement: RankPlacement, layout: PageLayout) -> None:
        logger.info(
            "KVCR direct linker up: agent=%s endpoint=%s (%s) digest=%s pools=%s",
            self.agent,
            self.endpoint,
            placement.describe(),
            layout.compatibility_digest,
            [p.name for p in layout.pools],
        )

    def _start(self) -> KVCRAdapter:
        # A fresh NIXL agent name per incarnation: peers and this process may
        # still remember the previous one after a flush. Its random tail makes
        # it unguessable: NIXL takes a notice's sender name from the message
        # itself, so a pull believes only peers told the name over the guarded
        # control channel (completion_senders), never a stranger naming itself.
        host, pid = socket.gethostname(), os.getpid()
        tail = secrets.token_hex(8)
        agent = f"kvcr-{host}-{pid}-{self._label}-{next(_INCARNATIONS)}-{tail}"
        factory = make_kvcr_factory(agent_name=agent, **self._factory_args)
        adapter = KVCRAdapter(factory, self._limits, name=f"kvcr-{self._label}")
        self.agent = agent
        self.own_endpoints = own_endpoints(adapter.endpoint, self._hosts)
        return adapter

    @property
    def failed(self) -> bool:
        """KVCR is gone (its owner thread failed, or a restart did not start the
        next one) or asked to be restarted: only ``restart`` helps."""
        adapter = self.adapter
        return self._stale or adapter.failed or adapter.restart_wanted

    def restart(self, layout: PageLayout, timeout_s: float) -> None:
        """Replace a failed KVCR: close it (an exception or a timeout is an
        unclean close: its DRAM stays quarantined) and start the next one, as a
        flush does; the caller made sure no restore reads the old DRAM. Raises
        when the next one does not start; the next call redoes whatever step
        did not finish (the DRAM hand-over included)."""
        self._next(layout, loads_quiet=True, timeout_s=timeout_s)

    def _next(self, layout: PageLayout, loads_quiet: bool, timeout_s: float) -> None:
        """Retire the running incarnation (once), hand its DRAM over (again
        until that succeeds) and start the next one, keyed for ``layout``."""
        old = self.adapter
        if not self._stale:
            self._retired = self._summed(old.stats())
            self._stale, self._dram_ready = True, False
            self._old_clean = self._close(old)
        if not self._dram_ready:
            # A copy still running past the deadline may read the old DRAM
            # however cleanly KVCR closed: that share is never reclaimed.
            clean = self._old_clean and loads_quiet
            if self._dram.flush(old, clean, timeout_s, reclaimable=loads_quiet):
                regions = layout.local_dram_regions(list(self._dram.storage.values()))
                self._factory_args["local_dram_pools"] = regions
            self._dram_ready = True
        self._factory_args["key_adapter"] = KeyAdapter(layout)  # its digest
        self.adapter = self._start()
        self._stale = self._dram_ready = False

    @staticmethod
    def _close(old: KVCRAdapter) -> bool:
        """Whether closing ``old`` proved its KVCR quiescent (DRAM idle)."""
        try:
            return old.close()
        except KVCRAdapterFailed as exc:
            # The owner thread failed, then closed KVCR itself: as clean as
            # that close was (a stuck or retained KVCR never is).
            clean = old.reclaim(0.0)
            if not clean:
                logger.error("KVCR failed (%s); its DRAM is quarantined", exc)
            return clean
        except Exception as exc:  # KVCRTimeoutError: stuck
            logger.error("KVCR close was not clean (%s); its DRAM is quarantined", exc)
            return False

    def flush(self, layout: PageLayout, loads_quiet: bool, timeout_s: float) -> None:
        """Close this incarnation and start the next one over DRAM the quarantine
        says is idle (``loads_quiet``: no restore copy can still read it), keyed
        for ``layout`` (new weights give it a new digest). The old one's close
        never makes this raise; a next one that does not start does (``failed``
        then holds and ``restart`` tries again)."""
        self._next(layout, loads_quiet, timeout_s)
        logger.info(
            "KVCR linker reset: residency cleared, endpoint=%s digest=%s",
            self.endpoint,
            layout.compatibility_digest,
        )

    def stats(self) -> AdapterStats:
        """The running adapter's stats with every counter summed over this rank's
        incarnations (a flush does not take back what was counted)."""
        if self._stale:  # already summed into the retired counts
            return dataclasses.replace(self._retired)
        return self._summed(self.adapter.stats())

    def _summed(self, now: AdapterStats) -> AdapterStats:
        totals = {f: getattr(now, f) + getattr(self._retired, f) for f in _COUNTERS}
        return dataclasses.replace(now, **totals)

    @property
    def endpoint(self) -> str:
        return self.adapter.endpoint

    def submit(
        self, commands: Iterable[Deposit | Fetch | Release | DiscardHint]
    ) -> None:
        for command in commands:
            self.adapter.submit(command)

    def release(self, claims: Sequence[ClaimId] | None) -> None:
        """Give KVCR back these residency claims (nothing when there are none)."""
        if claims:
            self.adapter.submit(Release(tuple(claims)))

    def inbound_refused(self) -> int:
        """Control-channel connections the inbound guard refused."""
        return int(self._factory_args["inbound_guard"].refused)
