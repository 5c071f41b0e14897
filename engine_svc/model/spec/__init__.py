"""Speculative decoding, the model's side: verifying draft tokens in the step that
computes them (``verify.py``), the draft rows' attention layout (``layout.py``) and the
draft model (``drafter.py``). The scheduler side (``engine_svc/sched/spec.py``) decides
the drafts; the runner only ever sees them in ``ScheduledRequest.draft_token_ids``."""

from engine_svc.model.spec.drafter import DraftModel
from engine_svc.model.spec.drafting import Drafter, NoDraftModel
from engine_svc.model.spec.layout import attention_rows
from engine_svc.model.spec.verify import PositionView, VerifyRows

__all__ = ["DraftModel", "Drafter", "NoDraftModel", "PositionView", "VerifyRows", "attention_rows"]
