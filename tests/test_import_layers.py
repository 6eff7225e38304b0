"""The package's architecture, held: rooms in layers, imports only downward, no cycle, no torch in the
planning layers.

Every import of every module under src/meshfit counts: at module level, inside functions, and under
`if TYPE_CHECKING:` (a cycle there is still a cycle a reader has to untangle). A module may import its own
room and any room on a lower layer; rooms on one layer are siblings that never import each other. The
layers, top to bottom, are `LAYERS` below; docs/development.md draws them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "meshfit"

# Top to bottom; a tuple holds siblings.
LAYERS = (
    ("commands",),
    ("dryrun", "calibrate", "demo", "runs"),
    ("planner", "train"),
    ("parallel",),
    ("config", "hardware"),
    ("layout",),
    ("models", "data", "memory"),
    ("util",),
)
LAYER_OF = {room: depth for depth, rooms in enumerate(LAYERS) for room in rooms}
TORCH_FREE = ("layout", "hardware", "planner")  # importable without torch: `meshfit plan` runs anywhere
LOOSE = {"__init__.py", "__main__.py"}  # the only modules at the package top


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The meshfit module an imported name lives in (`meshfit.a.b.func` -> `meshfit.a.b`)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported meshfit module, line, at module level) for every import statement in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = resolve(name, known) if name.startswith("meshfit") else None
            if target:
                found.append((target, node.lineno, id(node) in top))
    return found


def room(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def graph(known: dict[str, Path]) -> dict[str, set[str]]:
    return {m: {t for t, _, _ in imports(p, known) if t != m} for m, p in known.items()}


def layer_violations(known: dict[str, Path]) -> list[str]:
    found = []
    for module, path in known.items():
        here = room(module)
        if here == "__main__":
            continue  # the entry point: above every room
        for target, line, _ in imports(path, known):
            there = room(target)
            if there == here or (here == "" and module == "meshfit"):
                continue
            if here not in LAYER_OF or there not in LAYER_OF:
                found.append(f"{module}:{line} -> {target}: a room no layer names")
            elif LAYER_OF[there] <= LAYER_OF[here]:
                kind = "a sibling" if LAYER_OF[there] == LAYER_OF[here] else "an upper layer"
                found.append(f"{module}:{line} {here}/ imports {there}/ ({kind}): {target}")
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_only_the_entry_points_are_loose_at_the_package_top():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert set(loose) <= LOOSE, f"modules at the package top: {loose}; give each a room (a package)"
    rooms = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert rooms == sorted(LAYER_OF), f"rooms {rooms} against the layers' {sorted(LAYER_OF)}"


def test_imports_only_go_down_the_layers():
    assert layer_violations(modules()) == []


def test_no_import_cycle_between_files():
    assert cycles(graph(modules())) == []


def test_no_import_cycle_between_rooms():
    edges: dict[str, set[str]] = {}
    for module, targets in graph(modules()).items():
        edges.setdefault(room(module), set()).update(room(t) for t in targets if room(t) != room(module))
    assert cycles(edges) == []


def test_planning_layers_import_no_torch_at_module_level():
    known = modules()
    direct = []
    for module, path in known.items():
        if room(module) not in TORCH_FREE:
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            direct += [f"{module}:{node.lineno} {n}" for n in names if n == "torch" or n.startswith("torch.")]
    assert direct == []
    # What they import in turn (a package's __init__ included) must not bring torch in either.
    names = sorted(m for m in known if room(m) in TORCH_FREE)
    code = f"import importlib, sys\nfor m in {names!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_an_upward_import_is_caught(tmp_path):
    """The checks above can fail: the same tree with one upward import added inside a function of a low
    layer's module (layout/schedules.py, which config/ imports) breaks the layers and closes a cycle."""
    known = modules()
    copy = tmp_path / "schedules.py"
    copy.write_text(known["meshfit.layout.schedules"].read_text()
                    + "\n\ndef _late():\n    from meshfit.config import load_config\n")
    known["meshfit.layout.schedules"] = copy
    violations = layer_violations(known)
    assert len(violations) == 1 and "layout/ imports config/ (an upper layer): meshfit.config" in violations[0]
    assert any({"meshfit.config.sections", "meshfit.layout.schedules"} <= set(c) for c in cycles(graph(known)))
