"""memlab's import graph keeps DESIGN.md's layers: no loops, imports only downwards or sideways.

The graph is read from the source with ``ast``: every ``import memlab...`` and ``from ... import``
of a memlab module, at module level or inside a function (a lazy import is an edge too: the loop
it closes is only postponed to the first call), leaving out ``if TYPE_CHECKING:`` blocks (never
run). ``from package import name`` is an edge to the submodule ``package.name`` when there is one,
else to the package. Imports through ``importlib`` with computed names (``memlab/__init__.py``'s
lazy public names) are not seen; they are in the top layer, which may import anything.

Granularity: the units of DESIGN.md's layer table, not single modules. A unit is a package
(``memlab.line_profiler``, ``memlab.oom``, ``memlab.sources.allocator``, …) or a module that the
table places on its own (``memlab.courtesy``, ``memlab.history.export``, the layer-1 helpers); a
module belongs to the longest unit its name starts with. Loops inside one unit (``oom.postmortem``
and ``oom.state`` import each other lazily) are that package's own business; a loop between units
is a loop between concepts, which DESIGN.md forbids, and so is an import of a higher layer, even
without a loop yet: a lower layer takes a higher one's behaviour as a callback or an observer list
the higher one registers (``memlab._call_watches.CALL_WATCHES``, ``sources.tracker.OOM_OBSERVERS``).
Two placements differ from the table's words: ``memlab.sources.stats`` keeps only the key set, its
counters live in ``memlab.sources.allocator.stats`` (layer 2, as the allocator keeps them), and
``memlab.history.series`` replays snapshots with the allocator's size rules, so it is a layer-3
reader of snapshots beside ``history.export`` and the rest of ``history`` imports no allocator.

The last test imports every module alone, each in a fresh child of one interpreter that has
imported only torch, so that a module which imports only after another one was imported (a loop
that happens to work in one order) fails.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "memlab"

#: DESIGN.md's layers, lowest first: each unit and its layer.
LAYERS = {
    # 1: sizes, devices, gc-reachable tensors, names -> functions, and the other leaf helpers
    "memlab._units": 1,
    "memlab._devices": 1,
    "memlab._tensors": 1,
    "memlab._function_lookup": 1,
    "memlab._gpus": 1,
    "memlab._autocast": 1,
    "memlab._offload": 1,
    "memlab._movable": 1,
    "memlab._outputs": 1,
    "memlab._call_watches": 1,
    "memlab._progress": 1,
    "memlab._user_code": 1,
    "memlab._torch_version": 1,
    # 2: the CUDA caching allocator model; records of alloc/free with stacks, categories
    "memlab.sources.allocator": 2,
    "memlab.history": 2,
    # 3: the memory sources; snapshots read, written, replayed and drawn
    "memlab.sources": 3,
    "memlab.history.export": 3,
    "memlab.history.series": 3,
    "memlab.history.plot": 3,
    "memlab.history.timeline_svg": 3,
    "memlab.history.page": 3,
    "memlab.history.recording": 3,
    # 4: the line profiler, the reporter, courtesy
    "memlab.line_profiler": 4,
    "memlab.reporter": 4,
    "memlab.courtesy": 4,
    "memlab._parked": 4,  # Courtesy's placeholders (their storages are unseen by trackers)
    "memlab._parked_guard": 4,
    "memlab._moved": 4,
    # 5: estimates; beyond one process
    "memlab.estimate": 5,
    "memlab.distributed": 5,
    # 6: the planner; out-of-memory post-mortems
    "memlab.plan": 6,
    "memlab.oom": 6,
    # 7: the shells and the public face, which wires the layers together
    "memlab": 7,
    "memlab.__main__": 7,
    "memlab.cli": 7,
    "memlab.commands": 7,
    "memlab._arguments": 7,
    "memlab.extension": 7,
    "memlab.pytest_plugin": 7,
    "memlab.examples": 7,
    "memlab.integrations": 7,
}


class Import(NamedTuple):
    """One import statement: ``module`` (file ``path``, line ``line``) imports ``target``."""

    module: str
    target: str
    path: str
    line: int


def module_names() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name), sorted."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, source: str, path: str, is_package: bool, known: Iterable[str]) -> list[Import]:
    """The memlab imports of one module's ``source``, at any depth, outside ``TYPE_CHECKING``."""
    known = set(known)
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for statement in child.orelse:
                    visit_one(statement)
            else:
                visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend(
                Import(module, alias.name, path, node.lineno)
                for alias in node.names
                if alias.name.split(".")[0] == "memlab"
            )
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] == "memlab":
                named = [f"{target}.{alias.name}" for alias in node.names]
                targets = dict.fromkeys(name if name in known else target for name in named)
                found.extend(Import(module, name, path, node.lineno) for name in targets)
        visit(node)

    visit(ast.parse(source))
    return found


def package_imports() -> list[Import]:
    """Every memlab import of every module of the package."""
    names = module_names()
    found = []
    for module, path in names.items():
        relative = str(path.relative_to(PACKAGE.parent))
        found += imports_of(module, path.read_text(), relative, path.name == "__init__.py", names)
    return found


def unit_of(module: str) -> str:
    """The unit of :data:`LAYERS` that ``module`` belongs to (the bare package only for itself)."""
    parts = module.split(".")
    for end in range(len(parts), 1, -1):
        unit = ".".join(parts[:end])
        if unit in LAYERS:
            return unit
    if module == "memlab":
        return module
    raise KeyError(f"{module} is in no layer: add it (or its package) to LAYERS, as DESIGN.md places it")


