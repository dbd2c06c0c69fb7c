"""gpu_check.sh (the air-gapped GPU run): syntax, arguments, stage plan, report dir,
and the stage runner's PASS/FAIL/timeout bookkeeping, in seconds.

The stages' real work is not run here: ``--python`` points at a fake interpreter (a
shell script that exits with ``$FAKE_RC`` after ``$FAKE_SLEEP`` seconds), so what is
tested is the script's own logic. ``gpu_check.sh --dry-run`` runs the real stages.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cpu_harness.server import REPO

SCRIPT = REPO / "test" / "manual" / "kvcr_direct_linker" / "gpu_check.sh"
STAGES = [
    "env",
    "warmup",
    "gpu-tests",
    "gpu-tests-sanitizer",
    "microbench",
    "bench",
    "bench-families",
]
EMULATE_STAGES = ["env", "warmup", "gpu-tests", "gpu-tests-sanitizer"]
TIMEOUT_VARS = (
    "HOST_ENV",
    "WHEELHOUSE",
    "INSTALL",
    *(s.upper().replace("-", "_") for s in STAGES),
)


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    full = {k: v for k, v in os.environ.items() if k != "OUT"}
    full.update(env or {})
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )


def fake_dry_run(fake_python: Path, report_dir: Path, *args: str, **kw: Any):
    """``--dry-run`` with the fake interpreter, reporting under ``report_dir``."""
    return run(
        "--dry-run",
        "--python",
        str(fake_python),
        "--report-dir",
        str(report_dir),
        *args,
        **kw,
    )


def plan(out: str) -> dict[str, str]:
    lines = [
        ln
        for ln in out.splitlines()
        if ": " in ln and not ln.startswith(("stage", "step", "warning"))
    ]
    return dict(ln.split(": ", 1) for ln in lines)


def stage_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("stage ")]


def step_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("step ")]


def seconds(line: str) -> int:
    return int(line.split()[-1].rstrip("s"))


def test_bash_syntax() -> None:
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_gpu_tests_stage_covers_every_module_with_gpu_tests() -> None:
    """The gpu-tests stage's folder (``GPU_TEST_DIR``, whose modules mentioning
    ``mark.gpu`` it runs) exists and holds every test module that marks a test
    ``gpu`` (so a moved test is not silently dropped)."""
    text = SCRIPT.read_text()
    found = set(re.findall(r"^GPU_TEST_DIR=(\S+)$", text, re.M))
    assert len(found) == 1, found
    assert "grep -rl --include='test_*.py' 'mark\\.gpu' \"$GPU_TEST_DIR\"" in text
    folder = REPO / found.pop()
    assert folder.is_dir(), folder
    marked = {
        p
        for p in (REPO / "test" / "registered").rglob("test_*.py")
        if re.search(r"pytest\.mark\.gpu\b", p.read_text())
    }
    assert {p.name for p in marked} >= {
        "test_kvcr_gpu_data_path.py",
        "test_kvcr_replicated.py",
    }
    assert all(p.is_relative_to(folder) for p in marked), sorted(map(str, marked))


def test_no_gpu_marker_is_given_where_the_stage_cannot_see_it() -> None:
    """The stage runs the modules whose text says ``mark.gpu``: a marker given
    through an alias (``GPU = pytest.mark.gpu``) or a hook (``add_marker``) would
    run nowhere, so neither is allowed under test/."""
    hidden = [
        str(p.relative_to(REPO))
        for p in (REPO / "test").rglob("*.py")
        if re.search(
            r"^\s*\w+\s*=\s*pytest\.mark\.gpu\b"
            r"|add_marker\(\s*(?:pytest\.mark\.gpu|['\"]gpu)",
            p.read_text(),
            re.M,
        )
    ]
    assert hidden == []


def test_help_names_every_stage_and_option() -> None:
    proc = run("--help")
    assert proc.returncode == 0, proc.stderr
    assert "Usage:" in proc.stdout
    for word in (
        *STAGES,
        "--wheelhouse",
        "--dry-run",
        "--emulate-host",
        "--emulate-dir",
        "--stages",
        "--list-stages",
        "TORCH_CUDA_SANITIZER=1",
        "SGLANG_JIT_CACHE_DIR",
        "TRITON_CACHE_DIR",
    ):
        assert word in proc.stdout, word
    assert "set -euo pipefail" not in proc.stdout


def test_plan_dry_run_defaults() -> None:
    proc = run("--dry-run", "--list-stages")
    assert proc.returncode == 0, proc.stderr
    info = plan(proc.stdout)
    assert info["mode"] == "dry-run"
    assert info["python"] == str(REPO / ".venv" / "bin" / "python")
    assert info["report dir"] == str(REPO / ".cache" / "gpu_check")
    assert [ln.split()[1] for ln in stage_lines(proc.stdout)] == STAGES


def test_report_dir_follows_out_then_flag(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run("--dry-run", "--list-stages", env={"OUT": str(out)})
    assert plan(proc.stdout)["report dir"] == str(out / "gpu_check")
    mine = tmp_path / "mine"
    proc = run(
        "--dry-run", "--list-stages", "--report-dir", str(mine), env={"OUT": str(out)}
    )
    assert plan(proc.stdout)["report dir"] == str(mine)


@pytest.mark.parametrize(
    ("part", "stages"),
    [
        ("kernels", ["env", "gpu-tests", "gpu-tests-sanitizer", "microbench"]),
        ("serving", ["warmup", "bench", "bench-families"]),
    ],
)
def test_each_gpu_part_fits_one_device_call(
    tmp_path: Path, part: str, stages: list[str]
) -> None:
    """The install and each part's stages keep their own timeouts, and together
    with the stop grace a stage may overrun by they fit the budget of one
    device call (560 s, under its 600 s limit) (so no stage is cut short by design); the two parts cover every
    stage. All stages at once do not fit (the first H200 run timed them): the
    plan says so."""
    proc = run("--list-stages", "--wheelhouse", str(tmp_path), "--part", part)
    assert proc.returncode == 0, proc.stderr
    info = plan(proc.stdout)
    assert info["mode"] == "gpu" and info["python"] == "python3"
    assert [ln.split()[1] for ln in step_lines(proc.stdout)] == ["install"]
    assert [ln.split()[1] for ln in stage_lines(proc.stdout)] == stages
    lines = step_lines(proc.stdout) + stage_lines(proc.stdout)
    total = sum(seconds(ln) for ln in lines)
    assert all(seconds(ln) > 0 for ln in lines), proc.stdout
    grace = int(re.search(r"^STOP_GRACE_S=(\d+)", SCRIPT.read_text(), re.M)[1])
    budget = int(re.search(r"^GPU_DEADLINE_S=(\d+)", SCRIPT.read_text(), re.M)[1])
    assert 0 < budget <= 600  # one device call is at most 10 minutes
    # 10 s of slack: the transfer and the start of python itself
    assert grace > 0 and total + grace + 10 <= budget, (total, grace, budget)
    assert f"total timeout {total}s" in proc.stdout, proc.stdout
    assert f"budget {budget}s" in proc.stdout and "warning" not in proc.stdout
    assert info["caches"] == str(REPO / ".cache" / "gpu_check_home")
    everything = run("--list-stages", "--wheelhouse", str(tmp_path))
    assert [ln.split()[1] for ln in stage_lines(everything.stdout)] == STAGES
    assert "warning" in everything.stdout
    bad = run("--list-stages", "--wheelhouse", str(tmp_path), "--part", "x")
    assert bad.returncode == 2 and "unknown part" in bad.stderr


def test_emulate_host_plan(tmp_path: Path) -> None:
    """--emulate-host: the host env step, the wheelhouse build when none is given
    (else the given one), the install, then the emulation's stages; its caches
    must lie outside the repository (what lies in it travels to the GPU host)."""
    emulate = tmp_path / "emu"
    proc = run("--emulate-host", "--emulate-dir", str(emulate), "--list-stages")
    assert proc.returncode == 0, proc.stderr
    info = plan(proc.stdout)
    assert info["mode"] == "emulate-host"
    assert info["python"] == str(emulate / "host-py312" / "bin" / "python")
    assert info["emulate dir"] == str(emulate)
    steps = [ln.split()[1] for ln in step_lines(proc.stdout)]
    has_wheels = any((REPO / ".cache" / "wheelhouse").glob("*.whl"))
    assert steps == ["host-env", *([] if has_wheels else ["wheelhouse"]), "install"]
    assert [ln.split()[1] for ln in stage_lines(proc.stdout)] == EMULATE_STAGES
    assert "budget" not in proc.stdout  # off the GPU nothing is cut short
    wheels = tmp_path / "wh"
    wheels.mkdir()
    proc = run(
        "--emulate-host",
        "--emulate-dir",
        str(emulate),
        "--wheelhouse",
        str(wheels),
        "--list-stages",
        "--stages",
        "bench-families,env",
    )
    assert [ln.split()[1] for ln in step_lines(proc.stdout)] == ["host-env", "install"]
    assert [ln.split()[1] for ln in stage_lines(proc.stdout)] == [
        "env",
        "bench-families",
    ]
    inside = run("--emulate-host", "--emulate-dir", str(REPO / ".cache" / "x"))
    assert inside.returncode == 2 and "lies in the repository" in inside.stderr


def test_stage_subset_keeps_order_and_timeout_override() -> None:
    proc = run(
        "--dry-run",
        "--list-stages",
        "--stages",
        "bench,env",
        env={"GPU_CHECK_TIMEOUT_BENCH": "7"},
    )
    assert proc.returncode == 0, proc.stderr
    assert stage_lines(proc.stdout) == [
        "stage env timeout 120s",
        "stage bench timeout 7s",
    ]


@pytest.mark.parametrize(
    "args",
    [
        ["--bogus"],
        ["--dry-run", "--stages", "env,nope"],
        ["--dry-run", "--stages", ""],
        ["--dry-run", "--wheelhouse", "/tmp"],
        [],  # the GPU run needs a wheelhouse
        ["--wheelhouse", "/nonexistent/wheelhouse"],
        ["--wheelhouse"],
        ["--dry-run", "--stages", ","],
        ["--dry-run", "--stages="],
        ["--dry-run", "--emulate-host"],
        ["--emulate-host", "--emulate-dir"],
        ["--emulate-host", "--wheelhouse", "/nonexistent/wheelhouse"],
    ],
)
def test_bad_usage_exits_2(args: list[str], tmp_path: Path) -> None:
    # Should a usage error slip through, the run it starts stays short and local.
    short = {f"GPU_CHECK_TIMEOUT_{s}": "3" for s in TIMEOUT_VARS}
    proc = run(
        *args,
        env={"OUT": str(tmp_path), "GPU_CHECK_SITE": str(tmp_path / "site"), **short},
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "gpu_check:" in proc.stderr


def test_empty_wheelhouse_is_refused(tmp_path: Path) -> None:
    proc = run("--wheelhouse", str(tmp_path), "--report-dir", str(tmp_path / "r"))
    assert proc.returncode == 2 and "no *.whl" in proc.stderr


def test_every_stage_runs_and_reports(tmp_path: Path, fake_python: Path) -> None:
    reports = tmp_path / "reports"
    proc = fake_dry_run(fake_python, reports)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (reports / "summary.txt").read_text()
    for stage in STAGES:
        assert f"STAGE {stage} PASS" in proc.stdout
        assert f"STAGE {stage} PASS" in summary
        assert (reports / f"{stage}.log").is_file()
    assert "GPU_CHECK PASS" in summary
    assert "/proc/" not in proc.stdout + proc.stderr  # the leftover sweep stays quiet


def test_failures_continue_and_exit_nonzero(tmp_path: Path, fake_python: Path) -> None:
    reports = tmp_path / "reports"
    proc = fake_dry_run(fake_python, reports, env={"FAKE_RC": "5"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # Without CUDA the gpu stages collect: pytest's exit 5 is a failure unless the
    # collection plugin found gpu tests (which the fake interpreter never does).
    assert "STAGE env FAIL rc=1" in proc.stdout
    assert "STAGE gpu-tests FAIL rc=5" in proc.stdout
    assert "STAGE microbench FAIL rc=1" in proc.stdout
    assert "STAGE bench FAIL rc=5" in proc.stdout
    assert f"GPU_CHECK FAIL: {' '.join(STAGES)}" in proc.stdout


def test_gpu_mode_install_and_no_gpu_tests_fail(
    tmp_path: Path, fake_python: Path
) -> None:
    wheelhouse = tmp_path / "wh"
    wheelhouse.mkdir()
    (wheelhouse / "x-1.0-py3-none-any.whl").write_bytes(b"")
    (wheelhouse / "torch-2.11.0-cp312-cp312-linux_x86_64.whl").write_bytes(b"")
    proc = run(
        "--wheelhouse",
        str(wheelhouse),
        "--python",
        str(fake_python),
        "--report-dir",
        str(tmp_path / "r"),
        "--stages",
        "env,gpu-tests",
        env={"FAKE_RC": "5", "GPU_CHECK_SITE": str(tmp_path / "site")},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "refusing torch-2.11.0" in proc.stdout
    assert "STAGE install FAIL rc=5" in proc.stdout
    assert "STAGE gpu-tests FAIL rc=1" in proc.stdout  # exit 5 on the GPU: nothing ran
    env_log = (tmp_path / "r" / "env.log").read_text()
    assert "CARRY OK work tree" in env_log


def test_stage_timeout_is_enforced(tmp_path: Path, fake_python: Path) -> None:
    proc = fake_dry_run(
        fake_python,
        tmp_path,
        "--stages",
        "env",
        env={"FAKE_SLEEP": "30", "GPU_CHECK_TIMEOUT_ENV": "1"},
        timeout=25,
    )
    assert proc.returncode == 1
    assert (
        "STAGE env FAIL rc=124" in proc.stdout and "timed out after 1s" in proc.stdout
    )


def test_a_stage_never_runs_past_the_budget(tmp_path: Path, fake_python: Path) -> None:
    """With a budget (the GPU run's 560 s, here 36 s), a stage's timeout is cut to
    what is left of it less the stop grace (25 s), and a stage with under 10 s
    left is not started: it fails at once, so the call ends inside its limit."""
    proc = fake_dry_run(
        fake_python,
        tmp_path,
        "--stages",
        "env,bench",
        env={"GPU_CHECK_DEADLINE_S": "36", "FAKE_SLEEP": "3"},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    cut = re.search(r"== stage env \(timeout (\d+)s\)", proc.stdout)
    assert cut and 9 <= int(cut.group(1)) <= 11, proc.stdout
    assert "STAGE env PASS" in proc.stdout
    assert "STAGE bench FAIL rc=124 0s" in proc.stdout
    assert "no time left in the 36s budget" in proc.stdout


def test_leftover_processes_are_ended(tmp_path: Path, fake_python: Path) -> None:
    pids = tmp_path / "pids"
    proc = fake_dry_run(
        fake_python,
        tmp_path / "r",
        "--stages",
        "gpu-tests",
        env={"FAKE_DETACH": str(pids)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "leftover process(es)" in proc.stdout
    for pid in pids.read_text().split():
        assert (
            not Path(f"/proc/{pid}").exists()
            or "zombie" in Path(f"/proc/{pid}/status").read_text()
        ), f"pid {pid} survived the stage"
