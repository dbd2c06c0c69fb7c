"""One source of truth for the linker's numbers: the stats line is the snapshot.

After a real offload and restore through a bare linker, every scalar of
``stats_snapshot()`` appears in ``stats_line()`` under the same name with the same
value (as the drivers parse it), the nested ``misses`` and ``hints`` too, and the
counters moved by what the round trip did.
"""

from __future__ import annotations

import ast
import re

from cpu_harness.kvcr_pages import (
    PAGE_BYTES,
    fill_random,
    hashes_for,
    kv_transfer,
    make_linker,
    make_pool,
    offload_and_commit,
    prepare,
    restore,
)


def _line_values(line: str) -> dict[str, object]:
    assert line.startswith("KVCR_STATS ")
    values: dict[str, object] = {}
    for name, braced, plain in re.findall(r"(\w+)=(\{[^}]*\})?(\S+)?", line):
        values[name] = braced or plain
    return values


def test_the_stats_line_prints_every_number_of_the_snapshot(pool, linker):
    fill_random(pool, [1, 2], seed=3)
    hashes = hashes_for(2, "stats")
    assert offload_and_commit(linker, hashes, [1, 2]) is True
    prepare(linker, "r", hashes[:1])
    assert restore(linker, "r", hashes[:1], [5])
    snap = linker.stats_snapshot()
    line = _line_values(linker.stats_line())
    assert list(line) == list(snap)  # same names, same order
    for name, value in snap.items():
        if name == "misses":
            assert (
                line[name]
                == "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
            )
        elif name == "hints":
            assert ast.literal_eval(line[name]) == value
        else:
            assert float(line[name]) == float(value), name
    assert snap["offloads"] == 1 and snap["offload_pages"] == 2
    assert snap["offloaded_bytes"] == 2 * PAGE_BYTES
    assert snap["restored_bytes"] == PAGE_BYTES
    assert snap["loads"] == 1 and snap["load_pages"] == 1
    assert snap["resident_keys"] == 2
    linker.release_request("r")


def test_kvcr_counters_survive_a_flush():
    """A flush starts a new KVCR whose own counters start at 0; the snapshot (and
    so the stats line and the Prometheus counters fed from it) keeps counting."""
    pool = make_pool("cpu")
    # An in-flight budget of one page: a second offload while one is in flight
    # is refused (counted as refused_offload).
    lk = make_linker(pool, max_inflight_offload_bytes=PAGE_BYTES)
    try:
        fill_random(pool, [1, 2, 3], seed=4)
        hashes = hashes_for(3, "flush-counts")
        lk.offload(kv_transfer(hashes[:1], [1]), None)
        lk.offload(kv_transfer(hashes[1:2], [2]), None)
        lk.num_completed_offloads()  # the pump submits both deposits
        before = lk.stats_snapshot()["refused_offload"]
        assert before >= 1  # the second one found the budget taken
        lk.reset()
        assert lk.session.adapter.stats().refused_offload == 0  # a new KVCR
        assert lk.stats_snapshot()["refused_offload"] == before
        assert lk.session.stats().deposits >= 1
    finally:
        lk.close()
