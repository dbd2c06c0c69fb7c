"""Every refusal a KVCR start can make from the flags alone, naming the flag.

``check_startup`` runs where SGLang has parsed its arguments (the CLI parser and
``Engine(...)``): it parses the linker config when the flags select this linker,
then refuses topologies whose pages the linker cannot describe (pipeline, decode
and attention context parallelism) and a radix tree core other than SGLang's
Python one (``TREE_CORE_ENV``), which the plugin selects. Stdlib only.
"""

from __future__ import annotations

import os
from typing import Any

from sglang.srt.mem_cache.storage.kvcr.config.errors import (
    KVCRConfigError,
    KVCRUnavailableError,
)
from sglang.srt.mem_cache.storage.kvcr.config.linker_config import (
    BACKEND_FLAG,
    BACKEND_NAME,
    LINKER_MODULE_PATH,
    KVCRLinkerConfig,
)

TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"


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
    for field, flag, why in _UNSUPPORTED_TOPOLOGY:
        value = getattr(server_args, field, 1) or 1
        if value > 1:
            raise KVCRConfigError(
                f"{BACKEND_FLAG} kvcr does not support {flag} {value} ({why}); "
                f"run with {flag} 1 or use another linker"
            )


def check_startup(server_args: Any) -> bool:
    """Refuse what a KVCR start can tell is wrong from the flags alone; True when
    the flags enable this linker.

    The config is parsed when the flags select this linker and it is enabled or
    given a config (SGLang's own rule for ``dynamic``); the topology and the tree
    core only matter once it is enabled. Runs on the parsed namespace (through
    the parser ``_after_add_cli_args`` prepared) and on ``ServerArgs``.
    """
    backend = server_args.unified_cache_external_linker_backend
    config = server_args.unified_cache_external_linker_config
    enabled = bool(getattr(server_args, "enable_unified_cache_external_linker", False))
    if not uses_kvcr(backend, config) or not (enabled or config is not None):
        return False
    KVCRLinkerConfig.from_startup_config(backend, config)
    if enabled:
        refuse_unsupported_topology(server_args)
        _refuse_other_tree_core()
    return enabled


def ensure_python_tree_core() -> None:
    """Select SGLang's Python radix tree core for the KVCR linker (frontend)."""
    _refuse_other_tree_core()
    os.environ.setdefault(TREE_CORE_ENV, "python")


def _refuse_other_tree_core() -> None:
    chosen = os.environ.get(TREE_CORE_ENV)
    if chosen is not None and chosen != "python":
        raise KVCRUnavailableError(
            f"the KVCR linker needs {TREE_CORE_ENV}=python (got {chosen!r}): it "
            "publishes EXTERNAL KV events and clears stored marks on Python tree "
            "nodes; unset the variable or set it to python"
        )
