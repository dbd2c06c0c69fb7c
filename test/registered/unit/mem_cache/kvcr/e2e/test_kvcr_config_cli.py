"""A bad KVCR config on a real ``python -m sglang.launch_server`` is one line, no traceback.

Three real launches run side by side (a thread pool of 3, one module fixture): two
configs refused while SGLang parses its arguments (a field out of range, a value
that is not JSON), which must exit with status 2 and exactly one
``sglang serve: error:`` line on stderr, and one config that only the scheduler
can refuse (a DRAM budget below one page of the model), whose failure must be one
ERROR line in the log instead of SGLang's traceback. Every other bad config goes
through the same parse in-process in ``test_kvcr_config``. The scheduler log
filter itself is checked in-process too, on the record SGLang's
``run_scheduler_process`` writes. Python warnings are silenced in the children
(``PYTHONWARNINGS=ignore``): SGLang's own import-time ``UserWarning`` lines are
not this plugin's output.
"""

from __future__ import annotations

import json
import logging
import subprocess
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from cpu_harness.server import (
    REPO,
    kvcr_linker_args,
    run_to_exit,
    server_command,
    server_env,
)
from cpu_harness.tiny_model import ensure_tiny_model
from sglang.srt.mem_cache.storage.kvcr.config import one_line_errors
from sglang.srt.mem_cache.storage.kvcr.config.errors import (
    KVCRAdapterFailed,
    KVCRConfigError,
    KVCRUnavailableError,
)
from sglang.srt.mem_cache.storage.kvcr.config.linker_config import KVCRLinkerConfig

pytestmark = pytest.mark.server

PARSE_TIMEOUT_S = 240.0  # imports sglang on 2 loaded cores; exits before any worker
SCHEDULER_TIMEOUT_S = 300.0  # up to the scheduler building its cache, then exit
QUIET = {"PYTHONWARNINGS": "ignore"}
# Refused at parsing: a field out of range, and a value that is not JSON at all.
AT_PARSE = {
    "zero-size": json.dumps({"local_dram_bytes_per_worker": 0}),
    "not-json": "{local_dram_bytes_per_worker: 1}",
}
# Only the scheduler knows the model's page size: 1 byte is below one page.
IN_SCHEDULER = {"local_dram_bytes_per_worker": 1}


@dataclass(frozen=True, slots=True)
class Exited:
    rc: int | None
    stdout: str
    stderr: str


def _launch_to_parse_failure(config_text: str, model: Path, scratch: Path) -> Exited:
    cmd = server_command(model, 0, kvcr_linker_args(config_text))
    proc = subprocess.run(
        cmd,
        env=server_env(scratch, QUIET),
        cwd=str(REPO),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=PARSE_TIMEOUT_S,
        check=False,
    )
    return Exited(proc.returncode, proc.stdout, proc.stderr)


def _launch_to_scheduler_failure(model: Path, scratch: Path) -> Exited:
    rc, _, log = run_to_exit(
        [*kvcr_linker_args(IN_SCHEDULER), "--max-total-tokens", "2048"],
        model_path=model,
        log_path=scratch / "scheduler.log",
        env=QUIET,
        scratch=scratch,
        timeout=SCHEDULER_TIMEOUT_S,
    )
    return Exited(rc, log, "")


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Exited]:
    """All three launches, run concurrently; each one bounded by its timeout."""
    model = ensure_tiny_model()
    scratch = {name: tmp_path_factory.mktemp(name) for name in (*AT_PARSE, "scheduler")}
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {
            name: pool.submit(_launch_to_parse_failure, text, model, scratch[name])
            for name, text in AT_PARSE.items()
        }
        futures["scheduler"] = pool.submit(
            _launch_to_scheduler_failure, model, scratch["scheduler"]
        )
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("case", list(AT_PARSE))
def test_a_bad_config_exits_at_parse_with_status_2_and_one_line(launches, case):
    """The launcher exits as argparse does, status 2, and stderr is exactly one
    line: the prog, the flag, the field (or that it is not JSON) and the fix."""
    with pytest.raises(KVCRConfigError) as info:
        KVCRLinkerConfig.from_startup_config("kvcr", AT_PARSE[case])
    result = launches[case]
    assert result.rc == 2, result.stderr[-4000:]
    assert result.stdout == ""
    assert result.stderr.splitlines() == [f"sglang serve: error: {info.value}"]
    assert "--unified-cache-external-linker-config: " in result.stderr


