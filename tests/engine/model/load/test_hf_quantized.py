"""Quantized Hugging Face checkpoints (GPTQ, AWQ, compressed-tensors W4A16 / W8A16) written
here from a random-weight model, packed as each format's tools define it: the loader's
weights equal an independent dequantization of the integers written, and the engine's
greedy ids equal transformers' on those dequantized float weights."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.model.backends.quantized_layers import QuantizedLinear
from engine_svc.model.load.loader import quantized_linears
from engine_svc.model.native import load_kernels
from engine_svc.model.native.kernels import INT8_ACTIVATION_MAX_GROUP
from engine_svc.model.native.quant import quantize_activations, quantize_int8, with_groups_of_at_most
from engine_svc.types import SamplingParams
from tests.engine.test_engine_vs_transformers import _assert_same_or_near_tie, _prompts
from tests.model_factory import load_hf_model, make_model_dir

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
NUM_NEW = 8
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Format:
    method: str  # gptq | awq | compressed-tensors
    bits: int
    group: int  # -1: per channel
    symmetric: bool
    extra: tuple = ()  # extra quantization_config items

    @property
    def name(self) -> str:
        return f"{self.method}-{self.bits}bit-g{self.group}"


FORMATS = [
    Format("gptq", 4, 128, False, (("desc_act", False), ("checkpoint_format", "gptq"))),
    Format("gptq", 8, 32, True, (("checkpoint_format", "gptq_v2"),)),
    Format("awq", 4, 64, False),
    Format("compressed-tensors", 4, 32, True, (("format", "pack-quantized"),)),
    Format("compressed-tensors", 8, -1, True, (("format", "pack-quantized"),)),
]


# -- quantizing and packing, as each format's tools do --------------------------------------


def _quantize(w: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] int64 unsigned, z [N, G] int64, s [N, G] float16) with w ~ (q - z) * s."""
    n, k = w.shape
    group = k if fmt.group == -1 else fmt.group
    g = w.view(n, k // group, group)
    top = (1 << fmt.bits) - 1
    if fmt.symmetric:
        s = (g.abs().amax(dim=2) / (top // 2)).half()
        z = torch.full(s.shape, (top + 1) // 2, dtype=torch.int64)
    else:
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        s = ((hi - lo) / top).half()
        z = torch.round(-lo / s.float()).clamp(0, top).long()
    q = torch.round(g / s.float().unsqueeze(2)) + z.unsqueeze(2)
    return q.clamp(0, top).long().reshape(n, k), z, s


def _reference(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(q - z) * s, float32 [N, K]: each format's definition of its weights."""
    n, k = q.shape
    group = k // s.shape[1]
    return ((q.view(n, -1, group) - z.unsqueeze(2)).float() * s.float().unsqueeze(2)).reshape(n, k)


def _to_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] -> int32 [R * bits / 32, C]: row r holds rows r*per + j in bits bits*j (GPTQ's qweight)."""
    v, per = values.numpy().astype(np.uint64), 32 // bits
    out = np.zeros((v.shape[0] // per, v.shape[1]), np.uint64)
    for j in range(per):
        out |= v[j::per] << np.uint64(bits * j)
    return _to_int32(out)


def _pack_cols(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] -> int32 [R, C * bits / 32]: word c holds column c*per + order[j] in bits bits*j."""
    v, per = values.numpy().astype(np.uint64), 32 // bits
    order = order or tuple(range(per))
    out = np.zeros((v.shape[0], v.shape[1] // per), np.uint64)
    for j in range(per):
        out |= v[:, order[j] :: per] << np.uint64(bits * j)
    return _to_int32(out)


def _pack(w: torch.Tensor, fmt: Format) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A linear weight [N, K] as the format's tensors (by suffix), and their dequantization."""
    q, z, s = _quantize(w, fmt)
    n, k = w.shape
    if fmt.method == "gptq":
        group = k // s.shape[1]
        stored_z = (z - 1) & ((1 << fmt.bits) - 1) if dict(fmt.extra).get("checkpoint_format") == "gptq" else z
        tensors = {
            "qweight": _pack_rows(q.t(), fmt.bits),
            "qzeros": _pack_cols(stored_z.t(), fmt.bits),
            "scales": s.t().contiguous(),
            "g_idx": (torch.arange(k) // group).int(),
        }
    elif fmt.method == "awq":
        awq_order = (0, 2, 4, 6, 1, 3, 5, 7)
        tensors = {
            "qweight": _pack_cols(q.t(), 4, awq_order),
            "qzeros": _pack_cols(z.t(), 4, awq_order),
            "scales": s.t().contiguous(),
        }
    else:  # compressed-tensors, symmetric: signed q = q - z, stored + 2^(bits-1), i.e. q itself
        tensors = {
            "weight_packed": _pack_cols(q, fmt.bits),
            "weight_scale": s.contiguous(),
            "weight_shape": torch.tensor([n, k]),
        }
    return tensors, _reference(q, z, s)


def _quantization_config(fmt: Format) -> dict:
    if fmt.method == "gptq":
        return {"quant_method": "gptq", "bits": fmt.bits, "group_size": fmt.group, "sym": fmt.symmetric,
                **dict(fmt.extra)}  # fmt: skip
    if fmt.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": fmt.group, "zero_point": True, "version": "gemm"}
    weights = {"num_bits": fmt.bits, "type": "int", "symmetric": True, "dynamic": False, "actorder": None,
               "strategy": "channel" if fmt.group == -1 else "group",
               "group_size": None if fmt.group == -1 else fmt.group}  # fmt: skip
    return {
        "quant_method": "compressed-tensors", "format": dict(fmt.extra)["format"], "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
    }  # fmt: skip


def write_quantized(src, dst, fmt: Format, config_edit=None) -> dict[str, torch.Tensor]:
    """``src`` (a float checkpoint) as a quantized checkpoint at ``dst``; returns the
    dequantized weight of each quantized linear, by HF name."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    out, reference = {}, {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
            tensors, reference[name] = _pack(tensor, fmt)
            out.update({f"{module}.{suffix}": t for suffix, t in tensors.items()})
            if fmt.method != "compressed-tensors":  # GPTQ / AWQ checkpoints keep float16 elsewhere
                continue
        else:
            out[name] = tensor.half() if fmt.method != "compressed-tensors" and tensor.is_floating_point() else tensor
    (dst / "model.safetensors").unlink()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = _quantization_config(fmt)
    if config_edit:
        config_edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return reference


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return make_model_dir(
        tmp_path_factory.mktemp("hfq") / "float", arch="qwen2", vocab_size=512, hidden_size=128,
        intermediate_size=256, num_heads=4, num_kv_heads=2,
    )  # fmt: skip


def _hf_on(float_dir, reference: dict[str, torch.Tensor]):
    """transformers on the float checkpoint with the quantized layers' dequantized weights
    (and the float16 round trip of the rest, where the format stored them so)."""
    hf = load_hf_model(float_dir)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, nn.Linear) and f"{name}.weight" in reference:
                module.weight.copy_(reference[f"{name}.weight"])
    return hf


def _greedy_matches(core: EngineCore, hf) -> None:
    prompts = _prompts(7)[::8]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    for prompt, result in zip(prompts, core.generate(prompts, params)):
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0
            )
        _assert_same_or_near_tie(hf, prompt, result.output_token_ids, out[0, len(prompt) :].tolist())


def _engine(path, **overrides) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=256, block_size=16, **overrides))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_layers_equal_the_formats_dequantization_and_greedy_ids_match_transformers(float_dir, tmp_path, fmt):
    path = tmp_path / "model"
    reference = write_quantized(float_dir, path, fmt)
    layers = quantized_linears(path)
    assert layers is not None and len(layers) == 8  # qkv, o, gate_up, down of two layers
    for i in range(2):  # the fused layers hold the format's own weights, bit for bit
        p = f"model.layers.{i}"
        qkv = torch.cat([reference[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(layers[f"layers.{i}.attn.qkv_proj"].dequantize(), qkv)
        gate_up = torch.cat([reference[f"{p}.mlp.{x}_proj.weight"] for x in ("gate", "up")])
        assert torch.equal(layers[f"layers.{i}.mlp.gate_up_proj"].dequantize(), gate_up)
        assert torch.equal(layers[f"layers.{i}.mlp.down_proj"].dequantize(), reference[f"{p}.mlp.down_proj.weight"])
    kernels = load_kernels()
    assert kernels is not None
    down = layers["layers.0.mlp.down_proj"]
    x = torch.randn(20, down.in_features)
    want = F.linear(x, reference["model.layers.0.mlp.down_proj.weight"])
    got = kernels.qgemm(x, kernels.qpack(down))
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)

    hf = _hf_on(float_dir, reference)
    core = _engine(path, max_num_batched_tokens=64)
    assert core.runner.matmuls == fmt.method
    assert sum(isinstance(m, QuantizedLinear) for m in core.runner.model.modules()) == 8
    _greedy_matches(core, hf)


def test_dequantized_at_load_with_quantization_none(float_dir, tmp_path):
    fmt = FORMATS[2]
    reference = write_quantized(float_dir, tmp_path / "model", fmt)
    core = _engine(tmp_path / "model", quantization="none")
    assert core.runner.matmuls == "native"
    _greedy_matches(core, _hf_on(float_dir, reference))


def test_act_order_is_refused_quantized_and_served_dequantized(float_dir, tmp_path):
    path = tmp_path / "model"
    reference = write_quantized(float_dir, path, FORMATS[0], lambda c: c["quantization_config"].update(desc_act=True))
    state = load_file(str(path / "model.safetensors"))
    # act-order: input columns quantized in a permuted order, g_idx naming each one's group
    name = "model.layers.1.mlp.down_proj"
    w = load_file(str(float_dir / "model.safetensors"))[f"{name}.weight"]
    k = w.shape[1]
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(0))
    q, z, s = _quantize(w[:, perm], FORMATS[0])
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // 128).int()
    q_orig = torch.empty_like(q)
    q_orig[:, perm] = q
    state[f"{name}.qweight"] = _pack_rows(q_orig.t(), 4)
    state[f"{name}.qzeros"] = _pack_cols((z - 1).t() & 15, 4)
    state[f"{name}.scales"] = s.t().contiguous()
    state[f"{name}.g_idx"] = g_idx
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    reference[f"{name}.weight"] = (q_orig - z[:, g_idx.long()]).float() * s.float()[:, g_idx.long()]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj: act-order \(desc_act\) with a permuted"):
        _engine(path)
    core = _engine(path, quantization="none")
    _greedy_matches(core, _hf_on(float_dir, reference))


@pytest.mark.parametrize(
    "fmt,edit,message",
    [
        (FORMATS[2], lambda qc: qc.update(version="gemv"), "AWQ version 'gemv' is not supported; supported: gemm"),
        (FORMATS[0], lambda qc: qc.update(bits=3), "GPTQ bits 3 is not supported; supported: 4, 8"),
        (FORMATS[0], lambda qc: qc.update(quant_method="bitsandbytes"), "quant_method 'bitsandbytes' is not supported"),
        (  # static activation scales (input_scale tensors): not what int8 activations compute
            FORMATS[3],
            lambda qc: qc["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "int"}),
            "group_0.input_activations {'num_bits': 8, 'type': 'int'} is not supported; supported: dynamic",
        ),
        (
            FORMATS[3],
            lambda qc: qc["config_groups"]["group_0"].update(output_activations={"num_bits": 8, "type": "int"}),
            "group_0.output_activations: output quantization is not supported",
        ),
        (
            FORMATS[3],
            lambda qc: qc["config_groups"]["group_0"]["weights"].update(type="float"),
            "weights.type 'float' is not supported",
        ),
        (
            FORMATS[3],
            lambda qc: qc["config_groups"]["group_0"]["weights"].update(symmetric=False),
            "weights.symmetric false",
        ),
    ],
)
def test_what_cannot_be_served_is_refused_at_start_by_name(float_dir, tmp_path, fmt, edit, message):
    path = tmp_path / "model"
    write_quantized(float_dir, path, fmt, lambda c: edit(c["quantization_config"]))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _engine(path)


W8A8_INPUTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


def test_a_w8a8_checkpoint_dequantized_serves_float_activations(float_dir, tmp_path):
    edit = lambda c: c["quantization_config"]["config_groups"]["group_0"].update(input_activations=W8A8_INPUTS)  # noqa: E731
    reference = write_quantized(float_dir, tmp_path / "model", FORMATS[4], edit)
    core = _engine(tmp_path / "model", quantization="none")  # auto: nothing quantized to take int8 rows
    assert not any(isinstance(m, QuantizedLinear) for m in core.runner.model.modules())
    _greedy_matches(core, _hf_on(float_dir, reference))


@pytest.mark.parametrize("activations", ["auto", "none"])
def test_w8a8_checkpoints_serve_with_int8_activations(float_dir, tmp_path, activations):
    """compressed-tensors W8A8 (int8 weights per channel, dynamic int8 inputs per token): the
    weights as they are, the inputs quantized by the engine (per row and group of 32, the
    channel scales repeated over groups), where the CPU has int8 dot products; against
    transformers on the same weights with each layer's input quantized the same way. With
    ``--activation-quantization none``, float activations on the same weights."""
    fmt = FORMATS[4]  # 8 bits, per channel
    path = tmp_path / "model"
    edit = lambda c: c["quantization_config"]["config_groups"]["group_0"].update(input_activations=W8A8_INPUTS)  # noqa: E731
    reference = write_quantized(float_dir, path, fmt, edit)
    kernels = load_kernels()
    on = activations == "auto" and kernels is not None and kernels.int8_dot_products
    core = _engine(path, max_num_batched_tokens=64, activation_quantization=activations)
    layers = [m for m in core.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 8 and all(m.int8_activations == on for m in layers)
    # a row's one group where it is at most 512 wide (the int8 path's widest), else groups of 32
    assert all(m.weight_p.group == _a8_group(m.weight_p.in_features, on) for m in layers)
    hf = _hf_on(float_dir, reference)
    if on:
        for name, module in hf.named_modules():
            if isinstance(module, nn.Linear) and f"{name}.weight" in reference:
                group = _a8_group(module.in_features, on)
                module.register_forward_pre_hook(lambda _m, args, g=group: (quantize_activations(args[0], g),))
    _greedy_matches(core, hf)


def _a8_group(k: int, on: bool) -> int:
    return 32 if on and k > INT8_ACTIVATION_MAX_GROUP else k


def test_wide_channel_groups_become_groups_of_32_for_int8_activations():
    w = quantize_int8(torch.randn(8, 1024), 1024)
    narrow = with_groups_of_at_most(w, INT8_ACTIVATION_MAX_GROUP)
    assert narrow.group == 32 and torch.equal(narrow.dequantize(), w.dequantize())
    assert with_groups_of_at_most(narrow, INT8_ACTIVATION_MAX_GROUP) is narrow
