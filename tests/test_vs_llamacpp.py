"""benchmarks.vs_llamacpp without llama.cpp: its arguments, cells and llama-server command,
the figures it reads from a server's log and from /proc, and its load client against a
real Tandem pair's HTTP face.

No timing assertions: the figures depend on the machine.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import sys

import gguf
import pytest

from benchmarks import vs_llamacpp
from benchmarks.completions_load import run_cell
from benchmarks.llamacpp_server import command, parse_buffers
from benchmarks.resident import resident
from benchmarks.workloads import load

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    """A GGUF file with a 1,000-token vocabulary and no tensors: all the preparation reads."""
    path = tmp_path_factory.mktemp("gguf") / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(1000)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_cells_and_the_llama_server_command(small_gguf):
    args = vs_llamacpp.parse_args(["--llama-server", sys.executable, "--gguf", str(small_gguf), "--threads", "3"])
    cells, slots, ctx = vs_llamacpp.prepare(args)
    by_name = {c.name: c for c in cells}
    assert list(by_name) == ["batch1", "concurrent16", "concurrent64", "prefill_heavy"]
    assert [(c.concurrency, len(c.requests), c.goal) for c in cells] == [
        (1, 4, 1.0),
        (16, 16, 1.5),
        (64, 64, 1.5),
        (48, 48, None),
    ]
    assert {len(r["prompt_token_ids"]) for r in by_name["batch1"].requests} == {32}
    assert {r["max_tokens"] for r in by_name["batch1"].requests} == {128}
    for name in ("concurrent16", "concurrent64"):
        assert all(64 <= len(r["prompt_token_ids"]) <= 256 for r in by_name[name].requests)
        assert {r["max_tokens"] for r in by_name[name].requests} == {96}
    assert all(t < 1000 for c in cells for r in c.requests for t in r["prompt_token_ids"])  # folded into the vocab
    longest = max(c.longest() for c in cells)  # prefill_heavy's: it must fit every slot
    assert slots == 64 and ctx % (64 * 256) == 0 and longest <= ctx // slots < longest + 256
    argv = command(
        "/bin/llama-server", str(small_gguf), port=8123, threads=3, slots=slots, ctx=ctx, extra=["-fa", "on"]
    )
    value = {flag: argv[argv.index(flag) + 1] for flag in ("--threads", "--threads-batch", "--parallel", "--ctx-size")}
    assert value == {"--threads": "3", "--threads-batch": "3", "--parallel": "64", "--ctx-size": str(ctx)}
    assert argv[-2:] == ["-fa", "on"]


def test_bad_arguments_say_what_to_fix(small_gguf, tmp_path, capsys):
    with pytest.raises(SystemExit):
        vs_llamacpp.parse_args(["--llama-server", str(tmp_path / "none"), "--gguf", str(small_gguf)])
    assert "is not an executable file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vs_llamacpp.parse_args(["--llama-server", sys.executable, "--gguf", str(tmp_path / "none.gguf")])
    assert "is not a file" in capsys.readouterr().err
    args = vs_llamacpp.parse_args(["--llama-server", "x", "--gguf", str(small_gguf), "--sides", "tandem"])
    assert args.sides == ["tandem"]  # no llama.cpp needed for Tandem alone
    with pytest.raises(ValueError, match="unknown cells"):
        vs_llamacpp.make_cells(["batch2"], 4, 1000)


def test_cells_written_as_workload_files(small_gguf, tmp_path):
    argv = ["--llama-server", "x", "--gguf", str(small_gguf), "--cells", "batch1,concurrent16"]
    assert vs_llamacpp.main([*argv, "--write-cells", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batch1.jsonl", "concurrent16.jsonl"]
    assert [len(load(tmp_path / f"{n}.jsonl")) for n in ("batch1", "concurrent16")] == [4, 16]


def test_llama_server_buffers_are_read_from_its_log():
    log = (
        "load_tensors:   CPU_Mapped model buffer size =    93.80 MiB\n"
        "load_tensors:   CPU_REPACK model buffer size =    10.50 MiB\n"
        "llama_kv_cache:        CPU KV buffer size =   720.00 MiB\n"
        "sched_reserve:        CPU compute buffer size =    98.51 MiB\n"
    )
    buffers = parse_buffers(log)
    assert buffers["model"] == pytest.approx(104.3) and buffers["model:CPU_REPACK"] == 10.5
    assert buffers["KV"] == 720.0 and buffers["compute"] == 98.51


def test_resident_pages_of_a_mapped_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(8 << 20))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        before = resident(os.getpid(), str(path))["file_mapped_mib"]
        sum(view[i] for i in range(0, len(view), 4096))  # touch every page
        after = resident(os.getpid(), str(path))
    assert before <= after["file_mapped_mib"] and after["file_mapped_mib"] == pytest.approx(8.0, abs=0.1)
    assert after["rss_mib"] >= after["anon_mib"] + after["file_mapped_mib"] - 0.1
    assert after["peak_rss_mib"] >= after["rss_mib"] - 0.1


def test_tandem_side_serves_the_load_client_over_http(small_gguf):
    """The Tandem pair the benchmark starts (on the demo model: the memory baseline), and
    every request of a cell answered with exactly its max_tokens."""
    from engine_svc.demo_model import ensure_demo_model

    args = vs_llamacpp.parse_args(["--llama-server", "x", "--gguf", str(small_gguf), "--sides", "tandem",
                                   "--threads", "1", "--tandem-kv-cache-bytes", str(16 << 20)])  # fmt: skip
    requests = [{"prompt_token_ids": [5 + i, 7, 9, 11], "max_tokens": 3 + i} for i in range(3)]
    with vs_llamacpp.tandem_server(str(ensure_demo_model()), args, slots=4) as (url, engine_pid, frontend_pid):
        figures = asyncio.run(run_cell(url, requests, concurrency=2))
        memory = resident(engine_pid)
    assert figures["errors"] == [] and figures["num_output_tokens"] == 3 + 4 + 5
    assert figures["output_tok_per_s"] > 0 and all(isinstance(t, str) for t in figures["texts"])
    assert memory["rss_mib"] > memory["anon_mib"] > 0
