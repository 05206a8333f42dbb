"""The house's shape: imports run one way, each script loads only what its job needs, and the maps match the rooms.

    python -m pytest tests/test_layout.py

Every module outside tests/ is parsed (nothing is imported or run) and each import, at module level and inside
functions alike, is an arrow from the importing module to the imported one; an import under `if TYPE_CHECKING:`
(for type hints only, never run) is not. The one circle allowed: nanoGPT's GPT.from_pretrained reaches
core/weights/hf.py, which builds GPTs, from inside the method; model.py imports nothing of core/ at its top.

Then each script is imported in a process of its own (importing does no work) and the project modules it loaded
are checked against its job's rules (WINGS_NOT_LOADED). Last, the maps: each package's docstring names its rooms,
and the README's Layout block every file it lists; a name outside parentheses is a room there, and the two lists
must equal the files.
"""
import ast
import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import run_script

ROOT = Path(__file__).resolve().parent.parent
# model.py's one import of core/, inside GPT.from_pretrained: the one circle.
MODEL_METHOD_IMPORTS = ["core.weights.hf"]


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
    type_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                 for stmt in block.body for node in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
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


def _is_type_checking(test: ast.expr) -> bool:  # `if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


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


def test_the_one_circle_is_model_and_hf():
    found = [sorted(c) for c in circles(import_graph())]
    assert found == [["core.weights.hf", "model"]], f"import circles: {found}; move the shared piece down a floor"


def test_model_imports_nothing_of_core_at_its_top():
    modules = project_modules()
    at_top = [(name, line) for name, line, top in imports_of(modules["model"], modules) if top]
    assert at_top == [], f"model.py imports {at_top} at module level: the network stands on torch alone"
    inside = [name for name, _, top in imports_of(modules["model"], modules) if not top]
    assert inside == MODEL_METHOD_IMPORTS, inside


def test_the_walk_sees_imports_inside_functions_and_circles_through_them(tmp_path):
    """The walk itself: an import inside a function is an arrow, one for type hints only is not, and a cycle of three
    through it is found whole."""
    lazy = tmp_path / "lazy.py"
    lazy.write_text("import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from core import kernels\n\n"
                    "def f():\n    from core import cpu\n    from core.cpu import PackedLinear\n")
    assert imports_of(lazy, {"core.cpu": lazy, "core.kernels": lazy}) == [("core.cpu", 7, False), ("core.cpu", 8, False)]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


# --- what each script loads -----------------------------------------------------------------------------------------

SCRIPTS = ("train", "rl", "sample", "eval", "serve", "export", "plot", "bench")
PREPARING = ("model", "core.decoding", "core.serving", "core.training")
WINGS_NOT_LOADED = {  # entry -> the project modules (and the modules under them) it must not load
    **{str(p.relative_to(ROOT)): PREPARING for p in sorted(ROOT.glob("data/*/prepare.py"))},
    "data/chat/tasks.py": PREPARING,
    "train.py": ("core.serving", "core.decoding"),
    "rl.py": ("core.serving",),
    "sample.py": ("core.serving", "core.training"),
    "eval.py": ("core.serving", "core.training"),
    "export.py": ("core.serving", "core.training", "core.decoding"),
    "serve.py": ("core.training",),
    "plot.py": ("model", "core.decoding", "core.serving", "core.training"),
    "bench.py": (),
    **{str(p.relative_to(ROOT)): () for p in sorted(ROOT.glob("scripts/*.py"))},
}
# No start imports sharding (0.7 s): fsdp runs import it where they shard, save or load.
SHARDING = ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp")
# In one fresh process that has imported torch and numpy (no project module), a forked child per entry: import the
# entry (as a module, not __main__), recording which module first imported each module; print a line
# {"entry": ..., "importer": {project module: its importer}} per entry.
LOADED = """
import builtins, importlib.util, json, os, sys, traceback
import numpy, torch
sys.path.insert(0, ".")
wanted, failed = sys.argv[1].split(","), 0
for entry in sys.argv[2:]:
    sys.stdout.flush()
    if os.fork() == 0:
        importer, real = {}, builtins.__import__
        def tracing(name, globals=None, locals=None, fromlist=(), level=0):
            count = len(sys.modules)  # most imports find their module loaded: a set of thousands each is minutes
            module = real(name, globals, locals, fromlist, level)
            if len(sys.modules) != count:
                for new in list(sys.modules)[count:]:  # loaded in order: the new ones are last
                    importer.setdefault(new, (globals or {}).get("__name__", "?"))
            return module
        builtins.__import__ = tracing
        try:
            spec = importlib.util.spec_from_file_location("__entry__", entry)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        loaded = {m: i for m, i in importer.items() if m.split(".")[0] in wanted}
        print(json.dumps({"entry": entry, "importer": loaded}), flush=True)
        os._exit(0)
    failed += os.wait()[1] != 0
sys.exit(failed)
"""


