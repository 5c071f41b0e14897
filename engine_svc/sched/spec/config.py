"""``--speculative-config``: which drafts, how many, and whether the cost model decides."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
DRAFT_QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclass(frozen=True)
class SpeculativeConfig:
    """A JSON object, keys as vLLM spells them where vLLM has them."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2  # ngram
    prompt_lookup_max: int = 5  # ngram
    model: str | None = None  # draft_model: a checkpoint directory or a GGUF file
    quantization: str = "auto"  # draft_model: its weights, as the engine's --quantization
    # True: each step drafts what the measured acceptance and step costs say pays
    # (docs/speculative.md); False: every decoding request drafts all it can.
    adaptive: bool = True
    disable_by_batch_size: int | None = None  # no drafts while more requests than this run

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse and check; a ValueError names the key to fix."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError('--speculative-config must be a JSON object, e.g. \'{"method": "ngram"}\'')
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key(s) {unknown}; known keys: {sorted(known)}")
        config = cls(**raw)
        config.check()
        return config

    def check(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"--speculative-config: method {self.method!r} is not supported; expected one of {METHODS}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            _positive(name, getattr(self, name))
        if self.disable_by_batch_size is not None:
            _positive("disable_by_batch_size", self.disable_by_batch_size)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"--speculative-config: prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"--speculative-config: adaptive must be true or false, got {self.adaptive!r}")
        if self.quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(
                f"--speculative-config: quantization {self.quantization!r} is not one of {DRAFT_QUANTIZATIONS}"
            )
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    '--speculative-config: method "draft_model" needs "model": a checkpoint directory or GGUF file'
                )
            if not os.path.exists(self.model):
                raise ValueError(f"--speculative-config: draft model {self.model!r} does not exist")
        elif self.model is not None:
            raise ValueError(f'--speculative-config: "model" is only for method "draft_model", not {self.method!r}')


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"--speculative-config: {name} must be a positive integer, got {value!r}")
