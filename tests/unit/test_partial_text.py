"""async.partial_rollout: a sample interrupted at a push and continued (mrl.modes.continue_generation)
has the text, tokens and finish of one uninterrupted vLLM request, at every cut. The reference is
vLLM's own detokenizer and stop-string check fed one token a step, as its output processor does; the
engine side is emulated as VLLMEngine returns it: an interrupted sample with its tokens' own text,
a continuation as vLLM detokenizes and stops it given prompt + tokens so far as its prompt."""

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from transformers import PreTrainedTokenizerFast  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.engine import EngineCoreRequest  # noqa: E402
from vllm.v1.engine.detokenizer import IncrementalDetokenizer  # noqa: E402

from mrl.config import load_config  # noqa: E402
from mrl.models.tiny import build_tokenizer  # noqa: E402
from mrl.modes import continue_generation  # noqa: E402
from mrl.rollout.detokenize import Detokenizer  # noqa: E402
from mrl.rollout.engine import Generation  # noqa: E402
from mrl.trainer import batch_source  # noqa: E402

TOKENIZER = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())  # byte-level: 猫 is three tokens
PROMPT = TOKENIZER.encode("Q: ")


def vllm_request(prompt: list[int], tokens: list[int], stop: tuple[str, ...], stop_token: bool = False):
    """(text, tokens kept, stopped) that vLLM's output processor makes of `tokens` arriving one a
    step for a request with `prompt` (stop_token: the last one is the engine's stop token, EOS)."""
    request = EngineCoreRequest("r", prompt, None, SamplingParams(stop=list(stop) or None), None, 0.0, None, None, None)
    detok = IncrementalDetokenizer.from_new_request(TOKENIZER, request)
    for i, token in enumerate(tokens):
        if detok.update([token], stop_token and i == len(tokens) - 1):
            return detok.get_next_output_text(True, False), list(detok.output_token_ids), True
    return detok.get_next_output_text(True, False), list(detok.output_token_ids), stop_token


def interrupted_and_continued(tokens: list[int], cut: int, stop: tuple[str, ...], rest_finishes: bool = True,
                              stop_token: bool = False, prompt: list[int] = PROMPT) -> Generation:
    """The sample `tokens`, interrupted after `cut` of them and continued (same tokens, with the stop
    strings the trainer gives a continuation), merged."""
    detokenize = Detokenizer(TOKENIZER, stop)
    prefix = Generation(prompt, tokens[:cut], TOKENIZER.decode(tokens[:cut], skip_special_tokens=True),
                        [-0.1] * cut, None, 1, [1] * cut)
    rest_stop = detokenize.continuation_stop(prompt + tokens[:cut])
    text, kept, stopped = vllm_request(prompt + tokens[:cut], tokens[cut:], rest_stop, stop_token)
    if not rest_finishes and not stopped:  # interrupted again: the engine gives the tokens' own text
        text = TOKENIZER.decode(kept, skip_special_tokens=True)
    finish = "stop" if stopped else ("length" if rest_finishes else None)
    rest = Generation(prompt + tokens[:cut], kept, text, [-0.2] * len(kept), finish, 2, [2] * len(kept))
    return continue_generation(prefix, rest, detokenize)


def _check_every_cut(sample: str, stop: tuple[str, ...], prompt: list[int] = PROMPT, **kw) -> Generation:
    tokens = TOKENIZER.encode(sample, add_special_tokens=False)
    text, kept, stopped = vllm_request(prompt, tokens, stop, kw.get("stop_token", False))
    for cut in range(1, len(kept)):  # a cut after the token that ends the sample: it would not be interrupted
        merged = interrupted_and_continued(tokens, cut, stop, prompt=prompt, **kw)
        assert (merged.text, merged.token_ids) == (text, kept), f"cut after {cut} tokens"
        assert merged.finish_reason == ("stop" if stopped else ("length" if kw.get("rest_finishes", True) else None))
        assert merged.token_versions == [1] * cut + [2] * (len(kept) - cut) and len(merged.logprobs) == len(kept)
    return merged


def test_a_sample_cut_inside_a_multibyte_character_has_the_text_of_its_tokens():
    merged = _check_every_cut("Hi 猫 cat → done", ())
    assert merged.text == "Hi 猫 cat → done"


@pytest.mark.parametrize("sample, stop, text", [
    ("so the answer is 5 and more", ("the answer",), "so "),  # tokens: s|o| the| answer| is| |5| and| m|o|re
    ("Hi 猫 cat and a dog", ("猫 c",), "Hi "),  # the cut may split the stop string's first character
    ("so the answer is 5 and more", ("is 5 and", "answer is"), "so the "),  # the one completed first
])
def test_a_stop_string_across_the_cut_ends_the_sample_as_vllm_would(sample, stop, text):
    assert _check_every_cut(sample, stop).text == text


def test_a_stop_string_across_the_cut_ends_a_continuation_interrupted_again():
    _check_every_cut("so the answer is 5 and more", ("the answer",), rest_finishes=False)


def test_a_stop_string_in_the_prompt_does_not_end_a_continuation_cut_inside_a_character():
    """vLLM's decode stream, primed with a prompt that ends inside a character, returns the prompt's
    text with that character: a stop string there would end the continuation at once. The trainer
    gives such a continuation no stop strings (continuation_stop); the merge finds them all."""
    prompt = TOKENIZER.encode("no answer here: ")
    tokens = TOKENIZER.encode("Hi 猫 cat", add_special_tokens=False)
    assert vllm_request(prompt + tokens[:4], tokens[4:], ("answer",))[2]  # vLLM's own: stopped at once
    assert Detokenizer(TOKENIZER, ("answer",)).continuation_stop(prompt + tokens[:4]) == ()
    assert Detokenizer(TOKENIZER, ("answer",)).continuation_stop(prompt + tokens[:3]) == ("answer",)
    assert _check_every_cut("Hi 猫 cat", ("answer",), prompt).text == "Hi 猫 cat"


def test_a_stop_token_is_left_out_of_the_text():
    merged = _check_every_cut("so the answer is 5", (), stop_token=True)
    assert merged.text == "so the answer is " and merged.finish_reason == "stop"


def test_a_tokenizer_vllm_cannot_detokenize_fast_is_refused_by_name():
    with pytest.raises(TypeError, match="fast .*tokenizer.*async.partial_rollout: false"):
        Detokenizer(object())


def test_the_trainer_continues_a_sample_cut_inside_a_character_without_stop_strings():
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu_async.yaml",
                      ["async.partial_rollout=true", 'rollout.stop=["answer"]'])
    asked = []  # the sampling settings of each generate
    cluster = SimpleNamespace(generate_async=lambda prompts, settings: asked.append(settings),
                              interrupt_engines=None, sync_weights=None, release_engines=None)
    run = SimpleNamespace(cfg=cfg, tokenizer=TOKENIZER, train_set=[], sampler=SimpleNamespace(next_batch=list),
                          cluster=cluster, start=0, in_flight=None)
    plan = batch_source(run).plan
    tokens = TOKENIZER.encode("Hi 猫 cat", add_special_tokens=False)  # H|i| |猫 (3 tokens)| c|at
    partials = [Generation(PROMPT, tokens[:cut], "", [0.0] * cut, None, 1, [1] * cut) for cut in (3, 4)]
    plan.resume(2, partials, [(0, 1), (1, 1)])
    assert [s.stop for s in asked[0]] == [("answer",), ()]  # after " ": the stop strings; inside 猫: none
    assert plan.detokenize.stop == ("answer",)  # the merge checks them all