def chain(module: str, importer: dict[str, str], entry: str) -> str:
    """module <- what imported it <- ... <- the entry script."""
    links = [module]
    while links[-1] in importer and len(links) < 20:
        links.append(importer[links[-1]])
    return " <- ".join(links).replace("__entry__", entry)


def offences(entry: str, importer: dict[str, str], forbidden: tuple[str, ...]) -> list[str]:
    scripts = {name for name in importer if name.split(".")[0] in SCRIPTS + ("scripts",)}
    return ([f"{entry} loads {chain(m, importer, entry)}: a script imports core/, model.py and benchmarks/, "
             f"never another script" for m in sorted(scripts)]
            + [f"{entry} loads {chain(m, importer, entry)}, which its job does not need"
               for m in sorted(importer) if any(m == f or m.startswith(f + ".") for f in forbidden)])


@pytest.mark.slow
def test_each_script_loads_only_what_its_job_needs():
    entries = [p for p in WINGS_NOT_LOADED if (ROOT / p).is_file()]
    assert set(entries) >= {"train.py", "rl.py", "data/shakespeare_char/prepare.py", "data/chat/tasks.py"}
    wanted = ",".join(("core", "model", "benchmarks", "scripts", "torch") + SCRIPTS)
    result = run_script("-c", LOADED, wanted, *entries, timeout=300)
    assert result.returncode == 0, f"importing the entries: {result.stderr[-2000:]}"
    loaded = {r["entry"]: r["importer"] for r in (json.loads(line) for line in result.stdout.splitlines()
                                                 if line.startswith('{"entry"'))}
    assert list(loaded) == entries, result.stdout[-2000:]
    problems = [p for entry in entries for p in offences(entry, loaded[entry], WINGS_NOT_LOADED[entry] + SHARDING)]
    assert problems == [], "\n".join(problems)


def test_an_offence_names_the_module_and_who_pulled_it_in():
    importer = {"core": "core.data", "core.data": "__entry__", "core.data.chat": "__entry__",
                "core.decoding": "core.data.chat", "core.decoding.decode": "core.data.chat", "train": "core.data.chat"}
    assert offences("data/x/prepare.py", importer, PREPARING) == [
        "data/x/prepare.py loads train <- core.data.chat <- data/x/prepare.py: a script imports core/, model.py and "
        "benchmarks/, never another script",
        "data/x/prepare.py loads core.decoding <- core.data.chat <- data/x/prepare.py, which its job does not need",
        "data/x/prepare.py loads core.decoding.decode <- core.data.chat <- data/x/prepare.py, which its job does not "
        "need"]


# --- the maps: package docstrings and the README's Layout -----------------------------------------------------------

ROOM = re.compile(r"(?<![\w./<>-])([\w-]+\.(?:py|sh|mjs|json|md|html)|\w+/)(?![\w/])")


def named_rooms(text: str) -> set[str]:
    """The file (name.py, name.sh, ...) and folder (name/) names in text, leaving out what stands in parentheses."""
    depth, kept = 0, []
    for ch in text:
        depth += ch == "("
        kept.append(ch if depth == 0 else " ")
        depth -= ch == ")" and depth > 0
    return set(ROOM.findall("".join(kept)))


