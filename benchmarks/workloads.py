"""Seeded workload files (JSON lines: one request per line).

    python -m benchmarks.workloads            # (re)write benchmarks/workloads/*.jsonl

Each line: {"prompt_token_ids": [...] | "prompt": "...", "max_tokens": N}. Token-id
workloads suit any model with a vocabulary of at least ``vocab_size`` ids; ``fit_vocab``
folds them into a smaller one (the demo model has 2048 ids), ``fit_context`` trims
requests that would not fit a model's context, and ``salted`` makes repeated runs of one
workload miss the prefix cache the earlier runs filled.

The files hold ``standard``, ``shared_prefix`` and ``chat``; ``synthetic`` draws a
workload of any size and shape on the fly (``benchmarks.serve --synthetic``), and
``multi_prefix`` one of many requests behind a few system prompts
(``benchmarks.serve --multi-prefix``, for prefix-aware routing).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent / "workloads"


def standard(seed: int = 0, *, num_requests: int = 64, vocab_size: int = 8192) -> list[dict]:
    """64 requests, prompts uniform in [64, 512] random ids, outputs uniform in [32, 256]."""
    rng = random.Random(seed)
    return [
        {
            "prompt_token_ids": [rng.randrange(vocab_size) for _ in range(rng.randint(64, 512))],
            "max_tokens": rng.randint(32, 256),
        }
        for _ in range(num_requests)
    ]


def shared_prefix(
    seed: int = 1, *, num_requests: int = 64, vocab_size: int = 8192, prefix_len: int = 384
) -> list[dict]:
    """Many requests behind one long common system prompt, to show the prefix cache."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    return [
        {
            "prompt_token_ids": prefix + [rng.randrange(vocab_size) for _ in range(rng.randint(8, 64))],
            "max_tokens": rng.randint(16, 64),
        }
        for _ in range(num_requests)
    ]


def chat(seed: int = 2, *, num_requests: int = 64, vocab_size: int = 8192) -> list[dict]:
    """Short prompts, long outputs."""
    rng = random.Random(seed)
    return [
        {
            "prompt_token_ids": [rng.randrange(vocab_size) for _ in range(rng.randint(8, 48))],
            "max_tokens": rng.randint(128, 384),
        }
        for _ in range(num_requests)
    ]


def synthetic(
    seed: int = 0,
    *,
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
) -> list[dict]:
    """Random prompt ids in [0, vocab_size), lengths uniform in the given inclusive ranges."""
    rng = random.Random(seed)
    return [
        {
            "prompt_token_ids": [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_len))],
            "max_tokens": rng.randint(*output_len),
        }
        for _ in range(num_requests)
    ]


def multi_prefix(
    seed: int = 3,
    *,
    num_prefixes: int = 8,
    prefix_len: int = 512,
    requests_per_prefix: int = 16,
    suffix_len: tuple[int, int] = (8, 24),
    output_len: tuple[int, int] = (16, 32),
    vocab_size: int = 8192,
) -> list[dict]:
    """``num_prefixes`` distinct system prompts of ``prefix_len`` ids, each followed by
    ``requests_per_prefix`` requests with their own suffixes, interleaved in rounds: each
    round has one request of every prompt, in a seeded random order (a fixed cycle would
    let least-load routing alternate in step with it and keep prompts on engines by
    chance). The list order is the arrival order; each request carries ``"prefix"``, its
    system prompt's number."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab_size) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    requests = []
    for _ in range(requests_per_prefix):
        for p in rng.sample(range(num_prefixes), num_prefixes):
            suffix = [rng.randrange(vocab_size) for _ in range(rng.randint(*suffix_len))]
            requests.append(
                {"prompt_token_ids": prefixes[p] + suffix, "max_tokens": rng.randint(*output_len), "prefix": p}
            )
    return requests


def fit_vocab(requests: list[dict], vocab_size: int) -> tuple[list[dict], int]:
    """Folds ids >= vocab_size into range (id % vocab_size); returns the requests and how many
    ids were folded. Lengths, and so the load, stay the same; prefix sharing survives too."""
    folded = 0
    out = []
    for r in requests:
        ids = r["prompt_token_ids"]
        folded += sum(1 for t in ids if t >= vocab_size)
        out.append({**r, "prompt_token_ids": [t % vocab_size for t in ids]})
    return out, folded


def fit_context(requests: list[dict], max_model_len: int) -> tuple[list[dict], int]:
    """Cuts max_tokens, then the prompt's tail (a shared head stays shared), so that prompt
    plus output fits max_model_len; returns the requests and how many were changed."""
    changed = 0
    out = []
    for r in requests:
        ids, max_tokens = r["prompt_token_ids"], r["max_tokens"]
        if len(ids) + max_tokens > max_model_len:
            changed += 1
            max_tokens = max(1, min(max_tokens, max_model_len - len(ids)))
            ids = ids[: max_model_len - max_tokens]
        out.append({**r, "prompt_token_ids": ids, "max_tokens": max_tokens})
    return out, changed


def salted(requests: list[dict], salt: int, vocab_size: int) -> list[dict]:
    """Shifts every prompt's first id by ``salt``: prefix-cache block hashes chain from the
    first block, so a run with a new salt finds nothing cached by earlier runs, while
    prefixes shared inside the run stay shared. Lengths do not change."""
    if salt % vocab_size == 0:
        return requests
    return [
        {**r, "prompt_token_ids": [(r["prompt_token_ids"][0] + salt) % vocab_size, *r["prompt_token_ids"][1:]]}
        for r in requests
    ]


WORKLOADS = {"standard": standard, "shared_prefix": shared_prefix, "chat": chat}


def load(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write(name: str, requests: list[dict], out_dir: Path = HERE) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in requests))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write the seeded benchmark workloads")
    p.add_argument("--out-dir", type=Path, default=HERE)
    p.add_argument("--vocab-size", type=int, default=8192)
    args = p.parse_args(argv)
    for name, make in WORKLOADS.items():
        path = write(name, make(vocab_size=args.vocab_size), args.out_dir)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
