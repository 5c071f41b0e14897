"""A draft model must speak the target's vocabulary: the same token for every id.

Compared on the tokenizers both checkpoints ship (``tokenizer.json``, with its added
tokens); two checkpoints without one (random-weight test models) are compared on their
vocabulary sizes. The logits' widths may differ (a checkpoint may pad its embedding):
only the ids both know are drafted.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


class VocabularyMismatch(ValueError):
    """The draft model's vocabulary differs from the target's; the message says where."""


def check_same_vocabulary(target_dir: str | Path, draft_dir: str | Path, target_size: int, draft_size: int) -> None:
    """Raise ``VocabularyMismatch`` naming the first difference. ``*_size``: the
    checkpoints' ``vocab_size`` (their logits' widths)."""
    target, draft = _vocabulary(target_dir), _vocabulary(draft_dir)
    if target is None and draft is None:
        if target_size != draft_size:
            raise VocabularyMismatch(
                f"the draft model's vocabulary has {draft_size} ids, the target's {target_size} (neither ships a "
                "tokenizer.json to compare)"
            )
        return
    if target is None or draft is None:
        which = "target" if target is None else "draft model"
        raise VocabularyMismatch(f"the {which} ships no {TOKENIZER_FILE}, so its vocabulary cannot be compared")
    if len(target) != len(draft):
        raise VocabularyMismatch(f"the draft model's tokenizer has {len(draft)} tokens, the target's {len(target)}")
    by_id = {i: t for t, i in target.items()}
    for token, i in sorted(draft.items(), key=lambda e: e[1]):
        if by_id.get(i) != token:
            raise VocabularyMismatch(
                f"token id {i} is {token!r} for the draft model and {by_id.get(i)!r} for the target"
            )


def _vocabulary(model_dir: str | Path) -> dict[str, int] | None:
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise VocabularyMismatch(f"{path} cannot be read: {e}") from None
