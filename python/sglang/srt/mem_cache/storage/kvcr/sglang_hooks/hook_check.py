"""Whether a function carries a given hook from SGLang's ``HookRegistry``.

The registry wraps a target in a function whose closure holds the hook and sets
``__wrapped__`` to what it wrapped. SGLang's own decorators (the scheduler's
stage markers, for one) set ``__wrapped__`` too, so its presence says nothing:
``carries`` looks for the hook itself in the closures along the ``__wrapped__``
chain, whatever the order the wrappers were applied in.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

MAX_DEPTH = 16  # wrappers around one target; far more than any seen


def carries(fn: Any, hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` is in a wrapper along ``fn``'s ``__wrapped__`` chain."""
    for _ in range(MAX_DEPTH):
        if fn is None:
            return False
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # an empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
    return False


def hook_status(
    hooks: Iterable[tuple[str, Callable[..., Any], str]],
) -> dict[str, bool]:
    """Whether each ``(target, hook, kind)``'s target (``module.Class.attr``)
    carries its hook now."""
    status = {}
    for target, hook, _ in hooks:
        module_path, cls_name, attr = target.rsplit(".", 2)
        cls = getattr(importlib.import_module(module_path), cls_name)
        status[target] = carries(getattr(cls, attr), hook)
    return status
