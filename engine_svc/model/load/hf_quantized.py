"""A Hugging Face directory's quantized linear layers: GPTQ, AWQ and compressed-tensors.

    scheme = quantization_scheme(config)              None for a float checkpoint; what cannot be
                                                      served is refused here, by name, at start
    read_quantized_modules(files, scheme)             {HF module name: QuantizedWeight}, the
                                                      integers as they are (native/quant_hf.py)
    float_tensors(files, scheme, kept)                the float loader's (HF name, tensor) stream:
                                                      a kept module's weight as a meta tensor, any
                                                      other quantized module's dequantized

What loads (``config.json``'s ``quantization_config``):

    quant_method         what                                     refused by name
    gptq                 bits 4 or 8, any group size (-1: one     other bits; act-order with a
                         per row), sym or not, checkpoint_format  permuted g_idx (kept quantized;
                         gptq (v1) or gptq_v2                     ``--quantization none`` serves it)
    awq                  bits 4, version gemm, zero_point         gemv / marlin / exllama layouts
    compressed-tensors   W4A16 / W8A16: format pack-quantized     static or float activation
                         (4 or 8 bits) or naive / int-quantized   scales (input_scale, FP8),
                         (int8); symmetric int weights; strategy  output activations, float
                         group, channel or tensor; W8A8 / W4A8:   types, asymmetric weights,
                         the same weights with dynamic symmetric  act-order, sparsity, KV-cache
                         int8 input activations (per token or     schemes
                         tensor): served with int8 activations
                         (``--activation-quantization``)

Layers the model cannot hold quantized (the LM head, MoE experts) and, with
``--quantization none`` or without the native kernels, every layer, are dequantized at load
into the serving dtype with the same arithmetic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine_svc.model.native.quant import QuantizedWeight
from engine_svc.model.native.quant_hf import (
    AWQ_ORDER,
    UnsupportedQuantization,
    from_awq,
    from_compressed,
    from_gptq,
    unpack_int32,
)

logger = logging.getLogger(__name__)

METHODS = ("gptq", "awq", "compressed-tensors")
_COMPRESSED_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")


@dataclass(frozen=True)
class QuantScheme:
    method: str  # one of METHODS
    bits: int
    group: int  # -1: one group a row
    zero_plus_one: bool = False  # GPTQ's v1 checkpoint format: stored zeros are z - 1
    packed: bool = True  # compressed-tensors: int32 words (pack-quantized), else int8 (naive)
    # compressed-tensors W8A8 / W4A8: the checkpoint quantizes its layers' inputs to int8
    # (dynamic, symmetric), which the engine serves as its own int8 activations
    int8_activations: bool = False

    def describe(self) -> str:
        group = "per channel" if self.group == -1 else f"groups of {self.group}"
        return f"{self.method} {self.bits}-bit, {group}{', int8 activations' if self.int8_activations else ''}"


def _refuse(what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"quantization_config: {what}")


def quantization_scheme(config: dict) -> QuantScheme | None:
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    if method == "compressed-tensors":
        return _compressed(qc)
    raise _refuse(f"quant_method {method!r} is not supported; supported: {', '.join(METHODS)} (or a GGUF file)")


def _gptq(qc: dict) -> QuantScheme:
    bits, group = qc.get("bits"), int(qc.get("group_size", 128))
    if bits not in (4, 8):
        raise _refuse(f"GPTQ bits {bits} is not supported; supported: 4, 8")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"GPTQ checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2")
    return QuantScheme("gptq", int(bits), group, zero_plus_one=fmt == "gptq")


def _awq(qc: dict) -> QuantScheme:
    bits = qc.get("bits", qc.get("w_bit"))
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise _refuse(f"AWQ bits {bits} is not supported; supported: 4")
    if version != "gemm":
        raise _refuse(f"AWQ version {version!r} is not supported; supported: gemm")
    if not qc.get("zero_point", True):
        raise _refuse("AWQ without zero points (zero_point: false) is not supported")
    return QuantScheme("awq", 4, group)


def _compressed(qc: dict) -> QuantScheme:
    if qc.get("sparsity_config"):
        raise _refuse("compressed-tensors sparsity_config (sparse weights) is not supported")
    if qc.get("kv_cache_scheme"):
        raise _refuse("compressed-tensors kv_cache_scheme (a quantized KV cache) is not supported")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(f"compressed-tensors quantization_status {status!r} is not supported; supported: compressed")
    groups = list((qc.get("config_groups") or {}).items())
    if not groups:
        raise _refuse("compressed-tensors without config_groups")
    schemes = {_compressed_group(name, group, qc.get("format")) for name, group in groups}
    if len(schemes) > 1:
        raise _refuse("compressed-tensors with several weight schemes (config_groups differ) is not supported")
    return schemes.pop()


def _compressed_group(name: str, group: dict, default_format: str | None) -> QuantScheme:
    w = group.get("weights") or {}
    what = f"compressed-tensors config_groups.{name}"
    if group.get("output_activations"):
        raise _refuse(f"{what}.output_activations: output quantization is not supported")
    int8_activations = _int8_activations(group.get("input_activations"), what)
    fmt = str(group.get("format") or default_format or "").lower()
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy", "group")
    if fmt not in _COMPRESSED_FORMATS:
        raise _refuse(f"{what}: format {fmt!r} is not supported; supported: {', '.join(_COMPRESSED_FORMATS)}")
    if kind != "int":
        raise _refuse(f"{what}.weights.type {kind!r} is not supported; supported: int")
    if bits not in (4, 8) or (fmt != "pack-quantized" and bits != 8):
        raise _refuse(f"{what}.weights.num_bits {bits} in {fmt} is not supported; supported: 4, 8 (packed), 8")
    if not w.get("symmetric", True):
        raise _refuse(f"{what}.weights.symmetric false (zero points) is not supported")
    if w.get("actorder"):
        raise _refuse(f"{what}.weights.actorder {w.get('actorder')!r} is not supported")
    if w.get("dynamic"):
        raise _refuse(f"{what}.weights.dynamic is not supported")
    if strategy not in ("group", "channel", "tensor"):
        raise _refuse(f"{what}.weights.strategy {strategy!r} is not supported; supported: group, channel, tensor")
    group_size = int(w.get("group_size") or -1) if strategy == "group" else -1
    return QuantScheme(
        "compressed-tensors", int(bits), group_size, packed=fmt == "pack-quantized", int8_activations=int8_activations
    )


def _int8_activations(a: dict | None, what: str) -> bool:
    """Whether a config group quantizes its inputs the way the engine's int8 activations do
    (dynamic, symmetric int8, per token or tensor: the engine's per-group scales are finer);
    anything else is refused by name."""
    if not a:
        return False
    spec = (a.get("type", "int"), a.get("num_bits"), bool(a.get("dynamic")), a.get("symmetric", True))
    if spec != ("int", 8, True, True) or a.get("strategy", "token") not in ("token", "tensor"):
        raise _refuse(
            f"{what}.input_activations {a!r} is not supported; supported: dynamic symmetric int8 per token or "
            "tensor (W8A8, W4A8), or none (W4A16, W8A16)"
        )
    return True


# -- which tensors make up a quantized module ---------------------------------------------

# The tensors of one quantized module, by suffix; the first names the module.
_SUFFIXES = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_scale", "weight_packed", "weight_shape", "weight", "weight_g_idx"),
}


class _Tensors:
    """Every tensor of a set of safetensors files, read on demand."""

    def __init__(self, files: Sequence[Path]) -> None:
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self.where = {key: h for h in self._handles for key in h.keys()}

    def get(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)

    def shape(self, name: str) -> list[int]:
        return list(self.where[name].get_slice(name).get_shape())


def _modules(tensors: _Tensors, scheme: QuantScheme) -> dict[str, list[str]]:
    """{quantized module: the names of its tensors present}."""
    suffixes = _SUFFIXES[scheme.method]
    modules = {key.removesuffix("." + suffixes[0]) for key in tensors.where if key.endswith("." + suffixes[0])}
    return {m: [f"{m}.{s}" for s in suffixes if f"{m}.{s}" in tensors.where] for m in sorted(modules)}


def _convert(tensors: _Tensors, module: str, scheme: QuantScheme) -> QuantizedWeight:
    get = tensors.get
    if scheme.method == "gptq":
        g_idx = get(f"{module}.g_idx") if f"{module}.g_idx" in tensors.where else None
        return from_gptq(
            get(f"{module}.qweight"), get(f"{module}.qzeros"), get(f"{module}.scales"), g_idx, scheme.bits,
            scheme.group, scheme.zero_plus_one, module,
        )  # fmt: skip
    if scheme.method == "awq":
        qweight, qzeros, scales = (get(f"{module}.{s}") for s in ("qweight", "qzeros", "scales"))
        return from_awq(qweight, qzeros, scales, scheme.group, module)
    weight = get(f"{module}.weight_packed" if scheme.packed else f"{module}.weight")
    if f"{module}.weight_g_idx" in tensors.where:
        raise UnsupportedQuantization(f"{module}: act-order (weight_g_idx) is not supported")
    qw = from_compressed(weight, get(f"{module}.weight_scale"), scheme.bits, scheme.group, scheme.packed, module)
    if f"{module}.weight_shape" in tensors.where:
        shape = tuple(int(d) for d in get(f"{module}.weight_shape").tolist())
        if shape != (qw.out_features, qw.in_features):
            raise UnsupportedQuantization(f"{module}: weight_shape {shape} is not its packed shape (padded rows)")
    return qw


def _dequantize(tensors: _Tensors, module: str, scheme: QuantScheme) -> torch.Tensor:
    """The float32 weight [N, K] of any module of the scheme, whether the kernels' layout can
    hold it or not (a GPTQ g_idx in any order): w = (q - z) * s, as the format defines it."""
    try:
        return _convert(tensors, module, scheme).dequantize()
    except UnsupportedQuantization:
        if scheme.method != "gptq":
            raise
    get, bits = tensors.get, scheme.bits
    q = unpack_int32(get(f"{module}.qweight"), bits, 0)  # [K, N]
    k, n = q.shape
    g_idx = get(f"{module}.g_idx").long() if f"{module}.g_idx" in tensors.where else torch.arange(k) // scheme.group
    z = unpack_int32(get(f"{module}.qzeros"), bits, 1)[:, :n]
    if scheme.zero_plus_one:
        z = (z + 1) & ((1 << bits) - 1)
    s = get(f"{module}.scales").float()
    return ((q - z[g_idx]).float() * s[g_idx]).t().contiguous()


def _shape(tensors: _Tensors, module: str, scheme: QuantScheme) -> tuple[int, int]:
    if scheme.method == "gptq":
        rows, n = tensors.shape(f"{module}.qweight")
        return n, rows * 32 // scheme.bits
    if scheme.method == "awq":
        k, words = tensors.shape(f"{module}.qweight")
        return words * len(AWQ_ORDER), k
    if scheme.packed:
        n, words = tensors.shape(f"{module}.weight_packed")
        return n, words * 32 // scheme.bits
    n, k = tensors.shape(f"{module}.weight")
    return n, k


def read_quantized_modules(
    files: Sequence[Path], scheme: QuantScheme, wanted: Callable[[str], bool]
) -> dict[str, QuantizedWeight]:
    """The quantized modules ``wanted`` (by HF module name) in the kernels' layout. Raises
    UnsupportedQuantization, naming the module, for one the layout cannot hold."""
    tensors = _Tensors(files)
    out = {m: _convert(tensors, m, scheme) for m in _modules(tensors, scheme) if wanted(m)}
    logger.info(
        "%s: %d linear layers kept quantized, %.1f MiB",
        scheme.describe(),
        len(out),
        sum(w.nbytes for w in out.values()) / 2**20,
    )
    return out


def float_tensors(
    files: Sequence[Path], scheme: QuantScheme, kept: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor for the float loader, HF-named: a quantized module's tensors become its
    ``.weight``, a meta tensor where ``kept`` (its layer is served quantized), else the
    dequantized float32 weight."""
    tensors = _Tensors(files)
    modules = _modules(tensors, scheme)
    consumed = {name for names in modules.values() for name in names}
    dequantized = 0
    for module in modules:
        if kept(module):
            yield f"{module}.weight", torch.empty(_shape(tensors, module, scheme), device="meta")
        else:
            dequantized += 1
            yield f"{module}.weight", _dequantize(tensors, module, scheme)
    if dequantized:
        logger.info("%s: %d quantized layers dequantized at load", scheme.describe(), dequantized)
    for name in tensors.where:
        if name not in consumed:
            yield name, tensors.get(name)
