"""End to end on CPU servers: a hinted peer fetch restores only between workers
whose KV bytes agree (the compatibility digest).

Two KVCR-linker servers, A on the tiny model and B on a copy of it under another
path. B fetches A's pages (same content, other path: shared); after B's
``/update_weights_from_disk`` to other weights it fetches nothing and matches its
own recompute; after updating back to the copy it shares again (the digest follows
the checkpoint content through the flush that re-keys KVCR). A third server, C,
differs from A only by ``--json-model-override-args`` and fetches nothing. The
three boot in parallel (about 2 minutes on 2 cores): opt-in (``-m scenario``),
run by ``make faults`` (its ``digest`` part), not by ``make test``.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from cpu_harness import tiny_model
from cpu_harness.kvcr_pages import fetch_hint as page_hint
from cpu_harness.kvcr_servers import PAGE, computed_on, recompute, run
from cpu_harness.kvcr_servers import launch_linker as launch

pytestmark = [pytest.mark.server, pytest.mark.kvcr, pytest.mark.scenario]

PROMPT_LEN = 256
ALIGNED = (PROMPT_LEN - 1) // PAGE * PAGE
OVERRIDE = json.dumps({"rope_theta": 1234.0})
SLEEP = ("--sleep-on-idle",)


def hint_maker() -> Callable[[str, list[int]], dict]:
    """``fetch_hint(endpoint, ids)``: a hint naming ``endpoint`` for the whole pages
    of ``ids`` (storage hashes: a plain request publishes exactly these). Made
    before the servers boot: a cold SGLang import next to three idle servers on 2
    cores takes over a minute, and the first hint would wait for it."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    def fetch_hint(endpoint: str, ids: list[int]) -> dict:
        hashes = get_storage_hash_str(RadixKey(ids[:ALIGNED]), None, page_size=PAGE)
        return page_hint(endpoint, hashes)

    return fetch_hint


def update_weights(server: Any, path: Path) -> None:
    resp = server.post("/update_weights_from_disk", {"model_path": str(path)}, 120)
    assert resp.status_code == 200 and resp.json().get("success"), resp.text


def test_hinted_fetch_restores_only_between_workers_with_equal_kv(tmp_path):
    rng = random.Random(7)
    fetch_hint = hint_maker()

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
        # Three idle schedulers spinning on 2 cores starve kvcr's progress loops
        # past operation_timeout_ms (docs: Troubleshooting), restarting KVCR.
        a = launch("a", a_path, tmp_path, SLEEP)
        servers.append(a)
        b = launch("b", copy, tmp_path, SLEEP)
        servers.append(b)
        c = launch(
            "c", a_path, tmp_path, (*SLEEP, "--json-model-override-args", OVERRIDE)
        )
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
