"""NVIDIA Dynamo 1.6.1 picks the peer and writes the hint; the linker restores.

Runs ``kvcr_drivers.interop.dynamo_interop`` (its docstring says what each check
is) with Dynamo's selection service from ``.venv-interop``; selected only by
``-m interop`` (``make interop`` builds that venv), never in ``make test``.
"""

from __future__ import annotations

import pytest

from kvcr_drivers.interop import dynamo_interop

pytestmark = [pytest.mark.interop, pytest.mark.server, pytest.mark.kvcr]


def test_dynamo_written_hint_restores_from_the_peer(tmp_path):
    assert dynamo_interop.INTEROP_PYTHON.exists(), "run `make interop` first"
    report = dynamo_interop.run(tmp_path)
    seen = report["dynamo"]
    hint = seen["hint_as_written"]
    assert hint["protocol_version"] == "0.1", hint
    assert seen["hint_envelope"]["names_a"], seen["hint_envelope"]
    assert seen["restored_tokens"] >= 0.9 * seen["aligned_tokens"], seen
    assert report["checks"] == {
        "free_booking_picks_holder": True,
        "pinned_booking_restores_from_peer": True,
        "hint_carries_a_published_hashes": True,
        "salted_prompt": True,
        "flush_drops_index": True,
    }, seen
