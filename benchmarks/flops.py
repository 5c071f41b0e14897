"""Model FLOPs of a workload, the machine's matmul peak, and the ceiling they imply.

    workload_flops(shape, workload)  -> FLOPs an ideal engine must spend (prefix hits excluded)
    matmul_peak(dtype)               -> the fastest matmul this machine runs for the dtype
    memory_read_rate()               -> GB/s this machine reads from memory
    ceiling(...)                     -> output tokens/s if every FLOP ran at that peak

Counted FLOPs (one multiply-add = 2): the linear layers of every layer (q/k/v, o, gate/up,
down), attention (q.k and p.v over each token's context, causal), and the LM head for each
sampled token. Embedding lookups, norms, RoPE and softmax are left out: they are memory
work, a few percent of the total. A prompt token whose K/V an earlier request of the
workload left in the prefix cache (a full block of a shared prefix) costs nothing, as in
an engine with a large enough cache; the last prompt token is always computed, since its
logits give the first output token.

``StepRecorder`` wraps an engine's scheduler to keep what every step ran, so the same
counts give achieved FLOP/s per step kind (steps with prefill rows, decode-only steps).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

BLOCK_SIZE = 16  # prefix-cache granularity of both engines (their default block size)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelShape:
        """A Hugging Face directory's config.json, or a GGUF file's (through the directory
        the engine prepares for it)."""
        from engine_svc.model.load.gguf_checkpoint import resolve_model_dir

        config = json.loads((resolve_model_dir(model_dir)[0] / "config.json").read_text())
        num_heads = config["num_attention_heads"]
        return cls(
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            vocab_size=config["vocab_size"],
        )

    @property
    def linear_flops_per_token(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * hd
        o = self.num_heads * hd * h
        mlp = 3 * h * self.intermediate_size
        return 2 * self.num_layers * (qkv + o + mlp)

    @property
    def lm_head_flops_per_row(self) -> int:
        return 2 * self.hidden_size * self.vocab_size

    def kv_bytes_per_context_token(self, element_bytes: int) -> int:
        """Bytes of the K and V of one cached token, every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes

    def attention_flops(self, start: int, num_tokens: int) -> int:
        """Tokens at positions start .. start + num_tokens - 1, each attending to itself and
        every earlier position: q.k and p.v, 2 FLOPs per multiply-add each."""
        context = num_tokens * (2 * start + num_tokens + 1) // 2  # sum of (p + 1)
        return 4 * self.num_layers * self.num_heads * self.head_dim * context

    def chunk_flops(self, start: int, num_tokens: int, num_sampled: int) -> tuple[int, int, int]:
        """(linear, attention, lm_head) FLOPs of computing ``num_tokens`` tokens from ``start``."""
        return (
            num_tokens * self.linear_flops_per_token,
            self.attention_flops(start, num_tokens),
            num_sampled * self.lm_head_flops_per_row,
        )


