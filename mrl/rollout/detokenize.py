"""A sample's text and stop string as vLLM makes them, made again over a whole sample.

async.partial_rollout continues an interrupted sample as a new request whose prompt is the sample's
prompt and tokens so far. vLLM then detokenizes and checks stop strings in the continuation alone:
a stop string that begins before the cut is never seen, and a character whose bytes the cut splits
comes out garbled. So the merged sample (mrl.modes.continue_generation) gets its text and stop from
`Detokenizer`, which runs vLLM's detokenization over the whole sample as one uninterrupted request:
vLLM 0.32's v1 FastIncrementalDetokenizer and check_stop_strings (vllm/v1/engine/detokenizer.py),
for the settings mrl gives vLLM (skip_special_tokens, include_stop_str_in_output off, no
min_tokens; mrl.rollout.vllm_engine). No vLLM import: the driver merges, and `tokenizers` is the
library vLLM's fast detokenizer runs on. What still differs from an uninterrupted request is noted
where it arises (`Detokenizer.__init__`, `__call__`, `continuation_stop`); docs/training-modes.md,
"Partial rollout", describes the feature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# tokenizers' error when a decode stream's text stops being a prefix of itself (vLLM resets the stream)
_INVALID_PREFIX = "Invalid prefix encountered"


@dataclass(frozen=True)
class SampleText:
    """What vLLM would return for a sample's tokens: its text, how many of the tokens it keeps, and
    the stop string that ended it (None: none did)."""

    text: str
    kept: int
    stop: str | None


class Detokenizer:
    """vLLM's text and stop strings for whole samples (module docstring). `tokenizer`: the model's
    fast tokenizer (transformers' or a `tokenizers.Tokenizer`); `stop`: the sampling settings' stop
    strings."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        inner = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "_tokenizer", None)
        # vLLM's slow (Python) detokenizer is not reproduced: a tokenizer without a `tokenizers`
        # backend is refused.
        if not isinstance(inner, Tokenizer):
            raise TypeError(f"async.partial_rollout detokenizes continued samples as vLLM's fast detokenizer does, "
                            f"which needs a fast (tokenizers-backed) tokenizer; {type(tokenizer).__name__} is not one: "
                            "give the model a tokenizer.json, or set async.partial_rollout: false")
        self.tokenizer, self.stop = inner, tuple(stop)

    def __call__(self, prompt_ids: list[int], token_ids: list[int], stop_terminated: bool) -> SampleText:
        """The sample `token_ids` after `prompt_ids`. `stop_terminated`: the engine ended it on a
        stop token (EOS, finish_reason "stop"), which vLLM leaves out of the text unless a stop
        string ended it instead.

        Differs from vLLM for an EOS token that is not a special token and whose own text completes
        a stop string: vLLM leaves the EOS out of the text (finish "stop", the text up to the EOS);
        this, which cannot tell it from a stop string's end, cuts the text at the stop string."""
        stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=True)
        text, before_last = "", ""
        for i, token in enumerate(token_ids):
            before_last, checked = text, len(text)
            piece, stream = self._step(stream, token)
            text += piece
            stop = self._stop(text, len(text) - checked)
            if stop is not None:  # vLLM keeps the token completing the stop string, and the text before it
                return SampleText(text[:stop[1]], i + 1, stop[0])
        return SampleText(before_last if stop_terminated and token_ids else text, len(token_ids), None)

    def continuation_stop(self, prompt_ids: list[int]) -> tuple[str, ...]:
        """The stop strings to give vLLM for a continuation whose prompt is `prompt_ids` (the
        sample's prompt and tokens so far): none when it ends inside a character, where vLLM's
        decode stream (primed with a prompt that ends inside a character) returns the prompt's own
        text with that character, so a stop string in the prompt would end the continuation at once.
        The merge (__call__) finds every stop string anyway; such a continuation only runs on to EOS
        or its budget rather than stopping early, and the merge drops the tokens after the stop
        string (the same sample, more engine work)."""
        if self.tokenizer.decode(list(prompt_ids), skip_special_tokens=True).endswith("\ufffd"):
            return ()
        return self.stop

    def _step(self, stream: DecodeStream, token: int) -> tuple[str, DecodeStream]:
        """The text `token` adds ("" while a character is incomplete), as FastIncrementalDetokenizer."""
        try:
            return stream.step(self.tokenizer, token) or "", stream
        except (OverflowError, TypeError):  # an invalid token id: vLLM gives it no text
            return "", stream
        except Exception as err:  # noqa: BLE001 - re-raised unless it is the error vLLM recovers from
            if not str(err).startswith(_INVALID_PREFIX):
                raise
            stream = DecodeStream(skip_special_tokens=True)
            return stream.step(self.tokenizer, token) or "", stream

    def _stop(self, text: str, new_chars: int) -> tuple[str, int] | None:
        """(stop string, where it starts) of the stop string the new characters complete first
        (ties: the first in the list), as vLLM's check_stop_strings; None: none."""
        if not new_chars:
            return None
        best = None
        for stop in self.stop:
            start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
            if start != -1 and (best is None or start + len(stop) < best[1] + len(best[0])):
                best = (stop, start)
        return best
