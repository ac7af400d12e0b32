"""The package's layering: no module imports a higher layer, and no modules import each other.

Every module of resilient_ckpt is parsed with ``ast`` (nothing is imported): module-level and
function-level imports, ``if TYPE_CHECKING:`` ones too (a dependency all the same), relative
and absolute. Imports through ``importlib`` with a computed name (the root's lazy exports, the
bench's system table) are not seen.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

REPO = Path(__file__).resolve().parents[1]
PKG = "resilient_ckpt"
ARCHITECTURE = REPO / "docs" / "architecture.md"

# The layer order, bottom to top: a module may import its own layer and the layers below it.
# Written once, here; the "Layers" table of docs/architecture.md mirrors it (the last test
# checks that the two agree). Entries are top-level modules/packages of resilient_ckpt.
LAYERS: List[Tuple[str, ...]] = [
    ("errors", "version", "gc_pause", "fork_safe_locks", "ports", "thread_pools", "bits", "timing"),
    ("model",),
    ("parallel",),
    ("memory",),
    ("replication",),
    ("service",),
    ("persistent",),
    ("manager",),
    # DCP StorageWriter/Reader; the Lightning and Hugging Face integrations (over the manager)
    ("dcp", "integrations"),
    ("cli", "bench", "demo"),  # the tools
]
# The root package's __init__ (lazy public exports) sits on top: it may import anything.
ROOT_LAYER = len(LAYERS) - 1


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in sorted((REPO / PKG).rglob("*.py"))}


def _resolve(node: ast.ImportFrom, module: str, is_package: bool, known: Set[str]) -> List[str]:
    """The modules of resilient_ckpt an ``from ... import ...`` names."""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        parts = package.split(".")
        base_parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base != PKG and not base.startswith(PKG + "."):
        return []
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        # `from pkg import submodule` depends on the submodule; `from mod import name` on mod.
        out.append(sub if sub in known else base)
    return out


def _imports(module: str, source: str, is_package: bool, known: Set[str]) -> List[Edge]:
    """Every import of a resilient_ckpt module anywhere in ``source`` (functions included)."""
    edges = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name == PKG or a.name.startswith(PKG + ".")]
        elif isinstance(node, ast.ImportFrom):
            targets = _resolve(node, module, is_package, known)
        else:
            continue
        edges += [Edge(module, t, node.lineno) for t in targets if t != module]
    return edges


def _edges(modules: Dict[str, Path]) -> List[Edge]:
    known = set(modules)
    edges = []
    for module, path in modules.items():
        edges += _imports(module, path.read_text(), path.name == "__init__.py", known)
    return edges


def _layer_of(module: str) -> Optional[int]:
    if module == PKG:
        return ROOT_LAYER
    top = module.split(".")[1]
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    return None


def _describe(module: str) -> str:
    i = _layer_of(module)
    return f"layer {i} {'root package' if module == PKG else module.split('.')[1]}"


MODULES = _modules()
EDGES = _edges(MODULES)


def test_the_parse_sees_imports_of_every_kind():
    """Guards the parser itself, on a made-up module ``resilient_ckpt.a.b`` (b.py in package a)."""
    source = """
import os, resilient_ckpt.x.y
from typing import TYPE_CHECKING
from . import sib, name_in_a
from .sib import thing
from .. import __version__
from ..x import y as yy
from resilient_ckpt.z import f
if TYPE_CHECKING:
    from .typed import T
def later():
    from ...elsewhere import nothing  # beyond the package: not ours
    import resilient_ckpt
