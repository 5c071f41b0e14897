"""Sampler unit tests: CPU, small vocabularies, fixed generators, so each runs in milliseconds."""

from __future__ import annotations

import math

import pytest
import torch

from engine_svc.model.sample.sampler import Sampler
from engine_svc.sched.request import Request
from engine_svc.types import SamplingParams

VOCAB = 16


def make_request(request_id: str = "r", prompt=(1, 2, 3), output=(), eos=(), **params) -> Request:
    request = Request(request_id, list(prompt), SamplingParams(**params), eos_token_ids=tuple(eos))
    for token_id in output:
        request.append_output_token(token_id)
    return request


def make_sampler(vocab: int = VOCAB, seed: int = 0) -> Sampler:
    sampler = Sampler(vocab, "cpu")
    sampler.generator.manual_seed(seed)
    return sampler


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # torch.allclose rather than torch.testing, whose first import alone takes seconds.
    assert actual.shape == expected.shape and torch.allclose(actual, expected, atol=1e-6), (actual, expected)


def logits_from_probs(probs: list[float], rows: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(rows, -1).contiguous()  # [rows, vocab]


def support(sampler: Sampler, probs: list[float], rows: int = 500, calls: int = 4, **params) -> dict[int, int]:
    """Token -> count over rows * calls unseeded draws from the same distribution."""
    logits = logits_from_probs(probs, rows)
    requests = [make_request(f"r{i}", **params) for i in range(rows)]
    counts: dict[int, int] = {}
    for _ in range(calls):
        for token_id in sampler.sample(logits, requests).token_ids:
            counts[token_id] = counts.get(token_id, 0) + 1
    return counts


# ------------------------------------------------------------------------ greedy


def test_empty_batch_and_row_count_mismatch():
    out = make_sampler().sample(torch.zeros(0, VOCAB), [])
    assert out.token_ids == [] and out.logprobs == []
    with pytest.raises(ValueError):
        make_sampler().sample(torch.zeros(2, VOCAB), [make_request()])


def test_greedy_is_argmax_and_ignores_padding_columns():
    torch.manual_seed(0)
    logits = torch.randn(8, VOCAB + 4)  # [rows, vocab + padding]
    logits[:, VOCAB:] = 100.0  # padding columns must never win
    requests = [make_request(f"r{i}", temperature=0.0) for i in range(8)]
    out = make_sampler().sample(logits, requests)
    assert out.token_ids == logits[:, :VOCAB].argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_top_k_one_is_greedy():
    torch.manual_seed(1)
    logits = torch.randn(32, VOCAB)
    requests = [make_request(f"r{i}", temperature=1.5, top_k=1) for i in range(32)]
    sampler = make_sampler()
    for _ in range(5):
        assert sampler.sample(logits, requests).token_ids == logits.argmax(-1).tolist()


def test_small_temperature_tends_to_greedy():
    torch.manual_seed(2)
    logits = torch.randn(64, VOCAB)
    greedy = logits.argmax(-1).tolist()
    sampler = make_sampler()
    # Top-two gaps of randn rows are > 1e-3, so at T = 1e-4 the runner-up has weight < e^-10.
    for temperature in (1e-4, 1e-6, 0.0):  # 1e-6 is below the greedy cut-off
        requests = [make_request(f"r{i}", temperature=temperature) for i in range(64)]
        assert sampler.sample(logits, requests).token_ids == greedy


# ---------------------------------------------------------------- truncation sets


PROBS = [0.4, 0.3, 0.2, 0.1]


def test_top_k_keeps_k_best():
    assert set(support(make_sampler(4), PROBS, top_k=2)) == {0, 1}


def test_top_p_keeps_smallest_set_reaching_p():
    # Token 1 is kept (mass before it 0.4 < 0.6); token 2 is not (0.7 >= 0.6).
    assert set(support(make_sampler(4), PROBS, top_p=0.6)) == {0, 1}
    assert set(support(make_sampler(4), PROBS, top_p=0.75)) == {0, 1, 2}
    assert set(support(make_sampler(4), PROBS, top_p=0.01)) == {0}


def test_min_p_drops_tokens_below_fraction_of_best():
    # Threshold 0.3 * 0.4 = 0.12: token 3 (0.1) goes.
    assert set(support(make_sampler(4), PROBS, min_p=0.3)) == {0, 1, 2}


def test_top_k_top_p_min_p_combine():
    # top_k=3 renormalises to [4/9, 3/9, 2/9]: top_p=0.7 then keeps {0, 1}.
    assert set(support(make_sampler(4), PROBS, top_k=3, top_p=0.7)) == {0, 1}
    # Both truncations keep {0, 1, 2}; min_p=0.6 (threshold 0.24) leaves {0, 1}.
    assert set(support(make_sampler(4), PROBS, top_k=3, top_p=0.9, min_p=0.6)) == {0, 1}


def test_per_row_parameters_in_one_batch():
    rows = 300
    params = [dict(top_k=1), dict(top_k=2), dict(top_p=0.6), dict(min_p=0.3), dict()]
    requests = [make_request(f"r{i}", **params[i % len(params)]) for i in range(rows)]
    sampler = make_sampler(4)
    seen = [set() for _ in params]
    for _ in range(4):
        for i, token_id in enumerate(sampler.sample(logits_from_probs(PROBS, rows), requests).token_ids):
            seen[i % len(params)].add(token_id)
    assert seen == [{0}, {0, 1}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}]


