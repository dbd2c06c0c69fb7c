"""A refused KVCR start is one line, not a traceback: at parsing and in the scheduler.

At argument parsing, ``check_after_parsing(parser, action, check)`` makes the
config flag's JSON decoding lenient (a value that is not JSON is kept as
``UndecodedJSON``) and wraps the parser's ``parse_known_args``, so that ``check``
runs once every flag is known (``--unified-cache-external-linker-backend`` may come
after the config). A ``KVCRLinkerError`` from it ends the process the way argparse
ends it, exit status 2 and ``<prog>: error: <message>`` on stderr, but without
argparse's usage block: SGLang's usage is some 470 lines that would bury the one
line that says what to fix. A value that is not JSON and not meant for KVCR still
gets argparse's own error, usage included, exactly as without this plugin.

In the scheduler, the failures only a starting worker can find (a control port
already taken, no usable UCX, a DRAM budget below one page of this model) reach
SGLang's ``run_scheduler_process``, which logs them as one ERROR record holding the
whole traceback, from inside its ``except``. ``OneLineStartupFailure``, a filter
on that module's logger, replaces such a record, when the exception being handled
is a KVCR configuration or availability error, with one ERROR line that carries
the message (which already names the setting and the fix) and logs the traceback
at DEBUG (``--log-level debug``). Any other record passes unchanged, and if SGLang
stops logging that way the filter simply never matches. Stdlib only.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.config.errors import (
    KVCRConfigError,
    KVCRLinkerError,
    KVCRUnavailableError,
)

logger = logging.getLogger(__name__)

SCHEDULER_LOGGER = "sglang.srt.managers.scheduler"
EXIT_STATUS = 2  # argparse's status for a bad command line
_TRACEBACK = "Traceback (most recent call last)"


class UndecodedJSON(str):
    """A flag value that did not decode as JSON, kept for the check after parsing."""

    __slots__ = ()


def check_after_parsing(
    parser: argparse.ArgumentParser,
    action: argparse.Action,
    check: Callable[[argparse.Namespace], object],
) -> None:
    """Run ``check`` on every namespace ``parser`` parses; a refusal is one line.

    ``action`` is the JSON flag whose decoding becomes lenient; its value must be
    either decoded or refused by the time parsing returns.
    """
    decode = action.type
    if not callable(decode):
        return
    type_name = getattr(decode, "__name__", repr(decode))  # argparse's wording

    def decode_leniently(text: str) -> Any:
        try:
            return decode(text)
        except (ValueError, TypeError, RecursionError):
            return UndecodedJSON(text)

    decode_leniently.__name__ = type_name
    action.type = decode_leniently
    parse_known_args = parser.parse_known_args

    def parse_and_check(
        args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = parse_known_args(args, namespace)
        try:
            check(parsed)
        except KVCRLinkerError as exc:
            exit_with_one_line(parser, exc)
        value = getattr(parsed, action.dest, None)
        if isinstance(value, UndecodedJSON):  # not KVCR's: argparse's own error
            flag = "/".join(action.option_strings)
            parser.error(f"argument {flag}: invalid {type_name} value: {str(value)!r}")
        return parsed, extras

    parser.parse_known_args = parse_and_check  # type: ignore[method-assign,assignment]


def exit_with_one_line(parser: argparse.ArgumentParser, exc: BaseException) -> None:
    """Exit with status 2 and ``<prog>: error: <message>``: argparse, minus usage."""
    message = " ".join(str(exc).split())  # one line, whatever the message holds
    parser.exit(EXIT_STATUS, f"{parser.prog}: error: {message}\n")


# The plugin's hook around SGLang's linker factory: every linker build runs in it.
BUILD_FRAME = "_around_create_linker"


class OneLineStartupFailure(logging.Filter):
    """Shortens the scheduler's traceback record of a KVCR setup error to one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = sys.exc_info()[1]
        if not isinstance(exc, (KVCRConfigError, KVCRUnavailableError)):
            return True
        if _TRACEBACK not in record.getMessage() or not _while_building(exc):
            return True  # a failure while serving keeps its whole traceback
        logger.debug("Traceback of the failed start:", exc_info=exc)
        # Rewritten in place: the record still reaches the scheduler's handlers.
        record.msg = (
            "Scheduler failed to start: %s: %s (traceback at --log-level debug)"
        )
        record.args = (type(exc).__name__, exc)
        record.exc_info, record.exc_text = None, None
        return True


def _while_building(exc: BaseException) -> bool:
    """Whether ``exc`` came out of building the linker (SGLang's linker factory,
    through the plugin's create hook), not out of a linker already serving."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == BUILD_FRAME:
            return True
        tb = tb.tb_next
    return False


def install_scheduler_filter() -> None:
    """Add ``OneLineStartupFailure`` to the scheduler module's logger (idempotent)."""
    target = logging.getLogger(SCHEDULER_LOGGER)
    if not any(isinstance(f, OneLineStartupFailure) for f in target.filters):
        target.addFilter(OneLineStartupFailure())
