"""A checkpoint loaded for serving: weights read (a GGUF file's quantized blocks kept as
they are), layers on the backend ``backend.py`` chooses. The runner's model and a
speculative draft model are both loaded here.

    model, args, backend = load_served_model(model_dir, build, kernels="auto", ...)
"""

from __future__ import annotations

import logging

import torch

from engine_svc.model.args import ModelArgs
from engine_svc.model.backend import KernelBuild, ModelBackend, install_backend
from engine_svc.model.gguf_checkpoint import gguf_source
from engine_svc.model.gguf_quantized import read_quantized_linears
from engine_svc.model.llama import Transformer
from engine_svc.model.loader import load_model, read_config
from engine_svc.model.native.quant import QuantizedWeight

logger = logging.getLogger(__name__)


def load_served_model(
    model_dir: str,
    build: KernelBuild,
    *,
    kernels: str,
    device: torch.device,
    dtype: torch.dtype,
    batch_size_hint: int,
    quantization: str | None,
) -> tuple[Transformer, ModelArgs, ModelBackend]:
    """Weights on the device, their layers on the backend ``backend.py`` chooses.
    ``build`` is the native kernels' build, started before the weights load so that
    the two overlap; ``quantization`` is ``--quantization``."""
    prequantized = _gguf_quantized(model_dir, build, quantization)
    model, args = load_model(model_dir, device, dtype, kept_modules=prequantized or ())
    backend = install_backend(
        model,
        build.result(),
        wanted=kernels,
        device=device,
        dtype=dtype,
        batch_size_hint=batch_size_hint,
        quantization=quantization if quantization in ("int8", "int4") else None,
        prequantized=prequantized,
    )
    return model, args, backend


def _gguf_quantized(model_dir: str, build: KernelBuild, quantization: str | None) -> dict[str, QuantizedWeight] | None:
    """A GGUF file's quantized blocks as they are (``--quantization auto``, the default,
    where the native kernels run; read first, so those layers are never dequantized);
    else its weights are dequantized."""
    gguf_path = gguf_source(model_dir)
    if gguf_path is None or quantization not in (None, "auto"):
        return None
    if build.result() is None:  # waits for the kernels: the quantized GEMM is theirs
        logger.info("GGUF weights dequantized to the serving dtype: the quantized GEMM needs the native kernels")
        return None
    return read_quantized_linears(gguf_path, ModelArgs.from_hf_config(read_config(model_dir)))
