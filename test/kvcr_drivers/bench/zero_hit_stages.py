"""Where a cold request's added time goes: the zero-hit TTFT split by SGLang's own
request timestamps (``serving.request_stages``: tokenizer, before the forward,
the forward, after it), kvcr against no linker, round by round.

On a small shared host one TTFT sample moves by a third from round to round, most
of it inside the forward (the same prefill, 38-70 ms), so a 2% ratio of medians
cannot be placed from 120 rounds (``ratio_ci90``). The stages outside the forward
are short and steady: their paired difference is what the linker deterministically
adds to every cold request. ``zero_hit_ttft_ratio_outside_forward`` is the
informational ratio of no linker's median TTFT plus that difference to the median
itself, with the forward's own paired difference and every interval beside it.
It is a measurement by parts, not the target: the target stays the end-to-end
``zero_hit_ttft_ratio``.
"""

from __future__ import annotations

import statistics
from typing import Any

from kvcr_drivers.bench.metrics import difference_ci, median_difference, metric
from kvcr_drivers.bench.serving import STAGES

NAME = "zero_hit_ttft_ratio_outside_forward"
OUTSIDE = tuple(s for s in STAGES if s != "forward")


def stage_split(
    used: list[dict[str, Any]], arm: str = "kvcr", base: str = "none"
) -> dict[str, Any] | None:
    """Per stage, ``arm``'s paired median difference from ``base`` in ms with its
    90% bootstrap interval, over rounds whose samples both carry stages; None
    when fewer than two rounds do."""
    pairs = [
        (r["samples"][arm]["stages_ms"], r["samples"][base]["stages_ms"])
        for r in used
        if r["samples"][arm].get("stages_ms") and r["samples"][base].get("stages_ms")
    ]
    if len(pairs) < 2:
        return None
    split: dict[str, Any] = {"rounds": len(pairs)}
    columns = {s: ([a[s] for a, _ in pairs], [b[s] for _, b in pairs]) for s in STAGES}
    columns["outside_forward"] = (
        [sum(a[s] for s in OUTSIDE) for a, _ in pairs],
        [sum(b[s] for s in OUTSIDE) for _, b in pairs],
    )
    for name, (a, b) in columns.items():
        low, high = difference_ci(a, b)
        split[name] = {
            "added_ms": round(median_difference(a, b), 4),
            "added_ms_ci90": [round(low, 4), round(high, 4)],
            f"{base}_ms": round(statistics.median(b), 4),
        }
    return split


def stage_metric(split: dict[str, Any] | None, base_ttft_ms: float) -> dict[str, Any]:
    """The informational ``NAME`` metric from ``stage_split`` and no linker's
    median TTFT (an error metric when the servers reported no stages)."""
    if split is None:
        return metric(
            NAME,
            None,
            "ms",
            error="the servers reported no request stages (--enable-metrics)",
        )
    outside = split["outside_forward"]
    low, high = outside["added_ms_ci90"]
    return metric(
        NAME,
        base_ttft_ms + outside["added_ms"],
        "ms",
        base_ttft_ms,
        added_ms=outside["added_ms"],
        ratio_ci90=[round((base_ttft_ms + x) / base_ttft_ms, 4) for x in (low, high)],
        forward_added_ms=split["forward"]["added_ms"],
        forward_added_ms_ci90=split["forward"]["added_ms_ci90"],
        stages={s: split[s]["added_ms"] for s in STAGES},
        samples=split["rounds"],
    )
