"""The held-out evaluation (mrl/evaluation.py, the trainer's and `mrl eval`'s): greedy accuracy, and
with trainer.eval_samples the sampled accuracy drawn as the rollout draws (same temperature, one
fixed seed every time); pass@k, maj@k and per data source."""

from types import SimpleNamespace

from mrl.config import load_config
from mrl.rewards import RewardResult
from mrl.rollout.engine import Generation, per_prompt
from mrl.trainer import evaluate


class FakeCluster:
    """Answers prompt i correctly in the first `right[i]` of its samples; records the settings."""

    def __init__(self, right: list[int]):
        self.right, self.calls = right, []

    def generate(self, prompts, sampling):
        settings = per_prompt(sampling, len(prompts))
        self.calls.append(settings)
        texts = lambda i: ["ok" if k < self.right[i] else "no" for k in range(settings[i].n)]  # noqa: E731
        return [[Generation(p, [1], t, [0.0]) for t in texts(i)] for i, p in enumerate(prompts)], {}


class ExactReward:
    def score_batch(self, samples):
        return [RewardResult(float(s.response == s.ground_truth)) for s in samples]


def _run(eval_samples: int, right: list[int]) -> SimpleNamespace:
    overrides = [f"trainer.eval_samples={eval_samples}", "rollout.temperature=0.7", "rollout.seed=3"]
    cfg = load_config("configs/tiny_cpu_grpo.yaml", overrides, check_files=False)
    heldout = [{"prompt": f"p{i}", "prompt_ids": [i + 5], "ground_truth": "ok", "metadata": {}}
               for i in range(len(right))]
    return SimpleNamespace(cfg=cfg, heldout=heldout, cluster=FakeCluster(right), reward=ExactReward())


def test_greedy_only_by_default():
    run = _run(0, [1, 0, 1, 1])
    assert evaluate(run) == {"eval/accuracy": 0.75}
    assert [s.temperature for s in run.cluster.calls[0]] == [0.0] * 4 and len(run.cluster.calls) == 1


def test_sampled_accuracy_is_the_mean_over_every_sample_with_the_rollouts_temperature_and_one_seed():
    run = _run(4, [4, 1, 0, 2])  # greedy (the first sample): 3 of 4; sampled: 7 of 16
    first, second = evaluate(run), evaluate(run)
    assert first == second == {"eval/accuracy": 0.75, "eval/accuracy_sampled": 7 / 16}
    (greedy, *_), sampled, _, again = run.cluster.calls
    assert greedy.temperature == 0.0 and greedy.n == 1
    assert {(s.temperature, s.n) for s in sampled} == {(0.7, 4)}
    seeds = [s.seed for s in sampled]
    assert seeds == [s.seed for s in again] and None not in seeds  # the same draw at every evaluation
    assert len(set(seeds)) == len(seeds)  # each prompt its own random numbers


def test_no_heldout_set_no_accuracy():
    run = _run(4, [])
    assert evaluate(run) == {"eval/accuracy": None}


def test_pass_at_k_majority_at_k_and_per_data_source():
    from mrl import evaluation

    # prompt 0: 1 of 4 right, the majority wrong; 1: 3 of 4 right; 2: none; 3: 2 of 4, tie → the first answer
    answers = [["7", "8", "8", "8"], ["5", "5", "5", "6"], ["1", "2", "3", "4"], ["9", "0", "9", "0"]]
    truths = ["7", "5", "x", "9"]
    sources = ["gsm", "gsm", "math", "math"]

    def generate(prompt_ids, sampling):
        if isinstance(sampling, list):  # sampled: per prompt, seeded
            return [[Generation(p, [1], t, [0.0]) for t in answers[p[0]]] for p in prompt_ids]
        return [[Generation(p, [1], answers[p[0]][0], [0.0])] for p in prompt_ids]

    samples = [{"prompt": f"p{i}", "prompt_ids": [i], "ground_truth": t, "metadata": {"data_source": src}}
               for i, (t, src) in enumerate(zip(truths, sources))]
    score = lambda inputs: [RewardResult(float(s.response == s.ground_truth), {"extracted": s.response})  # noqa: E731
                            for s in inputs]
    greedy = evaluation.greedy_settings(SimpleNamespace(max_new_tokens=4, stop=[]))
    summary = evaluation.evaluate(generate, score, samples, greedy, evaluation.rollout_settings(
        SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4, n_samples_per_prompt=4, stop=[]), 0))
    assert summary["prompts"] == 4
    assert summary["greedy"] == {"accuracy": 0.75}  # the first answers: 7, 5, 1, 9
    assert summary["sampled"] == {"k": 4, "pass@1": 6 / 16, "pass@4": 0.75, "maj@4": 0.5}
    assert summary["by_source"] == {
        "gsm": {"greedy": {"accuracy": 1.0}, "sampled": {"k": 4, "pass@1": 4 / 8, "pass@4": 1.0, "maj@4": 0.5}},
        "math": {"greedy": {"accuracy": 0.5}, "sampled": {"k": 4, "pass@1": 2 / 8, "pass@4": 0.5, "maj@4": 0.5}}}


def test_mrl_eval_refuses_a_model_that_is_neither_an_hf_directory_nor_a_checkpoint(tmp_path, capsys):
    from mrl.cli.eval import main

    (tmp_path / "junk").mkdir()
    assert main(["configs/tiny_cpu_grpo.yaml", f"trainer.output_dir={tmp_path / 'run'}",
                 "--model", str(tmp_path / "junk")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--model {tmp_path / 'junk'} is neither an HF directory" in err, err
