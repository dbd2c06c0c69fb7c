"""End to end on CPU servers: ``--enable-metrics`` exports the linker's numbers.

Two KVCR-linker servers boot together. The metered one (``--enable-metrics``)
computes a prompt, loses it from the device to filler traffic and restores it
from KVCR; its ``/metrics`` then shows the replay's restored bytes as the
restored pages times the layout's page bytes, its hits in pages and tokens, one
lookup, one load and one timed copy, every offloaded page's bytes, and SGLang's
scheduler labels on every ``sglang:kvcr_`` series. The plain one runs without the
flag but with a ``PROMETHEUS_MULTIPROC_DIR`` of its own, so anything its
processes registered would land there: after traffic the directory holds no
``sglang:kvcr_`` metric and ``/metrics`` serves none.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.parser import text_string_to_metric_families

from cpu_harness import tiny_model
from cpu_harness.kvcr_servers import PAGE, launch_linker, run

pytestmark = [pytest.mark.server, pytest.mark.kvcr]

PROMPT_LEN = 256
ALIGNED = (PROMPT_LEN - 1) // PAGE * PAGE
POOL_TOKENS = 4 * PROMPT_LEN  # launch_linker's --max-total-tokens
VOCAB = 300
SETTLE_TIMEOUT_S = 60.0
PUBLISH_WAIT_S = 1.5  # longer than linker_metrics.PUBLISH_PERIOD_S
OWN_LABELS = ("cause", "reason", "op")  # the families' own labels


def page_bytes() -> int:
    """One page's bytes over every KVCR pool, from the layout of the tiny
    model's KV pool (and, as a cross-check, its geometry)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang.srt.mem_cache.storage.kvcr.layout import page_layout, pool_layout

    head_dim = tiny_model.HIDDEN // tiny_model.HEADS
    pool = MHATokenToKVPool(
        8 * PAGE,
        PAGE,
        torch.bfloat16,
        tiny_model.KV_HEADS,
        head_dim,
        tiny_model.LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    identity = pool_layout.ModelIdentity("m", "", "d", tp_rank=0, tp_size=1)
    layout = page_layout.PageLayout.from_kv_pool(pool, PAGE, identity=identity)
    geometry = tiny_model.LAYERS * 2 * PAGE * tiny_model.KV_HEADS * head_dim * 2
    assert layout.page_total == geometry
    return layout.page_total


def scrape(server: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every ``sglang:kvcr_`` sample: (name, sorted labels) -> value."""
    resp = server.get("/metrics")
    assert resp.status_code == 200, resp.text[:500]
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
        if s.name.startswith("sglang:kvcr_")
    }


def value(samples: dict, name: str, **own: str) -> float:
    """The one sample of ``name`` whose own labels are ``own``."""
    hits = [
        v
        for (n, labels), v in samples.items()
        if n == name and all(dict(labels).get(k) == x for k, x in own.items())
    ]
    assert len(hits) == 1, (name, own, hits)
    return hits[0]


def settled(server: Any) -> dict:
    """A scrape that a later one, past a publish period, repeats exactly."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last = scrape(server)
    while time.monotonic() < deadline:
        time.sleep(PUBLISH_WAIT_S)
        now = scrape(server)
        if now == last and now:
            return now
        last = now
    raise AssertionError(f"kvcr metrics still moving after {SETTLE_TIMEOUT_S} s")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("kvcr-metrics")
    model = tiny_model.ensure_tiny_model()
    multiproc = work / "plain-prometheus"
    multiproc.mkdir()
    handles: dict[str, Any] = {}
    try:
        handles["metered"] = launch_linker(
            "metered", model, work, ["--enable-metrics"], prompt_len=PROMPT_LEN
        )
        with pytest.MonkeyPatch.context() as env:  # the plain server's only
            env.setenv("PROMETHEUS_MULTIPROC_DIR", str(multiproc))
            handles["plain"] = launch_linker(
                "plain", model, work, prompt_len=PROMPT_LEN
            )
        for handle in handles.values():
            handle.wait_ready(420)
        handles["plain_dir"] = multiproc
        yield handles
    finally:
        for name, handle in handles.items():
            if name != "plain_dir":
                handle.stop()


def test_a_restore_moves_the_counters_by_its_bytes(servers):
    server = servers["metered"]
    rng = random.Random(11)
    prompt = [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]
    control, _ = run(server, prompt)
    for _ in range(2 * POOL_TOKENS // PROMPT_LEN + 2):  # evict it from the device
        run(server, [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)])
    before = settled(server)

    output, restored_tokens = run(server, prompt)
    assert output == control
    assert restored_tokens >= 0.9 * ALIGNED, server.log_tail()
    after = settled(server)
    for (name, labels), number in sorted(after.items()):  # the scrape, for logs
        if not name.endswith("_bucket"):
            own = ",".join(f"{k}={v}" for k, v in labels if k in OWN_LABELS)
            print(f"{name}{{{own}}} {number:g}")

    def moved(name: str) -> float:
        return value(after, name) - value(before, name)

    pages, nbytes = restored_tokens // PAGE, page_bytes()
    assert restored_tokens % PAGE == 0
    assert moved("sglang:kvcr_restored_bytes_total") == pages * nbytes
    assert moved("sglang:kvcr_hit_pages_total") == pages
    assert moved("sglang:kvcr_hit_tokens_total") == restored_tokens
    assert moved("sglang:kvcr_lookups_total") == 1
    assert moved("sglang:kvcr_loads_total") == 1
    assert moved("sglang:kvcr_restore_copy_seconds_count") == 1
    assert value(after, "sglang:kvcr_load_failures_total") == 0
    # Every submitted offload landed, page by page.
    offloaded = value(after, "sglang:kvcr_offloaded_pages_total")
    assert offloaded >= 11 * (PROMPT_LEN // PAGE) - 11  # 11 prompts' full pages
    assert value(after, "sglang:kvcr_offloaded_bytes_total") == offloaded * nbytes
    keys = value(after, "sglang:kvcr_resident_keys")
    assert keys > 0
    assert value(after, "sglang:kvcr_dram_used_bytes") == keys * nbytes
    assert value(after, "sglang:kvcr_dram_bytes") >= keys * nbytes
    assert value(after, "sglang:kvcr_misses_total", cause="unclaimed") >= 0


def test_every_kvcr_series_carries_the_scheduler_labels(servers):
    server = servers["metered"]
    text = server.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    scheduler = dict(families["sglang:num_running_reqs"].samples[0].labels)
    assert {"model_name", "tp_rank", "engine_type"} <= set(scheduler)
    ours = scrape(server)
    assert ours
    for name, labels in ours:
        common = {k: v for k, v in labels if k not in {*OWN_LABELS, "le"}}
        assert common == scheduler, name


def test_without_the_flag_nothing_is_registered(servers):
    server = servers["plain"]
    rng = random.Random(12)
    prompt = [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]
    run(server, prompt)
    time.sleep(PUBLISH_WAIT_S)  # a publish period: a registered exporter ran
    run(server, prompt)
    assert "KVCR direct linker up" in server.log_text()
    resp = server.get("/metrics")
    assert "sglang:kvcr_" not in resp.text
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(servers["plain_dir"]))
    names = [f.name for f in registry.collect()]
    assert not [n for n in names if n.startswith("sglang:kvcr_")], names
