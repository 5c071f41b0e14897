"""Mixture of experts in place of the MLP (Mixtral, Qwen3-MoE).

    router:  logits = x @ W_r.T            [num_tokens, num_experts]
             probs  = softmax(logits) in float32; top-k per token; renormalised to sum 1
                      where the family does (Mixtral always, Qwen3-MoE by norm_topk_prob)
    experts: each expert runs once per step, on exactly the tokens routed to it:

        (token, slot) pairs sorted by expert:  | e0: t3 t7 | e1: t0 | e2: (none) | e3: t0 t3 t7 |
        expert e reads x[tokens of its run], and its output, scaled by the router weight,
        is added back to those tokens' rows (index_add_), experts in ascending order.

Each token's sum over its experts therefore runs in the order transformers adds them.
``run_expert`` is ``F.linear`` here; with the native kernels, each expert's packed GEMMs
(backends/native_layers.py: gate/up fused with SiLU-and-multiply).
Weights are stacked per layer: gate/up ``[num_experts, 2 * moe_intermediate, hidden]``
and down ``[num_experts, hidden, moe_intermediate]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine_svc.model.arch.args import ModelArgs
from engine_svc.model.arch.layers import ACTIVATIONS

# (expert, x [count, hidden]) -> that expert's MLP output [count, hidden], before the router weight.
ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


class SparseMoE(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_experts = args.num_experts
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.act = ACTIVATIONS[args.hidden_act]
        hidden, intermediate = args.hidden_size, args.moe_intermediate_size
        self.router = nn.Linear(hidden, args.num_experts, bias=False)
        self.gate_up_experts = nn.Parameter(torch.empty(args.num_experts, 2 * intermediate, hidden))
        self.down_experts = nn.Parameter(torch.empty(args.num_experts, hidden, intermediate))
        self.hidden_act = args.hidden_act
        self.run_expert: ExpertFn = self._torch_expert

    def _torch_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_experts[expert]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down_experts[expert])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [num_tokens, top_k] in x's dtype, expert ids [num_tokens, top_k] long)."""
        probs = F.softmax(self.router(x).float(), dim=-1)  # [num_tokens, num_experts]
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), expert_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden]."""
        weights, expert_ids = self.route(x)
        flat_ids = expert_ids.view(-1)  # [num_tokens * top_k]: pair p is token p // top_k
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        flat_weights = weights.view(-1)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = pairs // self.top_k
            h = self.run_expert(expert, x[tokens])  # [count, hidden]
            out.index_add_(0, tokens, h * flat_weights[pairs, None])
        return out
