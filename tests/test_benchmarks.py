"""Smoke tests of the benchmarks on the demo model: every figure is filled, files are written.

No timing assertions: the figures depend on the machine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import grpc_floor, offline, serve
from benchmarks.workloads import fit_context, fit_vocab, salted, synthetic

pytestmark = pytest.mark.timeout(180)


def _holes(value, path: str = "") -> list[str]:
    """Paths of None / NaN values anywhere in a JSON document."""
    if isinstance(value, dict):
        return [h for k, v in value.items() for h in _holes(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [h for i, v in enumerate(value) for h in _holes(v, f"{path}[{i}]")]
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return [path]
    return []


ENTRY_KEYS = {
    "rate",
    "num_requests",
    "num_completed",
    "errors",
    "wall_s",
    "num_prompt_tokens",
    "num_output_tokens",
    "req_per_s",
    "output_tok_per_s",
    "total_tok_per_s",
    "arrival_req_per_s",
    "completion_req_per_s",
    "saturated",
    "ttft_ms",
    "itl_ms",
    "tpot_ms",
    "e2e_ms",
}
SMALL = ["--synthetic", "--num-requests", "6", "--prompt-len", "4:24", "--output-len", "2:5", "--seed", "3"]


def _check_entry(entry: dict, num_requests: int) -> None:
    assert ENTRY_KEYS <= entry.keys()
    assert entry["num_completed"] == num_requests and entry["errors"] == {}
    assert entry["num_output_tokens"] > 0
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert set(entry[key]) == {"mean", "p50", "p90", "p99"}
    assert entry["frontend_cpu_us_per_token"] >= 0 and entry["engine_cpu_us_per_token"] >= 0


def test_serve_rate_sweep_against_a_running_pair(pair, tmp_path, capsys):
    engine, frontend = pair
    out, png = tmp_path / "serve.json", tmp_path / "sweep.png"
    rc = serve.main(
        [
            "--target",
            frontend.address,
            *SMALL,
            "--rate",
            "8,inf",
            "--max-concurrency",
            "4",
            "--frontend-pid",
            str(frontend.proc.pid),
            "--engine-pid",
            str(engine.proc.pid),
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert [e["rate"] for e in report["results"]] == [8.0, "inf"]
    for entry in report["results"]:
        _check_entry(entry, 6)
    assert _holes({k: v for k, v in report.items() if k != "saturation_rate"}) == []
    assert "saturation_rate" in report
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "frontend CPU us/token" in table and "TTFT p99 ms" in table


def test_serve_launch_with_inprocess_comparison(tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "cdf.png"
    rc = serve.main(
        [
            "--launch",
            "--engine-arg=--num-kv-blocks 256",
            *SMALL,
            "--compare-inprocess",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    (entry,) = report["results"]
    _check_entry(entry, 6)
    assert entry["pair_over_inprocess"] > 0
    assert report["inprocess"]["output_tok_per_s"] > 0
    assert report["inprocess"]["num_output_tokens"] == entry["num_output_tokens"]
    # max_concurrency (no cap) and saturation_rate (one rate: nothing to find) are null here.
    assert _holes(report["results"]) == [] and _holes(report["inprocess"]) == []
    assert png.stat().st_size > 10_000


def test_offline_engine_figures(demo_model_dir, tmp_path):
    workload = synthetic(0, num_requests=4, prompt_len=(8, 24), output_len=(4, 6), vocab_size=2048)
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in workload))
    out = tmp_path / "offline.json"
    assert (
        offline.main(
            [
                "--model",
                str(demo_model_dir),
                "--workload",
                str(path),
                "--baseline",
                "none",
                "--kv-cache-bytes",
                str(16 << 20),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    figures = json.loads(out.read_text())["engine"]
    assert {"output_tok_per_s", "total_tok_per_s", "wall_s", "startup_s"} <= figures.keys()
    assert figures["num_output_tokens"] == sum(r["max_tokens"] for r in workload)
    assert all(figures[k] > 0 for k in ("output_tok_per_s", "total_tok_per_s", "wall_s", "startup_s"))


def test_offline_constraint_figures(demo_model_dir, tmp_path):
    """--constraint runs the workload constrained and unconstrained on the same tokens and
    times the first token with the compile cold and warm."""
    workload = synthetic(1, num_requests=3, prompt_len=(8, 16), output_len=(8, 12), vocab_size=2048)
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in workload))
    out = tmp_path / "offline.json"
    schema = Path(offline.__file__).parent / "schemas" / "order.json"
    argv = ["--model", str(demo_model_dir), "--workload", str(path), "--baseline", "none"]
    argv += ["--kv-cache-bytes", str(16 << 20), "--constraint", f"json_schema:{schema}", "--json", str(out)]
    assert offline.main(argv) == 0
    s = json.loads(out.read_text())["engine"]["structured"]
    assert s["kind"] == "json_schema" and 0 < s["num_output_tokens"] <= sum(r["max_tokens"] for r in workload)
    assert s["constrained_output_tok_per_s"] > 0 and s["unconstrained_output_tok_per_s"] > 0
    assert s["compile_ms"] > 0 and s["ttft_ms_cold_cache"] > 0 and s["ttft_ms_warm_cache"] > 0
    assert _holes(s) == []


def test_grpc_floor_counts_every_message_and_stops_its_server():
    figures = grpc_floor.measure(streams=3, messages=4, tick_ms=2)
    assert set(figures) == {"paced", "back_to_back"}
    for run in figures.values():
        assert run["messages"] == 12 and run["wall_s"] > 0 and run["server_cpu_us_per_message"] >= 0


def test_workload_helpers_keep_lengths():
    base = [{"prompt_token_ids": [5000, 7, 9000], "max_tokens": 4}, {"prompt_token_ids": [1] * 10, "max_tokens": 8}]
    folded, num_folded = fit_vocab(base, 2048)
    assert num_folded == 2 and all(t < 2048 for r in folded for t in r["prompt_token_ids"])
    assert [len(r["prompt_token_ids"]) for r in folded] == [3, 10]
    trimmed, num_trimmed = fit_context(base, 12)
    assert num_trimmed == 1 and all(len(r["prompt_token_ids"]) + r["max_tokens"] <= 12 for r in trimmed)
    assert trimmed[1]["prompt_token_ids"] == [1] * 10 and trimmed[1]["max_tokens"] == 2
    a, b = salted(base, 1, 2048), salted(base, 2, 2048)
    assert a[0]["prompt_token_ids"][1:] == b[0]["prompt_token_ids"][1:] == [7, 9000]
    assert a[0]["prompt_token_ids"][0] != b[0]["prompt_token_ids"][0]
    assert salted(base, 0, 2048) == base


def test_benchmark_model_tokenizer_covers_every_model_id(tmp_path):
    from benchmarks.make_model import write_tokenizer
    from frontend_svc.text.tokenizer import Tokenizer

    write_tokenizer(tmp_path, 8192)
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.vocab_size == 8192
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (1, (2,))
    assert tokenizer.decode([8191, 4000]) != ""


def test_multi_prefix_workload_interleaves_every_prompt_in_each_round():
    from benchmarks.workloads import multi_prefix

    work = multi_prefix(num_prefixes=4, prefix_len=32, requests_per_prefix=3, vocab_size=2048)
    assert len(work) == 12
    rounds = [[r["prefix"] for r in work[i : i + 4]] for i in range(0, 12, 4)]
    assert all(sorted(r) == [0, 1, 2, 3] for r in rounds) and len({tuple(r) for r in rounds}) > 1
    heads = {r["prefix"]: r["prompt_token_ids"][:32] for r in work}
    assert all(r["prompt_token_ids"][:32] == heads[r["prefix"]] for r in work)
    assert len({tuple(h) for h in heads.values()}) == 4
    assert all(8 <= len(r["prompt_token_ids"]) - 32 <= 24 and 16 <= r["max_tokens"] <= 32 for r in work)


MULTI = ["--multi-prefix", "--num-prefixes", "2", "--requests-per-prefix", "3", "--prefix-len", "48"]


def test_serve_multi_prefix_at_a_uniform_rate_reports_the_hit_rate(pair, tmp_path):
    _, frontend = pair
    out = tmp_path / "multi.json"
    args = ["--target", frontend.address, *MULTI, "--output-len", "2:3", "--rate", "20", "--arrivals", "uniform"]
    assert serve.main([*args, "--json", str(out)]) == 0
    (entry,) = json.loads(out.read_text())["results"]
    assert entry["num_completed"] == 6
    # One engine: every prompt's later requests find its first 3 blocks (48 tokens) cached.
    assert entry["num_cached_tokens"] >= 4 * 32 and 0 < entry["prefix_cache_hit_rate"] < 1
    # Evenly spaced: 6 arrivals at 20/s span 0.25 s.
    assert entry["arrival_req_per_s"] == pytest.approx(20, rel=0.2)


def test_compare_routing_runs_both_policies_and_reports_them(engine_proc, tmp_path, monkeypatch, capsys):
    """The comparison's whole path, with the engine cluster replaced by one running engine
    behind a fresh frontend per policy (launching engines is ``--launch``'s job, tested above)."""
    import contextlib

    from benchmarks import serve_routing
    from tests.services import start_frontend

    started = []

    @contextlib.contextmanager
    def one_engine(args, extra=()):
        frontend = start_frontend(engine_proc.address, extra=tuple(extra))
        started.append(extra)
        try:
            yield [engine_proc], frontend.wait_serving()
        finally:
            frontend.terminate()

    monkeypatch.setattr(serve_routing, "launched", one_engine)
    out, png = tmp_path / "routing.json", tmp_path / "routing.png"
    argv = ["--launch", "--engines", "2", "--compare-routing", *MULTI, "--output-len", "2:3", "--rate", "20"]
    assert serve.main([*argv, "--json", str(out), "--plot", str(png)]) == 0
    assert [e[:2] for e in started] == [("--routing", "least-load"), ("--routing", "prefix")]
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert runs["least-load"]["routing_decisions"] == {"least_load": 6}
    assert runs["prefix"]["routing_decisions"] == {"single_engine": 6}  # one engine: nothing to predict
    assert runs["prefix"]["prediction_agreement"] is None
    assert set(report["comparison"]) >= {"hit_rate_ratio", "ttft_mean_reduction", "output_throughput_ratio"}
    assert png.stat().st_size > 10_000
    assert "prefix over least-load" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # one rate, two or more engines, launched
        serve.parse_args(["--target", "x:1", "--compare-routing", *MULTI])


def test_capacity_runs_each_setting_and_fills_every_figure(tmp_path, capsys):
    """benchmarks.capacity on a token engine: every point measured, the report and ratios written."""
    from benchmarks import capacity

    out = tmp_path / "capacity.json"
    capacity.main(
        ["--calls", "1,64", "--rates", "500", "--settings", "default,interval1", "--window-s", "0.3"]
        + ["--json", str(out), "--plot", str(tmp_path / "capacity.png")]
    )
    report = json.loads(out.read_text())
    frontend_cpu = []
    for setting in ("default", "interval1"):
        for calls in ("1", "64"):
            (point,) = report["points"][setting][calls]
            assert point["tok_per_s"] > 0 and point["tokens_per_message"] >= 1 and point["errors"] == []
            assert point["frontend_cpu_us_per_token"] >= 0 and not _holes(point)
            frontend_cpu.append(point["frontend_cpu_us_per_token"])
    # CPU time comes from /proc in ticks of 10 ms: one 0.3 s window of a lightly loaded
    # frontend may see none, the four windows together do.
    assert sum(frontend_cpu) > 0
    assert set(report["ratios"]) == {"64", "1"}
    assert (tmp_path / "capacity.png").stat().st_size > 0
    assert "capacity tok/s" in capsys.readouterr().out


def test_tool_parser_cost_fills_every_figure():
    from benchmarks import tool_parsers

    report = tool_parsers.main(["--repeats", "1"])
    assert set(report) == {"hermes", "llama3_json", "mistral", "pythonic", "json"}
    assert not _holes(report)
    assert all(r["num_tokens"] > 50 for r in report.values())


def test_capacity_http_compares_the_two_faces(tmp_path):
    """benchmarks.capacity --http: the same calls over the HTTP face, and the ratios of the two."""
    from benchmarks import capacity

    out = tmp_path / "capacity.json"
    capacity.main(
        ["--calls", "1", "--rates", "500", "--settings", "default", "--http", "--window-s", "0.3"]
        + ["--json", str(out)]
    )
    report = json.loads(out.read_text())
    (point,) = report["points"]["default+http"]["1"]
    assert point["tok_per_s"] > 0 and point["errors"] == [] and not _holes(point)
    assert report["ratios"]["1"]["top_rate_http_over_grpc_default"] > 0


def test_http_vs_grpc_runs_both_faces_on_a_model(demo_model_dir, tmp_path):
    """benchmarks.http_vs_grpc: both faces stream every token asked for, in alternating order."""
    from benchmarks import http_vs_grpc

    out = tmp_path / "faces.json"
    argv = ["--model", str(demo_model_dir), "--concurrency", "2", "--requests", "2", "--max-tokens", "5"]
    assert http_vs_grpc.main([*argv, "--repetitions", "2", "--json", str(out)]) == 0
    cell = json.loads(out.read_text())["cells"]["2"]
    # (the ITL figures may be nan: a stream coalesced into one message has no gap)
    assert cell["ratio_tok_per_s"] > 0 and cell["grpc"]["output_tok_per_s"] > 0 and cell["http"]["output_tok_per_s"] > 0
    assert len(cell["runs"]["grpc"]) == len(cell["runs"]["http"]) == 2


def test_spec_figures(demo_model_dir, tmp_path):
    """benchmarks.spec on the demo model: both arms measured at every point, with acceptance."""
    from benchmarks import spec

    out = tmp_path / "spec.json"
    argv = ["--model", str(demo_model_dir), "--concurrency", "1", "2", "--num-requests", "2", "--max-tokens", "6"]
    assert spec.main([*argv, "--repeats", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    # The adaptive rule's learned step costs; a draft model's passes only with one.
    assert report["costs"]["step_ms"] and report["costs"]["draft_pass_ms"] == {}
    results = report["results"]
    assert [(r["workload"], r["concurrency"]) for r in results] == [
        ("copy_heavy", 1),
        ("copy_heavy", 2),
        ("open_chat", 1),
        ("open_chat", 2),
    ]
    for r in results:
        assert r["off_tok_per_s"] > 0 and r["on_tok_per_s"] > 0 and r["speedup"] > 0 and len(r["speedups"]) == 2
        # Greedy: the same tokens, run after run.
        assert {x["num_output_tokens"] for x in r["on"]} == {x["num_output_tokens"] for x in r["off"]}
        assert 0.0 <= r["acceptance_rate"] <= 1.0


def test_gguf_to_hf_writes_the_gguf_weights_bit_for_bit(smollm2_gguf, tmp_path):
    """The directory peers read holds the GGUF's own weights, config and tokenizer."""
    from safetensors.torch import load_file

    from benchmarks.gguf_to_hf import write_hf_dir
    from engine_svc.model.arch.args import ModelArgs
    from engine_svc.model.load.gguf_checkpoint import prepare_gguf_dir
    from engine_svc.model.load.gguf_weights import read_gguf_tensors

    out = write_hf_dir(smollm2_gguf, tmp_path / "hf")
    prepared = prepare_gguf_dir(smollm2_gguf)
    config = json.loads((out / "config.json").read_text())
    assert config.pop("torch_dtype") == "float32"
    assert config == {k: v for k, v in json.loads((prepared / "config.json").read_text()).items() if k != "torch_dtype"}
    assert (out / "tokenizer.json").read_bytes() == (prepared / "tokenizer.json").read_bytes()
    assert not (out / "gguf_source.json").exists()  # an ordinary directory, read by its safetensors
    written = load_file(out / "model.safetensors")
    expected, _ = read_gguf_tensors(smollm2_gguf, ModelArgs.from_hf_config(config))
    assert config["tie_word_embeddings"] and "lm_head.weight" not in written
    assert set(written) == {name for name, _ in expected}
    for name, value in expected:
        assert torch.equal(written[name], value), name


def test_gguf_to_hf_w8a8_rounds_each_row_to_int8_and_loads_with_int8_activations(smollm2_gguf, tmp_path):
    from safetensors.torch import load_file

    from benchmarks.gguf_to_hf import to_w8a8, write_hf_dir
    from engine_svc.model.load.hf_quantized import quantization_scheme

    out = write_hf_dir(smollm2_gguf, tmp_path / "hf")
    floats = load_file(out / "model.safetensors")
    written = load_file(to_w8a8(out) / "model.safetensors")
    name = "model.layers.3.mlp.down_proj.weight"
    q, scale = written[name], written[name.replace(".weight", ".weight_scale")]
    assert q.dtype == torch.int8 and scale.shape == (q.shape[0], 1)
    assert q.abs().amax(dim=1).eq(127).all()  # each row's largest weight on the grid's end
    assert (q.float() * scale - floats[name]).abs().le(scale / 2 + 1e-7).all()  # round to nearest
    assert torch.equal(written["model.embed_tokens.weight"], floats["model.embed_tokens.weight"])
    scheme = quantization_scheme(json.loads((out / "config.json").read_text()))
    assert scheme is not None and (scheme.bits, scheme.group, scheme.int8_activations) == (8, -1, True)


def test_step_recorder_counts_the_flops_of_the_workload(demo_model_dir):
    """Chunked prefills and decode rows, summed step by step, make the workload's FLOPs: a
    chunk is counted from where it starts, read before the step moves the request on."""
    from benchmarks.flops import (
        ModelShape,
        StepRecorder,
        decode_line,
        memory_read_rate,
        phase_bound_s,
        workload_flops,
    )
    from engine_svc.config import EngineConfig, build_parser
    from engine_svc.core import EngineCore
    from engine_svc.types import SamplingParams

    workload = synthetic(5, num_requests=5, prompt_len=(40, 90), output_len=(3, 7), vocab_size=2048)
    argv = ["--model", str(demo_model_dir), "--max-num-batched-tokens", "32", "--kv-cache-bytes", str(16 << 20)]
    core = EngineCore(EngineConfig.from_args(build_parser().parse_args(argv)))
    shape = ModelShape.from_model_dir(demo_model_dir)
    recorder = StepRecorder(shape)
    recorder.attach(core)
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in workload]
    core.generate([r["prompt_token_ids"] for r in workload], params)

    expected = workload_flops(shape, workload)
    assert expected["num_prompt_tokens_cached"] == 0
    assert sum(s.linear for s in recorder.steps) == expected["linear"]
    assert sum(s.attention for s in recorder.steps) == expected["attention"]
    assert sum(s.lm_head for s in recorder.steps) == expected["lm_head"]
    phases = recorder.summary()
    assert phases["prefill_steps"]["num_prefill_tokens"] == sum(len(r["prompt_token_ids"]) for r in workload)
    assert phases["prefill_steps"]["num_steps"] > len(workload)  # prompts longer than a step: chunked
    # Every computed token reads its own and every earlier position's K/V, in every step kind.
    computed = [len(r["prompt_token_ids"]) + r["max_tokens"] - 1 for r in workload]
    assert phases["all_steps"]["context_tokens"] == sum(n * (n + 1) // 2 for n in computed)
    decode = phases["decode_steps"]
    decode_rows = sum(r["max_tokens"] - 1 for r in workload)
    assert decode["num_decode_rows"] + phases["prefill_steps"]["num_decode_rows"] == decode_rows
    assert 0 < decode["attention_share"] < 1
    assert phases["decode_steps_32_rows"]["num_steps"] == 0  # five requests: never 32 rows
    line = decode_line(phases, shape, 100.0, 4)
    assert "with 32+ rows: none" in line
    gb = decode["context_tokens"] * 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4 / 1e9
    assert f"K/V read {gb:.1f} GB" in line
    decode_steps = [s for s in recorder.steps if not s.num_prefill_tokens]
    assert decode["attention_flops"] == sum(s.attention for s in decode_steps)
    assert decode["gemm_flops"] == sum(s.linear + s.lm_head for s in decode_steps)
    # The bound: its GEMM part the larger of FLOPs at the peak and weights at the read rate,
    # its attention part the larger of FLOPs at the peak and K/V at the read rate.
    weights = (shape.linear_flops_per_token + shape.lm_head_flops_per_row) // 2 * 4
    slow_memory = phase_bound_s(decode, shape, 1e6, 1e-3, 4, 4)  # memory-bound: bytes / rate
    assert slow_memory == pytest.approx((decode["num_steps"] * weights + gb * 1e9) / 1e6)
    slow_matmul = phase_bound_s(decode, shape, 1e-3, 1e6, 4, 4)  # FLOP-bound: FLOPs / peak
    assert slow_matmul == pytest.approx((decode["gemm_flops"] + decode["attention_flops"]) / 1e6)
    memory = memory_read_rate(64 << 20, repeats=3)
    assert memory["gbps"] > 0 and memory["threads"] >= 1
    bound = phase_bound_s(decode, shape, 100.0, memory["gbps"], 4, 4)
    line = decode_line(phases, shape, 100.0, 4, memory["gbps"], 4)
    assert f"bound {1000 * bound / decode['num_steps']:.1f} ms each" in line
    assert f"these steps at {bound / decode['seconds']:.0%} of the bound" in line