def find_cycle(edges: dict[str, dict[str, Import]]) -> list[str] | None:
    """A cycle of units (the first unit repeated at the end), or ``None``: depth first, in sorted
    order, so that the same graph always reports the same cycle."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(unit: str) -> list[str] | None:
        state[unit] = 1
        path.append(unit)
        for target in sorted(edges.get(unit, {})):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := walk(target)) is not None:
                return cycle
        path.pop()
        state[unit] = 2
        return None

    for unit in sorted(edges):
        if unit not in state and (cycle := walk(unit)) is not None:
            return cycle
    return None


def unit_edges(imports: Iterable[Import]) -> dict[str, dict[str, Import]]:
    """unit -> imported unit -> the first import statement that makes the edge."""
    edges: dict[str, dict[str, Import]] = {}
    for found in imports:
        source, target = unit_of(found.module), unit_of(found.target)
        if source != target:
            edges.setdefault(source, {}).setdefault(target, found)
    return edges


def describe_cycle(cycle: list[str], edges: dict[str, dict[str, Import]]) -> str:
    """The cycle, one unit edge a line, each with the import that makes it."""
    lines = [" -> ".join(cycle)]
    for source, target in itertools.pairwise(cycle):
        found = edges[source][target]
        lines.append(f"  {source} -> {target}: {found.path}:{found.line} imports {found.target}")
    return "\n".join(lines)


def upward_imports(imports: Iterable[Import]) -> list[str]:
    """Each import of a higher layer, said with its place and both layers."""
    return [
        f"{found.path}:{found.line}: {found.module} (layer {LAYERS[unit_of(found.module)]}) imports "
        f"{found.target} (layer {LAYERS[unit_of(found.target)]})"
        for found in imports
        if LAYERS[unit_of(found.target)] > LAYERS[unit_of(found.module)]
    ]


def test_every_module_is_in_a_layer_and_every_unit_names_modules():
    units = {module: unit_of(module) for module in module_names()}  # raises naming a stray module
    assert set(units.values()) == set(LAYERS)
    assert units["memlab.sources.allocator.stats"] == "memlab.sources.allocator"
    assert units["memlab.history.recorder"] == "memlab.history"


def test_no_module_imports_a_higher_layer():
    upward = upward_imports(package_imports())
    assert not upward, "imports of a higher layer (hand its behaviour down as a callback):\n" + "\n".join(
        upward
    )


def test_no_import_loop_between_layer_units():
    edges = unit_edges(package_imports())
    cycle = find_cycle(edges)
    assert cycle is None, "import loop between units:\n" + describe_cycle(cycle, edges)


def test_the_graph_sees_lazy_and_relative_imports_but_not_type_checking_blocks():
    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "import memlab.sources.tracker\n"
        "from . import records\n"
        "from memlab.line_profiler import LineProfiler\n"
        "if TYPE_CHECKING:\n"
        "    from memlab.oom import OOMReport\n"
        "def show():\n"
        "    from memlab.oom.watch import watching\n"
    )
    known = {
        "memlab.line_profiler",
        "memlab.line_profiler.records",
        "memlab.oom.watch",
        "memlab.sources.tracker",
    }
    found = imports_of("memlab.line_profiler.view", source, "view.py", False, known)
    assert [(f.target, f.line) for f in found] == [
        ("memlab.sources.tracker", 3),
        ("memlab.line_profiler.records", 4),
        ("memlab.line_profiler", 5),
        ("memlab.oom.watch", 9),
    ]


def test_a_loop_is_reported_with_the_import_that_makes_each_edge():
    imports = package_imports()
    imports.append(
        Import("memlab.line_profiler.profiler", "memlab.oom.watch", "memlab/line_profiler/profiler.py", 32)
    )
    edges = unit_edges(imports)
    cycle = find_cycle(edges)
    assert cycle is not None
    # oom -> estimate -> line_profiler, or oom -> estimate -> distributed -> line_profiler: both loops
    assert cycle[0] == cycle[-1] and {"memlab.estimate", "memlab.line_profiler", "memlab.oom"} <= set(cycle)
    described = describe_cycle(cycle, edges)
    assert (
        "  memlab.line_profiler -> memlab.oom: memlab/line_profiler/profiler.py:32 imports memlab.oom.watch"
        in described.splitlines()
    )
    assert upward_imports(imports[-1:]) == [
        "memlab/line_profiler/profiler.py:32: memlab.line_profiler.profiler (layer 4) imports "
        "memlab.oom.watch (layer 6)"
    ]


def test_a_module_outside_every_layer_is_named():
    with pytest.raises(KeyError, match=r"memlab\._new_helper is in no layer"):
        unit_of("memlab._new_helper")


_IMPORT_EACH = """
import importlib, json, os, sys, traceback
import torch  # the slow import every module shares, made once before the children fork

assert not [name for name in sys.modules if name.split(".")[0] == "memlab"]
failed = {}
for name in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(name)
        except BaseException:
            os.write(write, traceback.format_exc().encode())
            os._exit(1)
        sys.stdout.flush()  # what a module printed (it must print nothing) reaches the test
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        error = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    if status:
        failed[name] = error or f"exit status {status}"
print(json.dumps(failed))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="imports each module in a forked child")
def test_every_module_imports_alone_in_a_fresh_interpreter():
    names = list(module_names())
    assert {"memlab", "memlab.sources.allocator.caching", "memlab.oom.watch"} <= set(names)
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, json.dumps(names)],
        capture_output=True,
        text=True,
        cwd=PACKAGE.parent,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    *printed, report = result.stdout.splitlines()
    failed = json.loads(report)
    assert failed == {}, "\n".join(f"{name}:\n{error}" for name, error in failed.items())
    assert printed == []  # no module prints when imported
