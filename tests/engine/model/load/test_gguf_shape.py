"""A GGUF file's shape metadata is checked against its tensors before anything is built.

Files are written here with gguf's own writer (tests/gguf_factory.py), each telling one lie
about itself; each is refused in one line naming the file and the key, before any weight
is read. The honest file gives the numbers it holds.
"""

from __future__ import annotations

import pytest

from engine_svc.model.arch.llama import ModelArgs
from engine_svc.model.load.gguf_metadata import GGUFError, hf_config, open_gguf, read_shape
from engine_svc.model.load.gguf_weights import read_gguf_tensors
from tests.gguf_factory import write_tiny_gguf

LIES = {
    "block_count 10^6": (
        dict(metadata={"llama.block_count": 10**6}),
        "llama.block_count is 1000000: the file holds tensors of blocks 0 to 1 (2 in all)",
    ),
    "a block missing a tensor": (
        dict(drop=("blk.1.ffn_up.weight",)),
        "llama.block_count is 2: tensor blk.1.ffn_up.weight is missing",
    ),
    "head_count 0": (
        dict(metadata={"llama.attention.head_count": 0}),
        "llama.attention.head_count is 0: a positive integer is needed",
    ),
    "head_count_kv that does not divide head_count": (
        dict(metadata={"llama.attention.head_count_kv": 3}),
        "llama.attention.head_count_kv is 3: it must divide attention.head_count (4)",
    ),
    "head_count off by a factor": (  # q's rows still agree: 8 heads of 8
        dict(metadata={"llama.attention.head_count": 8}),
        "llama.attention.head_count_kv is 2: blk.0.attn_k.weight has 32 rows, not 2 x 8 "
        "(head dim embedding_length 64 / head_count 8)",
    ),
    "key_length": (
        dict(metadata={"llama.attention.key_length": 32}),
        "llama.attention.head_count is 4: blk.0.attn_q.weight has 64 rows, not 4 x 32 (attention.key_length)",
    ),
    "vocab_size 10^8": (
        dict(metadata={"llama.vocab_size": 10**8}),
        "llama.vocab_size is 100000000: above the most this engine serves (4,194,304)",
    ),
    "vocab_size within the cap": (
        dict(metadata={"llama.vocab_size": 300}),
        "llama.vocab_size is 300: token_embd.weight is [260, 64], 260 rows",
    ),
    "embedding_length": (
        dict(metadata={"llama.embedding_length": 128}),
        "llama.embedding_length is 128: token_embd.weight is [260, 64], 64 wide",
    ),
    "feed_forward_length": (
        dict(metadata={"llama.feed_forward_length": 256}),
        "llama.feed_forward_length is 256: blk.0.ffn_up.weight is [128, 64]",
    ),
    "context_length 2^32": (
        dict(metadata={"llama.context_length": 2**32}),
        "llama.context_length is 4294967296: above the most this engine serves (16,777,216)",
    ),
    "a text where a number belongs": (
        dict(metadata={"llama.block_count": "2"}),
        "llama.block_count is '2': a positive integer is needed",
    ),
    "a wrong tensor shape": (
        dict(shapes={"blk.1.attn_q.weight": (48, 64)}),
        "tensor blk.1.attn_q.weight is [48, 64]; the metadata (llama.embedding_length 64, head_count 4, "
        "head_count_kv 2, head dim 16, feed_forward_length 128, vocab_size 260) makes it [64, 64]",
    ),
}


def test_the_honest_file_gives_its_numbers(tmp_path):
    path = write_tiny_gguf(tmp_path / "honest.gguf")
    shape = read_shape(open_gguf(path), path, "llama")
    assert (shape.num_layers, shape.hidden_size, shape.vocab_size, shape.num_heads, shape.num_kv_heads) == (
        2, 64, 260, 4, 2
    )  # fmt: skip
    assert (shape.head_dim, shape.intermediate_size, shape.context_length) == (16, 128, 2048)
    config = hf_config(open_gguf(path), path)
    assert (config["num_hidden_layers"], config["max_position_embeddings"], config["vocab_size"]) == (2, 2048, 260)


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_lie_is_refused_in_one_line_naming_the_file_and_the_key(tmp_path, lie):
    options, message = LIES[lie]
    path = write_tiny_gguf(tmp_path / "lying.gguf", **options)
    with pytest.raises(GGUFError) as refused:
        hf_config(open_gguf(path), path)
    assert str(refused.value) == f"lying.gguf: {message}"


def test_the_weight_reader_checks_before_it_reads(tmp_path):
    """A prepared directory's config may come from before the file changed: the reader checks again."""
    honest = write_tiny_gguf(tmp_path / "honest.gguf")
    args = ModelArgs.from_hf_config(hf_config(open_gguf(honest), honest))
    lying = write_tiny_gguf(tmp_path / "lying.gguf", shapes={"blk.0.ffn_down.weight": (64, 96)})
    with pytest.raises(GGUFError, match=r"lying.gguf: tensor blk.0.ffn_down.weight is \[64, 96\]"):
        read_gguf_tensors(lying, args)
