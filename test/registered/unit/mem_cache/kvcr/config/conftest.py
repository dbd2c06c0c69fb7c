"""Tests of ``config/``: the linker config (every refusal one line naming the field
and the fix) and the start-up checks and errors, in-process and through SGLang's
own command-line parse.

``parse_command_line``: the parse ``python -m sglang.launch_server`` and ``sglang
serve`` run first (``prepare_server_args``), with the plugins loaded as they load
them; root logging, which a successful parse resets, is restored afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def parse_command_line(plugin_hooks: None) -> Iterator[Callable[..., Any]]:
    from sglang.srt.server_args import prepare_server_args

    root = logging.getLogger()
    saved = (root.level, list(root.handlers))

    def parse(*flags: str) -> Any:
        return prepare_server_args(["--model-path", "dummy", "--device", "cpu", *flags])

    yield parse
    root.handlers[:] = saved[1]
    root.setLevel(saved[0])
