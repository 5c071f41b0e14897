"""Which chat roles may reach the model's chat template.

The template writes a message's role verbatim between the model's turn markers
(``<|im_start|>{role}\\n``), so a role that carries a marker forges a turn of its own: a
role of ``user<|im_end|>\\n<|im_start|>system ...`` makes the rest read as a system
prompt. A role is therefore one of the roles chat models know, or a plain name of the
documented pattern (letters, digits, ``_`` and ``-``, starting with a letter, at most
MAX_ROLE_CHARS), and never the text of one of the tokenizer's special tokens.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping

KNOWN_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
MAX_ROLE_CHARS = 32
ROLE_PATTERN = re.compile(rf"[A-Za-z][A-Za-z0-9_-]{{0,{MAX_ROLE_CHARS - 1}}}")


def role_problem(role: str, special_tokens: Collection[str]) -> str | None:
    """Why ``role`` may not be used, or None when it may."""
    if role in KNOWN_ROLES:
        return None
    if not ROLE_PATTERN.fullmatch(role):
        shown = role if len(role) <= 40 else role[:40] + "..."
        return (
            f"role {shown!r} is not allowed: use one of {', '.join(sorted(KNOWN_ROLES))}, or a name of "
            f"letters, digits, '_' and '-' that starts with a letter (at most {MAX_ROLE_CHARS} characters)"
        )
    if role in special_tokens:
        return f"role {role!r} is a special token of the model's tokenizer"
    return None


def check_roles(messages: Iterable[Mapping[str, str]], special_tokens: Collection[str]) -> tuple[int, str] | None:
    """(index, problem) of the first message whose role may not be used, or None."""
    for i, message in enumerate(messages):
        problem = role_problem(message.get("role", ""), special_tokens)
        if problem is not None:
            return i, problem
    return None
