"""Prefix-aware routing against least-load: ``benchmarks.serve --compare-routing``.

    for policy in (least-load, prefix):
        start --engines engines and one frontend --routing POLICY (fresh processes: empty caches)
        run the workload once at the one --rate, reading the frontend's metrics around the run
    print both side by side with the ratios; --json / --plot write them

Figures per policy, besides those of every serve run (serve.py's docstring):

* ``prefix_cache_hit_rate``: prompt tokens the engines served from their prefix caches
  (each call's usage.cached_tokens) over all prompt tokens;
* ``routing_decisions``: the frontend's choices by reason during the run;
* ``prediction_agreement`` (prefix only): the share of calls whose predicted cached tokens
  (the frontend's index at routing time) equal the cached tokens the engine reported;
  ``predictions`` holds the counts (exact / over / under);
* ``ttft_samples_ms``: every call's TTFT, for plots;
* ``index_blocks_by_engine`` (prefix only): the blocks the frontend's index holds per
  engine at the end of the run: how the prompts were spread.

Ratios (prefix over least-load): ``hit_rate_ratio``, ``ttft_mean_reduction`` (1 - prefix
mean TTFT / least-load mean TTFT) and ``output_throughput_ratio``, each against its target.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import urllib.request
from pathlib import Path

from benchmarks.serve_launch import launched
from benchmarks.serve_load import drive
from benchmarks.serve_report import jsonable

POLICIES = ("least-load", "prefix")
TARGETS = {
    "hit_rate_ratio": 1.8,
    "ttft_mean_reduction": 0.30,
    "output_throughput_ratio": 1.0,
    "prediction_agreement": 0.95,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """The frontend's metrics: {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text = page.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def routing_figures(start: dict, end: dict) -> dict:
    """What the frontend's routing metrics moved by between two scrapes."""

    def moved(name: str, label: str) -> dict[str, int]:
        out = {}
        for key, value in end.items():
            if key[0] == name:
                delta = value - start.get(key, 0.0)
                if delta:
                    out[dict(key[1])[label]] = int(delta)
        return out

    def total(name: str) -> int:
        return int(end.get((name, ()), 0.0) - start.get((name, ()), 0.0))

    predictions = moved("tandem_frontend_prefix_predictions_total", "outcome")
    index_blocks = {
        dict(k[1])["engine"]: int(v) for k, v in end.items() if k[0] == "tandem_frontend_prefix_index_blocks"
    }
    num_predicted = sum(predictions.values())
    return {
        "routing_decisions": moved("tandem_frontend_routing_decisions_total", "reason"),
        "predictions": predictions,
        "prediction_agreement": predictions.get("exact", 0) / num_predicted if num_predicted else None,
        "predicted_cached_tokens": total("tandem_frontend_predicted_cached_tokens_total"),
        "served_cached_tokens_of_predicted": total("tandem_frontend_predicted_calls_cached_tokens_total"),
        "index_blocks_by_engine": index_blocks,  # at the end of the run (prefix routing only)
    }


def compare(runs: dict[str, dict]) -> dict:
    least, prefix = runs["least-load"], runs["prefix"]
    hit = (
        prefix["prefix_cache_hit_rate"] / least["prefix_cache_hit_rate"] if least["prefix_cache_hit_rate"] else math.inf
    )
    ratios = {
        "hit_rate_ratio": hit,
        "ttft_mean_reduction": 1.0 - prefix["ttft_ms"]["mean"] / least["ttft_ms"]["mean"],
        "output_throughput_ratio": prefix["output_tok_per_s"] / least["output_tok_per_s"],
        "prediction_agreement": prefix["prediction_agreement"] or 0.0,
    }
    ratios["targets_met"] = {k: ratios[k] >= target for k, target in TARGETS.items()}
    return ratios


