"""RoPE settings from ``config.json``: the theta and the scaling (rope type and its numbers)."""

from __future__ import annotations

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_ALIASES = {"su": "longrope"}  # Phi-3's earlier name


def rope_config(config: dict, params: dict | None = None) -> tuple[float, dict | None]:
    """(theta, scaling) from either ``rope_parameters`` (5.x) or ``rope_theta``/``rope_scaling`` (4.x);
    ``params`` is one layer type's entry where the family nests them per type (Gemma 3)."""
    if params is None:
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if "full_attention" in params:  # nested per layer type; the family reads each entry
            params = params["full_attention"]
    params = dict(params)
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = _ALIASES.get(rope_type, rope_type)
    params.pop("partial_rotary_factor", None)  # read by ModelArgs.from_hf_config
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    params.setdefault(
        "original_max_position_embeddings",
        config.get("original_max_position_embeddings") or config.get("max_position_embeddings"),
    )
    if rope_type == "longrope":
        params.setdefault(
            "factor", config.get("max_position_embeddings", 1) / params["original_max_position_embeddings"]
        )
    return theta, params
