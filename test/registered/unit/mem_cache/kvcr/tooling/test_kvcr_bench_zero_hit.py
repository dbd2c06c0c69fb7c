"""The zero-hit TTFT figure's uncertainty: ``metrics.ratio_ci`` (a paired bootstrap
interval of a ratio of medians) and the ``ratio_ci90`` that
``serving_micro.zero_hit_details`` puts on ``zero_hit_ttft_ratio``. The interval is
what tells a run that missed (or met) 1.02x by a hair from one that could not tell
the two apart on a noisy host."""

from __future__ import annotations

import argparse
import random

import pytest

from kvcr_drivers.bench.metrics import ratio_ci
from kvcr_drivers.bench.serving_micro import zero_hit_details


def noisy(n: int, seed: int, scale: float = 1.0) -> list[float]:
    rng = random.Random(seed)
    return [scale * rng.uniform(40.0, 70.0) for _ in range(n)]


def test_identical_arms_give_a_point_interval_at_one():
    a = noisy(50, 1)
    assert ratio_ci(a, list(a)) == (1.0, 1.0)


def test_a_clear_ten_percent_slowdown_is_bracketed_and_excludes_one():
    base = noisy(120, 2)
    rng = random.Random(3)
    slow = [x * 1.10 * rng.uniform(0.97, 1.03) for x in base]
    low, high = ratio_ci(slow, base)
    assert 1.0 < low < 1.10 < high < 1.2


def test_unrelated_noise_gives_an_interval_wider_than_its_paired_twin():
    base = noisy(120, 4)
    paired = [x * 1.02 for x in base]
    unpaired = noisy(120, 5, scale=1.02)
    p_low, p_high = ratio_ci(paired, base)
    u_low, u_high = ratio_ci(unpaired, base)
    assert p_high - p_low < 0.001  # every resample keeps the 2% exactly
    assert u_high - u_low > 0.03  # independent rounds: the medians wander
    assert u_low < 1.02 < u_high


def test_the_interval_is_reproducible_and_ordered():
    a, b = noisy(80, 6), noisy(80, 7)
    assert ratio_ci(a, b) == ratio_ci(a, b)
    low, high = ratio_ci(a, b, level=0.5)
    wide_low, wide_high = ratio_ci(a, b, level=0.99)
    assert wide_low <= low <= high <= wide_high


@pytest.mark.parametrize("a,b", [([1.0, 2.0], [1.0]), ([1.0], [1.0])])
def test_unpaired_or_single_samples_are_refused(a, b):
    with pytest.raises(ValueError, match="paired"):
        ratio_ci(a, b)


def round_of(ttft: dict[str, float]) -> dict:
    return {
        "external_busy": 0.0,
        "samples": {n: {"ttft_ms": v, "cached_tokens": 0} for n, v in ttft.items()},
    }


def test_zero_hit_metric_carries_an_interval_around_its_ratio():
    none = noisy(60, 8)
    rng = random.Random(9)
    rounds = [
        round_of({"none": x, "kvcr": x * 1.05 * rng.uniform(0.9, 1.1)}) for x in none
    ]
    args = argparse.Namespace(quiet_round_busy=0.5, ttft_prompts=60)
    details: dict = {}
    metrics: list[dict] = []
    zero_hit_details(args, details, rounds, ["none", "kvcr"], metrics)
    (m,) = metrics
    low, high = m["ratio_ci90"]
    assert m["name"] == "zero_hit_ttft_ratio"
    assert low <= m["ratio"] <= high
    assert low < 1.05 < high
    assert high - low < 0.2
