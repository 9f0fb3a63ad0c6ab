"""The sync plan: where every byte of every HF tensor lands in the engine's parameters.

Computed once per (trainer export, engine, engine TP rank) from data only: the HF tensors' names
and shapes (what the bridge's export yields), the engine's parameter metadata (names, shapes and
dtypes in checkpoint format, read from the vLLM worker: VLLMEngine.parameter_metadata), and
mrl/models/vllm_fusions.py, a table of vLLM's fusion rules (which HF tensors stack into which vLLM parameter,
in which order, along which dimension; read from vLLM 0.32's model files). The plan is checked for
full coverage: every element of every loaded engine parameter is written exactly once. An
expert-parallel engine's workers each hold whole experts, some of them: the metadata names the
global expert in each local slot (read from vLLM's expert map), and build_engine_plans checks that
every HF tensor reaches some worker and every expert exactly one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mrl.models.vllm_fusions import EXPERT_MODULE, FUSIONS, POST_APPLY, TP_DIMS, VOCAB

__all__ = ["EXPERT_MODULE", "FUSIONS", "POST_APPLY", "TP_DIMS", "VOCAB", "Copy", "PlanError", "build_engine_plans",
           "build_plan", "check_coverage", "hf_metadata"]


def hf_metadata(model_dir: str | Path) -> dict[str, dict]:
    """{HF name: {shape, dtype}} from a checkpoint's safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                out[name] = {"shape": tensor.get_shape(), "dtype": tensor.get_dtype()}
    return out


class PlanError(ValueError):
    """The plan does not cover the engine's parameters exactly once; the message names the parameter."""


Box = tuple[tuple[int, int], ...]  # one (start, stop) per dimension


@dataclass(frozen=True)
class Copy:
    """Copy `hf_name[hf_box]` into engine parameter `param[param_box]` (same element count)."""

    hf_name: str | None  # None: padding the sync leaves alone
    hf_box: Box
    param: str
    param_box: Box


def _full(shape) -> Box:
    return tuple((0, n) for n in shape)


def _volume(box: Box) -> int:
    v = 1
    for a, b in box:
        v *= max(0, b - a)
    return v


def _overlap(a: Box, b: Box) -> bool:
    return all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b))


