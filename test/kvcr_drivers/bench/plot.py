"""A picture of a benchmark report: a PNG beside its JSON.

``write_png(report, json_path)`` draws, from a ``kvcr_microbench.py`` or a
``kvcr_bench.py`` report as written, every streaming-TTFT sample per arm (zero-hit
and replay, baseline arms beside the kvcr arm, a median tick on each) and every
restore and offload bandwidth sample beside its baseline's. ``panels`` is the
report-to-data step (no matplotlib); ``render`` returns the Figure, so its
artists can be counted before it is saved. matplotlib is an optional extra
(``pip install 'sglang-kvcr[plot]'``), imported lazily and drawn with the Agg
canvas (no screen, no pyplot state); without it the result says how to get the
picture and nothing else changes. ``python -m kvcr_drivers.bench.plot REPORT.json``
redraws a saved report.
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import random
import statistics
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install 'sglang-kvcr[plot]'"
JITTER = 0.28  # half-width of a strip, in arm positions
LOG_SPAN = 15.0  # a panel whose samples span more than this factor gets a log axis


class Role(enum.Enum):
    BASELINE = "baseline"
    KVCR = "kvcr"
    OTHER = "other"


ROLE_COLORS = {Role.BASELINE: "#7f7f7f", Role.KVCR: "#1f77b4", Role.OTHER: "#ff7f0e"}


class Outcome(enum.Enum):
    WRITTEN = "written"
    NO_MATPLOTLIB = "no_matplotlib"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Arm:
    """One strip of samples; ``in_median`` says which of them the median covers
    (the microbench leaves rounds disturbed by other work out of it)."""

    label: str
    role: Role
    samples: tuple[float, ...]
    in_median: tuple[bool, ...] = ()
    group: str = ""  # arms of one comparison share a group (drawn between rules)

    def median(self) -> float | None:
        kept = [s for s, k in zip(self.samples, self.kept(), strict=True) if k]
        return statistics.median(kept) if kept else None

    def kept(self) -> tuple[bool, ...]:
        return self.in_median or (True,) * len(self.samples)


class Kind(enum.Enum):
    TTFT = "ttft"
    BANDWIDTH = "bandwidth"


@dataclass(frozen=True, slots=True)
class Panel:
    """One axes of samples; its ``note`` (what is missing, or why there is no
    axes at all when it has no arms) is a line of the legend's heading."""

    kind: Kind
    title: str
    ylabel: str
    arms: tuple[Arm, ...]
    note: str = ""


@dataclass(frozen=True, slots=True)
class PlotResult:
    outcome: Outcome
    path: Path
    points: int = 0
    error: str = ""

    def line(self) -> str:
        """The one line a report prints about its picture."""
        if self.outcome is Outcome.WRITTEN:
            return f"PLOT {self.path} ({self.points} samples drawn)"
        if self.outcome is Outcome.NO_MATPLOTLIB:
            return (
                f"PLOT skipped: matplotlib is not installed; for the picture "
                f"{self.path.name} run: {INSTALL_HINT}"
            )
        return f"PLOT failed ({self.error}); the JSON report is complete"


# ---------------------------------------------------------------- report -> data


def _role(name: str) -> Role:
    if name == "kvcr":
        return Role.KVCR
    return Role.BASELINE if name.startswith("none") else Role.OTHER


