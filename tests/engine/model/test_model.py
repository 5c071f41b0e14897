"""The model, loader, paged attention and runner against ``transformers`` on the same weights.

Models are tiny random-weight checkpoints from tests/model_factory.py, in float32, so our
logits must match the reference to ~1e-4 and greedy continuations must be identical.
Runner tests drive ``ModelRunner.execute`` with hand-built ``SchedulerOutput``s and
hand-assigned block tables (request i owns a reversed run of blocks, so tables are not
contiguous).
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys

import pytest
import torch

from engine_svc.model import runner as model_runner
from engine_svc.model.arch.args import ModelArgs
from engine_svc.model.attention import AttentionMetadata
from engine_svc.model.load.loader import load_model
from engine_svc.model.runner import ModelRunner
from engine_svc.outputs import ScheduledRequest, SchedulerOutput
from engine_svc.sched.request import Request
from engine_svc.types import SamplingParams
from tests.model_factory import EOS_TOKEN_ID, load_hf_model, make_model_dir

logger = logging.getLogger(__name__)

ATOL = 1e-4
BLOCK_SIZE = 8
BLOCKS_PER_REQUEST = 16  # 128 tokens per request
GREEDY = SamplingParams(temperature=0.0, max_tokens=1000)

MODEL_CASES = {
    "llama": dict(arch="llama"),
    "qwen2_bias_tied": dict(arch="qwen2", tie_word_embeddings=True),
    "mistral": dict(arch="mistral"),
    "llama_tied": dict(arch="llama", tie_word_embeddings=True),
    "llama3_rope": dict(
        arch="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "mha": dict(arch="llama", num_kv_heads=4),
    "gqa_one_kv_head": dict(arch="llama", num_kv_heads=1),
    "sharded": dict(arch="qwen2", shards=3),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Directories built on first use, shared by the whole module."""
    cache: dict[str, object] = {}

    def get(case: str):
        if case not in cache:
            cache[case] = make_model_dir(tmp_path_factory.mktemp(case) / "model", **MODEL_CASES[case])
        return cache[case]

    return get


@pytest.fixture(scope="module")
def llama_dir(model_dirs):
    return model_dirs("llama")


@pytest.fixture(scope="module")
def hf_llama(llama_dir):
    return load_hf_model(llama_dir)


def make_runner(model_dir, **kw) -> ModelRunner:
    kw.setdefault("num_kv_blocks", 64 * BLOCKS_PER_REQUEST)
    kw.setdefault("kv_cache_bytes", None)
    kw.setdefault("max_model_len", None)
    return ModelRunner(str(model_dir), device="cpu", dtype="float32", block_size=BLOCK_SIZE, **kw)


@pytest.fixture(scope="module")
def runner(llama_dir):
    return make_runner(llama_dir)


def blocks_of(i: int) -> list[int]:
    return list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST))[::-1]


def prompt(seed: int, length: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


@torch.no_grad()
def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([token_ids])).logits[0].float()  # [len, vocab]


@torch.no_grad()
def hf_greedy(hf, token_ids: list[int], num_tokens: int) -> list[int]:
    ids = list(token_ids)
    for _ in range(num_tokens):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    return ids[len(token_ids) :]


# ------------------------------------------------------------------ model vs transformers


