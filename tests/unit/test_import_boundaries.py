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


# Algorithm math, rewards, data and config are pure: they must not pull in a framework at all.
PURE_PACKAGES = ("mrl/algo", "mrl/rewards", "mrl/data", "mrl/config")


@pytest.mark.parametrize("package", PURE_PACKAGES)
def test_pure_packages_import_no_framework(package):
    files = sorted(ROOT.glob(f"{package}/**/*.py"))
    assert files, f"{package} has no Python files"
    offenders = {f.relative_to(ROOT).as_posix(): sorted(_imports(f) & {"megatron", "ray", "vllm"}) for f in files}
    assert not {k: v for k, v in offenders.items() if v}, offenders
