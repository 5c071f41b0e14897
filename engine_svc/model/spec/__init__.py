"""Speculative decoding, the model's side: verifying draft tokens in the step that
computes them (``verify.py``), the draft rows' attention layout (``layout.py``), the
draft model (``drafter.py``), its place around the target's step (``drafting.py``) and
the vocabulary check (``vocab.py``). The scheduler side (``engine_svc/sched/spec/``)
decides the drafts; the runner only ever sees them in ``ScheduledRequest.draft_token_ids``.

A new speculator that drafts on the scheduler side (prompt lookup's kind) belongs in
``engine_svc/sched/spec/``; one that runs a model in the step wraps the target's step here,
as ``DraftModel`` does."""

from engine_svc.model.spec.drafter import DraftModel
from engine_svc.model.spec.drafting import Drafter, NoDraftModel
from engine_svc.model.spec.layout import attention_rows
from engine_svc.model.spec.verify import PositionView, VerifyRows

__all__ = ["DraftModel", "Drafter", "NoDraftModel", "PositionView", "VerifyRows", "attention_rows"]
