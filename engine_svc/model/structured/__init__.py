"""Structured output on the model side: the grammar backend and the sampler's mask stage."""

from engine_svc.model.structured.backend import CompiledGrammar, GrammarError, LLGuidanceBackend
from engine_svc.model.structured.masks import BatchMask, GrammarMasks

__all__ = ["BatchMask", "CompiledGrammar", "GrammarError", "GrammarMasks", "LLGuidanceBackend"]
