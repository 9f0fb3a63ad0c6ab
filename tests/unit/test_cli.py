"""The `mrl` command (mrl/cli): usage, --version, `mrl merge`, per-direction `convert` help, the
tiny zoo's help, and `--help` answered without importing the heavy stacks (speed itself is measured
in docs/benchmarks.md, not asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mrl.cli import SUBCOMMANDS, main, version
from mrl.cli.convert import DIRECTIONS

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "ray", "vllm", "megatron", "transformers")

# Run in a fresh interpreter: every `--help` there, then the heavy modules that got imported.
_HELP_ALL = """
import contextlib, io, json, sys
from mrl.cli import SUBCOMMANDS, main
from mrl.cli.convert import DIRECTIONS
from mrl.cli.merge import main as mrl_merge

calls = [[name, "--help"] for name in SUBCOMMANDS] + [["convert", d, "--help"] for d in DIRECTIONS] + [["--help"]]
results = {}
for argv in calls + [["mrl-merge", "--help"]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = mrl_merge(argv[1:]) if argv[0] == "mrl-merge" else main(argv)
        except SystemExit as exit:
            code = exit.code
    results[" ".join(argv)] = {"code": code, "help": out.getvalue()}
heavy = sorted({name.split(".")[0] for name in sys.modules} & {"torch", "ray", "vllm", "megatron", "transformers"})
print(json.dumps({"results": results, "heavy": heavy}))
"""


@pytest.fixture(scope="module")
def helps() -> dict:
    done = subprocess.run([sys.executable, "-c", _HELP_ALL], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_every_help_answers_without_importing_torch_ray_vllm_megatron_or_transformers(helps):
    assert helps["heavy"] == []
    for argv, result in helps["results"].items():
        assert result["code"] == 0 and "usage:" in result["help"], argv
    assert set(SUBCOMMANDS) <= {argv.split()[0] for argv in helps["results"]}


def test_mrl_alone_prints_the_usage_and_is_a_usage_error(capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "usage: mrl SUBCOMMAND" in err and all(name in err for name in SUBCOMMANDS)
    assert main(["-h"]) == 0 and "usage: mrl SUBCOMMAND" in capsys.readouterr().out
    assert main(["nope"]) == 2 and "unknown subcommand 'nope'" in capsys.readouterr().err


def test_version(capsys):
    from importlib.metadata import version as installed

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"mrl {installed('mrl')}\n" == f"mrl {version()}\n"


def test_mrl_merge_is_mrl_dash_merge(helps, capsys, tmp_path):
    merge_help = helps["results"]["merge --help"]["help"]
    assert merge_help.startswith("usage: mrl merge ")
    assert merge_help.replace("usage: mrl merge", "usage: mrl-merge", 1) == helps["results"]["mrl-merge --help"]["help"]
    assert main(["merge", str(tmp_path / "none"), "--out", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.startswith("mrl merge: ")


def test_each_convert_direction_has_its_own_help(helps):
    texts = {d: helps["results"][f"convert {d} --help"]["help"] for d in DIRECTIONS}
    assert all(f"usage: mrl convert {d} " in texts[d] for d in DIRECTIONS)
    assert "--tp" in texts["hf-to-mcore"] and "--debug" in texts["hf-to-mcore"]
    assert "--dtype" in texts["fp8-to-hf"] and "--tp" not in texts["fp8-to-hf"]
    assert "--dtype" not in texts["hf-to-fp8"] and "--tp" not in texts["hf-to-fp8"]
    assert "(default bf16)" in texts["fp8-to-hf"] and "(default fp32)" in texts["hf-to-mcore"]
    top = helps["results"]["convert --help"]["help"]
    assert all(d in top for d in DIRECTIONS)


def test_names_kept_light_match_the_libraries():
    """The CLI names the dtypes and the report's file name itself, so that --help imports no torch."""
    from checkpoints_tools.convert import DTYPES as CONVERT_DTYPES
    from checkpoints_tools.merge import DTYPES as MERGE_DTYPES
    from mrl.cli import convert, merge, report
    from mrl.report import REPORT_NAME

    assert convert.DTYPE_NAMES == tuple(sorted(CONVERT_DTYPES))
    assert merge.DTYPE_NAMES == tuple(sorted(MERGE_DTYPES))
    assert report.REPORT_NAME == REPORT_NAME


def test_tiny_model_offers_the_architectures_and_still_accepts_the_test_variants(helps, capsys, monkeypatch, tmp_path):
    from mrl.models import tiny

    text = helps["results"]["tiny-model --help"]["help"]
    assert all(arch in text for arch in tiny.TINY_ARCHS)
    assert not any(variant in text for variant in tiny.TINY_VARIANTS)

    def write(arch, out, seed=0, force=False):
        Path(out).mkdir()
        (Path(out) / "config.json").write_text(json.dumps(tiny.tiny_hf_config(arch)))
        return Path(out)

    monkeypatch.setattr(tiny, "write_tiny_model", write)
    assert main(["tiny-model", "--arch", "qwen3_moe_dense", "--out", str(tmp_path / "m")]) == 0
    assert "wrote tiny qwen3_moe_dense model" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit:
        main(["tiny-model", "--arch", "gpt2", "--out", str(tmp_path / "g")])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "--arch 'gpt2' is not a tiny architecture" in err and "qwen3_moe_dense" not in err
