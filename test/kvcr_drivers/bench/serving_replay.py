"""(g) A prompt evicted from the device and replayed from KVCR, against a device
radix-cache hit and against recomputing it, and (h) the write-through of the same
traffic, on the microbench's CPU servers (``kvcr`` and ``none``, taking turns, the
idle one SIGSTOPped).

A round sends each of the two servers, in alternating order, the same fresh seed
prompt P cold, then P again (a device radix-cache hit), then ``fillers`` unique
prompts that cycle the device pool twice (``2 * max_total // prompt_len + 2``,
the rule of kvcr_bench's ``evict_replay``), then P once more. The hit and the
replay each wait ``serving.SETTLE_S`` first, so that neither sample also holds the
write-through of the request before it (on kvcr), only its own work. On ``kvcr`` the
last P is served from KVCR: the linker wrote P's pages through when they were
inserted and the fillers evicted them from the device. On ``none`` (no external
tier) it is recomputed. Every P is checked by the cached tokens the server reports
(``check_round``): the hits were device hits, the kvcr replay came from KVCR and
not the device, the none replay was recomputed; a round that is not so fails the
replay metrics with the reason.

``replay_ttft_vs_device_hit``: median kvcr replay TTFT over median kvcr device-hit
TTFT. ``replay_ttft_vs_recompute``: median kvcr replay TTFT over median none replay
(recompute) TTFT, informational. Round 0 warms the path up and is left out of the
medians.

``write_through_back_to_back``: the fillers run back to back (each sent when the
one before has answered), so on ``kvcr`` each one is served while the
write-through of the one before is still being done (its deposit held for a
batch result, at most 20 ms, or until the scheduler idles: ``BatchHold``), its
scheduling, prefill or output sharing the cores and the GIL with that work, which
the cold P (after a pause) never does. Per server: the median over rounds of
each round's median filler TTFT, over the median cold P TTFT (its slowdown back
to back); the metric is kvcr's slowdown over none's (informational), which
leaves out the per-server offset that a plain kvcr-over-none ratio of two
servers carries (see ``serving_micro``).

``write_through_pages_per_s`` / ``write_through_refusals`` come from these rounds'
unique prefills on the kvcr server (the seeds and fillers, back to back): the
``KVCR_STATS`` deltas (``serving.parse_stats``) from a line logged after the
decode_itl phase, before these rounds, to the first line logged a second or more
after them; pages per second of the time the kvcr server ran in these rounds (it
is SIGSTOPped otherwise; ``offload_pages`` is counted when an offload is issued).
Refusals add up ``offload_failures``, ``refused_offload`` (offload budget) and
``staging_full`` (staged path backpressure): one refused offload may move more
than one of them, so the sum may over-count, never hide one.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from cpu_harness import server as harness
from kvcr_drivers.bench import decode_itl, serving
from kvcr_drivers.bench.metrics import dist, metric, ratio_ci

REPLAY_METRICS = ("replay_ttft_vs_device_hit", "replay_ttft_vs_recompute")
WRITE_THROUGH_METRICS = ("write_through_pages_per_s", "write_through_refusals")
BACK_TO_BACK = "write_through_back_to_back"
# Every metric ``bench_replay`` reports, in report order, with its unit.
UNITS = {
    **dict.fromkeys(REPLAY_METRICS, "ms"),
    **dict(zip(WRITE_THROUGH_METRICS, ("pages/s", "count"), strict=True)),
    BACK_TO_BACK: "x",
}
REFUSAL_FIELDS = ("offload_failures", "refused_offload", "staging_full")
PAGE_FIELDS = ("offloads", "offload_pages", "offloaded_bytes")
HIT_SHARE = 0.9  # of the page-aligned prompt, as kvcr_bench's replay check


def fillers_for(max_total_tokens: int, prompt_len: int) -> int:
    """Unique prompts that cycle a device pool of ``max_total_tokens`` twice."""
    return 2 * max_total_tokens // prompt_len + 2


def check_round(got: dict[str, dict[str, dict[str, Any]]], need: int) -> list[str]:
    """What is wrong with one round's P samples (``{server: {"hit": s, "replay":
    s}}``, each ``serving.stream_ttft``'s record): hits must be device hits of at
    least ``need`` tokens; the kvcr replay must come from KVCR (``need`` tokens or
    more, none from the device); the none replay must be recomputed."""
    wrong = []
    for name, s in got.items():
        hit = s["hit"]
        if hit["cached_tokens"] < need or hit["external_cached_tokens"]:
            wrong.append(
                f"{name}: the second P was not a device hit (cached "
                f"{hit['cached_tokens']}, from KVCR {hit['external_cached_tokens']}, "
                f"need {need} from the device)"
            )
    kvcr, none = got["kvcr"]["replay"], got["none"]["replay"]
    if kvcr["external_cached_tokens"] < need or kvcr["device_cached_tokens"]:
        wrong.append(
            f"kvcr: the replay was not served from KVCR (from KVCR "
            f"{kvcr['external_cached_tokens']}, need {need}; from the device "
            f"{kvcr['device_cached_tokens']}, need 0)"
        )
    if none["cached_tokens"]:
        wrong.append(
            f"none: the replay was not recomputed ({none['cached_tokens']} cached "
            "tokens: the fillers did not evict P)"
        )
    return wrong


def replay_metrics(rounds: list[dict[str, Any]], need: int) -> list[dict[str, Any]]:
    """The two replay metrics from every round (``{"warmup": bool, "samples":
    {server: {"cold", "hit", "replay"}}}``); medians over the rounds that are not
    warm-ups. Any round that fails ``check_round`` (warm-ups included) makes both
    metrics errors that name it."""
    wrong = [
        f"round {i}: {w}"
        for i, r in enumerate(rounds)
        for w in check_round(r["samples"], need)
    ]
    used = [r["samples"] for r in rounds if not r["warmup"]]
    if not used:
        wrong.append("no measured round")
    error = "; ".join(wrong)[:2000] or None

    def ttft(name: str, kind: str) -> list[float]:
        return [s[name][kind]["ttft_ms"] for s in used]

    if not used:
        return [metric(n, None, "ms", error=error) for n in REPLAY_METRICS]
    replay, hit = ttft("kvcr", "replay"), ttft("kvcr", "hit")
    recompute = ttft("none", "replay")
    med = statistics.median
    common = {
        "samples": len(used),
        "replay_ms": replay,
        "replay_external_tokens": [
            s["kvcr"]["replay"]["external_cached_tokens"] for s in used
        ],
        "need_tokens": need,
    }
    return [
        metric(
            "replay_ttft_vs_device_hit",
            med(replay),
            "ms",
            med(hit),
            error=error,
            device_hit_ms=hit,
            pair_ratio=dist([a / b for a, b in zip(replay, hit, strict=True)]),
            ratio_ci90=(
                [round(x, 4) for x in ratio_ci(replay, hit)] if len(used) > 1 else None
            ),
            **common,
        ),
        metric(
            "replay_ttft_vs_recompute",
            med(replay),
            "ms",
            med(recompute),
            error=error,
            recompute_ms=recompute,
            kvcr_cold_ms=ttft("kvcr", "cold"),
            pair_ratio=dist([a / b for a, b in zip(replay, recompute, strict=True)]),
            **common,
        ),
    ]


def back_to_back_metric(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """``write_through_back_to_back`` from every round's samples (each server's
    ``"cold"`` sample and ``"fillers"``, the fillers' ``stream_ttft`` records);
    over the rounds that are not warm-ups. A filler or cold P served from cache,
    or a round without fillers, makes it an error that names it."""
    used = [r["samples"] for r in rounds if not r["warmup"]]
    wrong = [
        f"round {i}: {name} {why}"
        for i, r in enumerate(rounds)
        for name, s in r["samples"].items()
        for why in _unfit(s)
    ]
    if not used:
        wrong.append("no measured round")
    if wrong:
        return metric(
            BACK_TO_BACK, None, UNITS[BACK_TO_BACK], error="; ".join(wrong)[:2000]
        )
    med = statistics.median

    def rounds_of(name: str) -> tuple[list[float], list[float]]:
        b2b = [med(f["ttft_ms"] for f in s[name]["fillers"]) for s in used]
        return b2b, [s[name]["cold"]["ttft_ms"] for s in used]

    (kb, kc), (nb, nc) = rounds_of("kvcr"), rounds_of("none")
    return metric(
        BACK_TO_BACK,
        med(kb) / med(kc),
        UNITS[BACK_TO_BACK],
        med(nb) / med(nc),
        samples=len(used),
        kvcr_back_to_back_ms=kb,
        kvcr_cold_ms=kc,
        none_back_to_back_ms=nb,
        none_cold_ms=nc,
        kvcr_over_none_back_to_back=round(med(kb) / med(nb), 4),
        kvcr_over_none_cold=round(med(kc) / med(nc), 4),
    )


def _unfit(s: dict[str, Any]) -> list[str]:
    """Why one server's round cannot time its prefills back to back, if it
    cannot: every filler and the cold P must be computed, not served from cache."""
    why = [] if s["fillers"] else ["had no filler"]
    if any(f["cached_tokens"] for f in s["fillers"]):
        why.append("served a filler from cache")
    if s["cold"]["cached_tokens"]:
        why.append("served its cold P from cache")
    return why


def stats_delta(before: str, after: str) -> dict[str, int]:
    """The write-through counters moved between two KVCR_STATS lines (a counter
    missing from a line counts as 0 there)."""
    first, last = serving.parse_stats(before), serving.parse_stats(after)
    return {
        k: int(last.get(k, 0) - first.get(k, 0)) for k in PAGE_FIELDS + REFUSAL_FIELDS
    }


def write_through_metrics(
    before: str | None,
    after: str | None,
    running_s: float,
    unique_prefills: int,
) -> list[dict[str, Any]]:
    """``write_through_pages_per_s`` (offload pages over ``running_s``, the time
    the kvcr server ran) and ``write_through_refusals`` (the refusal counters'
    deltas, summed) from the stats lines before and after the traffic."""
    if before is None or after is None:
        error = "no KVCR_STATS line " + ("before" if before is None else "after")
        error += " the replay rounds to count the write-through from"
        return [metric(n, None, UNITS[n], error=error) for n in WRITE_THROUGH_METRICS]
    delta = stats_delta(before, after)
    error = None
    if delta["offload_pages"] <= 0:
        error = "the kvcr server offloaded no page during the replay rounds"
    common = {"unique_prefills": unique_prefills, "running_s": round(running_s, 3)}
    return [
        metric(
            "write_through_pages_per_s",
            delta["offload_pages"] / running_s if running_s > 0 else None,
            "pages/s",
            error=error,
            offload_pages=delta["offload_pages"],
            offloads=delta["offloads"],
            offloaded_bytes=delta["offloaded_bytes"],
            pages_per_prefill=round(
                delta["offload_pages"] / max(1, unique_prefills), 3
            ),
            **common,
        ),
        metric(
            "write_through_refusals",
            sum(delta[k] for k in REFUSAL_FIELDS),
            "count",
            error=error,
            **{k: delta[k] for k in REFUSAL_FIELDS},
            **common,
        ),
    ]


def bench_replay(
    args: argparse.Namespace,
    servers: dict[str, harness.ServerHandle],
    max_total_tokens: int,
    details: dict[str, Any],
    metrics: list[dict[str, Any]],
) -> None:
    """Round 0 (warm-up) and ``--replay-rounds`` rounds on kvcr and none (see the
    module docstring), then the five metrics into ``metrics``."""
    from kvcr_drivers.bench.serving_micro import stats_after  # imports this module

    runs = {name: servers[name] for name in ("none", "kvcr")}
    kvcr = runs["kvcr"]
    prompt_len, vocab = args.ttft_prompt_len, 300
    fillers = fillers_for(max_total_tokens, prompt_len)
    need = int(HIT_SHARE * serving.page_aligned(prompt_len, args.ttft_page_size))
    info: dict[str, Any] = {
        "method": __doc__,
        "prompt_len": prompt_len,
        "max_total_tokens": max_total_tokens,
        "fillers_per_round": fillers,
        "need_tokens": need,
    }
    details["replay"] = info
    # A stats line logged after the decode_itl phase's offloads (else a fresh one):
    # between it and these rounds the kvcr server only saw requests shorter than a
    # page, which offload nothing.
    prior = details.get("decode_itl", {}).get("kvcr_stats_after")
    if prior is None:
        with serving.running(kvcr):
            prior = stats_after(kvcr, time.time(), args.itl_stats_wait_s)
    info["kvcr_stats_before"] = prior
    rounds: list[dict[str, Any]] = []
    running_s = 0.0
    for i in range(1 + args.replay_rounds):
        make = decode_itl.prompt_maker(args.seed + 300 + i, prompt_len, vocab)
        seed, filler = make(), [make() for _ in range(fillers)]
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]
        got: dict[str, dict[str, Any]] = {}
        for name in order:
            server = runs[name]
            t0 = time.monotonic()
            with serving.running(server) as spread:
                t0 += spread  # the settle's varying part: not write-through time
                s = {"cold": serving.stream_ttft(server, seed, 1, timeout=120.0)}
                # The request before each of the hit and the replay (the cold
                # P, the last filler) writes its pages through a few ms after its
                # response, on the same cores: without the pause that deposit ran
                # inside the next sample (run J: a device hit 32.8 ms against a
                # 26.2 ms recompute on the other server).
                time.sleep(serving.SETTLE_S)
                s["hit"] = serving.stream_ttft(server, seed, 1, timeout=120.0)
                # Back to back: each filler served while the write-through of
                # the one before is still being done (write_through_back_to_back).
                s["fillers"] = [
                    serving.stream_ttft(server, ids, 1, timeout=120.0) for ids in filler
                ]
                time.sleep(serving.SETTLE_S)
                s["replay"] = serving.stream_ttft(server, seed, 1, timeout=120.0)
            if name == "kvcr":  # pauses included: the write-throughs run in them
                running_s += time.monotonic() - t0
            got[name] = s
        rounds.append({"warmup": i == 0, "samples": got})
        k, n = got["kvcr"], got["none"]
        print(
            f"[bench] replay round {i}: kvcr hit {k['hit']['ttft_ms']:.1f} ms, "
            f"replay {k['replay']['ttft_ms']:.1f} ms (from KVCR "
            f"{k['replay']['external_cached_tokens']} tokens); none recompute "
            f"{n['replay']['ttft_ms']:.1f} ms (cached {n['replay']['cached_tokens']}); "
            "filler medians: kvcr "
            f"{statistics.median(f['ttft_ms'] for f in k['fillers']):.1f} ms, none "
            f"{statistics.median(f['ttft_ms'] for f in n['fillers']):.1f} ms",
            flush=True,
        )
    ended = time.time()
    with serving.running(kvcr):
        after = stats_after(kvcr, ended + 1.0, args.itl_stats_wait_s)
    info.update(rounds=rounds, kvcr_running_s=round(running_s, 3))
    info["kvcr_stats_after"] = after
    metrics.extend(replay_metrics(rounds, need))
    metrics.extend(
        write_through_metrics(
            None if prior is None else prior[1],
            None if after is None else after[1],
            running_s,
            len(rounds) * (1 + fillers),
        )
    )
    metrics.append(back_to_back_metric(rounds))
