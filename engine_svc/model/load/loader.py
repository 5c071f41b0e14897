"""Load a Llama-family model from a local Hugging Face directory.

Expected files: ``config.json`` plus either ``model.safetensors`` or a sharded
``model.safetensors.index.json`` with the shards it names. Weights are renamed to ours and
q/k/v and gate/up are concatenated into the fused projections::

    model.layers.{i}.self_attn.{q,k,v}_proj.*    -> layers.{i}.attn.qkv_proj.*    (cat on dim 0)
    model.layers.{i}.self_attn.o_proj.*          -> layers.{i}.attn.o_proj.*
    model.layers.{i}.mlp.{gate,up}_proj.*        -> layers.{i}.mlp.gate_up_proj.* (cat on dim 0)
    model.layers.{i}.mlp.down_proj.*             -> layers.{i}.mlp.down_proj.*
    model.layers.{i}.input_layernorm.weight      -> layers.{i}.input_norm.weight
    model.layers.{i}.post_attention_layernorm.*  -> layers.{i}.post_attn_norm.weight
    model.layers.{i}.self_attn.qkv_proj.* / mlp.gate_up_proj.*   (Phi-3: fused in the checkpoint, kept)
    model.layers.{i}.self_attn.{q,k}_norm.weight -> layers.{i}.attn.{q,k}_norm.weight  (Qwen3, Gemma 3)
    model.layers.{i}.{pre,post}_feedforward_layernorm.weight -> layers.{i}.{pre,post}_ff_norm.weight  (Gemma 3)
    model.embed_tokens.weight / model.norm.weight / lm_head.weight   (lm_head absent when tied)

A quantized checkpoint (GPTQ, AWQ, compressed-tensors: ``hf_quantized.py``) has its linear
layers' integer tensors in place of their ``.weight``: ``quantized_linears`` reads them for
the layers served quantized (fused as above), and the float load dequantizes the others.

Mixture-of-experts layers (Mixtral's ``block_sparse_moe``, Qwen3-MoE's ``mlp``) stack their
experts, each expert's gate and up concatenated as for the dense MLP::

    ...{block_sparse_moe,mlp}.gate.weight                       -> layers.{i}.mlp.router.weight
    ...experts.{e}.{w1,gate_proj} / {w3,up_proj} -> layers.{i}.mlp.gate_up_experts [E, 2 * I, H]
    ...experts.{e}.{w2,down_proj}                -> layers.{i}.mlp.down_experts    [E, H, I]
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine_svc.model.arch.llama import ModelArgs, Transformer
from engine_svc.model.arch.rope import RotaryEmbedding, rope_attention_scaling, rope_inv_freq
from engine_svc.model.load.gguf_checkpoint import gguf_source
from engine_svc.model.load.gguf_weights import read_gguf_tensors
from engine_svc.model.load.hf_quantized import float_tensors, quantization_scheme, read_quantized_modules
from engine_svc.model.native.cpu import cpu_features
from engine_svc.model.native.quant import QuantizedWeight, concat_rows

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_RENAMES = {
    "self_attn.o_proj": "attn.o_proj",
    "mlp.down_proj": "mlp.down_proj",
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_attn_norm",
    "pre_feedforward_layernorm": "pre_ff_norm",
    "post_feedforward_layernorm": "post_ff_norm",
    "self_attn.qkv_proj": "attn.qkv_proj",  # Phi-3 checkpoints store them fused already
    "mlp.gate_up_proj": "mlp.gate_up_proj",
    "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm",
    "block_sparse_moe.gate": "mlp.router",
    "mlp.gate": "mlp.router",
}
_EXPERT_RE = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)")
# Expert projection -> (stacked parameter, part within the expert: gate 0, up 1).
_EXPERT_PARTS = {
    "w1": ("gate_up_experts", 0),
    "gate_proj": ("gate_up_experts", 0),
    "w3": ("gate_up_experts", 1),
    "up_proj": ("gate_up_experts", 1),
    "w2": ("down_experts", 0),
    "down_proj": ("down_experts", 0),
}
# Parts of a fused projection, in concatenation order.
_FUSED = {
    "self_attn.q_proj": ("attn.qkv_proj", 0),
    "self_attn.k_proj": ("attn.qkv_proj", 1),
    "self_attn.v_proj": ("attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_FUSED_PARTS = {"attn.qkv_proj": 3, "mlp.gate_up_proj": 2}


def auto_dtype(device: torch.device | str) -> tuple[torch.dtype, str]:
    """``--dtype auto``: the fastest dtype this device computes well, and why.

    On a CPU with bfloat16 dot products in hardware (AVX512-BF16, AMX) bfloat16 matmuls run
    at about twice the float32 rate; without them (AVX2-only) a bfloat16 product is
    computed in float32 anyway, so float32 avoids the conversions and the bfloat16
    roundings. On CUDA, float32: lower precisions there stay an explicit choice.
    """
    if torch.device(device).type != "cpu":
        return torch.float32, "the default off CPU"
    features = cpu_features()
    if features.native_bf16:
        kind = "AMX" if "amx_bf16" in features.flags else "AVX512-BF16"
        return torch.bfloat16, f"this CPU ({features.model_name}) has {kind} bfloat16 dot products"
    return torch.float32, f"this CPU ({features.model_name}) has no bfloat16 arithmetic (no AVX512-BF16 or AMX)"


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """Map a dtype name (or ``auto``) to torch and refuse combinations that cannot run."""
    if dtype == "auto":
        chosen, why = auto_dtype(device)
        logger.info("dtype auto: %s, because %s", str(chosen).removeprefix("torch."), why)
        return chosen
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; expected auto or one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"unsupported dtype {dtype}; expected one of {', '.join(DTYPES)}")
    if dtype == torch.float16 and torch.device(device).type == "cpu":
        raise ValueError("float16 is only supported on CUDA; use bfloat16 or float32 on CPU")
    return dtype


def read_config(model_dir: str | Path) -> dict:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model directory")
    return json.loads(config_path.read_text())


def read_special_token_ids(model_dir: str | Path) -> tuple[int | None, tuple[int, ...]]:
    """(bos_token_id, eos_token_ids) from config.json and generation_config.json.

    EOS ids of both files count (generation_config often lists extra end-of-turn ids).
    """
    model_dir = Path(model_dir)
    sources = [read_config(model_dir)]
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        sources.append(json.loads(gen_path.read_text()))
    bos: int | None = None
    eos: list[int] = []
    for src in sources:
        if src.get("bos_token_id") is not None:
            bos = int(src["bos_token_id"])
        ids = src.get("eos_token_id")
        for token_id in ids if isinstance(ids, list) else [ids]:
            if token_id is not None and int(token_id) not in eos:
                eos.append(int(token_id))
    return bos, tuple(eos)


def _weight_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {', '.join(missing)}")
        return files
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no weights in {model_dir}: expected model.safetensors or model.safetensors.index.json")


def expert_name(hf_name: str) -> tuple[str, tuple[int, int]] | None:
    """(our stacked parameter, (expert, part)) for an expert's weight, else None."""
    m = _LAYER_RE.fullmatch(hf_name)
    expert = None if m is None else _EXPERT_RE.fullmatch(m.group(2).removesuffix(".weight"))
    if m is None or expert is None:
        return None
    stacked, part = _EXPERT_PARTS[expert.group(2)]
    return f"layers.{m.group(1)}.mlp.{stacked}", (int(expert.group(1)), part)