def format_comparison(report: dict) -> str:
    runs, ratios = report["runs"], report["comparison"]

    def row(name: str, cell) -> str:
        return f"{name:<28}" + "".join(f"{cell(runs[p]):>26}" for p in POLICIES)

    def ms(e: dict, key: str, stat: str) -> str:
        return f"{(e[key] or {}).get(stat, math.nan):.1f}"

    lines = [
        f"model {report['model']}; workload {report['workload']}; {report['num_engines']} engines; "
        f"rate {report['rate']:g}/s ({report['arrivals']})",
        row("routing", lambda e: e["routing"]),
        row("completed / requests", lambda e: f"{e['num_completed']}/{e['num_requests']}"),
        row("prefix-cache hit rate", lambda e: f"{e['prefix_cache_hit_rate']:.3f}"),
        row(
            "TTFT mean / p50 / p99 ms",
            lambda e: f"{ms(e, 'ttft_ms', 'mean')} / {ms(e, 'ttft_ms', 'p50')} / {ms(e, 'ttft_ms', 'p99')}",
        ),
        row("E2E mean ms", lambda e: ms(e, "e2e_ms", "mean")),
        row("output tokens/s", lambda e: f"{e['output_tok_per_s']:.1f}"),
        row("wall s", lambda e: f"{e['wall_s']:.2f}"),
        row(
            "prediction agreement",
            lambda e: "-" if e["prediction_agreement"] is None else f"{e['prediction_agreement']:.3f}",
        ),
    ]
    for reason in sorted({r for e in runs.values() for r in e["routing_decisions"]}):
        lines.append(row(f"decisions: {reason}", lambda e, r=reason: str(e["routing_decisions"].get(r, 0))))
    lines.append("prefix over least-load:")
    for key, target in TARGETS.items():
        verdict = "met" if ratios["targets_met"][key] else "MISSED"
        lines.append(f"  {key:<26}{ratios[key]:>10.3f}   target >= {target:g}: {verdict}")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    runs = report["runs"]
    colors = {"least-load": "tab:grey", "prefix": "tab:blue"}
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    bars = (
        ("prefix_cache_hit_rate", "prefix-cache hit rate", lambda e: e["prefix_cache_hit_rate"]),
        ("output_tok_per_s", "output tokens/s", lambda e: e["output_tok_per_s"]),
        ("ttft_mean", "mean TTFT (ms)", lambda e: e["ttft_ms"]["mean"]),
    )
    for ax, (_, label, value) in zip(axes[[0, 2, 3]], bars):
        heights = [value(runs[p]) for p in POLICIES]
        ax.bar(POLICIES, heights, color=[colors[p] for p in POLICIES])
        for x, h in enumerate(heights):
            ax.annotate(f"{h:.4g}", (x, h), ha="center", va="bottom", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    ax = axes[1]
    for p in POLICIES:
        ttft = np.sort(np.asarray(runs[p]["ttft_samples_ms"]))
        if len(ttft):
            ax.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", color=colors[p], label=p)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 3.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    agreement = runs["prefix"]["prediction_agreement"]
    fig.suptitle(
        f"{report['model']}, {report['num_engines']} engines: {report['workload']}\n"
        f"rate {report['rate']:g}/s; prefix routing's predicted cached tokens exact for "
        f"{'-' if agreement is None else f'{agreement:.1%}'} of requests",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def replot(json_path: str, png_path: str) -> None:
    """The plot again from a written report: ``python -c 'from benchmarks.serve_routing import replot; ...'``."""
    plot(json.loads(Path(json_path).read_text()), png_path)


def compare_routing(args) -> int:
    runs: dict[str, dict] = {}
    report: dict = {}
    for policy in POLICIES:
        port = _free_port()
        with launched(args, ("--routing", policy, "--metrics-port", str(port))) as (engines, frontend):
            marks: dict[str, dict] = {}

            def on_rate(_i: int, when: str, port: int = port, marks: dict = marks) -> None:
                marks[when] = scrape(port)

            run = asyncio.run(drive(args, frontend.address, frontend.proc.pid, None, on_rate=on_rate))
        entry = run["results"][0]
        entry.update(routing_figures(marks["start"], marks["end"]), routing=policy)
        entry["ttft_samples_ms"] = [round(r.ttft * 1e3, 3) for r in entry["_results"] if r.ttft is not None]
        runs[policy] = entry
        report = {key: run[key] for key in ("model", "workload", "num_requests", "seed")}
    report.update(
        num_engines=args.engines,
        rate=args.rate[0],
        arrivals=args.arrivals,
        engine_args=args.engine_arg,
        runs=runs,
        comparison=compare(runs),
    )
    print(format_comparison(report))
    if args.plot:
        plot(report, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(jsonable(report), indent=2) + "\n")
        print(f"json: {args.json}")
    return 0 if all(not e["errors"] for e in runs.values()) else 1