"""
    known = {
        "resilient_ckpt",
        "resilient_ckpt.a",
        "resilient_ckpt.a.b",
        "resilient_ckpt.a.sib",
        "resilient_ckpt.a.typed",
        "resilient_ckpt.x",
        "resilient_ckpt.x.y",
        "resilient_ckpt.z",
    }
    got = [(e.dst, e.line) for e in _imports("resilient_ckpt.a.b", source, False, known)]
    assert sorted(got) == sorted(
        [
            ("resilient_ckpt.x.y", 2),
            ("resilient_ckpt.a.sib", 4),
            ("resilient_ckpt.a", 4),
            ("resilient_ckpt.a.sib", 5),
            ("resilient_ckpt", 6),
            ("resilient_ckpt.x.y", 7),
            ("resilient_ckpt.z", 8),
            ("resilient_ckpt.a.typed", 10),
            ("resilient_ckpt", 13),
        ]
    )
    # in a package's __init__, "." is the package itself
    init = _imports("resilient_ckpt.a", "from .sib import thing\n", True, known)
    assert [e.dst for e in init] == ["resilient_ckpt.a.sib"]


def test_every_module_belongs_to_a_layer():
    missing = sorted(m for m in MODULES if _layer_of(m) is None)
    assert not missing, (
        f"modules outside the layer table of {Path(__file__).name}: {missing}; add their "
        "package to LAYERS (and to docs/architecture.md)"
    )


def test_no_module_imports_a_higher_layer():
    upward = []
    for e in sorted(EDGES, key=lambda e: (e.src, e.line, e.dst)):
        i, j = _layer_of(e.src), _layer_of(e.dst)
        if i is not None and j is not None and j > i:
            upward.append(
                f"{e.src} -> {e.dst} ({_describe(e.src)} -> {_describe(e.dst)}; "
                f"{MODULES[e.src].relative_to(REPO)}:{e.line})"
            )
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def _components(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    sccs: List[List[str]] = []

    def strongconnect(v: str) -> None:  # ~60 modules: recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = [stack.pop()]
            while scc[-1] != v:
                scc.append(stack.pop())
            on_stack.difference_update(scc)
            if len(scc) > 1:
                sccs.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(sccs)


def _shortest_cycle(graph: Dict[str, Set[str]], members: Set[str], start: str) -> List[str]:
    """start -> ... -> start inside one component (breadth-first, so the shortest)."""
    prev: Dict[str, str] = {start: start}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle of its component")


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle (a -> ... -> a) per strongly connected component with more than one module."""
    return [_shortest_cycle(graph, set(scc), scc[0]) for scc in _components(graph)]


def test_cycle_finder_reports_a_cycle_as_a_path():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(g) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b", "c"}, "b": {"c"}, "c": {"a"}}) == [["a", "c", "a"]]  # the shortest
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph: Dict[str, Set[str]] = defaultdict(set)
    for m in MODULES:
        graph[m]
    for e in EDGES:
        graph[e.src].add(e.dst)
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _documented_layers() -> Dict[str, int]:
    """Top-level module -> layer number from the table under the "Layers" heading."""
    text = ARCHITECTURE.read_text()
    section = re.search(r"^#+ [^\n]*Layers[^\n]*\n(.*?)(?=^#+ |\Z)", text, re.M | re.S)
    assert section, f"{ARCHITECTURE.relative_to(REPO)} has no 'Layers' section"
    tops = {m.split(".")[1] for m in MODULES if m != PKG}
    out: Dict[str, int] = {}
    for row in section.group(1).splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].isdigit():
            continue
        for token in re.findall(r"`([^`]+)`", cells[1]):
            name = re.sub(r"\.py$", "", token.strip().strip("/")).replace("/", ".")
            parts = name.split(".")
            if parts[0] == PKG:
                parts = parts[1:]
            if parts and parts[0] in tops:
                out.setdefault(parts[0], int(cells[0]))
    return out


def test_docs_architecture_lists_the_same_layer_order():
    """docs/architecture.md's table: one row per layer, first cell its number, second cell the
    packages in backticks (e.g. `model/`); numbering may start anywhere, the order must match."""
    docs = _documented_layers()
    ours = {name: i for i, names in enumerate(LAYERS) for name in names}
    problems = [f"{n} is not in the table" for n in sorted(ours) if n not in docs]
    pairs = [(a, b) for a in sorted(ours) for b in sorted(ours) if a < b and a in docs and b in docs]
    for a, b in pairs:
        want = (ours[a] > ours[b]) - (ours[a] < ours[b])
        got = (docs[a] > docs[b]) - (docs[a] < docs[b])
        if want != got:
            problems.append(f"{a} (docs {docs[a]}, test {ours[a]}) vs {b} (docs {docs[b]}, test {ours[b]})")
    assert not problems, (
        f"{ARCHITECTURE.relative_to(REPO)} and LAYERS in {Path(__file__).name} disagree:\n"
        + "\n".join(problems)
    )
