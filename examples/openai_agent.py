"""An agent for `agent.loop: openai` (docs/agents.md): plain OpenAI-client code, pointed at the base_url
of its episode; every call it makes there is recorded with its exact tokens and trained on. Try it:
mrl train configs/tiny_cpu_grpo.yaml agent.loop=openai agent.openai_agent=examples/openai_agent.py:agent
or as a program of its own, the sample as JSON on stdin and OPENAI_BASE_URL set:
mrl train configs/tiny_cpu_grpo.yaml agent.loop=openai "agent.openai_agent=command: python examples/openai_agent.py"
"""

import openai


def agent(base_url: str, sample: dict) -> None:
    """Answer, then check the answer once: two calls, one linear episode (the second answer is scored)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "user", "content": sample["prompt"]}]
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "Check it, then answer again."}]


if __name__ == "__main__":
    import json
    import os
    import sys

    agent(os.environ["OPENAI_BASE_URL"], json.load(sys.stdin))
