"""SGLang plugin entry point: registers the ``kvcr`` linker backend.

``register()`` runs in every SGLang process through the ``sglang.srt.plugins``
entry-point group, before server arguments are parsed. It adds three hooks: an
AFTER hook on ``ServerArgs.add_cli_args`` that makes ``kvcr`` a valid
``--unified-cache-external-linker-backend`` choice, an AFTER hook on the frontend's
hierarchical-cache validation that parses the KVCR config at startup (so a bad
value fails before any worker starts, naming the field), and an AROUND hook on
``create_unified_cache_linker`` that builds ``KVCRDirectLinker`` for ``kvcr``.
Registration imports only SGLang's hook registry and the light config module.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.config import (
    BACKEND_FLAG,
    BACKEND_NAME,
    LINKER_CLASS_NAME,
    LINKER_MODULE_PATH,
    KVCRLinkerConfig,
)
from sglang.srt.mem_cache.storage.kvcr.errors import KVCRUnavailableError

logger = logging.getLogger(__name__)

TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"

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
    from sglang.srt.mem_cache.storage.kvcr import integration

    integration.register_hooks()
    _registered = True


def _after_add_cli_args(result: Any, parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if BACKEND_FLAG in action.option_strings:
            choices = list(action.choices or ())
            if BACKEND_NAME not in choices:
                action.choices = [*choices, BACKEND_NAME]
            return
    logger.warning("kvcr plugin: %s not found; backend not registered", BACKEND_FLAG)


def uses_kvcr(backend: str, config: object) -> bool:
    """True when the flags select this package's linker (alias or dynamic path)."""
    if backend == BACKEND_NAME:
        return True
    return (
        backend == "dynamic"
        and isinstance(config, dict)
        and config.get("linker_module_path") == LINKER_MODULE_PATH
    )


_UNSUPPORTED_TOPOLOGY = (
    (
        "pp_size",
        "--pp-size",
        "pipeline parallelism splits a page's layers across ranks",
    ),
    ("dcp_size", "--dcp-size", "decode context parallelism splits a page's tokens"),
    ("attn_cp_size", "--attn-cp-size", "context parallelism splits a page's tokens"),
)


def refuse_unsupported_topology(server_args: Any) -> None:
    """Refuse layouts whose pages the KVCR linker cannot describe, naming the flag."""
    from sglang.srt.mem_cache.storage.kvcr.errors import KVCRConfigError

    for field, flag, why in _UNSUPPORTED_TOPOLOGY:
        value = getattr(server_args, field, 1) or 1
        if value > 1:
            raise KVCRConfigError(
                f"{BACKEND_FLAG} kvcr does not support {flag} {value} ({why}); "
                f"run with {flag} 1 or use another linker"
            )


def _after_handle_hicache(result: Any, server_args: Any) -> None:
    if not getattr(server_args, "enable_unified_cache_external_linker", False):
        return
    backend = server_args.unified_cache_external_linker_backend
    config = server_args.unified_cache_external_linker_config
    if uses_kvcr(backend, config):
        KVCRLinkerConfig.from_startup_config(backend, config)
        refuse_unsupported_topology(server_args)
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
    if backend != BACKEND_NAME:
        return original(
            server_args,
            params,
            backend=backend,
            config=config,
            components=components,
            forward_stream=forward_stream,
        )
    return original(
        server_args,
        params,
        backend="dynamic",
        config={
            "linker": LINKER_CLASS_NAME,
            "linker_module_path": LINKER_MODULE_PATH,
            "linker_extra_config": dict(config or {}),
        },
        components=components,
        forward_stream=forward_stream,
    )


def ensure_python_tree_core() -> None:
    """Select SGLang's Python radix tree core for the KVCR linker (frontend)."""
    chosen = os.environ.get(TREE_CORE_ENV)
    if chosen is None:
        os.environ[TREE_CORE_ENV] = "python"
    elif chosen != "python":
        raise KVCRUnavailableError(
            f"the KVCR linker needs {TREE_CORE_ENV}=python (got {chosen!r}): it "
            "publishes EXTERNAL KV events and clears stored marks on Python tree "
            "nodes; unset the variable or set it to python"
        )