def test_top_k_alone_with_rows_without_top_k():
    # Only top-k in the batch takes the partial-topk path; a row without it keeps everything.
    requests = [make_request(f"r{i}", top_k=2 if i % 2 else 0) for i in range(400)]
    sampler = make_sampler(4)
    seen = [set(), set()]
    for _ in range(4):
        for i, token_id in enumerate(sampler.sample(logits_from_probs(PROBS, 400), requests).token_ids):
            seen[i % 2].add(token_id)
    assert seen == [{0, 1, 2, 3}, {0, 1}]


def vllm_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """vLLM's sort-based reference: top-k, then top-p over the renormalised rest."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    kth = logits_sort.gather(1, (logits_sort.size(1) - k).unsqueeze(1))
    logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    drop = logits_sort.softmax(dim=-1).cumsum(dim=-1) <= 1 - p.unsqueeze(1)
    drop[:, -1] = False
    logits_sort.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits_sort).scatter_(1, logits_idx, logits_sort)


@pytest.mark.parametrize("with_top_p_only_rows", [False, True])  # topk candidates vs full sort
def test_top_k_top_p_matches_vllm_reference(with_top_p_only_rows):
    vocab, rows = 200, 96
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(rows, vocab, generator=gen) * 2  # [rows, vocab]
    ks = [[1, 5, 50, vocab][i % 4] for i in range(rows)]
    ps = [[1.0, 0.5, 0.9, 0.99, 0.3][i % 5] for i in range(rows)]
    if not with_top_p_only_rows:  # rows without top-k then get no top-p either
        ps = [p if k < vocab else 1.0 for k, p in zip(ks, ps)]
    masked = make_sampler(vocab)._top_k_top_p(logits.clone(), ks, ps)
    reference = vllm_top_k_top_p(logits.clone(), torch.tensor(ks), torch.tensor(ps))
    assert torch.equal(masked.isfinite(), reference.isfinite())


def test_temperature_one_follows_softmax():
    probs = [0.1, 0.2, 0.3, 0.4]
    num = 4000
    counts = support(make_sampler(4, seed=1234), probs, rows=1000, calls=4)
    chi2 = sum((counts.get(i, 0) - num * p) ** 2 / (num * p) for i, p in enumerate(probs))
    assert chi2 < 25.0  # 3 degrees of freedom: P(chi2 > 25) ~ 1.6e-5 for a correct sampler


def test_temperature_flattens_distribution():
    # At T = 2 the weights become sqrt(p): token 0 goes from 10% to about 15%.
    counts = support(make_sampler(4, seed=7), [0.1, 0.2, 0.3, 0.4], rows=1000, calls=4, temperature=2.0)
    expected = math.sqrt(0.1) / sum(math.sqrt(p) for p in [0.1, 0.2, 0.3, 0.4])
    assert abs(counts[0] / 4000 - expected) < 0.02


# ------------------------------------------------------- bias, min_tokens, penalties


def test_logit_bias_forces_and_bans_tokens():
    torch.manual_seed(3)
    logits = torch.randn(4, VOCAB)
    requests = [
        make_request("a", temperature=0.0, logit_bias={5: 100.0}),
        make_request("b", temperature=1.0, logit_bias={7: 100.0}),
        make_request("c", temperature=0.0, logit_bias={int(logits[2].argmax()): -1e9}),
        make_request("d", temperature=0.0, logit_bias={VOCAB + 3: 100.0}),  # out of range: ignored
    ]
    token_ids = make_sampler().sample(logits, requests).token_ids
    assert token_ids[:2] == [5, 7]
    assert token_ids[2] == int(logits[2].topk(2).indices[1])
    assert token_ids[3] == int(logits[3].argmax())


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 10.0  # EOS
    logits[0, 4] = 9.0  # stop token
    logits[0, 5] = 8.0
    sampler = make_sampler()

    def pick(output, **params):
        request = make_request("r", output=output, eos=(3,), temperature=0.0, stop_token_ids=[4], **params)
        return sampler.sample(logits, [request]).token_ids[0]

    assert pick((), min_tokens=2) == 5
    assert pick((7,), min_tokens=2) == 5
    assert pick((7, 7), min_tokens=2) == 3  # reached: EOS allowed again
    assert pick((), min_tokens=0) == 3
    assert pick((), min_tokens=2, ignore_eos=True) == 3  # EOS does not stop it, so it is not masked

    # Sampled rows too: EOS and the stop token keep most of the mass but are never drawn.
    requests = [make_request(f"s{i}", eos=(3,), stop_token_ids=[4], min_tokens=1) for i in range(200)]
    token_ids = sampler.sample(logits.expand(200, -1), requests).token_ids
    assert 3 not in token_ids and 4 not in token_ids


class _CountingList(list):
    """A list that counts how often it is walked."""

    walks = 0

    def __iter__(self):
        _CountingList.walks += 1
        return super().__iter__()


class _CountingDict(dict):
    walks = 0

    def items(self):
        _CountingDict.walks += 1
        return super().items()

    def __iter__(self):
        _CountingDict.walks += 1
        return super().__iter__()


def test_long_stop_and_bias_lists_are_read_once_per_request_not_per_step():
    """Issue 18 item 1: a request with thousands of stop ids must not cost every step a
    walk over them (which also slowed every other request of the batch)."""
    vocab = 4096
    sampler = make_sampler(vocab)
    stops = _CountingList(range(100, 3100))
    bias = _CountingDict({t: -1.0 for t in range(200, 2200)})
    request = make_request("big", eos=(3,), min_tokens=50, stop_token_ids=stops, logit_bias=bias)
    neighbour = make_request("small", temperature=0.0)
    logits = torch.zeros(2, vocab)
    logits[:, 150] = 5.0  # a stop token: masked while min_tokens is not reached
    _CountingList.walks = _CountingDict.walks = 0
    for _ in range(10):
        token_ids = sampler.sample(logits, [request, neighbour]).token_ids
        assert token_ids[0] != 150 and token_ids[1] == 150
        request.append_output_token(token_ids[0])
    assert (_CountingList.walks, _CountingDict.walks) == (1, 1)
    sampler.forget(["big"])  # a preempted request is read again when it comes back
    sampler.sample(logits, [request, neighbour])
    assert (_CountingList.walks, _CountingDict.walks) == (2, 2)


def test_penalties_match_hand_computed_reference():
    sampler = make_sampler(6)
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]] * 4)
    prompt, output = (0, 1), (1, 2, 2)
    requests = [
        make_request("rep", prompt, output, repetition_penalty=2.0),
        make_request("freq", prompt, output, frequency_penalty=0.5),
        make_request("pres", prompt, output, presence_penalty=0.3),
        make_request("all", prompt, output, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3),
    ]
    expected = torch.tensor(
        [
            # repetition on prompt + output tokens {0, 1, 2}: positive / 2, negative * 2
            [1.0, -2.0, 0.25, 3.0, -2.0, 1.0],
            # frequency on output counts {1: 1, 2: 2}
            [2.0, -1.5, -0.5, 3.0, -2.0, 1.0],
            # presence on output tokens {1, 2}
            [2.0, -1.3, 0.2, 3.0, -2.0, 1.0],
            # repetition first, then -0.5 * count - 0.3
            [1.0, -2.8, -1.05, 3.0, -2.0, 1.0],
        ]
    )
    assert_close(sampler._process_logits(logits, requests), expected)
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0]))  # input untouched


def test_penalty_counts_follow_new_tokens_and_forget():
    sampler = make_sampler(6)
    logits = torch.zeros(1, 6)
    request = make_request("r", prompt=(0,), frequency_penalty=1.0)
    assert_close(sampler._process_logits(logits, [request]), torch.zeros(1, 6))
    request.append_output_token(4)
    request.append_output_token(4)
    request.append_output_token(5)
    assert_close(sampler._process_logits(logits, [request]), torch.tensor([[0, 0, 0, 0, -2.0, -1.0]]))
    request.append_output_token(5)
    assert_close(sampler._process_logits(logits, [request]), torch.tensor([[0, 0, 0, 0, -2.0, -2.0]]))
    # A forgotten slot is reused by a fresh request and must not leak the old counts.
    sampler.forget(["r"])
    other = make_request("other", prompt=(0,), output=(1,), frequency_penalty=1.0)
    assert_close(sampler._process_logits(logits, [other]), torch.tensor([[0, -1.0, 0, 0, 0, 0]]))


def test_no_processing_returns_input_unchanged():
    logits = torch.randn(3, VOCAB)
    requests = [make_request(f"r{i}", temperature=0.7, top_p=0.9) for i in range(3)]
    assert make_sampler()._process_logits(logits, requests) is logits


# ------------------------------------------------------------------------ seeds


def run_seeded(sampler: Sampler, request: Request, neighbours: list[Request], position: int, steps: int):
    """Sample ``steps`` tokens for ``request`` at ``position`` among ``neighbours``."""
    torch.manual_seed(99)
    logits = torch.randn(len(neighbours) + 1, 1000)  # flat-ish over a larger vocab
    tokens = []
    for _ in range(steps):
        batch = neighbours[:position] + [request] + neighbours[position:]
        row = logits.clone()
        row[position] = logits[0]  # the seeded request always sees the same logits
        tokens.append(sampler.sample(row, batch).token_ids[position])
        request.append_output_token(tokens[-1])
    return tokens


def test_same_seed_same_tokens_whatever_the_neighbours():
    first = run_seeded(make_sampler(1000, seed=1), make_request("a", seed=42), [], 0, steps=6)
    neighbours = [make_request(f"n{i}", seed=i if i % 2 else None) for i in range(5)]
    second = run_seeded(make_sampler(1000, seed=2), make_request("b", seed=42), neighbours, 3, steps=6)
    assert first == second
    other = run_seeded(make_sampler(1000, seed=1), make_request("c", seed=43), [], 0, steps=6)
    assert other != first


def test_seeded_tokens_survive_forget():
    # Preemption forgets a request; the token at a given step must not change because of it.
    sampler = make_sampler(1000)
    logits = torch.randn(1, 1000)
    request = make_request("r", seed=5, output=(1, 2))
    before = sampler.sample(logits, [request]).token_ids
    sampler.forget(["r"])
    assert sampler.sample(logits, [request]).token_ids == before


def test_mixed_batch_of_greedy_sampled_and_seeded_rows():
    torch.manual_seed(4)
    logits = torch.randn(4, 1000)
    requests = [
        make_request("greedy", temperature=0.0),
        make_request("seeded", seed=11, top_p=0.95),
        make_request("top1", top_k=1),
        make_request("free", temperature=0.8),
    ]
    out = make_sampler(1000).sample(logits, requests)
    alone = make_sampler(1000, seed=123).sample(logits[1:2], [make_request("x", seed=11, top_p=0.95)])
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[1] == alone.token_ids[0]
    assert out.token_ids[2] == int(logits[2].argmax())
    assert 0 <= out.token_ids[3] < 1000


# --------------------------------------------------------------------- logprobs


def test_logprobs_come_from_raw_logits_with_rank_and_top():
    torch.manual_seed(5)
    logits = torch.randn(3, VOCAB + 2)  # with padding columns
    requests = [
        make_request("a", temperature=0.0, logprobs=3, logit_bias={9: 50.0}, repetition_penalty=1.5),
        make_request("b", temperature=0.0),
        make_request("c", temperature=0.9, logprobs=0),
    ]
    out = make_sampler().sample(logits, requests)
    reference = torch.log_softmax(logits[:, :VOCAB], dim=-1)  # [rows, vocab]
    assert out.token_ids[0] == 9 and out.logprobs[1] is None

    for row in (0, 2):
        entry = out.logprobs[row]
        token_id = out.token_ids[row]
        assert entry.token_id == token_id
        assert entry.logprob == pytest.approx(float(reference[row, token_id]), abs=1e-6)
        assert entry.rank == 1 + int((reference[row] > reference[row, token_id]).sum())
    top = out.logprobs[0].top
    values, ids = reference[0].topk(3)
    assert [t for t, _ in top] == ids.tolist()
    assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-6)
    assert out.logprobs[2].top == []


def test_a_greedy_token_heads_its_top_list_where_logits_tie():
    """bfloat16 logits tie often: greedy takes the first maximum, and the top list orders
    equal values by token id, so the sampled token is its first entry."""
    logits = torch.full((2, VOCAB + 2), -4.0)
    logits[0, [14, 7, 11]] = 3.0  # three tied best
    logits[1, [5, 6]], logits[1, [12, 13, 15]] = 2.0, 1.0  # two best, then a tie across the edge
    out = make_sampler().sample(logits, [make_request("a", temperature=0.0, logprobs=3)] * 1
                                + [make_request("b", temperature=0.0, logprobs=3)])  # fmt: skip
    assert out.token_ids == [7, 5]
    assert [t for t, _ in out.logprobs[0].top] == [7, 11, 14]
    assert [t for t, _ in out.logprobs[1].top] == [5, 6, 12]  # the lowest id of the tied third
    assert all(lp.rank == 1 for lp in out.logprobs)


def test_prompt_logprobs():
    torch.manual_seed(6)
    logits = torch.randn(5, VOCAB + 2)
    targets = [3, 0, 15, 7, 7]
    entries = make_sampler().prompt_logprobs(logits, targets, num_top=2)
    reference = torch.log_softmax(logits[:, :VOCAB], dim=-1)
    assert len(entries) == 5
    for row, (entry, target) in enumerate(zip(entries, targets)):
        assert entry.token_id == target
        assert entry.logprob == pytest.approx(float(reference[row, target]), abs=1e-6)
        assert entry.rank == 1 + int((reference[row] > reference[row, target]).sum())
        assert [t for t, _ in entry.top] == reference[row].topk(2).indices.tolist()
    assert make_sampler().prompt_logprobs(torch.zeros(0, VOCAB), [], 2) == []


def test_state_works_inside_and_outside_inference_mode():
    # The runner samples under inference mode; state must stay usable from either side.
    sampler = make_sampler(6)
    request = make_request("r", prompt=(0,), output=(1,), presence_penalty=1.0, temperature=0.0)
    with torch.inference_mode():
        sampler.sample(torch.zeros(1, 6), [request])
    request.append_output_token(2)
    assert_close(sampler._process_logits(torch.zeros(1, 6), [request]), torch.tensor([[0, -1.0, -1.0, 0, 0, 0]]))
    assert sampler.sample(torch.zeros(1, 6), [request]).token_ids == [0]


@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_rows_is_argmax_on_ties_nan_and_sliced_rows(threads):
    """Greedy ids come from ``max``'s reduction, faster than ``argmax``'s: the same first
    maximum on rows full of ties, with NaN and -inf in them, on a column slice of wider
    logits (the padded vocabulary), at any thread count."""
    from engine_svc.model.sample.sampler_stages import argmax_rows

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        for trial in range(60):
            rows = int(torch.randint(1, 70, (1,), generator=g))
            x = torch.randint(0, 4, (rows, 49_200), generator=g).float()  # ties everywhere
            if trial % 3 == 1:
                x[:, ::7] = float("-inf")
            if trial % 3 == 2:
                x[rows // 2, 1000 + trial] = float("nan")
            logits = x[:, :49_152]
            assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1)), trial
    finally:
        torch.set_num_threads(before)
