"""The model families the engine serves, chosen by ``config.json``'s ``architectures``.

Each family is the shared decoder (``llama.py``) with options (``args.py``); a family's
entry maps its config fields onto them:

    architecture          q/k/v bias      q/k norm  MLP                    sliding window
    LlamaForCausalLM      attention_bias  -         dense (mlp_bias)       -
    MistralForCausalLM    -               -         dense                  every layer
    Qwen2ForCausalLM      always          -         dense                  layer_types / use_sliding_window
    Qwen3ForCausalLM      attention_bias  yes       dense                  layer_types / use_sliding_window
    MixtralForCausalLM    -               -         experts, renormalised  every layer
    Qwen3MoeForCausalLM   attention_bias  yes       experts (norm_topk_prob), dense on mlp_only_layers
    Gemma3ForCausalLM     attention_bias  yes       dense, GeGLU (tanh)    layer_types, own RoPE theta
    Phi3ForCausalLM       -               -         dense (fused gate_up)  every layer
                          (Phi-3 and Phi-4: fused qkv in the checkpoint, LongRoPE, partial rotary)

Gemma 3 (text) also scales embeddings by sqrt(hidden), norms by ``1 + w``, norms the
attention and MLP outputs (sandwich norms), and scales queries by query_pre_attn_scalar.

An architecture not listed is refused, naming the ``architectures`` field and what is
supported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypedDict

from engine_svc.model.arch.rope_config import rope_config


class FamilyOptions(TypedDict, total=False):
    """What a family sets of ``ModelArgs`` beyond the shape every config states (the
    fields of the same names there, where their meaning and defaults are written)."""

    architecture: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]
    norm_offset: float
    embed_scale: float | None
    sandwich_norms: bool
    attn_scale: float | None
    rope_theta: float
    rope_scaling: dict | None
    sliding_rope_theta: float | None
    final_logit_softcapping: float | None
    tie_word_embeddings: bool


def _layer_windows(config: dict, *, needs_flag: bool) -> tuple[int | None, ...]:
    """Per-layer window from ``layer_types`` (5.x configs) or, failing that, from
    ``sliding_window`` (with ``use_sliding_window`` where the family needs the flag, on the
    layers from ``max_window_layers`` on, as transformers does)."""
    num_layers = config["num_hidden_layers"]
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if needs_flag and not config.get("use_sliding_window", False) and "sliding_attention" not in (layer_types or []):
        return (None,) * num_layers
    if window is None:
        return (None,) * num_layers
    if layer_types:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported; supported: full_attention, sliding_attention")
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    first = config.get("max_window_layers", 0) if needs_flag else 0
    return tuple(int(window) if i >= first else None for i in range(num_layers))


def _llama(config: dict) -> FamilyOptions:
    bias = bool(config.get("attention_bias", False))
    return FamilyOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bool(config.get("mlp_bias", False)))


def _mistral(config: dict) -> FamilyOptions:
    return FamilyOptions(sliding_windows=_layer_windows(config, needs_flag=False))


def _qwen2(config: dict) -> FamilyOptions:
    return FamilyOptions(qkv_bias=True, sliding_windows=_layer_windows(config, needs_flag=True))


def _qwen3(config: dict) -> FamilyOptions:
    bias = bool(config.get("attention_bias", False))
    return FamilyOptions(
        qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_windows=_layer_windows(config, needs_flag=True)
    )


def _mixtral(config: dict) -> FamilyOptions:
    return _mistral(config) | FamilyOptions(
        num_experts=config["num_local_experts"],
        num_experts_per_tok=config["num_experts_per_tok"],
        moe_intermediate_size=config["intermediate_size"],
        norm_topk_prob=True,
    )


def _qwen3_moe(config: dict) -> FamilyOptions:
    num_layers = config["num_hidden_layers"]
    num_experts = config.get("num_experts") or config.get("num_local_experts") or 0
    step = config.get("decoder_sparse_step", 1)
    dense = set(config.get("mlp_only_layers") or [])
    return _qwen3(config) | FamilyOptions(
        num_experts=num_experts,
        num_experts_per_tok=config["num_experts_per_tok"],
        moe_intermediate_size=config["moe_intermediate_size"],
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        moe_layers=tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)),
    )


def _gemma3(config: dict) -> FamilyOptions:
    for name in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if config.get(name):
            raise ValueError(f"{name} = {config[name]!r} is not supported")
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope:
        rope_theta, rope_scaling = rope_config(config, rope["full_attention"])
        sliding_theta, sliding_scaling = rope_config(config, rope.get("sliding_attention", {}))
        if sliding_scaling is not None:
            raise ValueError("rope_parameters.sliding_attention: only the default rope type is supported")
    else:  # 4.x: rope_theta / rope_scaling for full layers, rope_local_base_freq for sliding ones
        rope_theta, rope_scaling = rope_config(config)
        sliding_theta = float(config.get("rope_local_base_freq", 10000.0))
    bias = bool(config.get("attention_bias", False))
    return FamilyOptions(
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        norm_offset=1.0,
        embed_scale=config["hidden_size"] ** 0.5,
        sandwich_norms=True,
        attn_scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        sliding_rope_theta=sliding_theta,
        final_logit_softcapping=config.get("final_logit_softcapping"),
        sliding_windows=_layer_windows(config, needs_flag=False),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
    )


FAMILIES: dict[str, Callable[[dict], FamilyOptions]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "MixtralForCausalLM": _mixtral,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "Gemma3ForCausalLM": _gemma3,
    "Phi3ForCausalLM": _mistral,  # same options; the loader keeps the checkpoint's fused projections
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


def architecture(config: dict) -> str:
    """The first of ``architectures`` the engine serves (``model_type`` when the list is absent)."""
    archs = config.get("architectures") or []
    if not archs and config.get("model_type") in _MODEL_TYPE_TO_ARCH:
        archs = [_MODEL_TYPE_TO_ARCH[config["model_type"]]]
    for arch in archs:
        if arch in FAMILIES:
            return arch
    name = ", ".join(archs) or f"model_type={config.get('model_type')!r}"
    raise ValueError(
        f"unsupported architecture {name} (config.json field 'architectures'); "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def family_options(config: dict) -> FamilyOptions:
    """``architecture`` plus the family's ModelArgs options for this config."""
    arch = architecture(config)
    return FamilyOptions(architecture=arch) | FAMILIES[arch](config)
