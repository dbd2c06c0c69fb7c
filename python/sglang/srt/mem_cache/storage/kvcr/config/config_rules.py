"""The linker config's ranges and cross-field rules, run on every config built.

``check`` is what ``KVCRLinkerConfig`` runs after construction: every integer
field against its range (in ``INT_RANGES`` order, so a bad timeout is named
before anything derived from it), the flags, the choices, the idle progress
sleep against the operation timeout, the abandon window, the control channel's
hosts, allowlist and CURVE files. A bad value raises one ``KVCRConfigError``
line that names the field and the fix. Stdlib only.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.storage.kvcr.config.value_checks import (
    check_curve_fields,
    config_error,
    is_wildcard,
    parse_allowlist_entry,
    require_host,
    require_int,
)

MAX_MS = 3_600_000  # timeouts: one hour at most, like owner_wait_timeout_s
EVICTION_POLICIES = ("lru", "fifo")
OFFLOAD_PATHS = ("auto", "staged", "direct")

INT_RANGES: dict[str, tuple[int, int | None]] = {  # (minimum, maximum), in order
    "local_dram_bytes_per_worker": (1, None),
    "control_port": (0, 65535),
    "operation_timeout_ms": (1, MAX_MS),
    "abandon_timeout_ms": (1, MAX_MS),
    "preparation_timeout_ms": (1, MAX_MS),
    "prepare_chunk_pages": (1, 1 << 20),
    "local_hit_wait_ms": (0, 1000),
    "offload_hold_batches": (0, 8),
    "idle_offload_wait_us": (0, 20000),
    "idle_offload_delay_us": (0, 20000),
    "gc_freeze_pages": (0, 1 << 30),
    "max_inflight_offload_bytes": (1, None),
    "max_inflight_prepare_bytes": (1, None),
    "max_abandoned_bytes": (1, None),
    "max_claimed_bytes": (0, None),
    "gil_switch_interval_us": (0, 5000),
    "max_quarantined_cores": (0, 64),
}


def check(cfg: Any) -> None:
    """Ranges and cross-field rules of a ``KVCRLinkerConfig``; a bad value raises
    one line naming it."""
    for name, (low, high) in INT_RANGES.items():
        require_int(name, getattr(cfg, name), minimum=low, maximum=high)
    wait = cfg.owner_wait_timeout_s
    if isinstance(wait, bool) or not isinstance(wait, (int, float)):
        raise config_error("owner_wait_timeout_s", "must be a number of seconds")
    if not 0 < wait <= 3600:
        raise config_error("owner_wait_timeout_s", "must be in (0, 3600] seconds")
    for flag in ("nixl_progress_thread", "accept_request_hints"):
        if not isinstance(getattr(cfg, flag), bool):
            raise config_error(flag, "must be true or false")
    if 0 < cfg.gil_switch_interval_us < 50:
        raise config_error(
            "gil_switch_interval_us",
            f"{cfg.gil_switch_interval_us} us would switch threads more often than "
            "they run; use 0 (leave Python's) or at least 50",
        )
    if cfg.progress_idle_ms is not None:  # unset: idle_sleep_ms derives it
        require_int("progress_idle_ms", cfg.progress_idle_ms, minimum=0, maximum=1000)
    if cfg.idle_sleep_ms * 4 > cfg.operation_timeout_ms:
        # kvcr turns this worker's source writes off when its progress loop
        # sleeps as long as an operation's timeout.
        raise config_error(
            "progress_idle_ms",
            f"{cfg.idle_sleep_ms} is over a quarter of operation_timeout_ms="
            f"{cfg.operation_timeout_ms}; lower it (or raise the timeout)",
        )
    if cfg.offload_path not in OFFLOAD_PATHS:
        raise config_error("offload_path", f"must be one of {list(OFFLOAD_PATHS)}")
    if cfg.eviction_policy not in EVICTION_POLICIES:
        raise config_error(
            "eviction_policy", f"must be one of {list(EVICTION_POLICIES)}"
        )
    if cfg.abandon_timeout_ms < 2 * cfg.operation_timeout_ms:
        raise config_error(
            "abandon_timeout_ms",
            f"must be >= 2 x operation_timeout_ms "
            f"({2 * cfg.operation_timeout_ms}); raise it or lower "
            f"operation_timeout_ms",
        )
    require_host("control_bind_host", cfg.control_bind_host)
    require_host("control_advertise_host", cfg.control_advertise_host)
    if not cfg.control_bind_host:
        raise config_error("control_bind_host", "must not be empty")
    if is_wildcard(cfg.control_bind_host) and not cfg.control_advertise_host:
        raise config_error(
            "control_advertise_host",
            f"is required when control_bind_host is {cfg.control_bind_host!r}; "
            f"set it to the address peers should dial",
        )
    if is_wildcard(cfg.control_advertise_host):
        raise config_error(
            "control_advertise_host", "must be a reachable address, not a wildcard"
        )
    allow = cfg.peer_endpoint_allowlist
    if not isinstance(allow, tuple) or not all(isinstance(e, str) for e in allow):
        raise config_error("peer_endpoint_allowlist", "must be a list of strings")
    for entry in allow:
        parse_allowlist_entry(entry)
    check_curve_fields(
        cfg.control_curve_secret_key_file, cfg.control_curve_public_keys_dir
    )