def _metric(report: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((m for m in report.get("metrics", []) if m["name"] == name), None)


def _verdict(m: dict[str, Any] | None) -> str:
    if not m or m.get("ratio") is None:
        return ""
    result = {True: "PASS", False: "FAIL", None: "info"}[m.get("passed")]
    target = f", target {m['target']}" if m.get("target") else ""
    return f"\nkvcr/baseline median {m['ratio']:.3g}x{target}: {result}"


def _arm(label: str, role: Role, values: Any, group: str) -> Arm:
    return Arm(label, role, tuple(float(v) for v in values), group=group)


# (panel, label, role, key): the copy section's per-rep GB/s lists ...
COPY_ARMS = (
    ("restore", "kvcr restore\ncontiguous", Role.KVCR, "restore_contiguous_gbps"),
    ("restore", "kvcr restore\nscattered", Role.KVCR, "restore_scattered_gbps"),
    ("restore", "torch copy_", Role.BASELINE, "torch_copy_gbps"),
    ("offload", "kvcr offload", Role.KVCR, "offload_gbps"),
    ("offload", "NIXL loopback\nWRITE", Role.BASELINE, "nixl_loopback_gbps"),
)
# ... and each transfer case's (cpu: host-to-host copies; cuda: pinned h2d/d2h).
TRANSFER_ARMS = (
    ("restore", "kvcr restore", Role.KVCR, "restore"),
    ("restore", "host copy_", Role.BASELINE, "h2d"),
    ("offload", "kvcr staged\noffload", Role.KVCR, "offload"),
    ("offload", "host copy_", Role.BASELINE, "d2h"),
)


def micro_panels(report: dict[str, Any]) -> list[Panel]:
    details = report.get("details", {})
    serving = details.get("serving", {})
    busy = serving.get("external_busy", [])
    limit = report.get("config", {}).get("quiet_round_busy", 1.0)
    arms = []
    for name, d in serving.items():
        if not (isinstance(d, dict) and "all_ttft_ms" in d):
            continue
        every = d["all_ttft_ms"]
        quiet = tuple(
            serving.get("noisy", False) or i >= len(busy) or busy[i] <= limit
            for i in range(len(every))
        )
        arms.append(Arm(name, _role(name), tuple(every), quiet))
    zero_hit = Panel(
        Kind.TTFT,
        f"Zero-hit streaming TTFT, {serving.get('prompt_len', '?')}-token prompts"
        + _verdict(_metric(report, "zero_hit_ttft_ratio")),
        "TTFT (ms)",
        tuple(arms),
        "Zero-hit TTFT: no serving section in this report"
        if not arms
        else "Zero-hit TTFT: no round was quiet enough, so every round is in the "
        "median (the report says noisy)"
        if serving.get("noisy")
        else "",
    )
    replay = Panel(
        Kind.TTFT,
        "Replay (restore) TTFT",
        "TTFT (ms)",
        (),
        "Replay (restore) TTFT: make bench has no replay workload; "
        "kvcr_bench.py (evict_replay) measures it",
    )
    copy, transfer = details.get("copy", {}), details.get("transfer", {})
    device = transfer.get("device", "cpu")
    plain = {"h2d": "pinned h2d", "d2h": "pinned d2h"} if device == "cuda" else {}
    arms_of: dict[str, list[Arm]] = {"restore": [], "offload": []}
    for kind, label, role, key in COPY_ARMS:
        if copy.get(key):
            arms_of[kind].append(_arm(label, role, copy[key], "copy section"))
    for case, got in transfer.items():
        if not (case.endswith("p") and isinstance(got, dict) and "gbps" in got):
            continue
        group = f"transfer {case[:-1]} pages ({device})"
        for kind, label, role, key in TRANSFER_ARMS:
            if got["gbps"].get(key):
                label = plain.get(key, label)
                arms_of[kind].append(_arm(label, role, got["gbps"][key], group))
    missing = "no copy or transfer section in this report"
    bandwidth = [
        Panel(
            Kind.BANDWIDTH,
            f"{what} bandwidth vs baselines" + _verdict(_metric(report, headline)),
            "GB/s (one dot per rep)",
            tuple(arms_of[what.lower()]),
            "" if arms_of[what.lower()] else f"{what} bandwidth: {missing}",
        )
        for what, headline in (
            ("Restore", "restore_copy_vs_torch_copy"),
            ("Offload", "offload_vs_nixl_loopback"),
        )
    ]
    return [zero_hit, replay, *bandwidth]


def serving_panels(report: dict[str, Any]) -> list[Panel]:
    configs = report.get("configs", {})
    titles = {
        "zero_hit": "Zero-hit streaming TTFT (unique prompts)",
        "evict_replay": "Replay (restore) TTFT: seed prompt again after fillers",
    }
    out = []
    for workload, title in titles.items():
        arms, skipped = [], []
        for name, r in configs.items():
            if r.get("status") != "ok":
                why = str(r.get("error", ""))[:90]
                skipped.append(
                    f"{name}: {r.get('status')}" + (f" ({why})" if why else "")
                )
                continue
            samples = r.get("samples", {}).get(workload)
            if samples is None:
                continue
            ext = [s.get("external_cached_tokens", 0) for s in samples]
            label = name
            if workload == "evict_replay" and ext:
                label += f"\nfrom ext. cache:\n{int(statistics.median(ext))} tok"
            arms.append(Arm(label, _role(name), tuple(s["ttft_ms"] for s in samples)))
        ratio = report.get("ttft_ratio_vs_none", {}).get(f"kvcr/{workload}")
        suffix = f"\nkvcr/none median {ratio:.3g}x" if ratio else ""
        note = (
            f"Not drawn: {'; '.join(skipped)}"
            if arms and skipped
            else f"{title}: workload not run"
            if not arms
            else ""
        )
        out.append(Panel(Kind.TTFT, title + suffix, "TTFT (ms)", tuple(arms), note))
    bw = report.get("bandwidth", {})
    moved = ", ".join(
        f"{k.replace('_', ' ')} {bw[k] / 2**20:.1f} MiB"
        for k in ("restored_bytes", "offloaded_bytes")
        if bw.get(k) is not None
    )
    note = (
        "Restore and offload bandwidth: not measurable from serving (KVCR_STATS "
        "has bytes, not copy durations); make bench measures both"
        + (f". KVCR_STATS: {moved}" if moved else "")
    )
    out.append(Panel(Kind.BANDWIDTH, "Bandwidth", "GB/s", (), note))
    return out


def panels(report: dict[str, Any]) -> tuple[str, list[Panel]]:
    """(figure title, panels) of either bench's report."""
    config = report.get("config", {})
    if "configs" in report:
        title = (
            f"kvcr_bench.py serving benchmark: device {config.get('device', 'cpu')}, "
            f"page {config.get('page_size')}, prompt {config.get('prompt_len')} "
            f"tokens, {config.get('reps')} reps"
        )
        return title, serving_panels(report)
    if "details" in report:
        versions = report.get("versions", {})
        title = (
            f"make bench (kvcr_microbench.py): device {config.get('device', 'cpu')}, "
            f"{report.get('cpus')} CPUs, quick={bool(config.get('quick'))}; "
            + ", ".join(f"{k} {v}" for k, v in versions.items())
        )
        return title, micro_panels(report)
    raise ValueError(
        "not a benchmark report: expected 'configs' (kvcr_bench.py) or "
        "'details' (kvcr_microbench.py) at the top level"
    )


# ---------------------------------------------------------------- data -> picture


def _draw(ax: Any, panel: Panel) -> None:
    from matplotlib.colors import to_rgba
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_title(panel.title, fontsize=10)
    ax.set_ylabel(panel.ylabel)
    ax.grid(axis="y", alpha=0.3)
    rng = random.Random(0)  # the same jitter every time: reproducible pictures
    for x, arm in enumerate(panel.arms):
        kept = arm.kept()
        color = ROLE_COLORS[arm.role]
        for in_median in (True, False):  # filled: in the median; hollow: left out
            ys = [y for y, k in zip(arm.samples, kept, strict=True) if k is in_median]
            if not ys:
                continue
            ax.scatter(
                [x + rng.uniform(-JITTER, JITTER) for _ in ys],
                ys,
                s=24,
                facecolors=to_rgba(color, 0.7) if in_median else "none",
                edgecolors=to_rgba(color, 0.9),
                linewidths=0.6 if in_median else 1.0,
                zorder=3,
            )
        med = arm.median()
        if med is not None:
            ax.hlines(med, x - 0.4, x + 0.4, colors="black", linewidth=2, zorder=4)
            ax.annotate(f"{med:.3g}", (x + 0.41, med), va="center", fontsize=8)
    ax.set_xticks(
        range(len(panel.arms)), [f"{a.label}\nn={len(a.samples)}" for a in panel.arms]
    )
    ax.tick_params(axis="x", labelsize=8)
    ax.set_xlim(-0.6, len(panel.arms) - 0.1)
    groups = [a.group for a in panel.arms]
    starts = [i for i, g in enumerate(groups) if g and (i == 0 or g != groups[i - 1])]
    for i in starts:
        if i:
            ax.axvline(i - 0.5, color="#999999", ls="--", lw=0.8)
        ax.text(
            i - 0.45,
            1.0,
            f" {groups[i]}",
            transform=ax.get_xaxis_transform(),
            va="top",
            fontsize=8,
            style="italic",
            color="#444444",
        )
    values = [v for a in panel.arms for v in a.samples if v > 0]
    if values and max(values) > LOG_SPAN * min(values):
        ax.set_yscale("log")  # e.g. quiet and disturbed TTFT rounds together
        ax.set_ylim(_tick_below(min(values)) * 0.92, max(values) * 1.35)
        ax.set_ylabel(panel.ylabel + ", log scale")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        top = max(values, default=1.0)
        ax.set_ylim(0, top * (1.18 if starts else 1.08))


def _tick_below(v: float) -> float:
    """The largest 1, 2 or 5 x 10^k at or under ``v`` (a labelled log tick)."""
    decade = 10.0 ** math.floor(math.log10(v))
    return max(m * decade for m in (1.0, 2.0, 5.0) if m * decade <= v)


def _legend(fig: Any, drawn: list[Panel], notes: list[str]) -> None:
    """One legend for every panel, under them, headed by what was not drawn."""
    from matplotlib.lines import Line2D

    arms = [a for p in drawn for a in p.arms]
    roles = {a.role for a in arms}
    labels = {
        Role.BASELINE: "baseline arm (no KVCR / plain copy)",
        Role.KVCR: "kvcr arm",
        Role.OTHER: "other arm (e.g. SGLang HiCache)",
    }
    handles = [
        Line2D([], [], marker="o", ls="", color=ROLE_COLORS[r], label=labels[r])
        for r in Role
        if r in roles
    ]
    handles.append(Line2D([], [], color="black", lw=2, label="median (value beside)"))
    if any(not all(a.kept()) for a in arms):
        handles.append(
            Line2D(
                [],
                [],
                marker="o",
                ls="",
                markerfacecolor="none",
                color="black",
                label="round disturbed by other work (not in the median)",
            )
        )
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncols=len(handles),
        title="\n".join(notes) or None,
        title_fontsize=9,
        alignment="center",
    )


