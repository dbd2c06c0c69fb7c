"""``accept_request_hints: false``: a worker that ignores every request hint.

SGLang takes ``kv_hints`` on ``/generate`` from any client; a worker clients can
reach without a hint-stripping router turns hints off. A hint is then counted as
``disabled`` and never dials a peer, while the same hint is honoured by a worker
that accepts hints (so the hint itself is good).
"""

from __future__ import annotations

import pytest

from cpu_harness.kvcr_pages import (
    fetch_hint,
    fill_random,
    hashes_for,
    kv_transfer,
    make_linker,
    make_pool,
    offload_and_commit,
    wait_until,
)
from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRConfigError
from sglang.srt.mem_cache.storage.kvcr.config.linker_config import KVCRLinkerConfig
from sglang.srt.mem_cache.storage.kvcr.fleet.router_hint import HintRejection
from sglang.srt.mem_cache.storage.kvcr.sglang_hooks.linker_hooks import (
    LinkerRequestContext,
)

GOOD = {"local_dram_bytes_per_worker": 1 << 26}


def test_the_setting_is_a_boolean_defaulting_to_on():
    assert KVCRLinkerConfig.from_dict(GOOD).accept_request_hints is True
    off = KVCRLinkerConfig.from_dict({**GOOD, "accept_request_hints": False})
    assert off.accept_request_hints is False
    with pytest.raises(KVCRConfigError, match="accept_request_hints"):
        KVCRLinkerConfig.from_dict({**GOOD, "accept_request_hints": "no"})


def _hinted_pages(lk, rid, hint, hashes):
    handle = lk.prepare_request(LinkerRequestContext(rid, 0, hint), kv_transfer(hashes))
    wait_until(lambda: lk.preparation_ready(handle), timeout=20, what="preparation")
    pages = lk.lookup(rid, kv_transfer(hashes))
    lk.release_request(rid)
    return pages


@pytest.mark.kvcr
def test_a_worker_with_hints_off_ignores_a_hint_another_worker_honours():
    source_pool = make_pool()
    fill_random(source_pool, [1, 2, 3], seed=5)
    source = make_linker(source_pool)
    closed = [source]
    try:
        hashes = hashes_for(3, "hints-off")
        assert offload_and_commit(source, hashes, [1, 2, 3]) is True
        hint = fetch_hint(source.endpoint, hashes)

        deaf = make_linker(make_pool(), accept_request_hints=False)
        closed.append(deaf)
        assert _hinted_pages(deaf, "off", hint, hashes) == []
        assert deaf.hints.stats.rejected[HintRejection.DISABLED] == 1
        assert deaf.hints.stats.accepted == 0
        assert "rejected_disabled" in deaf.stats_line()

        listening = make_linker(make_pool())
        closed.append(listening)
        assert _hinted_pages(listening, "on", hint, hashes) == [1, 2, 3]
    finally:
        for lk in reversed(closed):
            lk.close()
