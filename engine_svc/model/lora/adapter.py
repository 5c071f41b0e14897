"""A PEFT LoRA adapter directory, read and checked against the base model.

    adapter_config.json         peft_type LORA, r, lora_alpha, use_rslora, rank_pattern /
                                alpha_pattern, bias "none", target_modules
    adapter_model.safetensors   base_model.model.model.layers.{i}.{self_attn,mlp}.{x}_proj.lora_{A,B}.weight

Each target maps onto one part of our fused projections (load/loader.py fuses the base weights
the same way), so an adapter's q, k and v terms all add to the one ``qkv_proj`` GEMM::

    self_attn.{q,k,v}_proj -> attn.qkv_proj parts 0, 1, 2    mlp.{gate,up}_proj -> mlp.gate_up_proj parts 0, 1
    self_attn.o_proj       -> attn.o_proj                    mlp.down_proj      -> mlp.down_proj

lora_A is [r, in], lora_B [out, r]; PEFT's output is ``base(x) + (x @ A^T @ B^T) * scale``
with ``scale = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), so the scale is folded into B
here, in float32. Whatever the engine cannot compute exactly is refused by name, never
approximated: DoRA, LoRA biases, modules_to_save, embedding or LM-head targets, fused
checkpoint projections (Phi-3's qkv_proj), expert layers, a rank above --max-lora-rank,
and any other PEFT option that changes the arithmetic. The files are untrusted input:
``rank_pattern`` / ``alpha_pattern`` keys are regular expressions, matched by RE2 with
PEFT's rule (patterns.py); a weight that is NaN or infinite, or that the scale makes
infinite, is refused by tensor name; the config is read only up to MAX_CONFIG_BYTES.

The digest covers what decides the adapter's outputs (the weights file's bytes and the
config entries that set the scales), not its name: it starts the prefix-cache hash chain of
the adapter's requests (tandem_common/block_hash.py), so K/V computed under one adapter is
never served to another, even under the same name after a reload with new weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine_svc.model.arch.args import ModelArgs
from engine_svc.model.lora.patterns import PatternError, Patterns

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT's module name (within a decoder layer) -> (our fused module, part).
TARGETS: dict[str, tuple[str, int]] = {
    "self_attn.q_proj": ("attn.qkv_proj", 0),
    "self_attn.k_proj": ("attn.qkv_proj", 1),
    "self_attn.v_proj": ("attn.qkv_proj", 2),
    "self_attn.o_proj": ("attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0),
}
TARGET_NAMES = tuple(name.rpartition(".")[2] for name in TARGETS)  # q_proj ... down_proj
NUM_PARTS = {"attn.qkv_proj": 3, "attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}

_TENSOR_RE = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.((?:self_attn|mlp)\.[a-z_]+)\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight"
)
# adapter_config.json entries that do not change the served arithmetic (training-time or
# bookkeeping options); any other entry that is set (truthy) is refused by name.
_HARMLESS = {
    "peft_type", "task_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "bias",
    "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern", "base_model_name_or_path",
    "revision", "inference_mode", "init_lora_weights", "lora_dropout", "peft_version", "auto_mapping",
    "megatron_config", "megatron_core", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
    "qalora_group_size", "ensure_weight_tying", "fan_in_fan_out",
}  # fmt: skip
# The config entries the digest covers besides the weights: the ones that set the scales.
_DIGESTED = ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern")
# PEFT writes a few hundred bytes, or tens of KiB with a key per module in rank_pattern.
MAX_CONFIG_BYTES = 1 << 20


class LoraError(ValueError):
    """An adapter the engine cannot serve; the message names what and why."""


@dataclass(frozen=True)
class LoraPart:
    """One target's term inside one of our modules: rows ``part`` of its fused output."""

    part: int
    a: torch.Tensor  # [rank, in_features] float32
    b: torch.Tensor  # [part_out_features, rank] float32, the scale folded in

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: Path
    digest: bytes  # sha256 of the weights and the scale-setting config (module docstring)
    modules: dict[str, list[LoraPart]]  # our module name (layers.{i}.attn.qkv_proj) -> its parts
    max_rank: int

    @property
    def nbytes(self) -> int:
        return sum(p.a.numel() * 4 + p.b.numel() * 4 for parts in self.modules.values() for p in parts)


