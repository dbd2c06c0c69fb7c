"""Where the zero-hit time goes (``--stage-split``): ``serving.request_stages``
reads SGLang's request timestamps (``--enable-metrics``) into stages,
``zero_hit_stages`` pairs kvcr's stages with no linker's round by round and turns
what kvcr adds outside the forward window into the informational
``zero_hit_ttft_ratio_outside_forward``, and ``metrics.paired_ci`` bounds a
median paired difference. Without the flag the bench reports none of it."""

from __future__ import annotations

import argparse
import random

import pytest

from kvcr_drivers.bench import micro, zero_hit_stages
from kvcr_drivers.bench.metrics import median_difference, paired_ci
from kvcr_drivers.bench.serving import STAGE_MARKS, request_stages
from kvcr_drivers.bench.serving_micro import server_args, zero_hit_details

T0 = 1796559579.0


def meta_of(gaps_ms: list[float]) -> dict[str, float]:
    """SGLang's meta_info marks, ``gaps_ms`` apart, after ``T0``."""
    marks, t = {}, T0
    for name, gap in zip(STAGE_MARKS, [0.0, *gaps_ms], strict=True):
        t += gap / 1000.0
        marks[name] = t
    return {"prompt_tokens": 1024, **marks}


def test_request_stages_are_the_gaps_between_sglangs_marks_in_order():
    stages = request_stages(meta_of([0.5, 1.25, 48.0, 3.5]))
    assert stages == pytest.approx(
        {
            "tokenizer": 0.5,
            "before_forward": 1.25,
            "forward": 48.0,
            "after_forward": 3.5,
        },
        abs=1e-3,
    )


@pytest.mark.parametrize("missing", STAGE_MARKS)
def test_a_server_without_every_mark_gives_no_stages(missing):
    meta = meta_of([0.5, 1.0, 48.0, 3.0])
    assert request_stages({k: v for k, v in meta.items() if k != missing}) is None
    assert request_stages({**meta, missing: 0.0}) is None  # unset: SGLang's 0.0


def rounds_with(
    before: float,
    after: float,
    n: int = 80,
    seed: int = 1,
    mode: float | None = None,
    tokenizer: float = 0.0,
) -> list[dict]:
    """Rounds whose forward swings by tens of ms (unrelated per arm) while kvcr
    adds ``tokenizer`` ms in the tokenizer, ``before`` ms ahead of the forward and
    ``after`` ms behind it (and a null-linker arm, when ``mode`` is given, ``mode``
    ms ahead of the forward)."""
    rng = random.Random(seed)
    rounds = []
    arm_extras = [("none", (0.0, 0.0, 0.0)), ("kvcr", (tokenizer, before, after))]
    if mode is not None:
        arm_extras.append(("null_linker", (0.0, mode, 0.0)))
    for _ in range(n):
        base = [
            rng.uniform(0.4, 0.6),
            rng.uniform(0.9, 1.3),
            0.0,
            rng.uniform(2.5, 4.5),
        ]
        arms = {}
        for name, extra in arm_extras:
            gaps = [
                base[0] + extra[0],
                base[1] + extra[1],
                rng.uniform(38, 70),
                base[3] + extra[2],
            ]
            meta_stages = request_stages(meta_of(gaps))
            ttft = sum(gaps) + 2.0
            arms[name] = {"ttft_ms": ttft, "cached_tokens": 0, "stages_ms": meta_stages}
        rounds.append({"external_busy": 0.0, "samples": arms})
    return rounds


def args_for(prompts: int, split: bool = True) -> argparse.Namespace:
    return argparse.Namespace(
        quiet_round_busy=0.5, ttft_prompts=prompts, stage_split=split
    )


def test_the_added_time_outside_the_forward_is_found_through_a_noisy_forward():
    split = zero_hit_stages.stage_split(rounds_with(0.5, 0.3, tokenizer=0.2))
    assert split["rounds"] == 80
    outside = split["outside_forward"]
    assert outside["added_ms"] == pytest.approx(1.0, abs=0.01)
    low, high = outside["added_ms_ci90"]
    assert 0.98 < low <= high < 1.02
    assert split["tokenizer"]["added_ms"] == pytest.approx(0.2, abs=0.01)
    assert split["before_forward"]["added_ms"] == pytest.approx(0.5, abs=0.01)
    assert split["after_forward"]["added_ms"] == pytest.approx(0.3, abs=0.01)
    f_low, f_high = split["forward"]["added_ms_ci90"]
    assert f_low < 0.0 < f_high and f_high - f_low > 3.0  # noise, and it says so


def test_the_metric_is_informational_and_its_ratio_is_the_added_time_over_the_median():
    rounds = rounds_with(0.6, 0.0)
    args = args_for(80)
    details: dict = {}
    metrics: list[dict] = []
    zero_hit_details(args, details, rounds, ["none", "kvcr"], metrics)
    (m,) = [m for m in metrics if m["name"] == zero_hit_stages.NAME]
    base = details["median_ttft_ms"]["none"]
    assert m["baseline"] == pytest.approx(base, abs=1e-3)
    assert m["added_ms"] == pytest.approx(0.6, abs=0.01)
    assert m["ratio"] == pytest.approx((base + 0.6) / base, abs=2e-4)
    low, high = m["ratio_ci90"]
    # The baseline's median moves with the rounds drawn; the 0.6 ms does not.
    assert 1.0 < low <= m["ratio"] <= high < 1.0 + 0.6 / (base - 3.0)
    assert 3e-4 < high - low < 0.001  # the baseline's own spread counts
    assert m["target"] is None and m["passed"] is None
    assert m["quiet_rounds"] == 80 and m["noisy"] is False
    kvcr_stages = details["kvcr"]["stages_ms"]
    assert (
        len(kvcr_stages) == 80
        and kvcr_stages[0] == rounds[0]["samples"]["kvcr"]["stages_ms"]
    )
    assert set(m["stages"]) == {
        "tokenizer",
        "before_forward",
        "forward",
        "after_forward",
    }
    assert details["stages"]["rounds"] == 80


