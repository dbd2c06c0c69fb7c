"""``make demo`` runs the main job only, and says where it is as it goes.

The demo driver selects exactly the six base checks (no family servers) and tags
its progress lines ``demo``; a phase prints a start line and an end line with
the seconds since the run started and how long it took, and ``FAILED`` when it
raised. The Makefile's ``demo`` runs that driver, ``validate`` the full one.
No server is started here.
"""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from cpu_harness.server import REPO
from kvcr_drivers import validate

MANUAL = REPO / "test" / "manual" / "kvcr_direct_linker"
LINE_RE = re.compile(
    r"^\[demo \+\s*\d+\.\ds\] (start|done |FAILED) (.+?)(?: \((\d+\.\d) s\))?$"
)


def load_demo(monkeypatch):
    monkeypatch.syspath_prepend(str(MANUAL))
    spec = importlib.util.spec_from_file_location("kvcr_demo", MANUAL / "kvcr_demo.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kvcr_demo", module)
    spec.loader.exec_module(module)
    return module


def test_demo_selects_the_base_checks_and_tags_its_progress(monkeypatch, tmp_path):
    demo = load_demo(monkeypatch)
    seen = {}

    def fake_main(self):
        seen["selected"] = set(self.selected)
        seen["tag"] = self.progress.tag
        return 0

    monkeypatch.setattr(demo.Driver, "main", fake_main)
    monkeypatch.setattr(
        validate.ServingRun,
        "__init__",
        lambda self, args, name: setattr(self, "args", args),
    )
    assert demo.main(["--report", str(tmp_path / "r.json")]) == 0
    assert seen == {"selected": set(validate.BASE_CHECKS), "tag": "demo"}
    assert not set(validate.FAMILY_CHECKS) & seen["selected"]
    demo.main(["--checks", "peer_reuse", "--report", str(tmp_path / "r.json")])
    assert seen["selected"] == {"peer_reuse"}


def test_each_phase_prints_its_start_and_end_with_elapsed_seconds(capsys):
    progress = validate.Progress("demo")
    with progress.phase("boot servers"):
        pass
    with pytest.raises(RuntimeError), progress.phase("peer_reuse"):
        raise RuntimeError("boom")
    lines = capsys.readouterr().out.splitlines()
    parsed = [LINE_RE.match(line) for line in lines]
    assert all(parsed), lines
    assert [(m.group(1), m.group(2)) for m in parsed] == [
        ("start", "boot servers"),
        ("done ", "boot servers"),
        ("start", "peer_reuse"),
        ("FAILED", "peer_reuse"),
    ]
    assert parsed[1].group(3) is not None and parsed[3].group(3) is not None


def test_make_demo_and_validate_run_their_drivers():
    makefile = (REPO / "Makefile").read_text()
    demo = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    full = makefile.split("\nvalidate:", 1)[1].split("\n\n", 1)[0]
    assert "kvcr_demo.py" in demo and "kvcr_validate.py" not in demo
    assert "kvcr_validate.py" in full
