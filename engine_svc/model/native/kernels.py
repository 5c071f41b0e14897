"""ctypes bindings of the compiled kernels, with the argument checks the C code relies on.

Every tensor handed to C is a CPU tensor of the checked dtype and layout; the C side
trusts its inputs. ctypes releases the GIL for the duration of each call, so the gRPC
threads keep running while a kernel works. Threads come from the OpenMP runtime torch
has already loaded (same soname), so kernels and torch's own ops share one pool, sized
by ``torch.get_num_threads()`` at each call.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine_svc.model.native.api import (
    API_VERSION,
    DTYPE_CODES,
    EPILOGUE_NONE,
    EPILOGUE_SILU_MUL,
    SIGNATURES,
    AttnShape,
    DecodeRows,
    Layer,
    Linear,
    LoraTerm,
    PrefillChunks,
    StackShape,
)
from engine_svc.model.native.quant import QuantizedWeight
from engine_svc.model.native.quant_pack import PackedQuantWeight, pack_panels

_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float

# The kernels a decode step calls hundreds of times, also bound without argtypes: ctypes
# converts 17 declared arguments in ~2.9 us a call, against ~0.9 us for arguments passed as
# ctypes values (Zen 5, CPython 3.12), and a batch-1 step makes ~240 such calls. Their
# wrappers pass every argument as its C type: pointers as c_void_p (None for NULL), ``long``
# as c_long, ``float`` as c_float, ``int`` as Python ints that fit in 32 bits (checked).
_HOT = ("tk_qgemm", "tk_rms_norm", "tk_rope")


class KernelError(RuntimeError):
    pass


def _code(t: torch.Tensor) -> int:
    code = DTYPE_CODES.get(t.dtype)
    if code is None or t.device.type != "cpu":
        raise ValueError(f"native kernels take float32 or bfloat16 CPU tensors, got {t.dtype} on {t.device}")
    return code


def _contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("native kernels take contiguous tensors")


def _int32(v: int) -> int:
    """A size passed to C as ``int`` without argtypes: refused unless it fits."""
    if not -(2**31) <= v < 2**31:
        raise ValueError(f"native kernels take sizes below 2**31, got {v}")
    return v


def _check(name: str, rc: int) -> None:
    if rc != 0:
        raise KernelError(f"{name} failed (code {rc})")


class PackedWeight:
    """A linear layer's weight in the GEMM's panel layout (gemm.c), and its bias padded to
    whole panels (float32). ``out_features`` is the width of the result: half the weight's
    rows for a gate/up pair packed for the fused SiLU-and-multiply. ``linear``: the weight as
    ``tk_gemm`` takes it."""

    def __init__(
        self, panels: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int, silu_mul: bool
    ):
        self.panels = panels
        self.bias = bias
        self.in_features = in_features
        self.out_features = out_features
        self.silu_mul = silu_mul
        self.linear = Linear(
            quantized=0, kind=_code(panels), w=panels.data_ptr(), bias=None if bias is None else bias.data_ptr(),
            n=out_features, k=in_features, epilogue=EPILOGUE_SILU_MUL if silu_mul else EPILOGUE_NONE,
        )  # fmt: skip


# Groups of K the int8-activation path takes (quant_int8.c: a group's integer sums in one slice).
INT8_ACTIVATION_MAX_GROUP = 512


def supports_int8_activations(kernels: NativeKernels, w: PackedQuantWeight) -> bool:
    return kernels.int8_dot_products and w.group <= INT8_ACTIVATION_MAX_GROUP


class NativeKernels:
    def __init__(self, path: Path, isa: str) -> None:
        self.isa = isa
        self.path = path
        lib = ctypes.CDLL(str(path))
        # A build of other sources (benchmarks.decode_kernels builds an older commit's beside
        # this checkout's) may take other arguments: called with these, it would crash.
        built = lib.tk_api_version() if hasattr(lib, "tk_api_version") else 1
        if built != API_VERSION:
            raise KernelError(f"{path} has C API {built}, these bindings are for {API_VERSION} (tandem_api.h)")
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self._lib = lib
        raw = ctypes.CDLL(str(path))  # the same loaded object; its own function objects
        self._fast = {name: getattr(raw, name) for name in _HOT}
        for fn in self._fast.values():
            fn.restype = ctypes.c_int
        self.panel_width = lib.tk_gemm_nr()
        self.vector_width = self.panel_width // 2  # floats per vector register of this build
        # bfloat16 matmuls as bfloat16 dot products (AVX512-BF16), same bits as float32 multiply-adds
        self.bf16_dot_products = bool(lib.tk_gemm_bf16_dp())
        # int8 dot products (AVX512-VNNI / AVX-VNNI): qgemm's int8 activations
        self.int8_dot_products = bool(lib.tk_qgemm_int8())

    def supports_prefill_attention(self, head_dim: int) -> bool:
        """The prefill kernel works on whole vectors of head dimensions."""
        return head_dim % self.vector_width == 0

    # -- matmul -----------------------------------------------------------------------

    def pack(
        self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, silu_mul: bool = False
    ) -> PackedWeight:
        """Pack ``weight`` [N, K] (and ``bias`` [N]) for ``gemm`` in ``dtype``. With
        ``silu_mul``, the first N/2 rows are the gate and the last N/2 the up projection."""
        weight = weight.detach().contiguous()
        n, k = weight.shape
        if silu_mul and n % 2:
            raise ValueError("a gate/up weight has an even number of rows")
        nr = self.panel_width
        half = n // 2 if silu_mul else n
        num_panels = -(-half // nr) * (2 if silu_mul else 1)
        if dtype not in DTYPE_CODES:
            raise ValueError(f"native kernels pack float32 or bfloat16 weights, not {dtype}")
        # K rounded up to pairs in bfloat16 on builds with bfloat16 dot products (gemm_bf16.h)
        panels = torch.empty(num_panels * self._lib.tk_gemm_panel_k(k, DTYPE_CODES[dtype]) * nr, dtype=dtype)
        self._lib.tk_gemm_pack(weight.data_ptr(), _code(weight), n, k, int(silu_mul), panels.data_ptr(), _code(panels))
        padded = None
        if bias is not None:
            parts = bias.detach().float().split(half) if silu_mul else (bias.detach().float(),)
            cols = [torch.nn.functional.pad(p, (0, num_panels // len(parts) * nr - half)).view(-1, nr) for p in parts]
            padded = torch.stack(cols, 1).reshape(-1).contiguous() if silu_mul else cols[0].reshape(-1).contiguous()
        return PackedWeight(panels, padded, k, half, silu_mul)

    def panel_columns(self, w: PackedWeight) -> int:
        """Columns of the packed weight's panels: the width of a LoRA term's ``lb`` rows."""
        return w.panels.numel() // self._lib.tk_gemm_panel_k(w.in_features, _code(w.panels))

    def lora_term(
        self, w: PackedWeight, la: torch.Tensor, lb: torch.Tensor, ranks: torch.Tensor, spans: torch.Tensor
    ) -> LoraTerm:
        """The ``lora`` argument of ``gemm`` for weight ``w`` (see ``LoraTerm``), its rows
        set by ``LoraTerm.for_rows``; every rank at most R and every span within them are the
        caller's promise (the C code trusts them)."""
        _contiguous(la, lb, ranks, spans)
        nr = self.panel_width
        num_slots, r = la.shape[0], la.shape[-1]
        num_panels = self.panel_columns(w) // nr
        if ranks.dtype != torch.int32 or ranks.shape != (num_slots,):
            raise ValueError("lora_term: ranks are int32, one per slot")
        if spans.dtype != torch.int32 or spans.shape != (num_slots, num_panels, 2):
            raise ValueError("lora_term: spans are int32 [slots, weight panels, 2]")
        if la.dtype != lb.dtype or la.dtype not in DTYPE_CODES:
            raise ValueError("lora_term: la and lb are both float32 or both bfloat16")
        if (
            r % self.vector_width
            or la.shape != (num_slots, w.in_features, r)
            or lb.shape != (num_slots, num_panels, r, nr)
        ):
            raise ValueError(f"lora_term: la {tuple(la.shape)} / lb {tuple(lb.shape)} do not fit the weight")
        return LoraTerm(
            None, la.data_ptr(), lb.data_ptr(), ranks.data_ptr(), spans.data_ptr(), r, num_panels, None, _code(la)
        )

    def gemm(self, x: torch.Tensor, w: PackedWeight, lora: LoraTerm | None = None) -> torch.Tensor:
        """x [M, K] (row stride may exceed K) @ W^T (+ bias) -> [M, out_features], x's dtype;
        with ``lora`` (``lora_term``, set for these M rows) each row adds its adapter's term."""
        if x.dim() != 2 or x.shape[1] != w.in_features or x.stride(1) != 1:
            raise ValueError(f"gemm: expected [M, {w.in_features}] rows, got {tuple(x.shape)}")
        if x.dtype != w.panels.dtype:  # bfloat16 dot products take pairs of bfloat16 only
            raise ValueError(f"gemm: x is {x.dtype}, the weight was packed in {w.panels.dtype}; pack it in x's dtype")
        m = x.shape[0]
        out = torch.empty(m, w.out_features, dtype=x.dtype)
        code = _code(x)  # the panels' too (checked above)
        # bfloat16 A, widened to float32 (or paired, gemm_bf16.h) once per call; float32 A needs none.
        ws = torch.empty(m * w.in_features, dtype=torch.float32) if code else None  # alive through the call
        rc = self._lib.tk_gemm(
            ctypes.byref(w.linear), x.data_ptr(), x.stride(0), out.data_ptr(), w.out_features, code, m,
            None if ws is None else ws.data_ptr(), None if lora is None else ctypes.byref(lora),
            torch.get_num_threads(),
        )  # fmt: skip
        _check("gemm", rc)
        return out

    def qpack(
        self, weight: QuantizedWeight, bias: torch.Tensor | None = None, silu_mul: bool = False
    ) -> PackedQuantWeight:
        """``weight`` (and ``bias``) in this build's panels for ``qgemm`` (quant_pack.py). With
        ``silu_mul``, the first half of the rows are the gate and the second the up projection."""
        return pack_panels(weight, self.panel_width, bias, silu_mul)

    def qgemm(
        self, x: torch.Tensor, w: PackedQuantWeight, pre_activation: bool = False, int8_activations: bool = False
    ) -> torch.Tensor:
        """x [M, K] @ dequantized(W)^T (+ bias) -> [M, out_features] in x's dtype, W kept
        quantized (quant.c); SiLU-and-multiply for a gate/up weight, unless ``pre_activation``:
        then both halves, [M, 2 * out_features] = [gate | up]. With ``int8_activations``
        (builds with ``int8_dot_products``), x is first quantized per row and group of the
        weight (``quant.quantize_activations``) and the sums are integer dot products."""
        if x.dim() != 2 or x.shape[1] != w.in_features or x.stride(1) != 1:
            raise ValueError(f"qgemm: expected [M, {w.in_features}] rows, got {tuple(x.shape)}")
        if w.panel_width != self.panel_width:
            raise ValueError(f"qgemm: weight packed in panels of {w.panel_width}, this build's are {self.panel_width}")
        if int8_activations and not supports_int8_activations(self, w):
            raise ValueError(f"qgemm: int8 activations need int8 dot products and groups of at most 512 ({self.isa})")
        raw = pre_activation and w.silu_mul  # every panel as it is: gate and up panels alternate
        m, nr = x.shape[0], w.panel_width
        linear = w.linear(raw, int8_activations)
        out = torch.empty(m, linear.n, dtype=x.dtype)
        xf = x if x.dtype == torch.float32 else x.float()  # the kernel reads float32 rows
        rc = self._fast["tk_qgemm"](
            ctypes.byref(linear), _P(xf.data_ptr()), _L(xf.stride(0)), _P(out.data_ptr()), _L(out.stride(0)),
            _code(out), _int32(m), torch.get_num_threads(),
        )  # fmt: skip
        _check("qgemm", rc)
        if not raw:
            return out
        half, tiles = w.out_features, w.qs.shape[0] // 2
        return out.view(m, tiles, 2, nr).transpose(1, 2).reshape(m, 2, tiles * nr)[:, :, :half].reshape(m, 2 * half)

    def decode_stack(
        self, layers: ctypes.Array[Layer], shape: StackShape, rows: DecodeRows, x: torch.Tensor,
        residual: torch.Tensor, ws: torch.Tensor,
    ) -> int:  # fmt: skip
        """``tk_decode_stack`` (stack.c) as it is: its caller (``model/backends/decode_stack.py``)
        builds and checks the layer table, the rows and the buffers they point at."""
        return self._lib.tk_decode_stack(
            ctypes.byref(layers), len(layers), ctypes.byref(shape), ctypes.byref(rows), x.data_ptr(),
            residual.data_ptr(), ws.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip

    # -- small ops --------------------------------------------------------------------

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """norm(x) * weight; with ``residual``, first ``residual += x`` (in place) and the
        norm of the sum. x, residual [rows, dim]; weight [dim]; one dtype."""
        _contiguous(x, weight)
        code = _code(x)
        if residual is not None:
            _contiguous(residual)
            if residual.shape != x.shape or residual.dtype != x.dtype:
                raise ValueError("rms_norm: residual must match x")
        if weight.dtype != x.dtype or weight.shape[-1] != x.shape[-1]:
            raise ValueError("rms_norm: weight must match x's dtype and width")
        out = torch.empty_like(x)
        rows, dim = x.numel() // x.shape[-1], x.shape[-1]
        rc = self._fast["tk_rms_norm"](
            _P(out.data_ptr()), None if residual is None else _P(residual.data_ptr()), _P(x.data_ptr()),
            _P(weight.data_ptr()), _int32(rows), _int32(dim), _F(eps), code, torch.get_num_threads(),
        )  # fmt: skip
        _check("rms_norm", rc)
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, cols] float32 (a row's values contiguous; rows may lie further apart,
        as in a slice of wider logits) -> int64 [rows]: each row's first maximum, a NaN
        counting as the maximum, as ``x.max(dim=-1).indices``."""
        if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1:
            raise ValueError("argmax_rows takes a 2-D float32 CPU tensor whose rows are contiguous")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        rc = self._lib.tk_argmax_rows(
            out.data_ptr(), x.data_ptr(), x.stride(0), _int32(x.shape[0]), _int32(x.shape[1]), torch.get_num_threads()
        )
        _check("argmax_rows", rc)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * inter] -> silu(gate) * up [rows, inter]."""
        _contiguous(gate_up)
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        _check(
            "silu_mul",
            self._lib.tk_silu_mul(
                out.data_ptr(), gate_up.data_ptr(), rows, width // 2, _code(gate_up), torch.get_num_threads()
            ),
        )
        return out

    def rope(
        self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int, head_dim: int
    ) -> None:
        """Rotate the first ``num_heads`` heads of every row of ``qkv`` [rows, width] in place.
        positions [rows] int64; cos_sin [max_position, head_dim] float32 (cos | sin)."""
        if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] < num_heads * head_dim:
            raise ValueError("rope: qkv must be [rows, width] with unit column stride")
        if positions.dtype != torch.int64 or positions.shape[0] != qkv.shape[0] or not positions.is_contiguous():
            raise ValueError("rope: one int64 position per row")
        if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous() or cos_sin.shape[1] != head_dim:
            raise ValueError("rope: cos_sin must be float32 [max_position, head_dim]")
        rc = self._fast["tk_rope"](
            _P(qkv.data_ptr()), _L(qkv.stride(0)), _P(positions.data_ptr()), _P(cos_sin.data_ptr()),
            _int32(cos_sin.shape[0]), _int32(qkv.shape[0]), _int32(num_heads), _int32(head_dim), _code(qkv),
            torch.get_num_threads(),
        )  # fmt: skip
        _check("rope", rc)

    # -- attention --------------------------------------------------------------------

    def write_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> bool:
        """k, v ``[rows, kv_heads, head_dim]`` (views of one fused qkv tensor, say) into
        their slots (int64 ``[rows]``) of the caches ``[blocks, block_size, kv_heads,
        head_dim]``, rounded where the caches are bfloat16 beside float32 rows. False, with
        nothing written, for rows the kernel does not take as they lie (the caller copies
        them another way); raises on a slot outside the caches."""
        rows, kv_heads, head_dim = k.shape
        width = kv_heads * head_dim
        if (
            v.shape != k.shape or v.dtype != k.dtype or k.stride(0) != v.stride(0)
            or k.stride()[1:] != (head_dim, 1) or v.stride()[1:] != (head_dim, 1)
            or k_cache.dtype != v_cache.dtype or k_cache.dtype not in (k.dtype, torch.bfloat16)
            or k_cache.shape != v_cache.shape or k_cache.shape[2] * k_cache.shape[3] != width
            or not (k_cache.is_contiguous() and v_cache.is_contiguous() and slots.is_contiguous())
            or slots.dtype != torch.int64 or slots.shape != (rows,)
        ):  # fmt: skip
            return False
        shape = AttnShape(
            num_kv_heads=kv_heads, head_dim=head_dim, row_stride=k.stride(0), dtype=_code(k), kv_dtype=_code(k_cache)
        )
        rc = self._lib.tk_write_kv(
            ctypes.byref(shape), k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(),
            slots.data_ptr(), rows, k_cache.numel() // width, torch.get_num_threads(),
        )  # fmt: skip
        _check("write_kv (a slot outside the cache?)", rc)
        return True

    def _attn_shape(
        self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> AttnShape:
        """The attention's shape, checked: q and out share one dtype, the caches another, the
        same or bfloat16; out [rows, heads, head_dim]; caches [blocks, block_size, kv_heads,
        head_dim]."""
        _contiguous(out, k_cache, v_cache)
        code, kv_code = _code(q), _code(k_cache)
        if out.dtype != q.dtype or k_cache.dtype != v_cache.dtype:
            raise ValueError("attention: q and out share one dtype, the two caches another")
        if k_cache.dtype not in (q.dtype, torch.bfloat16):
            raise ValueError(
                f"attention: a {k_cache.dtype} cache beside {q.dtype} rows (the cache: theirs or bfloat16)"
            )
        num_heads, head_dim = out.shape[1], out.shape[2]
        if q.dim() != 2 or q.stride(1) != 1 or q.shape[1] < num_heads * head_dim or q.shape[0] != out.shape[0]:
            raise ValueError("attention: q must be [rows, >= heads * head_dim] with unit column stride")
        if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim or num_heads % k_cache.shape[2]:
            raise ValueError("attention: cache shape mismatch")
        _, block_size, num_kv_heads, _ = k_cache.shape
        return AttnShape(num_heads, num_kv_heads, head_dim, block_size, q.stride(0), scale, code, kv_code)

    @staticmethod
    def _check_int32(*tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.dtype != torch.int32 or not t.is_contiguous():
                raise ValueError("attention: index tensors must be contiguous int32")

    def decode_attention(
        self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        block_table: torch.Tensor, ctx_lens: torch.Tensor, max_ctx_len: int, scale: float,
    ) -> None:  # fmt: skip
        """One query token per row. out [rows, heads, head_dim]; q [rows, >= heads * head_dim]
        (the q part of qkv); caches [blocks, block_size, kv_heads, head_dim]; block_table
        [rows, stride] int32; ctx_lens [rows] int32."""
        shape = self._attn_shape(out, q, k_cache, v_cache, scale)
        self._check_int32(block_table, ctx_lens)
        num_rows = out.shape[0]
        if block_table.shape[0] != num_rows or ctx_lens.shape[0] != num_rows:
            raise ValueError("decode attention: one block-table row and one length per query row")
        rows = DecodeRows(
            num_rows=num_rows, block_table=block_table.data_ptr(), table_stride=block_table.shape[1],
            ctx_lens=ctx_lens.data_ptr(), max_ctx_len=max_ctx_len,
        )  # fmt: skip
        rc = self._lib.tk_decode_attention(
            ctypes.byref(shape), ctypes.byref(rows), out.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        _check("decode attention", rc)

    def prefill_attention(
        self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        block_table: torch.Tensor, chunk_rows: torch.Tensor, chunk_starts: torch.Tensor, chunk_lens: torch.Tensor,
        scale: float,
    ) -> None:  # fmt: skip
        """Causal attention of prefill chunks over the paged cache (their own K/V included).
        Chunk c: rows chunk_rows[c] .. + chunk_lens[c] of q/out, positions chunk_starts[c] ..;
        block_table [chunks, stride] int32."""
        shape = self._attn_shape(out, q, k_cache, v_cache, scale)
        self._check_int32(block_table, chunk_rows, chunk_starts, chunk_lens)
        num_chunks = chunk_lens.shape[0]
        if (
            block_table.shape[0] != num_chunks
            or chunk_rows.shape[0] != num_chunks
            or chunk_starts.shape[0] != num_chunks
        ):
            raise ValueError("prefill attention: one block-table row, row start and position per chunk")
        chunks = PrefillChunks(
            num_chunks, chunk_rows.data_ptr(), chunk_starts.data_ptr(), chunk_lens.data_ptr(), block_table.data_ptr(),
            block_table.shape[1],
        )  # fmt: skip
        rc = self._lib.tk_prefill_attention(
            ctypes.byref(shape), ctypes.byref(chunks), out.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        _check("prefill attention", rc)
