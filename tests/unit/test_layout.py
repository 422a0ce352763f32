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


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """vllm_afd modules ``name`` imports anywhere in its body (module level or lazily)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
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


#: The attention side and the concrete backends: the FFN side reaches them only through the
#: ``FFNTransport`` contract (``transport.base``) and the registry (``transport``).
NOT_FOR_THE_FFN_SIDE = {
    "vllm_afd.remote_experts",
    "vllm_afd.transport.endpoint",
    "vllm_afd.testing.reference",
    "vllm_afd.transport.slot_plane",
    "vllm_afd.transport.slot_plane_cuda",
    "vllm_afd.transport.slots",
    "vllm_afd.transport.tcp",
}


def test_the_ffn_side_imports_no_attention_side_and_no_concrete_backend():
    modules = _modules()
    assert NOT_FOR_THE_FFN_SIDE <= set(modules)  # each name is a module that exists
    ties = {
        name: sorted(_imports(name, path, modules) & NOT_FOR_THE_FFN_SIDE)
        for name, path in modules.items()
        if name == "vllm_afd.ffn" or name.startswith("vllm_afd.ffn.")
    }
    assert {name: found for name, found in ties.items() if found} == {}


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