def render(report: dict[str, Any]) -> Any:
    """The report's picture as a matplotlib Figure (ImportError without it): a
    row of TTFT panels over a row of bandwidth panels (a row of one spans the
    width); what could not be drawn is said in lines under the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    title, every = panels(report)
    rows = [
        [p for p in every if p.kind is kind and p.arms]
        for kind in Kind
        if any(p.kind is kind and p.arms for p in every)
    ]
    notes = list(dict.fromkeys(p.note for p in every if p.note))
    fig = Figure(
        figsize=(14.0, 5.2 * max(1, len(rows)) + 0.3 * len(notes)), layout="constrained"
    )
    FigureCanvasAgg(fig)
    fig.suptitle(title + "\nevery sample drawn, jittered sideways", fontsize=11)
    cols = max((len(row) for row in rows), default=1)
    grid = fig.add_gridspec(max(1, len(rows)), cols)
    for r, row in enumerate(rows):
        for i, panel in enumerate(row):
            where = grid[r, :] if len(row) == 1 else grid[r, i]
            _draw(fig.add_subplot(where), panel)
    _legend(fig, every, notes)
    return fig


def drawn_points(fig: Any) -> int:
    """Sample markers on ``fig``'s axes (median ticks and legends not counted)."""
    from matplotlib.collections import PathCollection

    return sum(
        len(c.get_offsets())
        for ax in fig.axes
        for c in ax.collections
        if isinstance(c, PathCollection)
    )


def png_path(json_path: Path) -> Path:
    return Path(json_path).with_suffix(".png")


def write_png(report: dict[str, Any], json_path: Path) -> PlotResult:
    """Draw ``report`` beside ``json_path`` (same name, ``.png``). Never raises:
    the numbers are in the JSON already; a missing extra or a drawing error is
    reported in the result instead."""
    path = png_path(json_path)
    try:
        import matplotlib  # noqa: F401  (the optional extra)
    except ImportError:
        return PlotResult(Outcome.NO_MATPLOTLIB, path)
    try:
        fig = render(report)
        points = drawn_points(fig)
        fig.savefig(path, dpi=110)
    except Exception as exc:
        traceback.print_exc()
        return PlotResult(Outcome.FAILED, path, error=f"{type(exc).__name__}: {exc}")
    return PlotResult(Outcome.WRITTEN, path, points)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="a kvcr_microbench.py or kvcr_bench.py JSON report")
    args = p.parse_args(argv)
    result = write_png(json.loads(Path(args.report).read_text()), Path(args.report))
    print(result.line())
    return 0 if result.outcome is Outcome.WRITTEN else 1


if __name__ == "__main__":
    sys.exit(main())
