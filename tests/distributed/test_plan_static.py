"""mrl plan's static bytes per rank equal what Megatron builds, layout by layout.

Tiny-zoo models in several layouts are built rank by rank on the meta device in a fake world
(torch's "fake" backend: no peers, no memory), wrapped in Megatron's own DDP and sharded by its own
distributed optimizer (mrl.megatron.footprint.static_footprint). For each rank the plan's parameter
list (names and shard sizes, in order) and its weight, gradient-buffer and optimizer bytes must be
exactly Megatron's: param and grad buffers with their padding, the fp32 main shards the optimizer
made, and Adam's two fp32 moments per optimized element. The moments rule and the replicated
(non-distributed) optimizer are checked on a real CPU build that takes an optimizer step.
DeepSeek-V3 671B's ranks are checked the same way in test_dsv3_671b_layout.py.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local
from mrl.megatron.footprint import ADAM_MOMENT_BYTES
from mrl.models.registry import model_spec_from_hf
from mrl.models.tiny import tiny_hf_config
from mrl.plan.ddp import rank_static
from mrl.plan.params import chunk_params
from mrl.plan.shapes import ModelShape, stage_chunks

# (tiny-zoo model, layout, world size, ranks to build): dense and MoE, TP (sequence parallel), PP
# with tied embeddings (a shared-embedding bucket on both ends), VPP, EP with ETP1, expert-DP > 1,
# GQA with fewer KV heads than TP ranks, and a DP that does not divide the 128-element alignment.
CASES = [
    ("llama", ParallelLayout(tp=2, pp=2), 8, (0, 7)),
    ("qwen2", ParallelLayout(tp=2), 6, (1,)),
    ("qwen3", ParallelLayout(pp=2, vpp=2), 4, (1, 2)),
    ("qwen3_moe", ParallelLayout(tp=2, ep=2), 4, (3,)),
    ("deepseek_v3", ParallelLayout(tp=2, pp=2, ep=2, etp=1), 8, (0, 5)),
    ("deepseek_v3", ParallelLayout(ep=4, etp=1), 8, (6,)),
    # CP: dense buffers reduced and sharded over DP·CP (the padding to lcm(DP·CP, 128) tells 6 from
    # DP 2), experts over expert-DP (CP folded in); with TP, and with EP.
    ("qwen2", ParallelLayout(cp=3), 6, (4,)),
    ("llama", ParallelLayout(tp=2, cp=2), 8, (3, 6)),
    ("deepseek_v3", ParallelLayout(cp=2, ep=2, etp=1), 4, (1, 2)),
]
BUILD_TIMEOUT_S = 300


def build_ranks(cases: list) -> list[dict]:
    """In a fresh process: each case's ranks, one after the other, built on meta in a fake world."""
    import warnings

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    warnings.simplefilter("ignore")
    import megatron_patches
    from megatron.core import parallel_state as ps

    from mrl.megatron.footprint import static_footprint
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import rank_coords
    from mrl.models.registry import model_spec_from_hf
    from mrl.models.tiny import tiny_hf_config

    megatron_patches.apply()
    results = []
    for arch, layout, world, ranks in cases:
        spec = model_spec_from_hf(tiny_hf_config(arch))
        for rank in ranks:
            dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
            ps.initialize_model_parallel(**layout.megatron_sizes(), create_gloo_process_groups=False)
            with torch.device("meta"):
                built = build_model(spec, layout, params_dtype=torch.bfloat16, transformer_impl="local")
            params = [(n, p.numel()) for chunk in built.chunks for n, p in chunk.named_parameters()]
            coords = rank_coords().__dict__ | {"dp_cp": ps.get_data_parallel_rank(with_context_parallel=True)}
            results.append(dict(arch=arch, layout=layout, world=world, rank=rank, coords=coords,
                                params=params, footprint=static_footprint(built)))
            ps.destroy_model_parallel()
            dist.destroy_process_group()
    return results


def planned(shape: ModelShape, layout: ParallelLayout, world: int, coords: dict, dtype: str = "bf16",
            distributed: bool = True) -> tuple[list[tuple[str, int]], tuple[int, int, int]]:
    """The plan's parameter list and (weights, grads, optimizer) bytes for the rank at `coords`
    (its rank in the dense sharding group DP·CP, and in expert-DP)."""
    params = [(t.name, t.numel) for chunk in stage_chunks(shape.layers, layout, coords["pp"])
              for t in chunk_params(shape, layout, chunk, dtype)]
    static = rank_static(shape, layout, world, coords["pp"], dtype, distributed, coords["dp_cp"], coords["edp"])
    return params, (static.weights, static.grads, static.optimizer)