def real_rooms(folder: Path, files: set[Path]) -> set[str]:
    """A package's modules (but __init__.py) and sub-packages, as name.py and name/."""
    inside = {p.relative_to(folder).parts for p in files if folder in p.parents}
    return ({parts[0] for parts in inside if len(parts) == 1 and parts[0] != "__init__.py"}
            | {parts[0] + "/" for parts in inside if len(parts) > 1 and parts[1:] == ("__init__.py",)})


def map_problems(where: str, named: set[str], real: set[str]) -> list[str]:
    return ([f"{where} does not name {room}, which is there" for room in sorted(real - named)]
            + [f"{where} names {room}, which is not there" for room in sorted(named - real)])


def test_each_package_docstring_names_its_rooms():
    files = set(project_modules().values())
    packages = sorted(p.parent for p in files if p.name == "__init__.py")
    assert {ROOT / "core", ROOT / "core" / "decoding", ROOT / "benchmarks"} <= set(packages)
    problems = []
    for package in packages:
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        rooms = doc.partition("\n\n")[2]  # the first paragraph is the package's title
        problems += map_problems(f"{package.relative_to(ROOT)}/__init__.py's docstring", named_rooms(rooms),
                                 real_rooms(package, files))
    assert problems == [], "\n".join(problems)


def layout_entries(readme: str) -> list[tuple[str, str]]:
    """(path, its description) per line of the README's Layout block that opens with a path (indented 2 per level
    below a folder); a description's wrapped lines are indented further."""
    block = readme.split("## Layout", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
    entries, folders = [], []
    for number, line in enumerate(block.splitlines(), 1):
        indent = len(line) - len(line.lstrip())
        if indent >= 8 or not line.strip():
            if entries:
                entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
            continue
        assert indent % 2 == 0 and indent // 2 <= len(folders), f"Layout line {number} is indented oddly: {line!r}"
        token, _, description = line.strip().partition(" ")
        folders = folders[:indent // 2]
        path = "".join(folders) + token
        if token.endswith("/"):
            folders.append(token)
        entries.append((path, description.strip()))
    return entries


def layout_problems(readme: str, files: set[Path]) -> list[str]:
    listed = set()
    for path, description in layout_entries(readme):
        listed.add(path)
        if path.endswith("/"):  # a folder's description may name files in it
            listed |= {path + name for name in named_rooms(description)}
    exists = {p for p in listed if any(ROOT.glob(re.sub(r"<\w+>", "*", p.rstrip("/"))))}
    want = {str(p.relative_to(ROOT)) for p in files if p.name != "__init__.py"
            and (p.parent == ROOT or p.relative_to(ROOT).parts[0] in ("core", "benchmarks", "scripts", "config"))}
    return ([f"the README's Layout does not list {p}" for p in sorted(want - listed)]
            + [f"the README's Layout lists {p}, which is not there" for p in sorted(listed - exists)])


def test_the_readmes_layout_lists_the_files():
    files = set(project_modules().values())
    assert layout_problems((ROOT / "README.md").read_text(), files) == []


def test_a_room_left_out_of_a_map_is_named(tmp_path):
    """The checks themselves: a room missing from a docstring or from the Layout, and a named one that is gone."""
    assert named_rooms("a.py (what b.py does), c/ and d.sh; e.g. f") == {"a.py", "c/", "d.sh"}
    assert map_problems("x", {"a.py", "gone.py"}, {"a.py", "new.py"}) == ["x does not name new.py, which is there",
                                                                         "x names gone.py, which is not there"]
    files = set(project_modules().values())
    readme = (ROOT / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.lstrip().startswith("replies.py "))
    assert layout_problems(readme.replace(line + "\n", ""), files) == [
        "the README's Layout does not list core/decoding/replies.py"]
    assert layout_problems(readme.replace(line, line.replace("replies.py", "answers.py")), files) == [
        "the README's Layout does not list core/decoding/replies.py",
        "the README's Layout lists core/decoding/answers.py, which is not there"]
