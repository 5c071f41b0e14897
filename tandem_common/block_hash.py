"""The prefix cache's block hash: one definition for the engine (which caches by it) and the
frontend (which predicts, from a prompt's token ids, which engine holds its blocks).

    prompt token ids (block_size = 4)
    +-------------+-------------+-------------+-------+
    | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 ... t11  | t12   |   <- a partial last block has no hash
    +-------------+-------------+-------------+-------+
    h0 = H(t0..t3)   h1 = H(h0 ‖ t4..t7)   h2 = H(h1 ‖ t8..t11)

H is SHA-256 over the parent's digest (none for the first block) followed by the block's
token ids as little-endian int64. Each hash covers every token before it, so equal hashes
mean equal prefixes, and an engine that holds h2 can serve the first 12 tokens of any
prompt whose third block hashes to h2. ``BLOCK_HASH_ALGORITHM`` names this definition on
the wire (GetModelInfo): a frontend predicts only for engines that hash the way it does.
A request under a LoRA adapter chains its first block to the adapter's digest instead of
to nothing (``LORA_BLOCK_HASH_ALGORITHM``). A request with a cache salt (a tenant's
secret) chains it to ``salted(that parent, salt)``: no block is shared across salts, so
one tenant cannot learn from timing whether another's prompt is cached.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes

BLOCK_HASH_ALGORITHM = "sha256-chain-int64le"
# The same, where a request under a LoRA adapter starts its chain from the adapter's digest
# (``parent_hash`` of its first block): K/V computed under one adapter is never a hit for
# another, nor for the base model. Engines that serve adapters name this one.
LORA_BLOCK_HASH_ALGORITHM = "sha256-chain-int64le+lora-digest"
BLOCK_HASH_ALGORITHMS = (BLOCK_HASH_ALGORITHM, LORA_BLOCK_HASH_ALGORITHM)  # what a frontend predicts for

_ITEM_BYTES = array("q").itemsize  # 8

MAX_CACHE_SALT_BYTES = 1024  # a request's cache salt, UTF-8 (checked by the frontend)
_SALT_DOMAIN = b"tandem-cache-salt\0"  # a salted parent is never a bare adapter digest


def salted(parent: BlockHash | None, cache_salt: str | None) -> BlockHash | None:
    """The parent of a request's first block hash: ``parent`` (an adapter's digest, None for
    the base model) with the request's cache salt mixed in; unchanged without one. Both
    services apply it the same way, so the frontend's predictions match the engine's hits."""
    if not cache_salt:
        return parent
    # Fixed-length prefix (domain, then a 32-byte digest or 32 zero bytes): unambiguous.
    return hashlib.sha256(_SALT_DOMAIN + (parent or bytes(32)) + cache_salt.encode()).digest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    data = array("q", token_ids)
    if sys.byteorder == "big":
        data.byteswap()
    return data.tobytes()


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block, chained with the hash of the block before it.

    SHA-256 rather than Python's ``hash``: a block hit hands one request the K/V that
    another request computed, so a collision silently corrupts output (and, on a shared
    server, could leak one tenant's context into another's). Python's tuple hash is 64-bit
    and not collision-resistant, so a crafted prompt could aim for another prefix's hash.
    """
    # The parent digest has a fixed length and every block has block_size tokens, so the
    # concatenation is unambiguous: first blocks (no parent) are shorter than all others.
    return hashlib.sha256((parent_hash or b"") + _token_bytes(token_ids)).digest()


def hash_blocks(
    token_ids: Sequence[int], block_size: int, num_blocks: int | None = None, parent_hash: BlockHash | None = None
) -> list[BlockHash]:
    """Hashes of the first ``num_blocks`` full blocks of ``token_ids`` (all full blocks when
    None), the first chained to ``parent_hash``. Equal to ``hash_block`` block by block, but
    the ids are packed once: about 1 us per block of 16 plus a few ms per 32k tokens."""
    num_full = len(token_ids) // block_size
    num_blocks = num_full if num_blocks is None else min(num_blocks, num_full)
    if num_blocks <= 0:
        return []
    data = _token_bytes(token_ids[: num_blocks * block_size])
    step = block_size * _ITEM_BYTES
    sha256 = hashlib.sha256
    hashes = []
    parent = parent_hash or b""
    for start in range(0, num_blocks * step, step):
        parent = sha256(parent + data[start : start + step]).digest()
        hashes.append(parent)
    return hashes


def max_hit_blocks(num_tokens: int, block_size: int, *, prompt_logprobs: bool = False) -> int:
    """How many leading blocks of a ``num_tokens``-token prompt a prefix-cache lookup may hit.

    The hit stops short of the last token, so at least one token is computed and there are
    logits to sample from; a request that asks for prompt logprobs needs the logits of
    every prompt position and hits nothing. The engine's lookup and the frontend's
    prediction both follow this rule, so that predicted and served cached tokens agree.
    """
    if prompt_logprobs or num_tokens <= 0:
        return 0
    return (num_tokens - 1) // block_size