def _rank_rows(rows: int, per_rank: int, rank: int, tp: int) -> tuple[int, int]:
    """This rank's rows of an HF tensor with `rows` along its split dim; K/V heads fewer than the
    ranks are replicated: rank r takes head group r // replicas, as vLLM's QKVParallelLinear does."""
    replicas = max(1, per_rank * tp // rows)
    start = (rank // replicas) * per_rank
    if start + per_rank > rows:
        raise PlanError(f"rank {rank}/{tp} needs rows {start}:{start + per_rank} of a tensor with {rows}")
    return start, start + per_rank


@dataclass(frozen=True)
class _Param:
    name: str
    shape: tuple[int, ...]
    rank: int
    tp: int

    @property
    def prefix(self) -> str:  # the module holding the fused/stacked parameter's parent
        return self.name.rsplit(".", 2)[0] if self.name.count(".") > 1 else ""

    @property
    def module(self) -> str:
        return self.name.split(".")[-2] if "." in self.name else ""

    @property
    def leaf(self) -> str:
        return self.name.rsplit(".", 1)[1]


def _shape(hf: dict, name: str, param: str) -> tuple[int, ...]:
    if name not in hf:
        raise PlanError(f"engine parameter {param!r} needs HF tensor {name!r}, which the export does not "
                        "yield: the fusion table (mrl/models/vllm_fusions.py FUSIONS) does not match this model")
    return tuple(hf[name])


def _stacked(p: _Param, parts, hf: dict) -> list[Copy]:
    """A fused module: its HF parts stacked along dim 0 of the weight (and bias)."""
    rows = {mod: _shape(hf, f"{p.prefix}.{mod}.{p.leaf}", p.name)[0] for mod, _ in parts}
    fixed = {mod: (rows[mod] if rule == "whole" else rows[mod] // p.tp) for mod, rule in parts if rule != "kv"}
    kv = [mod for mod, rule in parts if rule == "kv"]
    left = p.shape[0] - sum(fixed.values())
    for mod in kv:  # what the split parts leave, shared equally
        fixed[mod] = left // len(kv)
    copies, offset = [], 0
    for mod, rule in parts:
        name, length = f"{p.prefix}.{mod}.{p.leaf}", fixed[mod]
        src = (0, length) if rule == "whole" else _rank_rows(rows[mod], length, p.rank, p.tp)
        rest = _full(_shape(hf, name, p.name)[1:])
        copies.append(Copy(name, (src, *rest), p.name, ((offset, offset + length), *_full(p.shape[1:]))))
        offset += length
    return copies


def _local_experts(p: _Param, layout: dict | None) -> tuple[list[int], int, int]:
    """The global expert in each local slot, and the experts' own TP size and rank: with expert
    parallelism (`layout`, from the engine's metadata) some whole experts (vLLM gives the MoE layer
    TP 1), else every expert, split over the engine's TP ranks."""
    if layout is None:
        return list(range(p.shape[0])), p.tp, p.rank
    if layout["eplb"] or layout["physical"] != layout["logical"]:
        raise PlanError(f"engine parameter {p.name!r}: the engine balances experts (EPLB: {layout['physical']} "
                        f"physical slots for {layout['logical']} experts, moved at run time), which the in-place "
                        "plan cannot follow; start the engine without EPLB")
    if len(layout["ids"]) != p.shape[0]:
        raise PlanError(f"engine parameter {p.name!r} holds {p.shape[0]} experts, its expert map names "
                        f"{len(layout['ids'])}: fused shared experts (ROCm AITER) are not planned")
    return list(layout["ids"]), 1, 0


def _experts(p: _Param, parts, hf: dict, layout: dict | None = None) -> list[Copy]:
    """FusedMoE's [local experts, rows, cols] parameter from experts.{e}.<part>.weight: slot s holds
    global expert ids[s] (see _local_experts)."""
    ids, tp, rank = _local_experts(p, layout)
    copies = []
    for slot, e in enumerate(ids):
        offset = 0
        for mod, rule in parts:
            name = f"{p.prefix}.{e}.{mod}.weight"  # prefix: the HF `…mlp.experts` module
            rows, cols = _shape(hf, name, p.name)
            if rule == "row":  # down_proj: [hidden, intermediate/tp]
                src = ((0, rows), _rank_rows(cols, p.shape[2], rank, tp))
                dst = ((slot, slot + 1), (0, p.shape[1]), (0, p.shape[2]))
            else:  # gate/up stacked along dim 1: [2 · intermediate/tp, hidden]
                length = rows // tp
                src = (_rank_rows(rows, length, rank, tp), (0, cols))
                dst = ((slot, slot + 1), (offset, offset + length), (0, p.shape[2]))
                offset += length
            copies.append(Copy(name, src, p.name, dst))
    return copies


def _direct(p: _Param, hf: dict) -> list[Copy]:
    """An unfused parameter: the HF tensor of the same name, split for TP or replicated."""
    shape = _shape(hf, p.name, p.name)
    if p.module in VOCAB:  # vocab parallel, padded: rank r holds padded rows r·L … (r+1)·L
        per_rank = p.shape[0]
        start = min(p.rank * per_rank, shape[0])
        stop = min(start + per_rank, shape[0])
        rest = _full(p.shape[1:])
        copies = [Copy(p.name, ((start, stop), *rest), p.name, ((0, stop - start), *rest))]
        if stop - start < per_rank:
            copies.append(Copy(None, (), p.name, ((stop - start, per_rank), *rest)))
        return copies
    dim = TP_DIMS.get(p.module)
    if dim is None or (p.leaf == "bias" and dim == 1) or p.tp == 1:
        if shape != p.shape:
            raise PlanError(f"engine parameter {p.name!r} has shape {list(p.shape)}, HF tensor {list(shape)}: "
                            "a replicated parameter must match; is it missing from TP_DIMS or FUSIONS?")
        return [Copy(p.name, _full(shape), p.name, _full(p.shape))]
    dim = min(dim, len(shape) - 1)
    src = list(_full(shape))
    src[dim] = _rank_rows(shape[dim], p.shape[dim], p.rank, p.tp)
    return [Copy(p.name, tuple(src), p.name, _full(p.shape))]


def build_plan(arch: str, hf: dict[str, list[int]], engine: dict, fusions: dict | None = None) -> list[Copy]:
    """Every copy from the export's HF tensors (`hf`: name → shape) into one engine worker's
    parameters (`engine`: one entry of VLLMEngine.parameter_metadata()), checked for coverage."""
    if fusions is None:
        if arch not in FUSIONS:
            raise PlanError(f"no vLLM fusion table for architecture {arch!r}; known: {sorted(FUSIONS)}. "
                            "Add one to mrl/models/vllm_fusions.py FUSIONS, or use sync.apply: load_weights")
        fusions = FUSIONS[arch]
    copies: list[Copy] = []
    for name, meta in engine["params"].items():
        if meta.get("derived"):
            continue  # computed from siblings after loading (MLA's W_UK_T/W_UV)
        p = _Param(name, tuple(meta["shape"]), engine["tp_rank"], engine["tp_size"])
        if p.module in fusions["stacked"]:
            copies += _stacked(p, fusions["stacked"][p.module], hf)
        elif p.module == EXPERT_MODULE and p.leaf in fusions["experts"]:
            layout = engine.get("experts", {}).get(name.rpartition(".")[0])
            copies += _experts(p, fusions["experts"][p.leaf], hf, layout)
        else:
            copies += _direct(p, hf)
    check_coverage(copies, engine, hf)
    return copies


def check_coverage(copies: list[Copy], engine: dict, hf: dict) -> None:
    """Every element of every loaded engine parameter written exactly once, every HF tensor used."""
    boxes: dict[str, list[Copy]] = {}
    for c in copies:
        if c.hf_name is not None and _volume(c.hf_box) != _volume(c.param_box):
            raise PlanError(f"{c.param!r}: {c.hf_name!r}{list(c.hf_box)} has {_volume(c.hf_box)} elements, "
                            f"its target {list(c.param_box)} {_volume(c.param_box)}")
        boxes.setdefault(c.param, []).append(c)
    for name, meta in engine["params"].items():
        if meta.get("derived"):
            continue
        mine = boxes.get(name, [])
        for c in mine:
            if any(a < 0 or b > n for (a, b), n in zip(c.param_box, meta["shape"])):
                raise PlanError(f"engine parameter {name!r} {meta['shape']}: {c.hf_name!r} would be written at "
                                f"{list(c.param_box)}, outside it: the fusion table stacks too much into it")
        for i, a in enumerate(mine):
            for b in mine[i + 1 :]:
                if _overlap(a.param_box, b.param_box):
                    raise PlanError(f"engine parameter {name!r}: region {list(b.param_box)} is written twice "
                                    f"(from {a.hf_name!r} and {b.hf_name!r}): a fusion row is duplicated")
        numel = _volume(_full(meta["shape"]))
        covered = sum(_volume(c.param_box) for c in mine)
        if covered != numel:
            raise PlanError(f"engine parameter {name!r}: {numel - covered} of its {numel} elements are written "
                            "by no HF tensor: a fusion row is missing (mrl/models/vllm_fusions.py FUSIONS)")
    unused = sorted(set(hf) - {c.hf_name for c in copies} - _expert_split(engine, hf)[1])
    if unused:
        raise PlanError(f"HF tensor {unused[0]!r} ({len(unused)} in all) reaches no engine parameter: "
                        "the engine has no place for it, or the fusion table misses its row")


def _expert_split(engine: dict, hf: dict) -> tuple[set[str], set[str]]:
    """An expert-parallel worker's HF expert tensors: those of the experts it holds, and the others'.
    Each HF name is parsed once (`…mlp.experts.{e}.<part>.weight`): DeepSeek-V3 has ~45k of them."""
    by_module: dict[str, dict[int, list[str]]] = {}
    for name in hf:
        module, _, expert = name.rsplit(".", 2)[0].rpartition(".")
        if expert.isdigit():
            by_module.setdefault(module, {}).setdefault(int(expert), []).append(name)
    held: set[str] = set()
    foreign: set[str] = set()
    for module, layout in engine.get("experts", {}).items():
        local = set(layout["ids"])
        for expert, names in by_module.get(module.rsplit(".", 1)[0], {}).items():  # the HF `…mlp.experts`
            (held if expert in local else foreign).update(names)
    return held, foreign


def build_engine_plans(arch: str, hf: dict[str, list[int]], workers: list[dict],
                       fusions: dict | None = None) -> dict[int, list[Copy]]:
    """Every worker's plan (by TP rank), each checked by build_plan, and the engine's as a whole:
    every HF tensor reaches some worker, and with expert parallelism every expert exactly one
    (a worker holds its experts whole; two holding one would be EPLB's redundant copies)."""
    plans = {w["tp_rank"]: build_plan(arch, hf, w, fusions) for w in workers}
    missing = sorted(set(hf) - {c.hf_name for plan in plans.values() for c in plan})
    if missing:
        raise PlanError(f"HF tensor {missing[0]!r} ({len(missing)} in all) reaches no worker of the engine: "
                        "no worker's expert map holds its expert")
    holders: dict[str, list[int]] = {}
    for w in workers:
        for name in _expert_split(w, hf)[0]:
            holders.setdefault(name, []).append(w["tp_rank"])
    twice = sorted((name, ranks) for name, ranks in holders.items() if len(ranks) > 1)
    if twice:
        raise PlanError(f"HF tensor {twice[0][0]!r} is an expert held by workers {twice[0][1]}: the engine's "
                        "expert maps overlap (redundant experts are not planned)")
    return plans