@torch.inference_mode()
def our_prompt_logits(model, args: ModelArgs, token_ids: list[int]) -> torch.Tensor:
    """Full-prompt logits through paged attention, on a scrambled block table."""
    num_blocks = math.ceil(len(token_ids) / BLOCK_SIZE)
    shape = (num_blocks + 3, BLOCK_SIZE, args.num_kv_heads, args.head_dim)
    dtype = model.lm_head.weight.dtype
    kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(args.num_layers)]
    table = [(3 * b + 1) % (num_blocks + 3) for b in range(num_blocks)]
    meta = AttentionMetadata.build([len(token_ids)], [0], [table], block_size=BLOCK_SIZE, device="cpu", dtype=dtype)
    hidden = model(torch.tensor(token_ids), torch.arange(len(token_ids)), kv_caches, meta)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_prompt_logits_match_transformers(model_dirs, case):
    model_dir = model_dirs(case)
    model, args = load_model(model_dir, "cpu", "float32")
    hf = load_hf_model(model_dir)
    tokens = prompt(1, 45)
    ours = our_prompt_logits(model, args, tokens)
    ref = hf_logits(hf, tokens)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_model_args_from_config(model_dirs):
    config = json.loads((model_dirs("qwen2_bias_tied") / "config.json").read_text())
    args = ModelArgs.from_hf_config(config)
    assert args.architecture == "Qwen2ForCausalLM"
    assert (args.num_heads, args.num_kv_heads, args.head_dim) == (4, 2, 16)
    assert args.qkv_bias and not args.o_bias and args.tie_word_embeddings
    config = json.loads((model_dirs("llama3_rope") / "config.json").read_text())
    assert ModelArgs.from_hf_config(config).rope_scaling["rope_type"] == "llama3"
    # transformers 4.x layout: rope_theta and rope_scaling at the top level
    old = {k: v for k, v in config.items() if k != "rope_parameters"}
    old |= {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **MODEL_CASES["llama3_rope"]["rope_scaling"]}}
    args = ModelArgs.from_hf_config(old)
    assert args.rope_theta == 500000.0 and args.rope_scaling["factor"] == 8.0


def test_unsupported_rope_type_is_named():
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
    }
    with pytest.raises(NotImplementedError, match="yarn"):
        ModelArgs.from_hf_config(config)


# --------------------------------------------------------------------------- loader errors


