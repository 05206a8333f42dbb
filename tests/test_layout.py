"""The house's shape: imports run one way, so each room can be read without the ones above it.

    python -m pytest tests/test_layout.py

Every module outside tests/ is parsed (nothing is imported or run) and each import, at module level and inside
functions alike, is an arrow from the importing module to the imported one. The one circle allowed is
model.py <-> core/weights/hf.py: hf builds GPTs, and GPT.from_pretrained, as nanoGPT's users know it, reaches
back into hf from inside the method; model.py imports nothing of core/ at its top.
"""
import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED_CIRCLES = [{"model", "core.weights.hf"}]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    """Every tracked .py file outside tests/ (and any new one git does not ignore), by dotted name."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    paths = [ROOT / p for p in listed if not p.startswith("tests/") and (ROOT / p).is_file()]
    return {module_name(p): p for p in paths}


def imports_of(path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(module imported, line, at module level?) for each import of a project module in path."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from core import cpu` names the module core.cpu; `from core.cpu import X` names core.cpu
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        found += [(name, node.lineno, id(node) in top) for name in names if name in modules]
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: {target for target, _, _ in imports_of(path, modules)} - {name} for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_but_from_pretrained():
    graph = import_graph()
    assert "core.weights.hf" in graph["model"], "GPT.from_pretrained reaches core/weights/hf.py"
    unexpected = [sorted(c) for c in circles(graph) if c not in ALLOWED_CIRCLES]
    assert unexpected == [], f"import circles: {unexpected}; move the shared piece down a floor"


def test_model_imports_nothing_of_core_at_its_top():
    modules = project_modules()
    at_top = [(name, line) for name, line, top in imports_of(modules["model"], modules) if top]
    assert at_top == [], f"model.py imports {at_top} at module level: the network stands on torch alone"
    inside = [name for name, _, top in imports_of(modules["model"], modules) if not top]
    assert inside == ["core.weights.hf"], inside


def test_the_walk_sees_imports_inside_functions_and_circles_through_them(tmp_path):
    """The walk itself: an import inside a function is an arrow, and a cycle of three through it is found whole."""
    lazy = tmp_path / "lazy.py"
    lazy.write_text("import os\n\ndef f():\n    from core import cpu\n    from core.cpu import PackedLinear\n")
    assert imports_of(lazy, {"core.cpu": lazy}) == [("core.cpu", 4, False), ("core.cpu", 5, False)]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []
