"""Demonstrated conversations as SFT targets, laid out token for token as an agent's episode.

SFT on a conversation (assistant turns, tool answers between them) must see exactly the tokens the
agent loop (loop.py) will build in RL: each assistant turn's text tokenised then the template's
end-of-turn token, trained; the messages between turns and the next generation prompt as
ChatRenderer.append_ids appends them, masked. Ending a turn with the tokenizer's EOS instead (the
tiny zoo's is </s>, not ChatML's <|im_end|>) would teach a turn end the engine does not stop on and
the template never writes.
"""

from __future__ import annotations

from typing import Any


def conversation_target(chat: Any, messages: list[dict],
                        tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """The tokens after the prompt of a demonstrated conversation and their loss mask, exactly as an
    agent's episode builds them (loop.py): each assistant turn's text tokenised, then the
    end-of-turn token (1: trained), and the messages between turns (tool results, user turns) as
    `chat.append_ids` appends them, with the next generation prompt (0: not trained). `chat` is an
    mrl.agent.chat.ChatRenderer; the prompt (system, user, generation prompt) comes before these."""
    roles = [m.get("role") for m in messages]
    if not messages or roles[0] != "assistant" or roles[-1] != "assistant":
        raise ValueError(f"a demonstrated conversation must start and end with an assistant turn (the prompt holds "
                         f"the rest), got roles {roles}: move the others into the prompt, or end on the answer")
    ids: list[int] = []
    mask: list[int] = []
    between: list[dict] = []
    for message in messages:
        if message["role"] != "assistant":
            between.append(message)
            continue
        if between:  # appended together, as the loop appends a turn's tool answers
            appended = chat.append_ids(between, tools)
            ids, mask, between = ids + appended, mask + [0] * len(appended), []
        turn = chat.tokenizer.encode(message["content"], add_special_tokens=False) + chat.end_of_turn_ids()
        ids, mask = ids + turn, mask + [1] * len(turn)
    return ids, mask

