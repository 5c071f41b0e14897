"""A decode-only step's decoder layers in one native call (native/stack.c).

    build_decode_stack(model, kernels)       at load, after the native layers (backend.py):
                                             ``model.decode_stack``, None where the model
                                             does not qualify
    Transformer.forward                      a step of decode rows only goes through it

A decode step at small batch is a few milliseconds of arithmetic split into some 300 calls
(per layer a norm, four linear layers, RoPE, the K/V write, attention), and at batch 1 the
Python around them costs about as much as the kernels. ``tk_decode_stack`` calls the same
kernels with the same arguments in the same order, so its output is bit for bit the
module path's (tests/engine/model/backends/test_decode_stack.py).

It takes what its C code implements and nothing else: Llama-shaped layers (pre-norm, fused
qkv, full RoPE, no q/k norm, no sliding window, a SiLU-and-multiply MLP) on the native
kernels, no LoRA adapters (``LoraSlots`` takes it out), and either float32 activations (the
caches float32 or bfloat16) with packed float32 or quantized linear layers, or a bfloat16
model: bfloat16 activations and caches, every linear layer packed in bfloat16. Any other model, or a step with
prefill rows, takes the module path.
"""

from __future__ import annotations

import logging

import torch

from engine_svc.model.arch.layers import MLP, Attention
from engine_svc.model.arch.llama import DecoderLayer, Transformer
from engine_svc.model.attention import AttentionMetadata, KVCache
from engine_svc.model.attention.native import NativeDecode
from engine_svc.model.backends.native_layers import NativeLinear, NativeRMSNorm, NativeRotary
from engine_svc.model.backends.quantized_layers import QuantizedLinear
from engine_svc.model.native import NativeKernels
from engine_svc.model.native.api import DTYPE_CODES, AttnShape, DecodeRows, Layer, Linear, StackShape
from engine_svc.model.native.kernels import KernelError

logger = logging.getLogger(__name__)


def _linear(module: torch.nn.Module, dtype: torch.dtype) -> Linear | None:
    """The layer as the C code takes it for activations of ``dtype``, or None."""
    if type(module) is QuantizedLinear and dtype == torch.float32:
        return module.weight_p.linear(int8_activations=module.int8_activations)
    if type(module) is NativeLinear and module.packed.panels.dtype == dtype:
        return module.packed.linear
    return None


