"""Where a cold request's added time goes (``--stage-split``): the zero-hit TTFT
split by SGLang's own request timestamps (``serving.request_stages``: tokenizer,
before the forward, the forward window, after it), kvcr against no linker (and
against SGLang's linker mode alone, the null linker, when that control ran), round
by round.

On a small shared host one TTFT sample moves by a third from round to round (the
same 1024-token prefill: 38-120 ms end to end), most of it inside the forward
window, so a 2% ratio of
medians cannot be placed from 120 rounds (``ratio_ci90``). The stages outside
that window are short: the median of their paired differences is a lower bound on
what the linker adds to every cold request. Not the whole of it: SGLang's forward
window (from ``forward_entry_time``) also holds building the batch, the linker's
load start and finish, and whatever kvcr's threads take from the forward's cores.
``zero_hit_ttft_ratio_outside_forward`` is the informational ratio of no
linker's median TTFT plus that difference to the median itself. It is a
measurement by parts, not the target: the target stays the end-to-end
``zero_hit_ttft_ratio``, measured without ``--stage-split``, since
``--enable-metrics`` also turns kvcr's own Prometheus exporter on in its arm.
"""

from __future__ import annotations

import statistics
from typing import Any

from kvcr_drivers.bench.metrics import median_difference, metric, paired_ci
from kvcr_drivers.bench.serving import STAGES

NAME = "zero_hit_ttft_ratio_outside_forward"
OUTSIDE = tuple(s for s in STAGES if s != "forward")
MIN_ROUNDS = 2


def _pairs(used: list[dict[str, Any]], arm: str, base: str) -> list[tuple[Any, Any]]:
    """(arm's sample, base's sample) of every round whose two samples carry stages."""
    return [
        (r["samples"][arm], r["samples"][base])
        for r in used
        if arm in r["samples"]
        and base in r["samples"]
        and r["samples"][arm].get("stages_ms")
        and r["samples"][base].get("stages_ms")
    ]


def outside(sample: dict[str, Any]) -> float:
    """A sample's milliseconds in the stages outside the forward window."""
    return sum(sample["stages_ms"][s] for s in OUTSIDE)


def stage_split(
    used: list[dict[str, Any]], arm: str = "kvcr", base: str = "none"
) -> dict[str, Any] | None:
    """Per stage (and ``outside_forward``, the per-round sum of the others),
    ``arm``'s median paired difference from ``base`` in ms with its 90% bootstrap
    interval; None when fewer than ``MIN_ROUNDS`` rounds carry stages on both."""
    pairs = _pairs(used, arm, base)
    if len(pairs) < MIN_ROUNDS:
        return None
    split: dict[str, Any] = {"rounds": len(pairs)}
    columns = {
        s: (
            [a["stages_ms"][s] for a, _ in pairs],
            [b["stages_ms"][s] for _, b in pairs],
        )
        for s in STAGES
    }
    columns["outside_forward"] = (
        [outside(a) for a, _ in pairs],
        [outside(b) for _, b in pairs],
    )
    for name, (a, b) in columns.items():
        low, high = paired_ci(a, b, median_difference)
        split[name] = {
            "added_ms": round(median_difference(a, b), 4),
            "added_ms_ci90": [round(low, 4), round(high, 4)],
            f"{base}_ms": round(statistics.median(b), 4),
        }
    return split


def by_parts_ratio(arm: list[dict[str, Any]], base: list[dict[str, Any]]) -> float:
    """(base's median TTFT + the median paired outside-forward difference) /
    base's median TTFT, over paired samples."""
    base_ttft = statistics.median(b["ttft_ms"] for b in base)
    added = median_difference([outside(a) for a in arm], [outside(b) for b in base])
    return (base_ttft + added) / base_ttft


def stage_metric(
    used: list[dict[str, Any]], split: dict[str, Any] | None, **fields: Any
) -> dict[str, Any]:
    """The informational ``NAME`` metric (an error metric when the servers
    reported no stages). Its ``ratio_ci90`` resamples the rounds for the baseline's
    median TTFT and the added time together."""
    if split is None:
        return metric(
            NAME,
            None,
            "ms",
            error="the servers reported no request stages (--enable-metrics)",
            **fields,
        )
    pairs = _pairs(used, "kvcr", "none")
    arm, base = [a for a, _ in pairs], [b for _, b in pairs]
    base_ttft = statistics.median(b["ttft_ms"] for b in base)
    low, high = paired_ci(arm, base, by_parts_ratio)
    return metric(
        NAME,
        base_ttft * by_parts_ratio(arm, base),
        "ms",
        base_ttft,
        added_ms=split["outside_forward"]["added_ms"],
        added_ms_ci90=split["outside_forward"]["added_ms_ci90"],
        ratio_ci90=[round(low, 4), round(high, 4)],
        forward_added_ms=split["forward"]["added_ms"],
        forward_added_ms_ci90=split["forward"]["added_ms_ci90"],
        stages={s: split[s]["added_ms"] for s in STAGES},
        samples=split["rounds"],
        **fields,
    )


def add_split(
    details: dict[str, Any],
    used: list[dict[str, Any]],
    names: list[str],
    metrics: list[dict[str, Any]],
) -> None:
    """Every arm's per-round stages (the report's own record), the split against
    no linker (and the null linker when it ran) and the ``NAME`` metric."""
    for name in names:
        details.setdefault(name, {})["stages_ms"] = [
            r["samples"][name].get("stages_ms") for r in used
        ]
    details["stages"] = stage_split(used)
    if "null_linker" in names:  # what kvcr adds over SGLang's linker mode alone
        details["stages_vs_sglang_linker_mode"] = stage_split(used, base="null_linker")
    metrics.append(
        stage_metric(
            used,
            details["stages"],
            quiet_rounds=details.get("quiet_rounds"),
            noisy=details.get("noisy"),
        )
    )
