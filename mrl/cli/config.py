"""`mrl config CONFIG [section.key=value ...]`: validate a recipe and print it fully resolved.

Exit 0 with the resolved YAML; exit 2 with every problem listed. --no-file-checks skips what needs
files on this machine (model, data), to check a cluster recipe from a laptop.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from mrl.config import ConfigError, config_to_dict, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mrl config", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="recipe YAML (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.kl_coef=0.01")
    parser.add_argument("--no-file-checks", action="store_true", help="skip checks that need model/data files")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides, check_files=not args.no_file_checks)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
