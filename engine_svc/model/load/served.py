"""A checkpoint loaded for serving: weights read (a GGUF file's quantized blocks, a GPTQ /
AWQ / compressed-tensors checkpoint's integers kept as they are), layers on the backend
``backends/backend.py`` chooses. The runner's model and a speculative draft model are both loaded
here.

    model, args, backend = load_served_model(model_dir, build, kernels="auto", ...)
"""

from __future__ import annotations

import ctypes
import logging

import torch

from engine_svc.model.arch.args import ModelArgs
from engine_svc.model.arch.llama import Transformer
from engine_svc.model.backends.backend import KernelBuild, ModelBackend, install_backend
from engine_svc.model.load.gguf_checkpoint import gguf_source
from engine_svc.model.load.gguf_metadata import close_gguf
from engine_svc.model.load.gguf_quantized import read_quantized_embeddings, read_quantized_linears
from engine_svc.model.load.hf_quantized import quantization_scheme
from engine_svc.model.load.loader import load_model, quantized_linears, read_config
from engine_svc.model.native.kernels import INT8_ACTIVATION_MAX_GROUP
from engine_svc.model.native.quant import QuantizedWeight, with_groups_of_at_most

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
    activation_quantization: str = "auto",
    rope_positions: int | None = None,
) -> tuple[Transformer, ModelArgs, ModelBackend]:
    """Weights on the device, their layers on the backend ``backends/backend.py`` chooses.
    ``build`` is the native kernels' build, started before the weights load so that
    the two overlap; ``quantization`` is ``--quantization``, ``activation_quantization``
    ``--activation-quantization``; ``rope_positions`` the served context (max_model_len),
    which sizes the native rotary table."""
    prequantized, source, declared = _prequantized(model_dir, build, quantization)
    int8_activations = _int8_activations(activation_quantization, declared, prequantized is not None, build)
    if int8_activations and prequantized:
        # Per-channel scales repeated over groups of 32: the values stay, the activations
        # get a scale per group (quant_int8.c takes groups of up to 512).
        prequantized = {name: with_groups_of_at_most(w, INT8_ACTIVATION_MAX_GROUP) for name, w in prequantized.items()}
    model, args = load_model(model_dir, device, dtype, kept_modules=prequantized or ())
    gguf_path = gguf_source(model_dir)
    embeddings = read_quantized_embeddings(gguf_path, args) if prequantized and gguf_path else None
    backend = install_backend(
        model,
        build.result(),
        wanted=kernels,
        device=device,
        dtype=dtype,
        batch_size_hint=batch_size_hint,
        quantization=quantization if quantization in ("int8", "int4") else None,
        prequantized=prequantized,
        prequantized_source=source,
        quantized_embeddings=embeddings,
        int8_activations=int8_activations,
        rope_positions=rope_positions,
    )
    close_gguf()  # every weight is copied out of the file by now
    return model, args, backend


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
STEP_BUFFERS_MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
STEP_BUFFERS_TRIM_THRESHOLD = 128 << 20


def _glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc (its malloc tunables below), else None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def keep_step_buffers() -> bool:
    """Keep freed buffers of up to 32 MiB in the C heap instead of returning them to the
    system: a step allocates and frees the same large activations every time (a 1,024-token
    step of the benchmark model: 2-6 MiB per GEMM output), and glibc, which maps such
    blocks fresh and unmaps them when freed (or trims the heap above 2x its threshold), made
    the next step fault them back in page by page: the standard workload took 264,000 page
    faults in its 21 s, 15,000-17,000 with this. Up to 128 MiB of free heap stays resident.
    Call after start-up (``return_freed_heap`` has given back what loading freed). False
    where the C library is not glibc."""
    libc = _glibc()
    return libc is not None and bool(
        libc.mallopt(_M_MMAP_THRESHOLD, STEP_BUFFERS_MMAP_THRESHOLD)
        and libc.mallopt(_M_TRIM_THRESHOLD, STEP_BUFFERS_TRIM_THRESHOLD)
    )


def return_freed_heap() -> None:
    """Give the C heap's free pages back to the system: loading and warming up leave tens
    of MiB of freed buffers there (reading, dequantizing, packing), which glibc keeps
    resident (SmolLM2-135M's Q4_1 file: 92 MiB less RSS after start-up). Nothing where
    the C library is not glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _prequantized(
    model_dir: str, build: KernelBuild, quantization: str | None
) -> tuple[dict[str, QuantizedWeight] | None, str, bool]:
    """A quantized checkpoint's layers as they are, what kind it is, and whether it declares
    int8 activations (compressed-tensors W8A8 / W4A8): a GGUF file's blocks, or a GPTQ /
    AWQ / compressed-tensors directory's integers (``--quantization auto``, the default,
    where the native kernels run; read first, so those layers are never dequantized); else
    None, and its weights are dequantized at load. A format the engine cannot serve is
    refused here, by name."""
    gguf_path = gguf_source(model_dir)
    scheme = quantization_scheme(read_config(model_dir)) if gguf_path is None else None
    declared = scheme is not None and scheme.int8_activations
    if (gguf_path is None and scheme is None) or quantization not in (None, "auto"):
        return None, "", declared
    source = "gguf" if scheme is None else scheme.method
    if build.result() is None:  # waits for the kernels: the quantized GEMM is theirs
        logger.info("%s weights dequantized to the serving dtype: the quantized GEMM needs native kernels", source)
        return None, "", declared
    if gguf_path is not None:
        return read_quantized_linears(gguf_path, ModelArgs.from_hf_config(read_config(model_dir))), source, declared
    return quantized_linears(model_dir), source, declared


def _int8_activations(wanted: str, declared: bool, kept: bool, build: KernelBuild) -> bool:
    """``--activation-quantization``: ``int8`` on (refused later where it cannot run),
    ``none`` off, ``auto`` where the checkpoint declares int8 activations, its layers are
    ``kept`` quantized and this CPU has int8 dot products (else float activations: the same
    weights, a little more exact)."""
    if wanted != "auto":
        return wanted == "int8"
    if not declared:
        return False
    kernels = build.result()
    if not kept or kernels is None or not kernels.int8_dot_products:
        logger.info(
            "the checkpoint declares int8 activations; this engine computes with float activations instead "
            "(int8 dot products need its layers kept quantized on the native kernels, on a CPU with "
            "AVX512-VNNI or AVX-VNNI)"
        )
        return False
    return True