def _copy_dir(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_unknown_architecture_is_named(llama_dir, tmp_path):
    d = _copy_dir(llama_dir, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as e:
        load_model(d, "cpu", "float32")
    assert "LlamaForCausalLM" in str(e.value) and "Qwen2ForCausalLM" in str(e.value)


def test_loader_errors(llama_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope", "cpu", "float32")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "empty", "cpu", "float32")
    d = _copy_dir(llama_dir, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(d, "cpu", "float32")
    with pytest.raises(ValueError, match="float16"):
        load_model(llama_dir, "cpu", "float16")
    with pytest.raises(ValueError, match="int8"):
        load_model(llama_dir, "cpu", "int8")


def test_missing_lm_head_when_untied(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy_dir(llama_dir, tmp_path / "m")
    weights = load_file(d / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, d / "model.safetensors")
    with pytest.raises(ValueError, match="lm_head"):
        load_model(d, "cpu", "float32")


def test_bfloat16_runs_close_to_float32(llama_dir):
    model, args = load_model(llama_dir, "cpu", "bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16
    ref, _ = load_model(llama_dir, "cpu", "float32")
    tokens = prompt(2, 20)
    ours = our_prompt_logits(model, args, tokens).float()
    torch.testing.assert_close(ours, our_prompt_logits(ref, args, tokens), atol=0.25, rtol=0.05)


# ---------------------------------------------------------------------------- the runner


def test_runner_properties(llama_dir, tmp_path):
    r = make_runner(llama_dir, num_kv_blocks=None, kv_cache_bytes=10 * 2**20, max_model_len=4096)
    # 2 layers x K,V x 8 tokens x 2 kv heads x 16 dims x 4 bytes
    assert r.bytes_per_block == 2 * 2 * 8 * 2 * 16 * 4
    assert r.num_kv_blocks == 10 * 2**20 // r.bytes_per_block
    assert r.max_model_len == 1024  # capped by max_position_embeddings
    assert (r.vocab_size, r.block_size, r.dtype) == (512, BLOCK_SIZE, torch.float32)
    assert r.eos_token_ids == (EOS_TOKEN_ID,) and r.bos_token_id == 1
    assert r.model_args.architecture == "LlamaForCausalLM"
    assert make_runner(llama_dir, max_model_len=100).max_model_len == 100
    d = _copy_dir(llama_dir, tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert make_runner(d).eos_token_ids == (2, 7)
    # No size given: max_num_seqs requests of max_model_len (1024 / 8 blocks each) fit.
    assert make_runner(llama_dir, num_kv_blocks=None, max_num_seqs=3).num_kv_blocks == 3 * 1024 // BLOCK_SIZE


def test_warmup(runner):
    runner.warmup()


def test_prefill_in_one_chunk(runner, hf_llama):
    tokens = prompt(3, 30)
    req = Request("a", tokens, GREEDY)
    out = runner.execute(SchedulerOutput([ScheduledRequest(req, 30, blocks_of(0))]))
    assert out.sampled_token_ids == {"a": [hf_greedy(hf_llama, tokens, 1)[0]]}
    assert out.prompt_logprobs == {} and out.logprobs == {}


def test_prefill_in_chunks_then_decode(runner, hf_llama):
    tokens = prompt(4, 37)
    req = Request("a", tokens, GREEDY)
    # Chunks of 16 + 20 + 1: the last one-token chunk takes the decode path.
    for n in (16, 20):
        out = runner.execute(SchedulerOutput([ScheduledRequest(req, n, blocks_of(1))]))
        assert out.sampled_token_ids == {}  # chunk does not reach the end of the prompt
        req.num_computed_tokens += n
    expected = hf_greedy(hf_llama, tokens, 4)
    for step in range(4):
        out = runner.execute(SchedulerOutput([ScheduledRequest(req, 1, blocks_of(1))]))
        assert out.sampled_token_ids == {"a": [expected[step]]}
        req.num_computed_tokens += 1
        req.append_output_token(out.sampled_token_ids["a"][0])


def drive(runner, requests: list[Request], num_outputs: int, budget: int) -> None:
    """A minimal scheduler: decodes first, then prompt chunks within a token budget, until
    every request has ``num_outputs`` tokens. Request i owns ``blocks_of(i)``."""
    blocks = {r.request_id: blocks_of(i) for i, r in enumerate(requests)}
    finished: set[str] = set()
    while True:
        active = [r for r in requests if r.num_output_tokens < num_outputs]
        if not active:
            break
        active.sort(key=lambda r: r.num_tokens - r.num_computed_tokens != 1)
        scheduled, left = [], budget
        for r in active:
            n = min(r.num_tokens - r.num_computed_tokens, left)
            if n > 0:
                scheduled.append(ScheduledRequest(r, n, blocks[r.request_id]))
                left -= n
        out = runner.execute(SchedulerOutput(scheduled, finished_request_ids=finished))
        finished = set()
        for s in scheduled:
            r, needs_sample = s.request, s.needs_sample  # read before the counter moves
            r.num_computed_tokens += s.num_new_tokens
            r.num_prompt_logprobs_done += len(out.prompt_logprobs.get(r.request_id, []))
            if needs_sample:
                (token_id,) = out.sampled_token_ids[r.request_id]
                r.append_output_token(token_id)
                if r.num_output_tokens == num_outputs:
                    finished.add(r.request_id)
            else:
                assert r.request_id not in out.sampled_token_ids


def test_decodes_batched_with_prefill_chunks(runner, hf_llama):
    # Staggered arrivals: "late" prefills in chunks while the others decode.
    reqs = [Request(f"r{i}", prompt(10 + i, n), GREEDY) for i, n in enumerate([5, 23, 9, 17])]
    early, late = reqs[:3], reqs[3:]
    drive(runner, early, num_outputs=2, budget=64)
    long = Request("late", prompt(20, 61), GREEDY)
    drive(runner, early + late + [long], num_outputs=6, budget=24)
    for r in early + late + [long]:
        assert r.output_token_ids == hf_greedy(hf_llama, r.prompt_token_ids, 6), r


def test_many_decode_groups(runner, hf_llama):
    # More decodes than one decode group holds, with very different context lengths.
    reqs = [Request(f"r{i}", prompt(100 + i, 3 + (i * 37) % 90), GREEDY) for i in range(20)]
    drive(runner, reqs, num_outputs=2, budget=4096)
    for r in reqs:
        assert r.output_token_ids == hf_greedy(hf_llama, r.prompt_token_ids, 2), r


def test_prompt_logprobs_across_chunks(runner, hf_llama, monkeypatch):
    monkeypatch.setattr(model_runner, "PROMPT_LOGITS_CHUNK", 5)  # several LM-head calls per chunk
    tokens = prompt(5, 29)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, logprobs=2)
    req = Request("p", tokens, params)
    # Pretend a preemption already reported the first 4 entries.
    req.num_prompt_logprobs_done = 4
    entries = []
    for n in (10, 12, 7):
        out = runner.execute(SchedulerOutput([ScheduledRequest(req, n, blocks_of(2))]))
        got = out.prompt_logprobs.get("p", [])
        entries += got
        req.num_prompt_logprobs_done += len(got)
        req.num_computed_tokens += n
    ref = torch.log_softmax(hf_logits(hf_llama, tokens), dim=-1)  # [29, vocab]
    assert [e.token_id for e in entries] == tokens[5:]
    for p, entry in zip(range(4, 28), entries):
        assert entry.logprob == pytest.approx(ref[p, tokens[p + 1]].item(), abs=ATOL)
        assert len(entry.top) == 3
        assert entry.top[0][0] == int(ref[p].argmax())
    # The final chunk sampled, with its own logprobs.
    assert out.sampled_token_ids["p"] == [int(ref[-1].argmax())]
    assert out.logprobs["p"][0].logprob == pytest.approx(ref[-1].max().item(), abs=ATOL)
    assert len(out.logprobs["p"]) == 1 and len(out.logprobs["p"][0].top) == 2


def test_attention_metadata_layout():
    # Two decodes, then a fresh chunk and a continued chunk.
    meta = AttentionMetadata.build(
        [1, 1, 3, 2], [9, 0, 0, 4], [[5, 6, 8], [7], [1], [2, 3]], block_size=4, device="cpu"
    )
    # positions: 9 | 0 | 0 1 2 | 4 5  -> slots block*4 + offset
    assert meta.slot_mapping.tolist() == [8 * 4 + 1, 7 * 4, 4, 5, 6, 3 * 4, 3 * 4 + 1]
    [group] = meta.decode.groups
    assert (group.row_start, group.num_rows, group.num_blocks) == (0, 2, 3)
    assert group.block_ids.tolist() == [5, 6, 8, 7, 0, 0]
    assert (group.mask[:, 0, 0] == 0).sum(-1).tolist() == [10, 1]
    fresh, cont = meta.prefill.chunks
    assert (fresh.row_start, fresh.query_len, fresh.mask) == (2, 3, None)
    assert (cont.row_start, cont.start, cont.block_ids.tolist()) == (5, 4, [2, 3])
    assert (cont.mask == 0).tolist() == [[True] * 5 + [False], [True] * 6]
    with pytest.raises(ValueError, match="lead"):
        AttentionMetadata.build([2, 1], [0, 0], [[0], [1]], block_size=4, device="cpu")


def test_loading_does_not_import_torch_dynamo(demo_model_dir):
    """Start-up: arithmetic on the meta device (random init, buffers) runs torch's Python
    reference ops, which import torch._dynamo, seconds of start-up a server never uses."""
    code = (
        "import sys; from engine_svc.model.load.loader import load_model; "
        "model, _ = load_model(sys.argv[1], 'cpu', 'float32'); "
        "assert model.embed_tokens.weight.device.type == 'cpu'; "
        "print('torch._dynamo' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(demo_model_dir)], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "False"