class DecodeStack:
    """The model's layers as ``tk_decode_stack`` takes them (pointers into the modules'
    own tensors, which the model keeps alive), and the call."""

    def __init__(self, model: Transformer, kernels: NativeKernels, layers: list[Layer], shape: StackShape) -> None:
        self.kernels = kernels
        self.layers = (Layer * len(layers))(*layers)
        self.shape = shape
        assert isinstance(model.rotary, NativeRotary)
        self.cos_sin = model.rotary.cos_sin  # [max_position, head_dim] float32; never moves
        shape.cos_sin = self.cos_sin.data_ptr()
        self._caches: list[KVCache] | None = None
        self._cache_ptrs: tuple[int, int] = (0, 0)
        self.dtype = model.norm.weight.dtype  # the activations' (the model's)
        args = model.args
        inter = max(layer.gate_up.n for layer in layers)
        width = args.hidden_size + (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
        width += args.num_heads * args.head_dim + inter
        if self.dtype == torch.bfloat16:  # bfloat16 rows (half a float each), and tk_gemm's widened A
            width = (width + 1) // 2 + max(args.hidden_size, args.num_heads * args.head_dim, inter)
        self._width = width

    def takes(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step is one the stack runs: decode rows only, on the native kernel."""
        decode = meta.decode
        return (
            meta.prefill is None
            and isinstance(decode, NativeDecode)
            and decode.num_rows == x.shape[0]
            and x.dtype == self.dtype
        )

    def _point_at(self, kv_caches: list[KVCache]) -> None:
        first = (kv_caches[0][0].data_ptr(), kv_caches[-1][1].data_ptr())
        if kv_caches is self._caches and first == self._cache_ptrs:
            return
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"decode stack: {len(kv_caches)} caches for {len(self.layers)} layers")
        for layer, (k, v) in zip(self.layers, kv_caches):
            if k.dtype not in (torch.float32, torch.bfloat16) or not (k.is_contiguous() and v.is_contiguous()):
                raise ValueError("decode stack: caches must be contiguous float32 or bfloat16")
            if self.dtype == torch.bfloat16 and k.dtype != torch.bfloat16:
                raise ValueError("decode stack: a bfloat16 model's caches must be bfloat16")
            if k.shape[2:] != (self.shape.attn.num_kv_heads, self.shape.attn.head_dim) or k.shape != v.shape:
                raise ValueError(f"decode stack: a cache of shape {tuple(k.shape)} does not fit the model")
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
        self.shape.attn.block_size = kv_caches[0][0].shape[1]
        self.shape.attn.kv_dtype = DTYPE_CODES[kv_caches[0][0].dtype]
        self._caches, self._cache_ptrs = kv_caches, first

    def run(
        self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the embedding [rows, hidden] in the model's dtype (overwritten) -> (the last
        layer's MLP output, the residual stream), what the module path's layer loop returns."""
        decode = meta.decode
        assert isinstance(decode, NativeDecode)
        self._point_at(kv_caches)
        m = x.shape[0]
        x = x.contiguous()
        residual = torch.empty_like(x)
        ws = torch.empty(m * self._width, dtype=torch.float32)
        positions = positions.contiguous()
        slots = meta.slot_mapping.contiguous()
        table = decode.block_table
        rows = DecodeRows(
            m, positions.data_ptr(), slots.data_ptr(), table.data_ptr(), table.shape[1], decode.ctx_lens.data_ptr(),
            decode.max_ctx_len,
        )  # fmt: skip
        rc = self.kernels.decode_stack(self.layers, self.shape, rows, x, residual, ws)
        if rc != 0:
            raise KernelError(f"decode stack failed in layer {rc // 100 - 1} (code {rc % 100})")
        return x, residual


def build_decode_stack(model: Transformer, kernels: NativeKernels) -> DecodeStack | None:
    """The stack for ``model``, or None where one of its parts is not what the C code does
    (the reason is logged at debug level)."""

    def no(reason: str) -> DecodeStack | None:
        logger.debug("decode stack: not used (%s)", reason)
        return None

    args = model.args
    dtype = model.norm.weight.dtype  # the model's, and its activations'
    if dtype not in (torch.float32, torch.bfloat16):
        return no(f"{dtype} activations")
    if not isinstance(model.rotary, NativeRotary) or model.sliding_rotary is not None:
        return no("RoPE is not the native full rotation")
    layers: list[Layer] = []
    eps: set[float] = set()
    scales: set[float] = set()
    for layer in model.layers:
        if type(layer) is not DecoderLayer or layer.pre_ff_norm is not None or layer.post_ff_norm is not None:
            return no("a layer is not a pre-norm decoder layer")
        attn, mlp = layer.attn, layer.mlp
        if type(attn) is not Attention or attn.q_norm is not None or attn.sliding_window is not None:
            return no("attention with q/k norms or a sliding window")
        if type(mlp) is not MLP or not mlp.act_fused:
            return no("an MLP without the fused SiLU-and-multiply")
        norms = (layer.input_norm, layer.post_attn_norm)
        if not all(type(n) is NativeRMSNorm and n.weight.dtype == dtype for n in norms):
            return no("a norm off the native kernel")
        linears = [_linear(m, dtype) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(lin is None for lin in linears):
            return no(f"a linear layer that is neither packed in {dtype} nor quantized (float32 only)")
        eps.update(n.eps for n in norms)
        scales.add(attn.scale)
        layers.append(
            Layer(layer.input_norm.weight.data_ptr(), layer.post_attn_norm.weight.data_ptr(), *linears, None, None)
        )
    if len(eps) != 1 or len(scales) != 1:
        return no("norms or attention scales differ between layers")
    attn_shape = AttnShape(
        args.num_heads, args.num_kv_heads, args.head_dim, 0,  # block size and kv_dtype: the caches', at each step
        (args.num_heads + 2 * args.num_kv_heads) * args.head_dim, scales.pop(), DTYPE_CODES[dtype], 0,
    )  # fmt: skip
    shape = StackShape(attn_shape, args.hidden_size, eps.pop(), model.rotary.cos_sin.shape[0], None)
    return DecodeStack(model, kernels, layers, shape)
