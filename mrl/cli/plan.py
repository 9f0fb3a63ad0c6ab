"""`mrl plan RECIPE [section.key=value ...]`: memory per GPU of a recipe, and the layouts that fit.

Prints, for every pipeline stage of the actor (and critic), the bytes of weights, gradient buffers,
optimizer state and activations in the update, and beside them a colocated rollout engine's budget
while it generates; the engine's own weights and KV cache; a verdict per GPU; the step's estimated
rollout and update time. --search plans every TP × PP × EP × ETP layout of the recipe on the GPUs
(at its parallel.cp) and ranks those that fit by estimated step time. Only the model's
config.json is read (model.path). Exit 0: fits (with --search: some layout fits) and the update
accepts the recipe's batches; 1: it does not; 2: bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from mrl.config import ConfigError, load_config
from mrl.config.loading import apply_overrides, read_recipe
from mrl.plan import PlanError, Run, model_shape, plan
from mrl.plan.report import GB, render, to_dict
from mrl.plan.timing import FLOPS_EFFICIENCY, H100_BANDWIDTH_GBS, H100_BF16_TFLOPS, Gpu, lengths_of, step_time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mrl plan", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="recipe YAML (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.pp=8")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs in the cluster (default: launch.num_nodes × launch.gpus_per_node)")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0,
                        help="memory per GPU for tensors, in GB (10^9 bytes; default 80)")
    parser.add_argument("--gpu-bandwidth-gbs", type=float, default=H100_BANDWIDTH_GBS,
                        help="memory bandwidth per GPU in GB/s, for the rollout estimate (default: H100 SXM's 3350; "
                             "H200: 4800)")
    parser.add_argument("--gpu-tflops", type=float, default=H100_BF16_TFLOPS,
                        help="peak dense BF16 TFLOPS per GPU (default: H100/H200 SXM's 989)")
    parser.add_argument("--flops-efficiency", type=float, default=FLOPS_EFFICIENCY,
                        help=f"fraction of peak FLOPs that prefill and the update reach (default {FLOPS_EFFICIENCY})")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="prompt length to estimate with (default: rollout.max_model_len - the response)")
    parser.add_argument("--response-tokens", type=int, default=None,
                        help="response length to estimate with (default: rollout.max_new_tokens)")
    parser.add_argument("--search", action="store_true", help="rank the layouts that fit these GPUs")
    parser.add_argument("--top", type=int, default=10, help="layouts shown by --search")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_intermixed_args(argv)  # options may follow the overrides
    try:
        if args.gpus is not None and args.gpus < 1:
            raise PlanError(f"--gpus must be >= 1, got {args.gpus}.")
        for flag in ("gpu_memory_gb", "gpu_bandwidth_gbs", "gpu_tflops", "flops_efficiency"):
            if getattr(args, flag) <= 0:
                raise PlanError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}.")
        if args.flops_efficiency > 1:
            raise PlanError(f"--flops-efficiency is a fraction of peak: give at most 1, got {args.flops_efficiency}.")
        gpu = Gpu(args.gpu_bandwidth_gbs * GB, args.gpu_tflops * 1e12, args.flops_efficiency)
        cfg = load_config(args.config, args.overrides + _cluster_overrides(args), check_files=False)
        shape = model_shape(cfg.model.path, cfg.model.tiny)
        gpu_bytes = int(args.gpu_memory_gb * GB)
        if args.search:
            return _search(cfg, shape, args, gpu_bytes, gpu)
        result = plan(shape, Run.of(cfg, shape, args.gpus), gpu_bytes)
        run = result.run
        lengths = lengths_of(run.max_model_len, run.max_new_tokens, args.prompt_tokens, args.response_tokens)
        step = step_time(result, lengths, gpu)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    except PlanError as exc:
        print(f"mrl plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(to_dict(result, step), indent=2) if args.json else render(result, step, lengths, gpu))
    return 0 if result.fits and not result.run.problems else 1


def _cluster_overrides(args: argparse.Namespace) -> list[str]:
    """--gpus as launch.num_nodes (nodes of the recipe's launch.gpus_per_node), so the config's
    resource checks see the cluster being planned."""
    if args.gpus is None:
        return []
    errors: list[str] = []
    tree = apply_overrides(read_recipe(args.config), args.overrides, errors)
    try:
        node = int(str((tree.get("launch") or {}).get("gpus_per_node", 0)))
    except ValueError:
        return []  # load_config names the bad value
    if node == 0:
        return ["launch.num_nodes=1", f"launch.gpus_per_node={args.gpus}"]
    if args.gpus % node:
        raise PlanError(f"--gpus {args.gpus} is not a whole number of nodes of launch.gpus_per_node {node}: "
                        "give a multiple, or override launch.gpus_per_node.")
    return [f"launch.num_nodes={args.gpus // node}"]


def _search(cfg, shape, args, gpu_bytes: int, gpu: Gpu) -> int:
    from mrl.plan.search import render as render_search
    from mrl.plan.search import search

    gpus = args.gpus or cfg.launch.num_nodes * cfg.launch.gpus_per_node
    if gpus < 1:
        raise PlanError("the recipe is a CPU run (launch.gpus_per_node 0): give the cluster's size with --gpus N.")
    result = search(cfg, shape, gpus, gpu_bytes, gpu, (args.prompt_tokens, args.response_tokens))
    if args.json:
        print(json.dumps({"engine_tp": result.engine_tp, "problems": list(result.problems),
                          "fits": [to_dict(p, t) for p, t in zip(result.fits[: args.top], result.times)],
                          "rejected": [dict(layout=r.layout.describe(), reason=r.reason, shortfall=r.shortfall)
                                       for r in result.rejected]}, indent=2))
    else:
        print(render_search(result, args.top))
    return 0 if result.fits and not result.problems else 1


if __name__ == "__main__":
    sys.exit(main())
