"""The kernels' C API (``tandem_api.h``) as ctypes sees it.

    SIGNATURES   {name: (restype, argtypes)} of every function the header declares, read from
                 its prototypes (the one place they are written)
    API_VERSION  the header's TK_API_VERSION, which a build must report (``tk_api_version``)
    Linear, LoraTerm, AttnShape, DecodeRows, PrefillChunks, Layer, StackShape
                 the header's structs, mirrored once each, field for field
    DTYPE_CODES, SCALE_CODES, EPILOGUE_*   its enums

tests/engine/model/native/test_native_api.py holds the mirrors and the codes to the header.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import torch

HEADER = Path(__file__).resolve().parent / "tandem_api.h"

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # TK_F32, TK_BF16
SCALE_CODES = {torch.float32: 0, torch.float16: 2}  # a quantized weight's scales: TK_F32, TK_F16
EPILOGUE_NONE, EPILOGUE_SILU_MUL = 0, 1  # TK_EPI_NONE, TK_EPI_SILU_MUL

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
# What a parameter of a prototype is to ctypes: every pointer is a c_void_p.
C_TYPES: dict[str, type | None] = {"int": _I, "long": _L, "float": _F, "void": None}

_COMMENT = re.compile(r"/\*.*?\*/", re.DOTALL)
_PROTOTYPE = re.compile(r"\b(int|void)\s+(tk_\w+)\s*\(([^)]*)\)\s*;")


def read_signatures(header: str) -> dict[str, tuple[type | None, list[type]]]:
    """{name: (restype, argtypes)} of the prototypes in the header's text."""
    signatures = {}
    for restype, name, params in _PROTOTYPE.findall(_COMMENT.sub(" ", header)):
        argtypes = []
        for param in params.split(","):
            words = param.replace("*", " * ").split()
            if words == ["void"]:
                continue
            ctype = _P if "*" in words else C_TYPES[words[-2]]
            assert ctype is not None, f"{name}: a parameter of type void"
            argtypes.append(ctype)
        signatures[name] = (C_TYPES[restype], argtypes)
    return signatures


_TEXT = HEADER.read_text()
SIGNATURES = read_signatures(_TEXT)
_VERSION = re.search(r"#define TK_API_VERSION (\d+)", _TEXT)
assert _VERSION is not None
API_VERSION = int(_VERSION.group(1))


class Linear(ctypes.Structure):
    """``tk_linear``: one linear layer's weight as its kernel takes it (``PackedWeight.linear``,
    ``PackedQuantWeight.linear``); it points into the weight's tensors, which never move."""

    _fields_ = [
        ("quantized", _I), ("kind", _I), ("w", _P), ("scale", _P), ("min", _P), ("sdtype", _I), ("group", _I),
        ("bias", _P), ("n", _I), ("k", _I), ("epilogue", _I), ("xquant", _I),
    ]  # fmt: skip


class LoraTerm(ctypes.Structure):
    """``tk_lora`` (gemm_lora.h): a LoRA term per row, added inside the GEMM.

    Built once per layer by ``NativeKernels.lora_term``, which checks the slot tensors (their
    storage never moves: slots are written in place); ``for_rows`` points it at a step's
    rows. Whoever builds one keeps its tensors alive while it is used."""

    _fields_ = [
        ("row_slot", _P),  # int32 [M]: the row's adapter slot, or -1
        ("la", _P),  # [S, K, R]: lora_A^T of every slot
        ("lb", _P),  # [S, NP, R, NR]: lora_B^T x scale per weight panel
        ("ranks", _P),  # int32 [S]: ranks each slot uses
        ("spans", _P),  # int32 [S, NP, 2]: the ranks [t0, t1) each weight panel adds
        ("r", _I),  # R: ranks, a whole number of vectors
        ("np", _I),
        ("xa", _P),  # float32 workspace, >= M x R
        ("ldtype", _I),  # la and lb: float32 or bfloat16
    ]

    def for_rows(self, row_slot: torch.Tensor, xa: torch.Tensor) -> LoraTerm:
        """This term for a step's rows: ``row_slot`` int32 [M] (slots below S, the caller's
        promise), ``xa`` a float32 workspace of at least M x R; both contiguous."""
        if xa.numel() < row_slot.shape[0] * self.r:
            raise ValueError("lora term: the workspace holds fewer than M x R floats")
        self.row_slot, self.xa = row_slot.data_ptr(), xa.data_ptr()
        return self


class AttnShape(ctypes.Structure):
    """``tk_attn_shape``: the attention's heads and paged cache, and the rows' stride."""

    _fields_ = [
        ("num_heads", _I), ("num_kv_heads", _I), ("head_dim", _I), ("block_size", _I), ("row_stride", _L),
        ("scale", _F), ("dtype", _I), ("kv_dtype", _I),
    ]  # fmt: skip


class DecodeRows(ctypes.Structure):
    """``tk_decode_rows``: a decode step's rows (positions and slots for the stack only)."""

    _fields_ = [
        ("num_rows", _I), ("positions", _P), ("slots", _P), ("block_table", _P), ("table_stride", _I),
        ("ctx_lens", _P), ("max_ctx_len", _I),
    ]  # fmt: skip


class PrefillChunks(ctypes.Structure):
    """``tk_prefill_chunks``: a prefill step's chunks."""

    _fields_ = [
        ("num_chunks", _I), ("rows", _P), ("starts", _P), ("lens", _P), ("block_table", _P), ("table_stride", _I),
    ]  # fmt: skip


class Layer(ctypes.Structure):
    """``tk_layer``: one decoder layer of the decode stack."""

    _fields_ = [
        ("in_norm", _P), ("post_norm", _P), ("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear),
        ("k_cache", _P), ("v_cache", _P),
    ]  # fmt: skip


class StackShape(ctypes.Structure):
    """``tk_stack_shape``: what every layer of the decode stack shares."""

    _fields_ = [("attn", AttnShape), ("hidden", _I), ("eps", _F), ("max_position", _I), ("cos_sin", _P)]
