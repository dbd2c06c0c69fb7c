"""The linker's lifecycle: weight updates, flush, close, quiescence, and recovery
from a KVCR fault. New weights refuse every page until the flush after the
update re-keys KVCR with their identity.

A linker fault degrades serving, it never stops it. Every hook pumps results
(``KVCRDirectLinker._pump``), and each pump ends in ``_watch_kvcr``: when the
session reports its KVCR failed (the owner thread died, or kvcr turned source
writes off until a restart) the linker goes DOWN once, logged at ERROR and
counted (``kvcr_failures``). While DOWN lookups miss (``kvcr_down``),
preparations fetch nothing and offloads complete as failed, so every request is
recomputed; the failed adapter answers every command it had as FAILED, so
nothing waits on it. A restart is tried from the once-a-step pump
(``num_completed_offloads``, never between a request's lookup and its load) once
``owner.recovery`` says its backoff is due (1 s, doubling to 60 s) and it is safe: no restore queued or started
(restore slots index the old DRAM, which a restart replaces), and no offload
result still pending or stored but not yet taken by SGLang (its stored mark must
be set before this rank reports every page it held removed). A restart drops
what the old KVCR held (preparations and their claims, which are never sent
anywhere; resident pages, reported removed so every rank clears their stored
marks) and starts a new KVCR through the session (the old one's DRAM stays
quarantined); on success the linker is UP again (``kvcr_restarts``), else it
stays DOWN with a doubled backoff. Preparations are kept while DOWN: a request
whose lookup hit just before the fault still restores from the old DRAM, which
nothing writes any more and nothing replaces before its restore has finished.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import ClaimId
from sglang.srt.mem_cache.storage.kvcr.owner.recovery import Recovery

if TYPE_CHECKING:
    from sglang.srt.mem_cache.storage.kvcr.config.linker_config import (
        KVCRLinkerConfig,
    )
    from sglang.srt.mem_cache.storage.kvcr.datapath.dram_copy import DramCopier
    from sglang.srt.mem_cache.storage.kvcr.datapath.offloader import Offloader
    from sglang.srt.mem_cache.storage.kvcr.datapath.restore import Restorer
    from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import PageLayout
    from sglang.srt.mem_cache.storage.kvcr.observability.linker_stats import (
        LinkerStats,
        StatsReport,
    )
    from sglang.srt.mem_cache.storage.kvcr.owner.idle_freeze import IdleFreezer
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_adapter import KVCRAdapter
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_session import KVCRSession
    from sglang.srt.mem_cache.storage.kvcr.owner.quarantine import KVCRDram
    from sglang.srt.mem_cache.storage.kvcr.requests.preparation import Preparations
    from sglang.srt.mem_cache.storage.kvcr.requests.residency import Residency

logger = logging.getLogger(__name__)


class LinkerLifecycle:
    """Flush, close and KVCR recovery of ``KVCRDirectLinker`` (see the module
    docstring); the linker owns the collaborators named below."""

    config: KVCRLinkerConfig
    session: KVCRSession
    restorer: Restorer
    offloader: Offloader
    copier: DramCopier
    preparations: Preparations
    residency: Residency
    replicas: Any
    weights: Any
    layout: PageLayout
    dram: KVCRDram
    report: StatsReport
    recovery: Recovery
    freezer: IdleFreezer
    stats: LinkerStats

    @property
    def _adapter(self) -> KVCRAdapter:
        return self.session.adapter

    def _route(self) -> None:
        """Submit ready offloads and route every drained result (the linker's)."""
        raise NotImplementedError

    # ---- weight updates (re-keyed by the next flush) ----------------------------

    def weights_changing(
        self, source: str, model_path: str | None = None, load_format: str | None = None
    ) -> None:
        """The served weights are being replaced (``source``: disk, tensor, ...):
        pages are refused until the next ``reset()`` (SGLang's flush after the
        update) re-keys KVCR with the new identity (model_identity)."""
        self.weights.changing(model_path, load_format)
        logger.info(
            "KVCR: weights changing (%s); pages refused until the next flush", source
        )

    @property
    def weights_pending(self) -> bool:
        """Whether new weights are served but KVCR is not re-keyed for them yet."""
        return self.weights.pending

    # ---- the heap between requests ----------------------------------------------

    def freeze_when_quiet(self, holds_sessions: Callable[[], bool] | None) -> None:
        """On a fully idle pass with nothing in flight (no deposit, no
        preparation, no request of an SGLang session held), once enough pages
        came, collect and freeze the heap (``IdleFreezer``): full collections
        then skip KVCR's page objects. ``holds_sessions`` is asked last."""
        pages = self.stats.offload_pages + self.stats.prepared_pages
        queue = self.offloader.queue
        busy = queue.has_deferred or queue.deposits_in_flight
        if not self.freezer.due(pages) or busy or not self.preparations.quiet:
            return
        if holds_sessions is None or not holds_sessions():
            self.freezer.maybe_freeze(pages)

    # ---- flush and close -----------------------------------------------------------

    def reset(self) -> None:
        """Flush: drop every claim and preparation and rebuild an empty KVCR."""
        timeout = self.config.owner_wait_timeout_s
        loads_quiet, claims = self.restorer.quiesce(timeout)
        staging_quiet = self.offloader.quiesce(timeout)
        self._release_all(claims)
        identity = self.weights.take_pending()
        if identity is not None:
            # New weights: a new digest, so no peer (or old page) of the old
            # weights ever matches a key of the new ones.
            self.layout = self.layout.with_identity(identity)
        self.offloader.reset(staging_quiet, self.layout)
        self.preparations.reset()
        self.replicas.reset()
        self.residency.reset(self.layout)
        try:
            self.session.flush(self.layout, loads_quiet, timeout)
        except Exception as exc:  # the next KVCR did not start: recompute for now
            if not self.recovery.down:
                self._go_down(f"no KVCR after the flush: {exc!r}")
            return
        finally:
            self.freezer.thaw()  # the old core's objects: collectable again
        if self.recovery.down:
            self.recovery.came_up(restarted=False)
            logger.info(
                "KVCR is up again after the flush: agent=%s", self.session.agent
            )

    def close(self) -> None:
        try:
            timeout = self.config.owner_wait_timeout_s
            stopped, claims = self.restorer.quiesce(timeout)
            stopped = self.restorer.close(timeout) and stopped
            stopped = self.offloader.close(timeout) and stopped
            self._release_all(claims)
            self.report.tick(force=True)
            try:
                quiet = self._adapter.close() and stopped
            except Exception as exc:  # failed or stuck: its DRAM may not be idle
                logger.error("KVCR close at shutdown was not clean: %s", exc)
                quiet = False
            # After KVCR: its deposits' copy ops wait for their copies while closing.
            quiet = self.copier.close(timeout) and quiet
            if quiet:
                self.restorer.close_span()
            self.dram.close(quiet, self.offloader.staging_buffers())
        finally:
            self.freezer.thaw()  # whatever raised: nothing stays frozen by us

    def is_quiescent(self) -> bool:
        """Nothing in flight: no claims held, no restore batch, no offload."""
        return (
            self.claims_outstanding() == 0
            and self.restorer.is_quiescent()
            and len(self.offloader.queue) == 0
        )

    def claims_outstanding(self) -> int:
        """Residency claims KVCR holds for this linker (what it must release)."""
        return self._adapter.claims_outstanding()

    def claims_held(self) -> int:
        return self.preparations.gauges().claims_held

    def quarantined_bytes(self) -> int:
        return self.dram.quarantine.bytes()

    def _release_all(self, claims: list[ClaimId] | None = None) -> None:
        self.session.release([*(claims or ()), *self.preparations.release_all()])
        self._adapter.wait_idle(self.config.owner_wait_timeout_s)
        self._route()

    # ---- recovery ------------------------------------------------------------------

    @property
    def kvcr_down(self) -> bool:
        """KVCR is gone: every request is recomputed until a restart."""
        return self.recovery.down

    def _watch_kvcr(self, may_restart: bool) -> None:
        """After each pump: go DOWN when KVCR failed; restart it when due and safe,
        and only from the once-a-step pump (``may_restart``): a restart between a
        request's lookup and its load would drop the claims the load needs."""
        if self.copier.wedged:  # the device is wedged: down for good
            if not self.recovery.down:
                failed = self.offloader.queue.fail_pending()  # never answered
                self._go_down(
                    f"the DRAM copier's stream stalled, {failed} offloads failed; "
                    "the device is wedged, no restart"
                )
            return
        if not self.recovery.down:
            if self.session.failed:
                self._go_down(self._failure_cause())
            return
        due = may_restart and self.recovery.due(time.monotonic())
        if due and self._restart_is_safe():
            self._restart()

    def _failure_cause(self) -> str:
        adapter = self._adapter
        if adapter.failed:
            return f"owner thread failed: {adapter.failure!r}"
        if adapter.restart_wanted:
            return "kvcr disabled this worker's source writes until a restart"
        return "the last restart did not start KVCR"

    def _go_down(self, cause: str) -> None:
        self.recovery.went_down(time.monotonic(), cause)
        logger.error(
            "KVCR is down (%s): every request is recomputed; restarting it in %.0f s",
            cause,
            self.recovery.next_attempt - self.recovery.down_since,
        )

    def _restart_is_safe(self) -> bool:
        """No restore reads the old DRAM and no offload result is still pending
        or stored-but-untaken (the old adapter's answers were drained first)."""
        return not self.restorer.has_work and not self.offloader.queue.has_pending

    def _restart(self) -> None:
        self.preparations.release_all()  # the dead KVCR's claims: never sent
        self.preparations.reset()
        self.replicas.reset()
        self.residency.drop_all()  # every rank clears their stored marks
        self.freezer.thaw()  # the dead core's objects: collectable again
        try:
            self.session.restart(self.layout, self.config.owner_wait_timeout_s)
        except Exception as exc:
            backoff = self.recovery.attempt_failed(time.monotonic())
            logger.error(
                "KVCR restart %d failed (%r); next try in %.0f s",
                self.recovery.attempts,
                exc,
                backoff,
            )
            return
        down_s = time.monotonic() - self.recovery.down_since
        self.recovery.came_up(restarted=True)
        logger.info(
            "KVCR restarted after %.1f s down: agent=%s endpoint=%s",
            down_s,
            self.session.agent,
            self.session.endpoint,
        )