def megatron_bytes(footprint: dict) -> tuple[int, int, int]:
    return footprint["weight_bytes"], footprint["grad_bytes"], footprint["optimizer_bytes"]


def tiny_shape(arch: str) -> ModelShape:
    return ModelShape.of(model_spec_from_hf(tiny_hf_config(arch)))


@pytest.fixture(scope="module")
def built_ranks() -> list[dict]:
    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        return pool.apply_async(build_ranks, (CASES,)).get(timeout=BUILD_TIMEOUT_S)
    except multiprocessing.TimeoutError:
        pytest.fail(f"the meta builds did not finish within {BUILD_TIMEOUT_S}s")
    finally:
        pool.terminate()


def test_parameters_and_static_bytes_equal_megatron(built_ranks):
    assert len(built_ranks) == sum(len(ranks) for *_, ranks in CASES)
    for r in built_ranks:
        where = f"{r['arch']} {r['layout'].describe()} rank {r['rank']}"
        params, plan = planned(tiny_shape(r["arch"]), r["layout"], r["world"], r["coords"])
        assert params == r["params"], where
        assert plan == megatron_bytes(r["footprint"]), where
    # The cases exercise what they claim: padding, shared-embedding buckets, expert buffers with DP > 1.
    footprints = {(r["arch"], r["rank"]): r["footprint"] for r in built_ranks}
    assert any(b["numel"] != b["numel_unpadded"] for f in footprints.values() for b in f["buffers"])
    assert any(b["expert"] and b["dp"] > 1 for b in footprints["deepseek_v3", 6]["buffers"])
    assert len(footprints["llama", 7]["buffers"]) == 2  # the last stage's bf16 and fp32 (norm) buffers
    cp = {(r["arch"], r["layout"].describe(), r["rank"]): r for r in built_ranks if r["layout"].cp > 1}
    assert all(b["dp"] == 6 for b in cp["qwen2", "TP1×PP1×CP3", 4]["footprint"]["buffers"])  # DP·CP, not DP 2
    assert {b["dp"] for b in cp["deepseek_v3", "TP1×PP1×CP2×EP2×ETP1", 2]["footprint"]["buffers"]} == {4, 2}
    assert len({r["coords"]["dp_cp"] for r in cp.values()}) > 1


def _real_optimizer_state(rank: int, world: int, hf_dir: str, layout: ParallelLayout) -> dict:
    """One Adam step of a real fp32 build (megatron-core's mixed-precision optimizers refuse bf16
    parameters on a CPU); what its optimizer and DDP buffers hold afterwards."""
    from mrl.config.schema import OptimConfig
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import destroy_layout, initialize_layout
    from mrl.megatron.training import lm_micro_batches, make_trainable, train_step
    from mrl.models.registry import model_spec_from_hf

    coords = initialize_layout(layout)
    spec = model_spec_from_hf(hf_dir)
    trainable = make_trainable(build_model(spec, layout), OptimConfig(lr=1e-3, use_distributed_optimizer=False))
    tokens = torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    assert not train_step(trainable, lm_micro_batches(tokens, layout.tp)).skipped
    states = [s for opt in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer])
              for s in opt.optimizer.state.values()]
    moments = sum(s[k].numel() * s[k].element_size() for s in states for k in ("exp_avg", "exp_avg_sq"))
    chunks = trainable.ddp_chunks
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for c in chunks
                for b in c.buffers + c.expert_parallel_buffers)
    weights = sum(p.numel() * p.element_size() for c in trainable.built.chunks for p in c.parameters())
    destroy_layout()
    return dict(coords=vars(coords) | {"dp_cp": coords.dp}, weights=weights, grads=grads, optimizer=moments)


def test_replicated_adam_on_a_real_cpu_build(tiny_model_dir):
    """fp32 parameters: no main copy, exp_avg and exp_avg_sq of every element on every DP rank."""
    layout = ParallelLayout(ep=2)
    results = run_local(_real_optimizer_state, 2, str(tiny_model_dir("qwen3_moe")), layout, timeout_s=240)
    shape = ModelShape.of(model_spec_from_hf(tiny_model_dir("qwen3_moe")))
    for result in results:
        _, plan = planned(shape, layout, 2, result["coords"], dtype="fp32", distributed=False)
        assert plan == (result["weights"], result["grads"], result["optimizer"])
        assert result["optimizer"] == ADAM_MOMENT_BYTES * result["weights"] // 4  # two moments per element
