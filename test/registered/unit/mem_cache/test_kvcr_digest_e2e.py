"""End to end on CPU servers: a hinted peer fetch restores only between workers
whose KV bytes agree (the compatibility digest).

Two KVCR-linker servers, A on the tiny model and B on a copy of it under another
path. B fetches A's pages (same content, other path: shared); after B's
``/update_weights_from_disk`` to other weights it fetches nothing and matches its
own recompute; after updating back to the copy it shares again (the digest follows
the checkpoint content through the flush that re-keys KVCR). A third server, C,
differs from A only by ``--json-model-override-args`` and fetches nothing. The
three boot in parallel (about 2-3 minutes on 2 cores).
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO / "test"))

from cpu_harness import server as harness  # noqa: E402
from cpu_harness import tiny_model  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.kvcr]

PAGE = 16
PROMPT_LEN = 256
OUTPUT_LEN = 8
ALIGNED = (PROMPT_LEN - 1) // PAGE * PAGE
OVERRIDE = json.dumps({"rope_theta": 1234.0})


def page_hashes(token_ids: list[int]) -> list[int]:
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from sglang.srt.mem_cache.storage.kvcr.router_hint import page_hash_to_u64

    hashes = get_storage_hash_str(RadixKey(token_ids[:ALIGNED]), None, page_size=PAGE)
    return [page_hash_to_u64(h) for h in hashes]


def fetch_hint(endpoint: str, ids: list[int]) -> dict[str, Any]:
    action = {
        "action_id": "fetch-0",
        "action_type": "kv.fetch",
        "action_version": "1.0",
        "payload": {
            "source_control_endpoint": endpoint,
            "block_hashes": page_hashes(ids),
        },
    }
    return {"protocol_version": "1.0", "message_id": "digest", "actions": [action]}


def launch(name: str, model: Path, work: Path, extra: tuple[str, ...] = ()) -> Any:
    control_port = harness.free_port()
    config = {
        "local_dram_bytes_per_worker": 64 << 20,
        "control_port": control_port,
        "operation_timeout_ms": 10000,
        "abandon_timeout_ms": 20000,
        "preparation_timeout_ms": 5000,
    }
    args = [
        "--page-size",
        str(PAGE),
        "--max-total-tokens",
        str(4 * PROMPT_LEN),
        "--max-running-requests",
        "4",
        *extra,
        *harness.kvcr_linker_args(config),
    ]
    # Started without waiting: the three servers boot side by side.
    handle = harness.launch_server(
        args, model_path=model, log_path=work / f"{name}.log", wait=False
    )
    handle.endpoint = f"tcp://127.0.0.1:{control_port}"
    return handle


def run(server: Any, ids: list[int], **extra: Any) -> tuple[list[int], int]:
    out = server.generate(input_ids=ids, max_new_tokens=OUTPUT_LEN, **extra)
    meta = out.get("meta_info", {})
    external = int((meta.get("cached_tokens_details") or {}).get("host", 0) or 0)
    return list(out["output_ids"]), external


def computed_on(server: Any, ids: list[int]) -> list[int]:
    """``ids`` computed (and offloaded) on ``server``: its output."""
    output, _ = run(server, ids)
    time.sleep(1.0)  # the write-through offload to KVCR DRAM is asynchronous
    return output


def recompute(server: Any, ids: list[int]) -> list[int]:
    """``server``'s own output for ``ids`` with nothing cached."""
    assert server.flush_cache().status_code == 200
    output, external = run(server, ids)
    assert external == 0
    return output


def update_weights(server: Any, path: Path) -> None:
    resp = server.post("/update_weights_from_disk", {"model_path": str(path)}, 120)
    assert resp.status_code == 200 and resp.json().get("success"), resp.text


def test_hinted_fetch_restores_only_between_workers_with_equal_kv(tmp_path):
    rng = random.Random(7)

    def prompt() -> list[int]:
        return [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]

    a_path = Path(shutil.copytree(tiny_model.ensure_tiny_model(), tmp_path / "a"))
    copy = Path(shutil.copytree(a_path, tmp_path / "copy"))
    other = Path(shutil.copytree(a_path, tmp_path / "other"))
    vocab = json.loads((other / "config.json").read_text())["vocab_size"]
    with mock.patch.object(tiny_model, "SEED", tiny_model.SEED + 1):
        tiny_model._write_weights(other, vocab_size=vocab)

    servers: list[Any] = []
    try:
        a = launch("a", a_path, tmp_path)
        servers.append(a)
        b = launch("b", copy, tmp_path)
        servers.append(b)
        c = launch("c", a_path, tmp_path, ("--json-model-override-args", OVERRIDE))
        servers.append(c)
        for handle in servers:
            handle.wait_ready(420)

        # Same weights under another path: B restores A's pages.
        ids = prompt()
        control = computed_on(a, ids)
        output, external = run(b, ids, kv_hints=fetch_hint(a.endpoint, ids))
        assert external >= 0.9 * ALIGNED, (external, b.log_tail())
        assert output == control

        # B now serves other weights: A's pages are not B's KV.
        update_weights(b, other)
        ids = prompt()
        control_a = computed_on(a, ids)
        output, external = run(b, ids, kv_hints=fetch_hint(a.endpoint, ids))
        assert external == 0, b.log_tail()
        assert output == recompute(b, ids)
        assert output != control_a  # the weights really differ

        # Back to A's weights (from the copy's path): shared again.
        update_weights(b, copy)
        ids = prompt()
        control = computed_on(a, ids)
        output, external = run(b, ids, kv_hints=fetch_hint(a.endpoint, ids))
        assert external >= 0.9 * ALIGNED, (external, b.log_tail())
        assert output == control

        # One config override apart (RoPE changes K): nothing restores.
        ids = prompt()
        control_a = computed_on(a, ids)
        output, external = run(c, ids, kv_hints=fetch_hint(a.endpoint, ids))
        assert external == 0, c.log_tail()
        assert output == recompute(c, ids)
    finally:
        for handle in servers:
            handle.stop()
