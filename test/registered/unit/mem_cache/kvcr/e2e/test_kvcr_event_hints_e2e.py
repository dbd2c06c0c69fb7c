"""End to end on CPU servers: a hint built only from worker A's published KV
events restores on worker B, for plain, salted and ``extra_key`` requests.

A subscriber reads A's ``BlockStored`` events from SGLang's own ZMQ publisher
(dynamo format, which namespaces salted and keyed pages) and builds B's
``kv.fetch`` hint from them the way a router does. Each request restores on B with
output equal to A's; A's hashes for one salt sent with another salt restore
nothing. (LoRA needs adapter weights the CPU server does not load here; its
namespacing is checked against SGLang's recorder in test_kvcr_event_hashes.py.)
"""

from __future__ import annotations

import random

import pytest

from cpu_harness import kvcr_servers as kvs
from cpu_harness import server as harness
from cpu_harness import tiny_model
from cpu_harness.kvcr_pages import fetch_hint

pytestmark = [pytest.mark.server, pytest.mark.kvcr]

PROMPT_LEN = 256
PAGES = (PROMPT_LEN - 1) // kvs.PAGE  # whole pages SGLang caches of a prompt
ALIGNED = PAGES * kvs.PAGE


def test_hints_built_from_published_events_restore_on_a_peer(tmp_path):
    rng = random.Random(11)

    def prompt() -> list[int]:
        return [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]

    model = tiny_model.ensure_tiny_model()
    events_port = harness.free_port()
    servers = []
    subscriber = None
    try:
        a = kvs.launch_linker(
            "a", model, tmp_path, kvs.kv_events_args(events_port, dynamo=True)
        )
        servers.append(a)
        b = kvs.launch_linker(
            "b", model, tmp_path, kvs.kv_events_args(harness.free_port(), dynamo=True)
        )
        servers.append(b)
        for handle in servers:
            handle.wait_ready(420)
        subscriber = kvs.EventSubscriber(events_port)

        def restore_on_b(ids: list[int], **namespace: str) -> None:
            control = kvs.computed_on(a, ids, **namespace)
            published = subscriber.wait_chain(ids, PAGES)
            hint = fetch_hint(a.endpoint, published)
            output, external = kvs.run(b, ids, kv_hints=hint, **namespace)
            assert external >= 0.9 * ALIGNED, (namespace, external, b.log_tail())
            assert output == control, namespace

        restore_on_b(prompt())
        restore_on_b(prompt(), cache_salt="tenant-a")
        restore_on_b(prompt(), extra_key="conversation-7")
        restore_on_b(prompt(), cache_salt="tenant-a", extra_key="conversation-7")

        # A's hashes for tenant-a, sent with another tenant's request: nothing.
        ids = prompt()
        control = kvs.computed_on(a, ids, cache_salt="tenant-a")
        hint = fetch_hint(a.endpoint, subscriber.wait_chain(ids, PAGES))
        output, external = kvs.run(b, ids, kv_hints=hint, cache_salt="tenant-b")
        assert external == 0, b.log_tail()
        assert output == control  # same model and tokens: the salt only scopes reuse
    finally:
        if subscriber is not None:
            subscriber.close()
        for handle in servers:
            handle.stop()
