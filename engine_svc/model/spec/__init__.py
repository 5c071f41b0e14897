"""Speculative decoding, the model's side: verifying draft tokens in the step that
computes them (``verify.py``). The scheduler side (``engine_svc/sched/spec.py``) decides
the drafts; the runner only ever sees them in ``ScheduledRequest.draft_token_ids``."""

from engine_svc.model.spec.layout import attention_rows
from engine_svc.model.spec.verify import PositionView, VerifyRows

__all__ = ["PositionView", "VerifyRows", "attention_rows"]
