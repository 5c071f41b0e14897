"""Text workloads for speculative decoding (JSON lines of chat turns).

    python -m benchmarks.spec_workloads    # (re)write the two files below

* ``copy_heavy.jsonl``: tasks whose answer mostly repeats the prompt: rewrite a
  paragraph, extract sentences, quote, repeat, and continue code that follows a pattern.
  The paragraphs come from ``engine_svc/demo_corpus.txt`` (plain English prose).
* ``open_chat.jsonl``: the control, open questions whose answers copy nothing.

Each line: {"messages": [{"role": "user", "content": "..."}], "max_tokens": N, "task": "..."}.
"""

from __future__ import annotations

import random
from pathlib import Path

from benchmarks.workloads import HERE, write

CORPUS = Path(__file__).resolve().parent.parent / "engine_svc" / "demo_corpus.txt"

COPY_TASKS = {
    "rewrite": "Rewrite the following paragraph with American spelling, changing nothing else:\n\n{p}",
    "extract": "Copy out the first three sentences of this paragraph exactly as written:\n\n{p}",
    "quote": "Quote the paragraph below in full, inside double quotes, then name its topic.\n\n{p}",
    "repeat": "Repeat this text word for word:\n\n{p}",
}

CODE = """Continue this Python module: add the methods for the fields that are left, in the same style.

class {name}:
    def __init__(self, {args}):
{assigns}

    def get_{f0}(self):
        return self.{f0}

    def set_{f0}(self, value):
        self.{f0} = value

    def get_{f1}(self):
        return self.{f1}

    def set_{f1}(self, value):
        self.{f1} = value
"""

FIELDS = ["name", "colour", "height", "weight", "price", "owner", "label", "count", "size", "speed", "score", "level"]

OPEN_QUESTIONS = [
    "Write a short poem about the sea at night.",
    "Give me three tips for learning to cook.",
    "What are some good habits for a healthy morning?",
    "Tell me a short story about a lost dog that finds its way home.",
    "Why do people enjoy gardening? Answer in a few sentences.",
    "Describe a busy market in a small town.",
    "What should I pack for a weekend of hiking?",
    "Explain why the sky is blue to a child.",
]


def paragraphs() -> list[str]:
    text = CORPUS.read_text()
    return [p.strip() for p in text.split("\n\n") if len(p.strip()) > 300]


def copy_heavy(seed: int = 5, num_requests: int = 64, max_tokens: int = 128) -> list[dict]:
    rng = random.Random(seed)
    passages = paragraphs()
    requests = []
    for i in range(num_requests):
        if i % 5 == 4:
            fields = rng.sample(FIELDS, 5)
            content = CODE.format(
                name=rng.choice(["Plant", "Order", "Animal", "Vehicle", "Book"]),
                args=", ".join(fields),
                assigns="\n".join(f"        self.{f} = {f}" for f in fields),
                f0=fields[0],
                f1=fields[1],
            )
            task = "code"
        else:
            task = rng.choice(sorted(COPY_TASKS))
            content = COPY_TASKS[task].format(p=rng.choice(passages))
        requests.append({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "task": task})
    return requests


def open_chat(seed: int = 6, num_requests: int = 64, max_tokens: int = 128) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "messages": [{"role": "user", "content": rng.choice(OPEN_QUESTIONS)}],
            "max_tokens": max_tokens,
            "task": "chat",
        }
        for _ in range(num_requests)
    ]


def main() -> int:
    for name, make in (("copy_heavy", copy_heavy), ("open_chat", open_chat)):
        print(f"wrote {write(name, make(), HERE)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
