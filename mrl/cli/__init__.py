"""The `mrl` command: one entry point, one module per subcommand. The command-line modules live
here, above the library they call (mrl-merge is mrl.cli.merge). A subcommand's module builds its
parser before importing torch, Ray, vLLM, Megatron or transformers, so `--help` answers at once
(tests/unit/test_cli.py checks the imports)."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

# subcommand → (module with main(argv), or module:function, one-line help)
SUBCOMMANDS = {
    "verify": ("mrl.cli.verify", "check HF ⇄ Megatron parity (logits and bitwise export) in a layout"),
    "tiny-model": ("mrl.models.tiny", "write a tiny random HF model of a supported architecture"),
    "config": ("mrl.cli.config", "validate a run config (recipe + overrides) and print it resolved"),
    "plan": ("mrl.cli.plan", "memory per GPU of a recipe (actor, critic, rollout engine); --search: layouts that fit"),
    "convert": ("mrl.cli.convert", "HF → an mrl checkpoint (hf-to-mcore); FP8 HF ⇄ plain HF (fp8-to-hf, hf-to-fp8)"),
    "merge": ("mrl.cli.merge:subcommand", "an mrl or Megatron-LM checkpoint → a HuggingFace directory (= mrl-merge)"),
    "train": ("mrl.cli.train:train", "RL training (SFT warm start when trainer.sft_steps > 0) from a recipe"),
    "sft": ("mrl.cli.train:sft", "supervised fine-tuning only, ending in a checkpoint"),
    "eval": ("mrl.cli.eval", "score a model or checkpoint on prompts with vLLM: accuracy, pass@k, maj@k"),
    "report": ("mrl.cli.report", "write a run's report: curves, config and traced samples in one HTML page"),
}


def usage() -> str:
    lines = ["usage: mrl SUBCOMMAND [options]   (mrl --version: the installed version)", "", "subcommands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines.append("\n`mrl SUBCOMMAND --help` describes each.")
    return "\n".join(lines)


def version() -> str:
    """The installed distribution's version; from a source tree that was not installed, setup.py's."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("mrl")
    except PackageNotFoundError:
        setup = Path(__file__).resolve().parents[2] / "setup.py"
        found = re.search(r'version="([^"]+)"', setup.read_text()) if setup.is_file() else None
        return found.group(1) if found else "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # a usage error, as argparse treats a missing argument
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        print(f"mrl {version()}")
        return 0
    if argv[0] not in SUBCOMMANDS:
        print(f"mrl: unknown subcommand {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, _, function = SUBCOMMANDS[argv[0]][0].partition(":")
    return getattr(importlib.import_module(module), function or "main")(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
