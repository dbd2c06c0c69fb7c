"""The fast scenarios in ``make test``'s order: every in-process scenario, then the
peer group (its children spawned first, so their imports overlap with the
in-process work), then the allowlist scenario with the peer group's positive
control."""

from __future__ import annotations

from collections.abc import Callable

from kvcr_drivers.faults import local
from kvcr_drivers.faults.common import Scenario, run_scenario
from kvcr_drivers.faults.copy_fault import scenario_failed_device_copy_mid_layer
from kvcr_drivers.faults.peer_scenarios import run_peer_scenarios
from kvcr_drivers.faults.peers import PeerChildren

IN_PROCESS: dict[str, Callable[[Scenario], None]] = {
    "stale_hint": local.scenario_stale_hint,
    "preparation_deadline_late_completions": (
        local.scenario_preparation_deadline_late_completions
    ),
    "failed_device_copy_mid_layer": scenario_failed_device_copy_mid_layer,
    "reset_during_inflight": local.scenario_reset_during_inflight,
    "reset_during_inflight_staged": lambda sc: local.scenario_reset_during_inflight(
        sc, "staged"
    ),
    "capacity_exhausted": local.scenario_capacity_exhausted,
    "offload_backpressure": local.scenario_offload_backpressure,
    "offload_backpressure_staged": lambda sc: local.scenario_offload_backpressure(
        sc, "staged"
    ),
}


def run_fast_scenarios(names: list[str] | None = None) -> list[Scenario]:
    """Every in-process scenario and the peer group, in the order ``make test`` uses."""
    children = PeerChildren.spawn()  # imports overlap with the in-process work
    results = []
    try:
        for name, body in IN_PROCESS.items():
            if names is None or name in names:
                results.append(run_scenario(name, body))
        peers = run_peer_scenarios(children)
    finally:
        children.close()
    control = next(s for s in peers if s.name == "unreachable_peer_close_retained")
    if names is None or "hint_outside_allowlist" in names:
        results.append(
            run_scenario(
                "hint_outside_allowlist",
                lambda sc: local.scenario_hint_outside_allowlist(
                    sc, control.details or None
                ),
            )
        )
    return results + peers
