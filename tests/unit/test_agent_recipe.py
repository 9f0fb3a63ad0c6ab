"""The agent recipe's data and SFT (configs/tiny_cpu_agent.yaml): arithmetic on operands too long to
enumerate, demonstrations that call the calculator (careless ones skip it), and SFT on a demonstrated
conversation laid out token for token as the agent loop lays out the episode, tool tokens masked."""

import asyncio
import functools

import pytest
import torch

from mrl.data import ArithmeticTask, PromptTemplate, prompt_samples
from mrl.data.arithmetic import conversation
from mrl.experience import packed_sft_batch, sft_batch
from mrl.rollout.engine import Generation, SamplingSettings

SYSTEM = "Call the calculator for sums."


@functools.cache
def tokenizer():
    """The tiny zoo's tokenizer as written to disk: ChatML, end of sequence </s> (not <|im_end|>)."""
    from transformers import PreTrainedTokenizerFast

    from mrl.models.tiny import _CHAT_TEMPLATE, build_tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), chat_template=_CHAT_TEMPLATE,
                                   eos_token="</s>", pad_token="<pad>")


def test_long_operands_are_drawn_distinct_in_disjoint_seeded_splits():
    task = ArithmeticTask(ops=("+",), min_operand=10_000, max_operand=99_999, heldout_fraction=0.25, seed=3,
                          teacher_error=0.5, tool_calls=True)
    train, heldout = task.sample(200, "train"), task.sample(50, "heldout")
    prompts = [r["prompt"] for r in train]
    assert len(set(prompts)) == 200 and not set(prompts) & {r["prompt"] for r in heldout}
    assert train == task.sample(200, "train") and train != task.sample(200, "train", seed=1)
    for record in train:
        a, b = record["prompt"][:-1].split("+")
        assert len(a) == len(b) == 5 and record["answer"] == str(int(a) + int(b))
        assert task.split_of(int(a), "+", int(b)) == "train"
    with pytest.raises(ValueError, match="asked for 5000 heldout problems of about 40040"):
        ArithmeticTask(ops=("+",), min_operand=0, max_operand=2_000, heldout_fraction=0.01).sample(5000, "heldout")


def test_demonstrations_call_the_calculator_and_careless_ones_skip_it():
    from mrl.agent.tools import Toolbox, load_tool

    task = ArithmeticTask(ops=("+",), min_operand=10_000, max_operand=99_999, seed=1, teacher_error=0.4,
                          tool_calls=True)
    train = task.sample(100, "train")
    shown = [d for r in train for d in r["demonstrations"]]
    skipped = [d for d in shown if len(d) == 1]
    assert 0.3 < len(skipped) / len(shown) < 0.5
    assert all(d == [{"role": "assistant", "content": r["answer"]}] for r in train for d in r["demonstrations"]
               if len(d) == 1), "a careless demonstration answers right, from memory"
    called = next(d for d in train[0]["demonstrations"] if len(d) == 3)
    toolbox = Toolbox([load_tool("calculator")])
    (call,), errors = toolbox.parse(called[0]["content"], "chatml")
    assert not errors and call.arguments == {"expression": train[0]["prompt"][:-1]}
    (result,) = asyncio.run(toolbox.call_all([call]))
    assert [m["role"] for m in called] == ["assistant", "tool", "assistant"]
    assert called[1]["content"] == result.content == called[2]["content"] == train[0]["answer"]
    assert ArithmeticTask(("+",), 0, 20, tool_calls=True).sample(5, "train")[0]["demonstrations"][0][0]["role"] \
        == "assistant", "no careless teacher: one demonstration, the call"
    # the records' conversations reach SFT as they are (a text demonstration is still a string)
    samples = prompt_samples(train[:2], PromptTemplate(), sft_key="demonstrations")
    assert samples[0]["demonstrations"] == train[0]["demonstrations"]


def _episode(chat, prompt_ids: list[int], turns: list[str]) -> Generation:
    """The built-in tool_calling loop on an engine that answers turn k with turns[k] + <|im_end|>."""
    from mrl.agent.loop import EpisodeContext, tool_calling
    from mrl.agent.tools import Toolbox, load_tool

    async def generate(ids, sampling):
        assert sampling.stop_token_ids == tuple(chat.end_of_turn_ids())
        text = turns[tokenizer().decode(ids).count("<|im_start|>assistant") - 1]
        tokens = tokenizer().encode(text, add_special_tokens=False) + chat.end_of_turn_ids()
        return Generation(list(ids), tokens, text, [-0.5] * len(tokens), "stop", 0, [0] * len(tokens))

    ctx = EpisodeContext(generate, SamplingSettings(max_tokens=128), chat, Toolbox([load_tool("calculator")]))
    return asyncio.run(tool_calling({"prompt_ids": prompt_ids}, ctx)).to_generation()


