"""Speculative decoding, the scheduler's side (no torch): what the scheduler asks of it
and the engine without it (``speculation.py``), the config, prompt lookup, the adaptive
rule and the costs it weighs, the totals. The model's side (verification, the
draft model) is ``engine_svc/model/spec/``; docs/speculative.md says what works with what."""

from engine_svc.sched.spec.config import SpeculativeConfig
from engine_svc.sched.spec.costs import StepCosts
from engine_svc.sched.spec.ngram import NgramIndex, propose_ngram
from engine_svc.sched.spec.plan import Offer, choose_drafts
from engine_svc.sched.spec.speculation import NoSpeculation, Speculation
from engine_svc.sched.spec.speculator import Speculator
from engine_svc.sched.spec.stats import SpecStats

__all__ = [
    "NgramIndex",
    "NoSpeculation",
    "Offer",
    "SpecStats",
    "SpeculativeConfig",
    "Speculation",
    "Speculator",
    "StepCosts",
    "choose_drafts",
    "propose_ngram",
]
