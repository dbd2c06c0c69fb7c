"""Building a real KVCR, and saying why it failed to start.

``make_kvcr_factory`` returns the factory the owner thread calls (every KVCR
call runs there): it opens the peer control channel (on ``control_port`` + the
rank's offset, or on a port the OS picks, bound before anyone can take it; with
an inbound guard from control_auth), builds the KVCR and returns it with its
endpoint as a ``BuiltKVCR``. ``startup_remedy`` turns the start-up failures whose
cause lies outside this package (a taken port, no UCX plugin, no GPUDirect RDMA,
a bad UCX setting) into a one-line fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from sglang.srt.mem_cache.storage.kvcr.config.linker_config import KVCRLinkerConfig
from sglang.srt.mem_cache.storage.kvcr.fleet.control_auth import InboundGuard
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import KeyAdapter, PageLayout
from sglang.srt.mem_cache.storage.kvcr.owner import kvcr_patches
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_commands import Callbacks
from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import page_fills

if TYPE_CHECKING:
    from sglang.srt.mem_cache.storage.kvcr.owner.quarantine import KVCRDram


@dataclasses.dataclass(frozen=True, slots=True)
class BuiltKVCR:
    """A started KVCR and the control endpoint peers reach it at."""

    kvcr: Any
    endpoint: str


# One line each: what failed, and the setting that fixes it.
_REMEDY_PORT = (
    "; control_port (+ attention rank) is already in use on this host: give each "
    "worker a free range of control_port values, or set control_port to 0"
)
_REMEDY_NO_UCX = (
    "; NIXL has no usable UCX backend (its plugin is missing or failed to load): "
    "unset NIXL_PLUGIN_DIR or point it at nixl's plugins, and reinstall "
    "nixl==1.5.0 (nixl-cu12/nixl-cu13)"
)
_REMEDY_REGISTRATION = (
    "; UCX could not register KVCR's host DRAM (ibv_reg_mr in the UCX log): raise "
    "the locked-memory limit (ulimit -l / the container's memlock), lower "
    "local_dram_bytes_per_worker, or set UCX_TLS=tcp to leave RDMA out"
)
_REMEDY_UCX_START = (
    "; the NIXL UCX backend failed to start (the UCX ERROR lines say why): "
    "UCX_TLS must include tcp, and UCX_NET_DEVICES must name existing devices"
)


def startup_remedy(exc: BaseException) -> str:
    """A one-line fix for the startup failures whose cause lies outside this package.

    NIXL reports most of them as a bare status (``NIXL_ERR_BACKEND``), so the nixl
    call that raised it (``register_memory`` or ``create_backend``, read from the
    traceback) tells a missing plugin, a failed registration and a bad UCX
    setting apart; any other failure gets no remedy.
    """
    message = str(exc)
    nixl_calls = _nixl_calls(exc)
    if "Address already in use" in message:
        return _REMEDY_PORT
    if "No plugins available for NIXL" in message or (
        "NIXL_ERR_NOT_FOUND" in message and "register_memory" in nixl_calls
    ):
        return _REMEDY_NO_UCX
    if ("ibv_reg_mr" in message and "Bad address" in message) or (
        "NIXL_ERR_BACKEND" in message and "register_memory" in nixl_calls
    ):
        return _REMEDY_REGISTRATION
    if "NIXL_ERR_BACKEND" in message and "create_backend" in nixl_calls:
        return _REMEDY_UCX_START
    return ""


def _nixl_calls(exc: BaseException) -> set[str]:
    """Names of the nixl functions on the tracebacks of ``exc`` and its causes."""
    names: set[str] = set()
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        tb = cause.__traceback__
        while tb is not None:
            if str(tb.tb_frame.f_globals.get("__name__", "")).startswith("nixl"):
                names.add(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        cause = cause.__cause__ or cause.__context__
    return names


def make_kvcr_factory(
    *,
    agent_name: str,
    pool_layouts: Sequence[tuple[str, int]],
    local_dram_pools: Sequence[tuple[str, int, int]],
    key_adapter: Any,
    control_bind_host: str,
    control_advertise_host: str,
    control_port: int,
    operation_timeout_ms: int,
    abandon_timeout_ms: int,
    eviction_policy: str,
    nixl_progress_thread: bool,
    progress_idle_ms: int = 0,
    inbound_guard: Any = None,
    local_copier: Any = None,
) -> Callable[[Callbacks], BuiltKVCR]:
    """A factory that builds the real KVCR on the owner thread; with an
    ``inbound_guard`` (``control_auth.InboundGuard``) its control channel checks
    who connects; its deposits are filled by ``local_copier``
    (``datapath.dram_copy.DramCopier``, ``kvcr_patches.page_fills``): no framework
    memory is registered with it."""

    def build(callbacks: Callbacks) -> BuiltKVCR:
        kvcr_patches.configure(progress_idle_ms)
        _install_peer_checks()  # refuses a kvcr whose internals differ
        page_fills.install()  # refuses a kvcr whose internals differ
        from kvcr import KVCR, KVCRBindings
        from kvcr.config import KVCRBackendConfigs, KVCRConfig, LocalDramOptions
        from kvcr.control_channels import ZmqPeerControlChannel
        from kvcr.policy import FIFOPolicy, LRUPolicy

        channel_cls: Any = ZmqPeerControlChannel
        if inbound_guard is not None:
            channel_cls = functools.partial(
                kvcr_patches.guarded_channel_class(), guard=inbound_guard
            )
        if control_port:
            control = channel_cls(
                control_bind_host, control_port, control_advertise_host
            )
        else:
            control = _channel_on_own_port(
                channel_cls, control_bind_host, control_advertise_host
            )
        policy = LRUPolicy() if eviction_policy == "lru" else FIFOPolicy()
        kv: Any = None
        try:
            with kvcr_patches.nixl_agent_settings(nixl_progress_thread):
                kv = KVCR(
                    KVCRConfig(
                        nixl_agent_name=agent_name,
                        pool_layouts=list(pool_layouts),
                        operation_timeout_ms=operation_timeout_ms,
                        abandon_timeout_ms=abandon_timeout_ms,
                        nixl_listen_port=0,
                    ),
                    KVCRBindings(
                        request_pin=callbacks.request_pin,
                        poll_pin_results=callbacks.poll_pin_results,
                        release_pin=callbacks.release_pin,
                        framework_control=control,
                        key_adapter=key_adapter,
                        inventory_sink=callbacks.inventory_sink,
                        policy=policy,
                        on_resilience_event=callbacks.on_resilience_event,
                    ),
                    KVCRBackendConfigs(
                        local_dram=LocalDramOptions(pools=list(local_dram_pools)),
                    ),
                )
            kvcr_patches.pace(kv, progress_idle_ms)  # its own, whatever others set
            if local_copier is not None:
                page_fills.attach(kv, local_copier)  # before any deposit
            return BuiltKVCR(kv, str(control.endpoint))
        except BaseException:
            if kv is not None:  # built, then refused (attach): not left running
                with contextlib.suppress(Exception):
                    kv.close()
            close = getattr(control, "close", None)
            if close is not None:
                close()
            raise

    return build


def _install_peer_checks() -> None:
    """kvcr's peer checks (kvcr_patches): a pull's completion only from the agent
    it was sent to, bounded write-probe fences, the DRAM of failed fetches
    counted. Each raises when kvcr's internals are not 0.1.1's."""
    from sglang.srt.mem_cache.storage.kvcr.owner.kvcr_patches import (
        completion_senders,
        probe_fences,
        unresolved_fills,
    )

    for patch in (completion_senders, probe_fences, unresolved_fills):
        patch.install()


def _channel_on_own_port(channel_cls: Any, bind_host: str, advertise_host: str) -> Any:
    """A control channel on a port the OS picks, bound before anyone can take it.

    Picking a free port, closing it and letting the channel bind it later races
    with every other process doing the same (KVCR startup then fails with
    "Address already in use"); the channel adopts this listener instead.
    """
    import socket

    listener = socket.create_server((bind_host, 0))
    try:
        channel = channel_cls(bind_host, int(listener.getsockname()[1]), advertise_host)
        channel.adopt_listener(listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the channel owns the descriptor now
    return channel


def factory_args(
    layout: PageLayout,
    cfg: KVCRLinkerConfig,
    control_port: int,
    dram: KVCRDram,
    local_copier: Any = None,
) -> dict[str, Any]:
    """``make_kvcr_factory``'s arguments but the agent name (per incarnation)."""
    return {
        "pool_layouts": layout.kvcr_pool_layouts(),
        "local_dram_pools": layout.local_dram_regions(list(dram.storage.values())),
        "key_adapter": KeyAdapter(layout),
        "control_bind_host": cfg.control_bind_host,
        "control_advertise_host": cfg.advertise_host,
        "control_port": control_port,
        "operation_timeout_ms": cfg.operation_timeout_ms,
        "abandon_timeout_ms": cfg.abandon_timeout_ms,
        "eviction_policy": cfg.eviction_policy,
        "nixl_progress_thread": cfg.nixl_progress_thread,
        "progress_idle_ms": cfg.idle_sleep_ms,
        "inbound_guard": InboundGuard.from_config(cfg),
        "local_copier": local_copier,
    }
