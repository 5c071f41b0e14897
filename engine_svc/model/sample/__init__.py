"""Turning a step's logits into tokens.

    logits_rows.py     which rows of a step need logits, and for what
    sampler.py         Sampler: the stages in order, one call per step
    sampler_stages.py  the stages, pure tensor functions (penalties, temperature, top-k/p/min-p, ...)
    sampler_state.py   what the sampler keeps per request across steps (token counts, seeds, masks)

A new sampler stage is a pure function in ``sampler_stages.py`` called in its place by
``Sampler``; its per-request state, if any, goes in ``sampler_state.py``.
"""
