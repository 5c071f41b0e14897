"""GGUF's quantized blocks kept as the kernels' layouts: what they dequantize to equals
the gguf package's reference dequantization (llama.cpp's own reader), bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine_svc.model.native.quant_gguf import BLOCK_BYTES, BLOCK_SIZE, from_gguf_blocks
from engine_svc.model.native.quant_pack import pack_panels

# Byte offsets of each block's float16 fields: random bytes there could spell inf or NaN.
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fmt: skip


def _random_blocks(name: str, n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    num_blocks, size = n * (k // BLOCK_SIZE[name]), BLOCK_BYTES[name]
    blocks = rng.integers(0, 256, (num_blocks, size), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        blocks[:, at : at + 2] = (
            (rng.standard_normal(num_blocks) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
        )
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("name", list(BLOCK_BYTES))
def test_blocks_dequantize_as_the_reference_reader_does(name):
    n, k = 6, 512
    raw = _random_blocks(name, n, k, seed=len(name))
    want = quants.dequantize(raw, getattr(GGMLQuantizationType, name)).reshape(n, k)
    qw = from_gguf_blocks(name, raw, (n, k))
    np.testing.assert_array_equal(qw.dequantize().numpy(), want)
    assert qw.nbytes <= raw.nbytes * 2  # as read: float32 scales


@pytest.mark.parametrize("name,extra", [("Q8_0", 0), ("Q4_1", 0), ("Q4_0", 2)])
def test_packed_blocks_take_the_files_bytes(name, extra):
    """Resident: float16 scales and mins as the file has them (Q4_0 adds its -8 d as a min,
    2 bytes a block; Q5_x, held as int8, take 1.125 bytes a weight against the file's 0.75)."""
    n, k = 64, 512
    raw = _random_blocks(name, n, k, seed=7)
    packed = pack_panels(from_gguf_blocks(name, raw, (n, k)), 32)
    assert packed.scale.dtype == torch.float16
    assert packed.nbytes <= raw.nbytes + extra * n * k // 32
    assert torch.equal(packed.dequantize(), from_gguf_blocks(name, raw, (n, k)).dequantize())


def test_types_that_cannot_stay_quantized_are_refused_by_name():
    with pytest.raises(ValueError, match="GGUF tensor type Q2_K cannot be kept quantized; supported: Q8_0"):
        from_gguf_blocks("Q2_K", np.zeros((1, 84), np.uint8), (1, 256))
    with pytest.raises(ValueError, match="whole blocks of 256"):
        from_gguf_blocks("Q4_K", np.zeros((1, 144), np.uint8), (1, 128))
    assert torch.is_tensor(from_gguf_blocks("Q8_0", np.zeros((1, 34), np.uint8), (1, 32)).qs)
