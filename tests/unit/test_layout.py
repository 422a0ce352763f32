"""The package's shape: no import circle, a small root in data-path order, one source per flag."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import vllm_afd
from vllm_afd.config import FLAG_KEYS, flag_table

PACKAGE = Path(vllm_afd.__file__).parent
README = PACKAGE.parent / "README.md"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks (a type-only import runs
    nothing: it is a contract a type checker holds, not a tie)."""
    nodes, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            todo.extend(node.orelse)
            continue
        nodes.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """vllm_afd modules ``name`` imports anywhere in its body (module level or lazily), type-only
    imports aside."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
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


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["vllm_afd"], "the graph must see register()'s lazy import"
    assert _cycles(graph) == []


def _unit(module: str) -> str:
    """The folder (``ffn``, ``attention``, ...) or root module (``config``, ``errors``, ...)
    ``module`` belongs to; ``vllm_afd`` for the package's ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _unit_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        ties = graph.setdefault(_unit(name), set())
        ties.update(_unit(t) for t in _imports(name, path, modules))
    return {unit: ties - {unit} for unit, ties in graph.items()}


#: Folder ties that must never exist. The FFN side reaches the attention side only through the
#: transport's contract (``transport.base``) and registry; the transport knows neither side nor
#: what places them; errors come from ``errors.py``, which needs nothing, and ``envs.py`` reads
#: the environment needing only it.
NEVER = {
    "ffn": {"attention", "placement", "deployment", "cli", "bench"},
    "attention": {"ffn", "placement", "deployment", "cli", "bench", "patches"},
    "transport": {"attention", "ffn", "placement", "deployment", "patches", "config", "metrics"},
    "placement": {"attention", "deployment", "cli", "bench"},
    "errors": {"*"},
    "envs": {"*"},
}
#: What ``envs`` may import.
ENVS_NEEDS = {"errors"}


def test_no_folder_imports_what_it_must_not():
    graph = _unit_graph()
    assert set(NEVER) <= set(graph) and "attention" in graph
    found = {}
    for unit, never in NEVER.items():
        allowed = ENVS_NEEDS if unit == "envs" else set()
        bad = graph[unit] - allowed if "*" in never else graph[unit] & never
        if bad:
            found[unit] = sorted(bad)
    assert found == {}


def test_no_two_folders_import_each_other():
    graph = _unit_graph()
    both = {(a, b) for a in graph for b in graph[a] if a < b and a in graph.get(b, set())}
    assert both == set()


def test_folders_form_no_circle_but_through_the_patches():
    """``patches/`` is the one folder tied both ways: its wrappers run at vLLM's call sites
    and call into the product (W4 opens the attention session, the engine-args wrapper starts
    the deployment), and product modules call the patch helpers they need (``ffn/weights``:
    F1-F3). Without it the folders form no circle."""
    graph = _unit_graph()
    without = {u: ties - {"patches"} for u, ties in graph.items() if u != "patches"}
    assert _cycles(without) == []


#: The concrete backends: the FFN side reaches them only through the registry (``transport``).
CONCRETE_BACKENDS = {
    "vllm_afd.transport.endpoint",
    "vllm_afd.transport.slot_plane",
    "vllm_afd.transport.slot_plane_cuda",
    "vllm_afd.transport.slots",
    "vllm_afd.transport.nixl",
    "vllm_afd.testing.reference",
}


def test_the_ffn_side_imports_no_concrete_backend():
    modules = _modules()
    assert CONCRETE_BACKENDS <= set(modules)  # each name is a module that exists
    ties = {
        name: sorted(_imports(name, path, modules) & CONCRETE_BACKENDS)
        for name, path in modules.items()
        if _unit(name) == "ffn"
    }
    assert {name: found for name, found in ties.items() if found} == {}


def test_errors_come_from_errors_py():
    """Every import of a product error names ``vllm_afd.errors``, not a module that happens
    to import it."""
    import vllm_afd.errors as errors

    names = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, Exception)}
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module not in (None, "vllm_afd.errors"):
                found += [
                    f"{name}: {a.name} from {node.module}" for a in node.names if a.name in names
                ]
    assert found == []


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_package_root_is_small():
    root = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(root) <= 9, root


def test_no_product_module_over_900_lines():
    """The tools (bench/, planner/) aside: a module that long holds more than one job."""
    long = {
        name: n
        for name, path in _modules().items()
        if not name.startswith(("vllm_afd.bench", "vllm_afd.planner"))
        and (n := len(path.read_text().splitlines())) > 900
    }
    assert long == {}, long


def test_the_planner_is_pure():
    """The planner reads configs and files and computes: it imports no engine, FFN, transport,
    placement or benchmark module (``vllm-afd profile`` is ``bench/calibrate.py``)."""
    modules = _modules()
    allowed = ("vllm_afd.planner", "vllm_afd.config", "vllm_afd.errors", "vllm_afd.envs")
    imported = {
        target
        for name, path in modules.items()
        if name.startswith("vllm_afd.planner")
        for target in _imports(name, path, modules)
    }
    assert {t for t in imported if not t.startswith(allowed)} == set()


def test_microbatch_is_pure():
    """The ping-pong mechanism imports neither vLLM nor the rest of the package."""
    tree = ast.parse((PACKAGE / "microbatch.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] in ("vllm", "vllm_afd")}


def test_readme_flag_table_is_the_config():
    """README's flag table is exactly what ``AFDConfig``'s field metadata declares."""
    rows = re.findall(r"^\| `(--afd-[^`]*)` \| (.*?) \| (.*?) \|$", README.read_text(), re.M)
    expected = [
        (flag, f"`{default}`" if default else "", text) for flag, default, text in flag_table()
    ]
    assert rows == expected
    assert [r[0].split()[0] for r in rows] == list(FLAG_KEYS)


def test_test_files_have_unique_names():
    """Test folders have no ``__init__.py`` (pytest imports each file by its base name), so two
    test files of one name would stop the whole run at collection."""
    names = [p.name for p in (PACKAGE.parent / "tests").rglob("*.py") if p.name != "conftest.py"]
    assert sorted({n for n in names if names.count(n) > 1}) == []