@pytest.mark.parametrize("careless", [False, True])
def test_sft_on_a_conversation_is_the_episode_token_for_token(careless):
    """The SFT target of a demonstration and its mask equal the tokens and loss mask of the episode in
    which the model says what the teacher said; the tool's answer and the prompts around it carry no loss."""
    from mrl.agent.chat import ChatRenderer
    from mrl.agent.demonstrations import conversation_target

    chat = ChatRenderer(tokenizer())
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "12345+67890="}]
    prompt = chat.prompt_ids(messages)
    shown = conversation(12345, "+", 67890, careless=careless)
    target, mask = conversation_target(chat, shown)
    episode = _episode(chat, prompt, [m["content"] for m in shown if m["role"] == "assistant"])
    assert episode.agent["turns"] == (1 if careless else 2) and episode.agent["tool_errors"] == 0
    assert target == episode.token_ids and mask == episode.loss_mask
    chat.check(messages + shown, prompt + target)  # the whole template's render, decoded
    trained = tokenizer().decode([t for t, m in zip(target, mask) if m])
    assert trained == "".join(m["content"] + "<|im_end|>" for m in shown if m["role"] == "assistant")
    if not careless:
        untrained = tokenizer().decode([t for t, m in zip(target, mask) if not m])
        assert untrained == "\n<|im_start|>tool\n80235<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="start and end with an assistant turn"):
        conversation_target(chat, shown[:2] if not careless else [{"role": "tool", "content": "1"}])


def test_sft_batches_train_only_the_assistant_tokens_of_a_conversation():
    from mrl.inputs import tokenize_samples

    task = ArithmeticTask(ops=("+",), min_operand=10_000, max_operand=99_999, seed=2, teacher_error=0.5,
                          tool_calls=True)
    template = PromptTemplate(chat=True, system=SYSTEM)
    samples = tokenize_samples(prompt_samples(task.sample(2, "train"), template, tokenizer=tokenizer(),
                                              sft_key="demonstrations"), tokenizer())
    prompts, targets, masks = zip(*[(s["prompt_ids"], t, m) for s in samples
                                    for t, m in zip(s["sft_targets"], s["sft_masks"])])
    assert all(m is not None and len(m) == len(t) for t, m in zip(targets, masks))
    # a text demonstration next to them trains on all of its tokens, as before
    prompts, targets, masks = prompts + ([1, 2],), targets + ([7, 8, 2],), masks + (None,)
    wanted = [[t for t, m in zip(target, mask or [1] * len(target)) if m] for target, mask in zip(targets, masks)]
    for batch in (sft_batch(prompts, targets, masks), packed_sft_batch(prompts, targets, 256, 1, masks)):
        labels, mask = batch["tokens"][:, 1:], batch["response_mask"].bool()
        got = sorted(labels[i][mask[i]].tolist() for i in range(labels.shape[0]))
        if "segments" in batch:  # packed: a row's labels are its sequences' in turn
            assert sorted(sum(got, [])) == sorted(sum(wanted, []))
        else:
            assert got == sorted(wanted)
    assert torch.equal(sft_batch(prompts, targets)["response_mask"].sum(1),
                       torch.tensor([float(len(t)) for t in targets])), "no masks: every target token"


def test_held_out_evaluation_counts_episodes_whose_tool_call_succeeded():
    from mrl import evaluation
    from mrl.rewards import RewardResult

    def episode(text: str, calls: int, errors: int) -> Generation:
        return Generation([1], [2], text, [0.0], "stop", agent={"turns": 1 + (calls > 0), "tool_calls": calls,
                                                                 "tool_errors": errors})

    answers = {"1+1=": [episode("2", 1, 0), episode("2", 0, 0)], "2+2=": [episode("5", 2, 1), episode("4", 1, 1)]}

    def generate(ids, sampling):
        greedy = isinstance(sampling, SamplingSettings)  # sampled: seeded settings, one a prompt
        return [answers[p][:1] if greedy else answers[p] for p in ("1+1=", "2+2=")]

    samples = [{"prompt_ids": [1], "prompt": p, "ground_truth": str(eval(p[:-1])), "metadata": {}}
               for p in ("1+1=", "2+2=")]
    score = lambda inputs: [RewardResult(float(i.response == i.ground_truth)) for i in inputs]  # noqa: E731
    summary = evaluation.evaluate(generate, score, samples, SamplingSettings(),
                                  SamplingSettings(temperature=1.0, n=2, seed=1))
    assert summary["agent"]["greedy"] == {"tool_call_success": 1.0, "turns_mean": 2.0, "tool_errors": 0.5}
    assert summary["agent"]["sampled"]["tool_call_success"] == 0.5  # 2 of 4: none made, one of two failed
    plain = [[Generation([1], [2], "2", [0.0])]] * 2
    assert "agent" not in evaluation.evaluate(lambda ids, s: plain, score, samples, SamplingSettings())