def our_name(hf_name: str) -> tuple[str, int | None] | None:
    """(our parameter name, part index for fused weights) or None for names we skip."""
    if hf_name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return hf_name.removeprefix("model."), None
    m = _LAYER_RE.fullmatch(hf_name)
    if m is None:
        return None
    layer, rest = m.groups()
    module, _, suffix = rest.rpartition(".")  # suffix: weight | bias
    if module in _FUSED:
        fused, part = _FUSED[module]
        return f"layers.{layer}.{fused}.{suffix}", part
    if module in _RENAMES:
        return f"layers.{layer}.{_RENAMES[module]}.{suffix}", None
    return None


def load_model(
    model_dir: str | Path,
    device: torch.device | str,
    dtype: str | torch.dtype,
    kept_modules: Collection[str] = (),
) -> tuple[Transformer, ModelArgs]:
    """Build the model on ``device`` in ``dtype`` with the directory's weights.

    A directory prepared from a GGUF file (``gguf_checkpoint.py``) holds a config.json but
    no safetensors: its weights come from the GGUF file it names, dequantized, except the
    weights of ``kept_modules`` (our module names), left on the meta device for layers that
    will be served from the file's quantized blocks. A quantized Hugging Face checkpoint's
    layers are dequantized likewise, ``kept_modules`` left on the meta device.
    """
    model_dir = Path(model_dir)
    dtype = resolve_dtype(dtype, device)
    config = read_config(model_dir)
    args = ModelArgs.from_hf_config(config)

    def kept(hf_name: str) -> bool:
        mapped = our_name(hf_name)
        return mapped is not None and mapped[0].removesuffix(".weight") in kept_modules

    gguf_path = gguf_source(model_dir)
    if gguf_path is not None:
        tensors, freq_factors = read_gguf_tensors(gguf_path, args, kept if kept_modules else None)
        return build_model(args, tensors, device, dtype, gguf_path, freq_factors=freq_factors)
    scheme = quantization_scheme(config)
    if scheme is not None:
        quantized = float_tensors(_weight_files(model_dir), scheme, lambda module: kept(f"{module}.weight"))
        return build_model(args, quantized, device, dtype, model_dir)
    return build_model(args, _safetensors_tensors(model_dir), device, dtype, model_dir)