def cached_prefix_lengths(workload: list[dict], block_size: int = BLOCK_SIZE) -> list[int]:
    """Per request, prompt tokens an ideal prefix cache serves: whole blocks that an earlier
    request of the workload computed, never the last prompt token."""
    seen: set[bytes] = set()
    out = []
    for r in workload:
        ids = r["prompt_token_ids"]
        parent = b""
        cached, hit = 0, True
        for b in range(len(ids) // block_size):
            parent = hashlib.sha256(parent + repr(ids[b * block_size : (b + 1) * block_size]).encode()).digest()
            if hit and parent in seen and (b + 1) * block_size < len(ids):
                cached = (b + 1) * block_size
            else:
                hit = False
            seen.add(parent)
        out.append(cached)
    return out


def workload_flops(shape: ModelShape, workload: list[dict], block_size: int = BLOCK_SIZE) -> dict:
    """FLOPs of generating every request's ``max_tokens`` tokens after its prompt."""
    linear = attention = lm_head = 0
    num_prompt_computed = 0
    for r, cached in zip(workload, cached_prefix_lengths(workload, block_size)):
        prompt_len, max_tokens = len(r["prompt_token_ids"]), r["max_tokens"]
        # The prompt (minus its cached head), then one decode step per output token but the last.
        num_new = prompt_len - cached + max_tokens - 1
        num_prompt_computed += prompt_len - cached
        lin, att, head = shape.chunk_flops(cached, num_new, max_tokens)
        linear, attention, lm_head = linear + lin, attention + att, lm_head + head
    return {
        "linear": linear,
        "attention": attention,
        "lm_head": lm_head,
        "total": linear + attention + lm_head,
        "num_prompt_tokens_computed": num_prompt_computed,
        "num_prompt_tokens_cached": sum(len(r["prompt_token_ids"]) for r in workload) - num_prompt_computed,
        "num_output_tokens": sum(r["max_tokens"] for r in workload),
    }


# -- the machine's peak -------------------------------------------------------------------


def _best_rate(fn, amount: int, repeats: int) -> float:
    """``amount`` (FLOPs, bytes) per second of ``fn``'s fastest run, in billions."""
    fn()
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return amount / best / 1e9


def matmul_peak(dtype: str, shape: ModelShape | None = None, repeats: int = 7) -> dict:
    """GFLOP/s of the fastest matmul this machine runs on matrices of ``dtype``, measured now.

    Tried: ``F.linear`` and oneDNN's packed matmul, on a 2048-cube and on the model's widest
    projection at 1024 rows. bfloat16 numbers are exactly representable in float32, so a
    bfloat16 product can always be computed in float32 (an AVX2 CPU has no faster way): for
    bfloat16 the float32 figure counts too. The best of all is the peak. ``repeats`` runs
    per case, the fastest kept: other load on the machine only slows a run down.
    """
    import torch
    import torch.nn.functional as F

    dtypes = {"float32": [torch.float32], "bfloat16": [torch.bfloat16, torch.float32]}[dtype]
    cases = [(2048, 2048, 2048)]
    if shape is not None:
        cases.append((1024, shape.hidden_size, 2 * shape.intermediate_size))
    g = torch.Generator().manual_seed(0)
    results: dict[str, float] = {}
    for dt in dtypes:
        for m, k, n in cases:
            a, w = torch.randn(m, k, generator=g).to(dt), torch.randn(n, k, generator=g).to(dt)
            name = f"{str(dt).removeprefix('torch.')} {m}x{k}x{n}"
            flops = 2 * m * k * n
            results[f"{name} F.linear"] = _best_rate(lambda a=a, w=w: F.linear(a, w), flops, repeats)
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
                results[f"{name} packed"] = _best_rate(
                    lambda a=a, p=packed: torch.ops.mkldnn._linear_pointwise(a, p, None, "none", [], ""), flops, repeats
                )
            except (RuntimeError, AttributeError, NotImplementedError):
                pass
    best = max(results, key=results.__getitem__)
    return {"gflops": results[best], "best": best, "cases": results, "threads": torch.get_num_threads()}


def memory_read_rate(nbytes: int = 512 << 20, repeats: int = 7) -> dict:
    """GB/s this machine reads from memory, measured now: a float32 sum over ``nbytes``
    (far beyond the caches) on torch's threads, read front to back, the fastest of
    ``repeats`` runs. A decode step's K/V is read block by block from anywhere in the pool,
    which a machine reads at most this fast."""
    import torch

    x = torch.ones(nbytes // 4)
    return {"gbps": _best_rate(x.sum, nbytes, repeats), "bytes": nbytes, "threads": torch.get_num_threads()}


def ceiling(flops: dict, peak_gflops: float) -> dict:
    """Output tokens/s with every FLOP at the peak."""
    seconds = flops["total"] / (peak_gflops * 1e9)
    return {"output_tok_per_s": flops["num_output_tokens"] / seconds, "seconds": seconds}


# -- per-step accounting ------------------------------------------------------------------


@dataclass
class StepRecord:
    duration_s: float
    num_prefill_tokens: int  # rows of chunks longer than one token
    num_decode_rows: int
    linear: int
    attention: int
    lm_head: int

    @property
    def flops(self) -> int:
        return self.linear + self.attention + self.lm_head


@dataclass
class StepRecorder:
    """Keeps, for every engine step, its duration, its rows and their FLOPs.

    ``attach(core)`` wraps ``core.step`` and ``core.scheduler.schedule`` of one engine; the
    engine itself is not changed. A chunk of one token counts as a decode row (a one-token
    prompt is rare enough not to matter).
    """

    shape: ModelShape
    steps: list[StepRecord] = field(default_factory=list)

    def attach(self, core) -> None:
        scheduler, step = core.scheduler, core.step
        schedule = scheduler.schedule
        pending: list = []

        def recorded_schedule():
            out = schedule()
            # A chunk's start and needs_sample read the request as it is now: once the step
            # has run they describe the next chunk, so they are taken here.
            pending.append([(s.start, s.num_new_tokens, s.needs_sample) for s in out.scheduled])
            return out

        def recorded_step():
            t0 = time.perf_counter()
            outputs = step()
            duration = time.perf_counter() - t0
            chunks = pending.pop()
            if chunks:
                self.steps.append(self._record(chunks, duration))
            return outputs

        scheduler.schedule = recorded_schedule
        core.step = recorded_step

    def _record(self, chunks: list[tuple[int, int, bool]], duration: float) -> StepRecord:
        """chunks: (start, num_new_tokens, needs_sample) of each scheduled chunk."""
        rec = StepRecord(duration, 0, 0, 0, 0, 0)
        for start, num_new_tokens, needs_sample in chunks:
            lin, att, head = self.shape.chunk_flops(start, num_new_tokens, int(needs_sample))
            rec.linear, rec.attention, rec.lm_head = rec.linear + lin, rec.attention + att, rec.lm_head + head
            if num_new_tokens == 1:
                rec.num_decode_rows += 1
            else:
                rec.num_prefill_tokens += num_new_tokens
        return rec

    def summary(self) -> dict:
        """Achieved FLOP/s of steps with prefill rows, of decode-only steps (all of them,
        and those of 32 rows or more), and of all steps. ``context_tokens``: the keys (and
        values) the steps' attention reads, summed over rows, per layer."""
        per_context_token = self.shape.attention_flops(0, 1)  # one query over one key, every layer

        def phase(steps: list[StepRecord]) -> dict:
            seconds = sum(s.duration_s for s in steps)
            flops = sum(s.flops for s in steps)
            attention = sum(s.attention for s in steps)
            return {
                "num_steps": len(steps),
                "seconds": seconds,
                "gflops": flops / seconds / 1e9 if seconds else 0.0,
                "num_prefill_tokens": sum(s.num_prefill_tokens for s in steps),
                "num_decode_rows": sum(s.num_decode_rows for s in steps),
                "ms_per_step": 1000 * seconds / len(steps) if steps else 0.0,
                "attention_share": attention / flops if flops else 0.0,
                "context_tokens": attention // per_context_token,
                "gemm_flops": flops - attention,
                "attention_flops": attention,
            }

        decode = [s for s in self.steps if not s.num_prefill_tokens]
        return {
            "prefill_steps": phase([s for s in self.steps if s.num_prefill_tokens]),
            "decode_steps": phase(decode),
            "decode_steps_32_rows": phase([s for s in decode if s.num_decode_rows >= 32]),
            "all_steps": phase(self.steps),
        }


def phase_bound_s(
    p: dict, shape: ModelShape, peak_gflops: float, read_gbps: float, kv_bytes: int, weight_bytes: int
) -> float:
    """The least time the steps of a phase of ``StepRecorder.summary()`` take with the parts
    of a layer in sequence, as the engine runs them: the linear layers and the LM head at
    the matmul peak, or their weights (weight_bytes an element) read at read_gbps where that
    takes longer; then the attention at the peak, or its K/V (kv_bytes an element) read at
    read_gbps where that takes longer. Summed over the phase's steps before the maxima are
    taken, so it is a lower bound on the sum of the steps' own, for a model whose weights
    and K/V come from memory each step (a model that fits in the caches can beat it)."""
    weights = (shape.linear_flops_per_token + shape.lm_head_flops_per_row) // 2 * weight_bytes
    kv = p["context_tokens"] * shape.kv_bytes_per_context_token(kv_bytes)
    peak, rate = peak_gflops * 1e9, read_gbps * 1e9
    gemm = max(p["gemm_flops"] / peak, p["num_steps"] * weights / rate)
    return gemm + max(p["attention_flops"] / peak, kv / rate)


def decode_line(
    phases: dict,
    shape: ModelShape,
    peak_gflops: float,
    kv_bytes: int,
    read_gbps: float | None = None,
    weight_bytes: int | None = None,
) -> str:
    """One line on the decode-only steps of ``StepRecorder.summary()``: their FLOP/s as a
    share of the peak, all of them and those of 32+ rows, and the K/V their attention read
    (kv_bytes: bytes of one cached key or value element); with the memory's read rate and
    the weights' element size, also their bound (``phase_bound_s``): what share of the peak
    such steps reach at most, and how close to it they came."""
    per_token = shape.kv_bytes_per_context_token(kv_bytes)
    parts = []
    for key, label in (("decode_steps", "decode-only steps"), ("decode_steps_32_rows", "with 32+ rows")):
        p = phases[key]
        if not p["num_steps"]:
            parts.append(f"{label}: none")
            continue
        gb = p["context_tokens"] * per_token / 1e9
        part = (
            f"{label}: {p['num_steps']} at {p['gflops']:.1f} GFLOP/s ({p['gflops'] / peak_gflops:.0%} of the peak),"
            f" {p['ms_per_step']:.1f} ms each, K/V read {gb:.1f} GB, {gb / p['seconds']:.1f} GB/s over their time"
        )
        if read_gbps and weight_bytes:
            bound = phase_bound_s(p, shape, peak_gflops, read_gbps, kv_bytes, weight_bytes)
            most = (p["gemm_flops"] + p["attention_flops"]) / bound / 1e9 / peak_gflops
            part += (
                f", bound {1000 * bound / p['num_steps']:.1f} ms each ({most:.0%} of the peak at most;"
                f" these steps at {bound / p['seconds']:.0%} of the bound)"
            )
        parts.append(part)
    return "; ".join(parts)