def test_a_config_only_the_scheduler_can_refuse_is_one_error_line(launches):
    """The scheduler's refusal (below one page) is one ERROR line with the
    message and its fix; SGLang's 'Scheduler hit an exception' traceback is gone."""
    result = launches["scheduler"]
    log = result.stdout
    assert result.rc is not None, f"still running after {SCHEDULER_TIMEOUT_S}s"
    assert result.rc != 0, log[-4000:]
    failed = [line for line in log.splitlines() if "failed to start" in line]
    assert len(failed) == 1, log[-4000:]
    assert "Scheduler failed to start: KVCRConfigError: " in failed[0]
    assert "local_dram_bytes_per_worker=1 leaves 1 bytes" in failed[0]
    assert "set it to at least" in failed[0]
    assert "--unified-cache-external-linker-config" in failed[0]  # the flag
    assert "Traceback" not in log, log[-4000:]
    assert "Scheduler hit an exception" not in log
    assert "Uvicorn running" not in log


# ---- the scheduler log filter, in-process ---------------------------------------


def _around_create_linker(exc: Exception) -> None:
    """Stands in for the plugin's create hook: raising here is a failed build."""
    raise exc


def _scheduler_logs_failure(exc: Exception, building: bool = True) -> None:
    """What SGLang's ``run_scheduler_process`` does with a failed start (or, not
    ``building``, with a linker error raised while serving)."""
    assert _around_create_linker.__name__ == one_line_errors.BUILD_FRAME
    scheduler_logger = logging.getLogger(one_line_errors.SCHEDULER_LOGGER)
    try:
        if building:
            _around_create_linker(exc)
        raise exc
    except Exception:
        scheduler_logger.error("Scheduler hit an exception: %s", traceback.format_exc())


def test_the_filter_turns_a_setup_error_traceback_into_one_line(caplog):
    """A KVCR setup error's traceback record becomes one ERROR line (message and
    fix) and the traceback goes to DEBUG; other failures keep their traceback."""
    one_line_errors.install_scheduler_filter()
    one_line_errors.install_scheduler_filter()
    scheduler_logger = logging.getLogger(one_line_errors.SCHEDULER_LOGGER)
    assert (
        sum(
            isinstance(f, one_line_errors.OneLineStartupFailure)
            for f in scheduler_logger.filters
        )
        == 1
    )
    caplog.set_level(logging.DEBUG)
    taken = KVCRUnavailableError(
        "KVCR failed to start: [Errno 98] Address already in use; set control_port 0"
    )
    _scheduler_logs_failure(taken)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        f"Scheduler failed to start: KVCRUnavailableError: {taken} "
        "(traceback at --log-level debug)"
    ]
    # Rewritten in place: the scheduler's own handlers still get it.
    assert errors[0].name == one_line_errors.SCHEDULER_LOGGER
    assert errors[0].exc_info is None
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert [r.exc_info[1] for r in debug if r.exc_info] == [taken]
    # A KVCR error out of a linker already serving (a flush restarting KVCR)
    # keeps its traceback, as do other failures.
    serving = (KVCRUnavailableError(str(taken)), False)
    others = [
        (RuntimeError("CUDA out of memory"), True),
        (KVCRAdapterFailed("x"), True),
    ]
    for other, building in (serving, *others):
        caplog.clear()
        _scheduler_logs_failure(other, building)
        (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert record.name == one_line_errors.SCHEDULER_LOGGER
        assert "Traceback (most recent call last)" in record.getMessage()