def test_with_a_null_linker_arm_the_split_also_says_what_kvcr_adds_over_it():
    rounds = rounds_with(0.7, 0.0, mode=0.3)
    args = args_for(80)
    details: dict = {}
    zero_hit_details(args, details, rounds, ["none", "null_linker", "kvcr"], [])
    over = details["stages_vs_sglang_linker_mode"]["before_forward"]["added_ms"]
    assert over == pytest.approx(0.4, abs=0.01)
    assert details["stages"]["before_forward"]["added_ms"] == pytest.approx(
        0.7, abs=0.01
    )
    details = {}
    zero_hit_details(args, details, rounds_with(0.7, 0.0), ["none", "kvcr"], [])
    assert "stages_vs_sglang_linker_mode" not in details


def test_the_split_uses_only_the_rounds_the_ratio_uses():
    quiet = rounds_with(0.5, 0.0, n=30, seed=2)
    busy = rounds_with(9.0, 9.0, n=40, seed=3)  # a majority, were they counted
    for r in busy:
        r["external_busy"] = 0.9
    metrics: list[dict] = []
    zero_hit_details(args_for(30), {}, quiet + busy, ["none", "kvcr"], metrics)
    (m,) = [m for m in metrics if m["name"] == zero_hit_stages.NAME]
    assert m["samples"] == 30
    assert m["added_ms"] == pytest.approx(0.5, abs=0.01)


def test_without_the_flag_there_is_no_split_and_no_metric():
    details: dict = {}
    metrics: list[dict] = []
    rounds = rounds_with(0.5, 0.0, n=20)
    zero_hit_details(
        args_for(20, split=False), details, rounds, ["none", "kvcr"], metrics
    )
    assert [m["name"] for m in metrics] == ["zero_hit_ttft_ratio"]
    assert "stages" not in details and "stages_ms" not in details["kvcr"]


def test_the_split_is_per_round_and_needs_two_rounds():
    def sample(before: float) -> dict:
        stages = {"tokenizer": 0.5, "before_forward": before, "forward": 40.0}
        return {"ttft_ms": 50.0, "stages_ms": {**stages, "after_forward": 3.0}}

    rounds = [
        {"samples": {"kvcr": sample(k), "none": sample(n)}}
        for k, n in ((1.0, 1.0), (20.0, 0.0), (0.0, 0.0))
    ]
    # Round by round kvcr added 0, 20 and 0 ms: 0, where the medians differ by 1.
    split = zero_hit_stages.stage_split(rounds)
    assert split["before_forward"]["added_ms"] == 0.0
    assert zero_hit_stages.stage_split(rounds[:1]) is None


def test_servers_without_stages_give_an_error_metric_not_a_figure():
    rounds = rounds_with(0.5, 0.0, n=10)
    for r in rounds:
        for sample in r["samples"].values():
            sample["stages_ms"] = None
    metrics: list[dict] = []
    zero_hit_details(args_for(10), {}, rounds, ["none", "kvcr"], metrics)
    (m,) = [m for m in metrics if m["name"] == zero_hit_stages.NAME]
    assert m["value"] is None and "--enable-metrics" in m["error"]


def test_a_median_difference_interval_of_a_fixed_offset_is_a_point_and_unpaired_lists_are_refused():
    rng = random.Random(4)
    base = [rng.uniform(40, 70) for _ in range(50)]
    assert paired_ci(
        [x + 0.25 for x in base], base, median_difference
    ) == pytest.approx((0.25, 0.25))
    with pytest.raises(ValueError, match="paired"):
        paired_ci([1.0, 2.0], [1.0], median_difference)


def test_the_difference_is_taken_round_by_round_before_the_median():
    # Differences 0, 20, 0 (median 0) where the medians differ by 1 ...
    assert median_difference([1.0, 20.0, 0.0], [1.0, 0.0, 0.0]) == 0.0
    # ... and 5, -25, 1 (median 1) where they differ by -24.
    assert median_difference([5.0, 5.0, 30.0], [0.0, 30.0, 29.0]) == 1.0


def test_only_the_flag_starts_the_servers_with_sglangs_metrics():
    args = argparse.Namespace(ttft_page_size=16, ttft_prompt_len=1024)
    assert "--enable-metrics" not in server_args(args, 8192)
    args.stage_split = True
    assert server_args(args, 8192)[-1] == "--enable-metrics"


def test_a_failed_serving_section_reports_the_split_metric_only_with_the_flag():
    names = ("zero_hit_ttft_ratio",)
    off = argparse.Namespace(stage_split=False)
    on = argparse.Namespace(stage_split=True)
    assert micro.section_metrics("serving", names, off) == names
    assert micro.section_metrics("serving", names, on)[-1] == zero_hit_stages.NAME
    assert zero_hit_stages.NAME not in micro.metric_names("cpu")