def quantized_linears(model_dir: str | Path) -> dict[str, QuantizedWeight] | None:
    """A quantized Hugging Face checkpoint's linear layers in the kernels' layout, by our
    module name, q/k/v and gate/up stacked (None for a float checkpoint). The LM head,
    embeddings and MoE experts are left to the float load. Raises UnsupportedQuantization
    (a ValueError) naming a layer the layout cannot hold."""
    model_dir = Path(model_dir)
    scheme = quantization_scheme(read_config(model_dir))
    if scheme is None:
        return None

    def wanted(module: str) -> bool:
        mapped = our_name(f"{module}.weight")
        return mapped is not None and mapped[0] not in ("lm_head.weight", "embed_tokens.weight")

    parts: dict[str, dict[int, QuantizedWeight]] = {}
    whole: dict[str, QuantizedWeight] = {}  # one tensor in the file (Phi-3's fused projections too)
    for module, weight in read_quantized_modules(_weight_files(model_dir), scheme, wanted).items():
        mapped = our_name(f"{module}.weight")
        assert mapped is not None
        name, part = mapped[0].removesuffix(".weight"), mapped[1]
        if part is None:
            whole[name] = weight
        else:
            parts.setdefault(name, {})[part] = weight
    for name, pieces in parts.items():
        expected = _FUSED_PARTS[".".join(name.split(".")[-2:])]
        if len(pieces) == expected:  # else a part is float: the whole layer stays float
            whole[name] = concat_rows([pieces[i] for i in range(expected)])
    return whole


def _safetensors_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                yield hf_name, f.get_tensor(hf_name)


def _stack_experts(
    source: Path, name: str, pieces: dict[tuple[int, int], torch.Tensor], num_experts: int
) -> torch.Tensor:
    """[num_experts, out, in]: each expert's parts (gate, up) concatenated, experts stacked."""
    num_parts = 2 if name.endswith("gate_up_experts") else 1
    missing = [key for key in ((e, p) for e in range(num_experts) for p in range(num_parts)) if key not in pieces]
    if missing or len(pieces) != num_experts * num_parts:
        raise ValueError(f"{source}: {name} needs {num_experts} experts x {num_parts} parts, got {sorted(pieces)}")
    return torch.stack([torch.cat([pieces[e, p] for p in range(num_parts)], dim=0) for e in range(num_experts)])


def build_model(
    args: ModelArgs,
    tensors: Iterable[tuple[str, torch.Tensor]],
    device: torch.device | str,
    dtype: torch.dtype,
    source: Path,
    *,
    freq_factors: torch.Tensor | None = None,
) -> tuple[Transformer, ModelArgs]:
    """The model from Hugging Face-named tensors; ``freq_factors`` ([head_dim // 2]) divide
    the RoPE frequencies, as llama.cpp's ``rope_freqs`` tensor does."""
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    experts: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    for hf_name, raw in tensors:
        stacked = expert_name(hf_name)
        if stacked is not None:
            experts.setdefault(stacked[0], {})[stacked[1]] = raw.to(dtype)
            continue
        mapped = our_name(hf_name)
        if mapped is None:
            if not hf_name.endswith("rotary_emb.inv_freq"):
                logger.warning("ignoring unexpected weight %s in %s", hf_name, source.name)
            continue
        name, part = mapped
        tensor = raw.to(dtype)
        if part is None:
            state[name] = tensor
        else:
            parts.setdefault(name, {})[part] = tensor
    for name, pieces in parts.items():
        expected = _FUSED_PARTS[".".join(name.split(".")[-3:-1])]
        if len(pieces) != expected:
            raise ValueError(f"{source}: incomplete weights for {name} ({len(pieces)} of {expected} parts)")
        state[name] = torch.cat([pieces[i] for i in range(expected)], dim=0)
    for name, expert_pieces in experts.items():
        state[name] = _stack_experts(source, name, expert_pieces, args.num_experts)
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise ValueError(f"{source}: lm_head.weight is missing and tie_word_embeddings is false")

    with torch.device("meta"):
        model = Transformer(args)
    expected_names = {n for n in model.state_dict() if not (args.tie_word_embeddings and n == "lm_head.weight")}
    missing = sorted(expected_names - state.keys())
    if missing:
        raise ValueError(f"{source}: missing weights {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    model.load_state_dict({k: v if v.is_meta else v.to(device) for k, v in state.items()}, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.tie_weights()
    inv_freq = rope_inv_freq(args)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.float()
    assert isinstance(model.rotary, RotaryEmbedding)
    model.rotary.inv_freq = inv_freq.to(device)
    model.rotary.attention_scaling = rope_attention_scaling(args)
    if model.sliding_rotary is not None:  # Gemma 3's local theta: no scaling, by definition
        model.sliding_rotary.inv_freq = rope_inv_freq(args, sliding=True).to(device)
    model.eval().requires_grad_(False)
    logger.info(
        "loaded %s from %s: %d layers, hidden %d, vocab %d, %s on %s",
        args.architecture,
        source,
        args.num_layers,
        args.hidden_size,
        args.vocab_size,
        dtype,
        device,
    )
    return model, args
