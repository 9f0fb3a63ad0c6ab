"""Import boundaries from DESIGN.md: only a few packages may import megatron, ray or vllm."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAY_IMPORT = {
    "megatron": ("mrl/megatron", "mrl/bridge", "mrl/models", "megatron_patches", "checkpoints_tools"),
    "ray": ("mrl/launch",),
    "vllm": ("mrl/rollout",),
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", list(MAY_IMPORT))
def test_only_allowed_packages_import(package):
    offenders = []
    for path in sorted(ROOT.glob("mrl/**/*.py")) + sorted(ROOT.glob("checkpoints_tools/**/*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if package in _imports(path) and not rel.startswith(MAY_IMPORT[package]):
            offenders.append(rel)
    assert not offenders, f"{package} imported outside {MAY_IMPORT[package]}: {offenders}"
