"""Import boundaries from DESIGN.md: only a few packages may import megatron, ray or vllm, and the
packages of mrl form no cycle. Every import counts, also one inside a function (ast.walk sees them)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAY_IMPORT = {
    "megatron": ("mrl/megatron", "mrl/bridge", "mrl/models", "megatron_patches", "checkpoints_tools"),
    "ray": ("mrl/launch",),
    "vllm": ("mrl/rollout",),
}


def _modules(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function (relative imports resolved)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            names.add(".".join(p for p in (base, node.module or "") if p))
    return names


def _imports(path: Path) -> set[str]:
    return {name.split(".")[0] for name in _modules(path)}


@pytest.mark.parametrize("package", list(MAY_IMPORT))
def test_only_allowed_packages_import(package):
    offenders = []
    for path in sorted(ROOT.glob("mrl/**/*.py")) + sorted(ROOT.glob("checkpoints_tools/**/*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if package in _imports(path) and not rel.startswith(MAY_IMPORT[package]):
            offenders.append(rel)
    assert not offenders, f"{package} imported outside {MAY_IMPORT[package]}: {offenders}"


# Algorithm math, rewards, data, config, quantisation formats and the memory plan are pure: they must
# not pull in a framework at all.
PURE_PACKAGES = ("mrl/algo", "mrl/rewards", "mrl/data", "mrl/config", "mrl/quant", "mrl/plan")


@pytest.mark.parametrize("package", PURE_PACKAGES)
def test_pure_packages_import_no_framework(package):
    files = sorted(ROOT.glob(f"{package}/**/*.py"))
    assert files, f"{package} has no Python files"
    offenders = {f.relative_to(ROOT).as_posix(): sorted(_imports(f) & {"megatron", "ray", "vllm"}) for f in files}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def _unit(module: str) -> str | None:
    """The package a module belongs to for the cycle check: mrl.X (a subpackage or a top-level
    module of mrl), or a top-level package of this repository."""
    parts = module.split(".")
    if parts[0] == "mrl":
        return ".".join(parts[:2]) if len(parts) > 1 else None
    return parts[0] if parts[0] in ("checkpoints_tools", "megatron_patches") else None


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.glob("mrl/**/*.py")) + sorted(ROOT.glob("checkpoints_tools/**/*.py")):
        rel = path.relative_to(ROOT).with_suffix("").parts
        source = _unit(".".join(rel[:-1] if rel[-1] == "__init__" else rel))
        if source is None:
            continue
        targets = {_unit(m) for m in _modules(path)}
        graph.setdefault(source, set()).update(t for t in targets if t and t != source)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle's packages, found by depth-first search (one cycle per back edge)."""
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        state[node] = "done"
        stack.pop()

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_package_import_cycles():
    graph = package_graph()
    assert "mrl.sync" in graph and "mrl.bridge" in graph["mrl.sync"], "the graph misses imports"
    assert not cycles(graph), "package import cycles (import from a lower package, or move the code): " + "; ".join(
        " → ".join(c) for c in cycles(graph))
