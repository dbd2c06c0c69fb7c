"""SGLang plugin entry point: registers the ``kvcr`` linker backend.

``register()`` runs in every SGLang process through the ``sglang.srt.plugins``
entry-point group, before server arguments are parsed. It adds three hooks: an
AFTER hook on ``ServerArgs.add_cli_args`` that makes ``kvcr`` a valid
``--unified-cache-external-linker-backend`` choice and has the parser run
``check_startup`` once it has parsed (a bad config then exits with status 2 and
one ``<prog>: error:`` line naming the flag, the field and the fix), an AFTER hook
on the frontend's hierarchical-cache validation that runs the same checks for
``Engine(...)``, which parses no command line, and an AROUND hook on
``create_unified_cache_linker`` that builds the rank's linker
(``builder.build_linker``) for ``kvcr`` and for the ``dynamic`` route
naming ``KVCRDirectLinker``. It also installs the filter that shortens a scheduler's failed KVCR start to one
ERROR line (``config.one_line_errors``). Registration imports only SGLang's hook registry
and light, stdlib-only modules.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.config import one_line_errors
from sglang.srt.mem_cache.storage.kvcr.config.linker_config import (
    BACKEND_FLAG,
    BACKEND_NAME,
    FLAG,
    LINKER_CLASS_NAME,
)
from sglang.srt.mem_cache.storage.kvcr.config.startup_checks import (
    check_startup,
    ensure_python_tree_core,
    uses_kvcr,
)

logger = logging.getLogger(__name__)


ADD_CLI_ARGS_TARGET = "sglang.srt.server_args.ServerArgs.add_cli_args"
HANDLE_HICACHE_TARGET = "sglang.srt.arg_groups.hicache_hook.handle_hicache"
CREATE_LINKER_TARGET = (
    "sglang.srt.mem_cache.unified_cache.linker_factory.create_unified_cache_linker"
)

_registered = False


def register() -> None:
    """Register the ``kvcr`` backend hooks (idempotent)."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ADD_CLI_ARGS_TARGET, _after_add_cli_args, HookType.AFTER)
    HookRegistry.register(HANDLE_HICACHE_TARGET, _after_handle_hicache, HookType.AFTER)
    HookRegistry.register(CREATE_LINKER_TARGET, _around_create_linker, HookType.AROUND)
    one_line_errors.install_scheduler_filter()
    from sglang.srt.mem_cache.storage.kvcr.sglang_hooks import integration

    integration.register_hooks()
    _registered = True


def _after_add_cli_args(result: Any, parser: argparse.ArgumentParser) -> None:
    actions = {s: a for a in parser._actions for s in a.option_strings}
    backend = actions.get(BACKEND_FLAG)
    if backend is None:
        logger.warning(
            "kvcr plugin: %s not found; backend not registered", BACKEND_FLAG
        )
        return
    choices = list(backend.choices or ())
    if BACKEND_NAME not in choices:
        backend.choices = [*choices, BACKEND_NAME]
    if FLAG in actions:
        one_line_errors.check_after_parsing(parser, actions[FLAG], check_startup)


def _after_handle_hicache(result: Any, server_args: Any) -> None:
    if check_startup(server_args):
        ensure_python_tree_core()


def _around_create_linker(
    original: Callable[..., Any],
    server_args: Any,
    params: Any,
    *,
    backend: str,
    config: dict[str, Any] | None,
    components: Any,
    forward_stream: Any = None,
) -> Any:
    extra = _kvcr_extra_config(backend, config)
    if extra is None:
        return original(
            server_args,
            params,
            backend=backend,
            config=config,
            components=components,
            forward_stream=forward_stream,
        )
    # One builder for both routes: it describes the rank once and picks the
    # rank's linker (a follower where rank-replicated pools are stored once).
    from sglang.srt.mem_cache.storage.kvcr.builder import build_linker

    return build_linker(
        server_args,
        params,
        components=components,
        extra_config=extra,
        forward_stream=forward_stream,
    )


def _kvcr_extra_config(backend: str, config: Any) -> dict[str, Any] | None:
    """The KVCR config when the flags select ``KVCRDirectLinker`` (the ``kvcr``
    alias, or the stock ``dynamic`` route naming it, validated as SGLang does);
    None for any other linker."""
    if backend == BACKEND_NAME:
        return dict(config or {})
    if not uses_kvcr(backend, config) or config.get("linker") != LINKER_CLASS_NAME:
        return None
    from sglang.srt.mem_cache.unified_cache.linker_config import (
        UnifiedCacheLinkerConfig,
    )

    return dict(UnifiedCacheLinkerConfig.from_dict(config).linker_extra_config or {})
