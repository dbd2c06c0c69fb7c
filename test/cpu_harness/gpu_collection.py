"""pytest plugin for ``gpu_check.sh``'s gpu test stages where torch sees no CUDA device.

There, ``pytest -m gpu`` runs nothing: the suite's conftest deselects every
``gpu`` test, and pytest exits 5. Loaded with ``-p cpu_harness.gpu_collection``
(``--collect-only``), this counts the ``gpu`` tests that were collected (every
module imported under this interpreter and its packages) and then deselected,
prints ``gpu-tests: collected N gpu tests in M modules ...``, and turns the exit 5
into 0 when at least one was found and nothing failed to collect. A module that
fails to import is still a collection error (exit 2).
"""

from __future__ import annotations

from typing import Any

_gpu_items: list[Any] = []


def pytest_deselected(items: list[Any]) -> None:
    _gpu_items.extend(item for item in items if item.get_closest_marker("gpu"))


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    modules = {item.nodeid.split("::", 1)[0] for item in _gpu_items}
    print(
        f"\ngpu-tests: collected {len(_gpu_items)} gpu tests in {len(modules)} "
        "modules (not run: torch sees no CUDA device)"
    )
    if int(exitstatus) == 5 and _gpu_items:
        session.exitstatus = 0