def module_shapes(args: ModelArgs, module: str) -> tuple[int, tuple[int, ...]]:
    """(in_features, out_features of each part) of one of our LoRA-able modules."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    return {
        "attn.qkv_proj": (args.hidden_size, (q, kv, kv)),
        "attn.o_proj": (q, (args.hidden_size,)),
        "mlp.gate_up_proj": (args.hidden_size, (args.intermediate_size, args.intermediate_size)),
        "mlp.down_proj": (args.intermediate_size, (args.hidden_size,)),
    }[module]


def read_adapter(name: str, path: str | Path, args: ModelArgs, *, max_rank: int) -> LoraAdapter:
    """The adapter in directory ``path``, checked against the base model ``args``; raises
    ``LoraError`` naming what cannot be served."""
    path = Path(path)
    where = f"LoRA adapter {name!r} ({path})"
    config = _read_config(path, where)
    patterns = _patterns(config, where)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        other = (
            " (adapter_model.bin is a pickle; save with safetensors, PEFT's default)"
            if (path / "adapter_model.bin").is_file()
            else ""
        )
        raise LoraError(f"{where}: {WEIGHTS_FILE} not found{other}")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        for key in f.keys():
            m = _TENSOR_RE.fullmatch(key)
            if m is None or m.group(2) not in TARGETS:
                raise LoraError(
                    f"{where}: tensor {key} is not a LoRA weight of a supported target "
                    f"({', '.join(TARGET_NAMES)} of a decoder layer)"
                )
            layer = int(m.group(1))
            if not 0 <= layer < args.num_layers:
                raise LoraError(f"{where}: tensor {key} names layer {layer}; the base model has {args.num_layers}")
            if m.group(2).startswith("mlp.") and args.moe_layers[layer]:
                raise LoraError(f"{where}: tensor {key} targets the MLP of layer {layer}, a mixture of experts")
            tensor = f.get_tensor(key).float()
            if not bool(torch.isfinite(tensor).all()):
                raise LoraError(f"{where}: tensor {key} in {WEIGHTS_FILE} holds NaN or infinite values")
            pairs.setdefault((layer, m.group(2)), {})[m.group(3)] = tensor
    if not pairs:
        raise LoraError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    modules: dict[str, list[LoraPart]] = {}
    for (layer, target), ab in sorted(pairs.items()):
        hf_module = f"model.layers.{layer}.{target}"
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{where}: {hf_module} has lora_{next(iter(ab))} but not its pair")
        ours, part = TARGETS[target]
        in_features, outs = module_shapes(args, ours)
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (outs[part], rank):
            raise LoraError(
                f"{where}: {hf_module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the base model "
                f"needs [r, {in_features}] and [{outs[part]}, r]"
            )
        if rank > max_rank:
            raise LoraError(f"{where}: {hf_module} has rank {rank}, above --max-lora-rank {max_rank}")
        scale = _scale(config, patterns, hf_module, rank, where)
        scaled = b * scale
        if not bool(torch.isfinite(scaled).all()):
            raise LoraError(f"{where}: {hf_module} lora_B times its scale {scale:g} (alpha / r) is not finite")
        modules.setdefault(f"layers.{layer}.{ours}", []).append(LoraPart(part, a.contiguous(), scaled.contiguous()))
    return LoraAdapter(
        name=name,
        path=path,
        digest=_digest(config, weights),
        modules=modules,
        max_rank=max(p.rank for parts in modules.values() for p in parts),
    )


def _read_config(path: Path, where: str) -> dict:
    config_path = path / CONFIG_FILE
    if not path.is_dir():
        raise LoraError(f"{where}: not a directory")
    if not config_path.is_file():
        raise LoraError(f"{where}: {CONFIG_FILE} not found; expected a PEFT adapter directory")
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise LoraError(f"{where}: {CONFIG_FILE} is larger than {MAX_CONFIG_BYTES >> 10} KiB")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraError(f"{where}: {CONFIG_FILE} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoraError(f"{where}: {CONFIG_FILE} is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise LoraError(f"{where}: peft_type is {config.get('peft_type')!r}; only LORA adapters are served")
    if config.get("bias", "none") != "none":
        raise LoraError(f"{where}: bias is {config['bias']!r}; adapters that train biases are not served")
    if config.get("fan_in_fan_out"):
        raise LoraError(f"{where}: fan_in_fan_out is set (Conv1D layers); the engine's layers are Linear")
    for key, value in config.items():
        if key not in _HARMLESS and value:
            raise LoraError(f"{where}: {key} is set ({value!r}); the engine serves plain LoRA only, refusing it")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise LoraError(f"{where}: {key} must be a positive number, got {value!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise LoraError(f"{where}: {key} must be an object")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(t for t in targets if t not in TARGET_NAMES and t not in TARGETS)
        if unknown:
            raise LoraError(
                f"{where}: target_modules {', '.join(unknown)} not supported; supported: {', '.join(TARGET_NAMES)}"
            )
    return config


def _patterns(config: dict, where: str) -> tuple[Patterns, Patterns]:
    """(rank_pattern, alpha_pattern) compiled (patterns.py); LoraError names a key refused."""
    try:
        return Patterns("rank_pattern", config.get("rank_pattern") or {}), Patterns(
            "alpha_pattern", config.get("alpha_pattern") or {}
        )
    except PatternError as e:
        raise LoraError(f"{where}: {CONFIG_FILE}: {e}") from None


def _scale(config: dict, patterns: tuple[Patterns, Patterns], module: str, rank: int, where: str) -> float:
    r = patterns[0].value(module, config["r"])
    alpha = patterns[1].value(module, config["lora_alpha"])
    if r != rank:
        raise LoraError(f"{where}: {module} has rank {rank} but its config says r = {r}")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _digest(config: dict, weights: Path) -> bytes:
    h = hashlib.sha256(b"tandem-lora-v1\0")
    h.update(json.dumps({k: config.get(k) for k in _DIGESTED}, sort_keys=True).encode())
    with weights.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.digest()
