"""The package's house rules, read off its source: layers import down, no circles.

Every import of one of the package's modules by another (module level, inside a
function or under ``TYPE_CHECKING`` alike) is an arrow. An arrow between two
subpackages must be in ``MAY_IMPORT``; a subpackage never imports the top-level
modules (the plugin, the builder, the linkers, ``rank_setup``); and no set of
modules imports each other in a loop. Module and class sizes stay small.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sglang.srt.mem_cache.storage.kvcr as pkg

PKG = pkg.__name__
ROOT = Path(pkg.__file__).parent
TOP = "<top>"  # the package's own top-level modules

# Which subpackages each subpackage may import (its own modules always).
MAY_IMPORT: dict[str, frozenset[str]] = {
    "config": frozenset(),
    "device": frozenset(),
    "layout": frozenset({"config"}),
    "fleet": frozenset({"config", "layout"}),
    "observability": frozenset({"config", "fleet"}),
    "sglang_hooks": frozenset({"config", "fleet"}),
    "owner": frozenset({"config", "device", "layout", "fleet", "observability"}),
    "requests": frozenset(
        {"config", "layout", "fleet", "observability", "sglang_hooks", "owner"}
    ),
    "datapath": frozenset(
        {
            "config",
            "device",
            "layout",
            "fleet",
            "observability",
            "sglang_hooks",
            "owner",
            "requests",
        }
    ),
}
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 310  # "about 300": the linker class is the largest


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((PKG, *parts))] = path
    return out


def _arrows(modules: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, imported) for every import between the package's modules."""
    arrows = set()
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            # ``from pkg.sub import module`` names a module; else the module itself.
            hit = next((t for t in targets if t in modules and t != PKG), None)
            if hit is not None and hit != name:
                arrows.add((name, hit))
    return arrows


def _room(module: str) -> str:
    """The subpackage a module lives in, or TOP for the package's own modules."""
    parts = module[len(PKG) + 1 :].split(".")
    return parts[0] if len(parts) > 1 else TOP


def _circles(arrows: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, list[str]] = {}
    for a, b in arrows:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_subpackage_is_in_the_table():
    rooms = {_room(m) for m in _modules()} - {TOP}
    assert rooms == set(MAY_IMPORT), rooms ^ set(MAY_IMPORT)


def test_the_table_itself_points_one_way():
    order: list[str] = []
    left = dict(MAY_IMPORT)
    while left:
        ready = [r for r, deps in left.items() if deps <= set(order)]
        assert ready, f"the allowed imports loop among {sorted(left)}"
        order += sorted(ready)
        for r in ready:
            del left[r]


def test_imports_between_subpackages_point_down():
    upward = sorted(
        f"{a} -> {b}"
        for a, b in _arrows(_modules())
        if _room(a) != _room(b)
        and _room(a) != TOP
        and (_room(b) == TOP or _room(b) not in MAY_IMPORT[_room(a)])
    )
    assert upward == [], "imports against the layer table:\n" + "\n".join(upward)


def test_no_import_circles():
    assert _circles(_arrows(_modules())) == []


def test_the_checks_see_a_planted_upward_import_and_circle():
    """The graph reader would catch a layer importing up and a two-module loop."""
    arrows = {
        (f"{PKG}.config.errors", f"{PKG}.owner.kvcr_adapter"),
        (f"{PKG}.owner.kvcr_adapter", f"{PKG}.config.errors"),
    }
    assert _circles(arrows) == [sorted(a for a, _ in arrows)]
    a, b = next(iter(sorted(arrows)))
    assert _room(a) == "config" and _room(b) == "owner"
    assert "owner" not in MAY_IMPORT["config"]
    # The real graph has arrows of every kind this test reads (from imports, lazy
    # imports inside functions, and ``from pkg.sub import module``).
    real = _arrows(_modules())
    assert (f"{PKG}.plugin", f"{PKG}.builder") in real  # lazy, in a function
    assert (f"{PKG}.builder", f"{PKG}.rank_setup") in real  # module form
    assert len(real) > 100


def test_modules_and_classes_stay_small():
    big = []
    for name, path in _modules().items():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            big.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    big.append(f"{name}.{node.name}: {size} lines")
    assert big == [], big
