"""Text to train a large benchmark tokenizer on, generated in code (nothing is downloaded).

    lines(num_chars, seed) -> list[str]

A Zipf-weighted lexicon (common English words, then pronounceable pseudo-words) makes
sentences, one-line and indented JSON documents, numbers, dates, e-mail addresses and
code lines: enough distinct text for a byte-level BPE of 32k-128k merges whose tokens look
like a real model's (words, JSON punctuation runs, digit groups), which is what the cost of
a grammar's token mask depends on.
"""

from __future__ import annotations

import bisect
import json
import random

_COMMON = """the of and to a in is it you that he was for on are with as his they be at one have this
from or had by word but what some we can out other were all there when up use your how said an each
she which do their time if will way about many then them write would like so these her long make
thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line turn cause much mean before move right
old too same tell does set three want air well also play small end put home read hand port large
add even land here must big high such follow act why ask men change went light kind off need
house picture try again animal point mother world near build self earth father head stand own page
country found answer school grow study still learn plant cover food sun four between state keep
server request response model token grammar schema parser value field string integer boolean array
object null true false user account order product customer address email phone status created
updated identifier description amount price currency quantity category tags metadata""".split()
_ONSETS = "b c d f g h j k l m n p r s t v w z br cr dr fr gr pr tr bl cl fl gl pl sl st sp sk sn sw th sh ch".split()
_VOWELS = "a e i o u y ai ea ee oa oo ou ie io au".split()
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "d", "ck", "ng", "nd", "st", "nt", "sh", "th", "x", "ing", "ed", "er"]


def lines(num_chars: int, seed: int = 0) -> list[str]:
    """About ``num_chars`` characters of mixed text, as lines."""
    rng = random.Random(seed)
    words = _lexicon(rng, 20 + num_chars // 100)
    weights = [1.0 / (i + 10) ** 0.9 for i in range(len(words))]
    cumulative = _cumsum(weights)

    def word() -> str:
        return words[bisect.bisect_left(cumulative, rng.random() * cumulative[-1])]

    def value(depth: int = 0):
        k = rng.random()
        if depth < 2 and k < 0.15:
            return {word(): value(depth + 1) for _ in range(rng.randint(1, 4))}
        if depth < 2 and k < 0.25:
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        if k < 0.45:
            return rng.randint(-1000, 10 ** rng.randint(1, 8))
        if k < 0.55:
            return round(rng.uniform(-1e4, 1e4), rng.randint(1, 4))
        if k < 0.62:
            return rng.choice([True, False, None])
        if k < 0.7:
            date = f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
            return f"{date}T{rng.randint(0, 23):02d}:00:00Z"
        if k < 0.75:
            return f"{word()}.{word()}@{word()}.com"
        return " ".join(word() for _ in range(rng.randint(1, 8)))

    out: list[str] = []
    size = 0
    while size < num_chars:
        k = rng.random()
        if k < 0.55:
            line = " ".join(word() for _ in range(rng.randint(4, 20))).capitalize() + rng.choice([".", "?", "!", ","])
        elif k < 0.85:
            doc = {word() + rng.choice(["", "_", "-"]) + word(): value() for _ in range(rng.randint(2, 8))}
            line = json.dumps(doc, indent=rng.choice([None, None, 2]))
        else:
            a, b = word(), word()
            line = rng.choice(
                [
                    f"def {a}_{b}(x, y={rng.randint(0, 99)}):\n    return x + y * {rng.randint(1, 9)}",
                    f"SELECT {a}, {b} FROM t_{a} WHERE id = {rng.randint(1, 9999)};",
                    f'<{a} id="{b}">{rng.randint(0, 99999)}</{a}>',
                ]
            )
        out.append(line)
        size += len(line) + 1
    return out


def _lexicon(rng: random.Random, size: int) -> list[str]:
    words = list(dict.fromkeys(_COMMON))
    seen = set(words)
    while len(words) < size:
        w = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.choice([1, 2, 2, 3]))
        )
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def _cumsum(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for v in values:
        total += v
        out.append(total)
    return out
