"""The engine's configuration: one dataclass, built once from the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields


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
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    max_waiting: int = 1024
    max_message_bytes: int = 16 * 1024 * 1024
    shutdown_timeout: float = 30.0
    metrics_port: int = 0
    ready_file: str | None = None
    log_level: str = "INFO"
    log_format: str = "text"
    otlp_endpoint: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    num_threads: int | None = None
    kernels: str = "auto"
    seed: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB when neither --num-kv-blocks nor --kv-cache-bytes is given


def build_parser() -> argparse.ArgumentParser:
    d = EngineConfig()
    p = argparse.ArgumentParser(
        prog="tandem-engine",
        description="Tandem engine: scheduler, paged KV cache, model and sampler behind one "
        "bidirectional gRPC stream (tandem.engine.v1.EngineService).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="local Hugging Face model directory (Llama, Mistral, Qwen2); "
        "default: the built-in demo model (random weights, gibberish text)",
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
        type=int,
        default=None,
        help="context length cap (default: the model's max_position_embeddings)",
    )
    m.add_argument(
        "--num-threads",
        type=int,
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
    m.add_argument("--seed", type=int, default=d.seed, help="seed of the sampler's shared generator")

    s = p.add_argument_group("scheduler and KV cache")
    s.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most requests running at once")
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="token budget per step, shared by prefill chunks and decodes",
    )
    s.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    kv = s.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks")
    kv.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help=f"KV cache size in bytes (default {DEFAULT_KV_CACHE_BYTES} when no size is given)",
    )
    s.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse KV blocks of identical prompt prefixes",
    )
    s.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"])
    s.add_argument(
        "--max-waiting",
        type=int,
        default=d.max_waiting,
        help="waiting-queue length beyond which new requests get RESOURCE_EXHAUSTED",
    )

    n = p.add_argument_group("server")
    n.add_argument("--host", default=d.host, help="address to listen on")
    n.add_argument("--port", type=int, default=d.port, help="gRPC port (0 picks a free one)")
    n.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes, help="gRPC message size limit")
    n.add_argument(
        "--ready-file",
        default=None,
        metavar="PATH",
        help="write the port and state (listening, then serving) here as JSON; removed on exit. "
        "For tools that start the engine, e.g. with --port 0 (see tandem_common/ready.py)",
    )
    n.add_argument(
        "--shutdown-timeout",
        type=float,
        default=d.shutdown_timeout,
        help="seconds running requests may take to finish after SIGTERM",
    )
    n.add_argument("--tls-cert", default=None, help="server certificate (PEM); enables TLS")
    n.add_argument("--tls-key", default=None, help="server private key (PEM)")
    n.add_argument("--tls-ca", default=None, help="CA (PEM) that client certificates must chain to (mutual TLS)")

    o = p.add_argument_group("observability")
    o.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus port (0 = off)")
    o.add_argument("--log-level", default=d.log_level, help="DEBUG, INFO, WARNING, ERROR")
    o.add_argument("--log-format", default=d.log_format, choices=["text", "json"])
    o.add_argument(
        "--otlp-endpoint",
        default=None,
        help="OTLP gRPC endpoint for traces, e.g. http://otel-collector:4317 (HOST:PORT alone means "
        "plaintext); default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, "
        "tracing is off when none is set",
    )
    return p
