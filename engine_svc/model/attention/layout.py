"""The step's batch layout: what every attention backend's builder starts from.

Request ``i`` contributes ``query_lens[i]`` consecutive rows at positions ``starts[i] ..``;
single-token requests (decodes) lead, multi-token chunks follow. Its block table covers at
least ``seq_lens[i] = starts[i] + query_lens[i]`` tokens, ``blocks_needed[i]`` blocks.

Rows are expanded per request with numpy rather than ``torch.repeat_interleave``: torch
runs that in a parallel region even for a handful of rows, and a step's index math must
not wait for a second thread the OS has taken away (8 ms on a busy 2-core machine).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [num_blocks, block_size, kv_heads, head_dim]


@dataclass(frozen=True)
class BatchLayout:
    block_size: int
    query_lens: list[int]
    starts: list[int]
    seq_lens: list[int]  # start + query_len: the tokens each request attends to
    blocks_needed: list[int]  # ceil(seq_len / block_size)
    num_decodes: int  # the leading requests with query_len == 1
    table: torch.Tensor  # [num_reqs, max(blocks_needed)] long, each row padded with block 0

    @classmethod
    def build(
        cls, query_lens: list[int], starts: list[int], block_tables: list[list[int]], block_size: int
    ) -> BatchLayout:
        """Checks the layout (decodes first, tables long enough; ValueError otherwise) and
        pads the block tables into one tensor, so index math runs as tensor ops."""
        num_reqs = len(query_lens)
        num_decodes = 0
        while num_decodes < num_reqs and query_lens[num_decodes] == 1:
            num_decodes += 1
        if any(n == 1 for n in query_lens[num_decodes:]):
            raise ValueError("single-token requests must lead the batch")
        seq_lens = [s + n for s, n in zip(starts, query_lens)]
        blocks_needed = [-(-n // block_size) for n in seq_lens]
        for r, (table_row, nb) in enumerate(zip(block_tables, blocks_needed)):
            if len(table_row) < nb:
                raise ValueError(f"request {r}: block table has {len(table_row)} blocks, {nb} needed")
        max_blocks = max(blocks_needed)
        table = torch.tensor(
            [bt[:nb] + [0] * (max_blocks - nb) for bt, nb in zip(block_tables, blocks_needed)], dtype=torch.long
        )
        return cls(block_size, query_lens, starts, seq_lens, blocks_needed, num_decodes, table)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    def slot_mapping(self, positions: torch.Tensor) -> torch.Tensor:
        """Flat cache slot of each row's K/V: [num_tokens] long, on CPU."""
        req_of_row = torch.from_numpy(np.repeat(np.arange(self.num_reqs), self.query_lens))
        return self.table[req_of_row, positions // self.block_size] * self.block_size + positions % self.block_size


def flat_positions(query_lens: list[int], starts: list[int]) -> torch.Tensor:
    """Position of every row of the flattened batch: [num_tokens] long, on CPU."""
    if all(n == 1 for n in query_lens):  # a decode-only step: one row per request, at its start
        return torch.tensor(starts, dtype=torch.long)
    q_lens = np.asarray(query_lens, dtype=np.int64)
    offsets = np.asarray(starts, dtype=np.int64) - (np.cumsum(q_lens) - q_lens)  # position - row, per request
    return torch.from_numpy(np.arange(int(q_lens.sum()), dtype=np.int64) + np.repeat(offsets, q_lens))
