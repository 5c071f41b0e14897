"""Table, JSON and PNG of a ``benchmarks.serve`` report (see serve.py for what each figure means)."""

from __future__ import annotations

import math

LATENCIES = (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def jsonable(value):
    """Drops private keys (``_results`` ...) and writes infinite rates as "inf"."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items() if not k.startswith("_")}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return value


def _rate_label(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate:g} req/s"


def _num(value, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return format(value, fmt)


def format_table(report: dict) -> str:
    entries = report["results"]
    rows: list[tuple[str, list[str]]] = [
        ("offered rate", [_rate_label(e["rate"]) for e in entries]),
        ("completed / requests", [f"{e['num_completed']}/{e['num_requests']}" for e in entries]),
        ("errors", [", ".join(f"{k} {v}" for k, v in sorted(e["errors"].items())) or "none" for e in entries]),
        ("wall s", [_num(e["wall_s"], ".2f") for e in entries]),
        ("requests/s", [_num(e["req_per_s"], ".2f") for e in entries]),
        ("output tokens/s", [_num(e["output_tok_per_s"], ".1f") for e in entries]),
        ("total tokens/s", [_num(e["total_tok_per_s"], ".1f") for e in entries]),
        ("tokens/message", [_num(e.get("tokens_per_message"), ".2f") for e in entries]),
        (
            "arrivals/s -> completions/s",
            [f"{_num(e['arrival_req_per_s'], '.2f')} -> {_num(e['completion_req_per_s'], '.2f')}" for e in entries],
        ),
    ]
    for key, name in (*LATENCIES[:2], ("tpot_ms", "TPOT"), LATENCIES[2]):
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{name} {stat} ms", [_num((e[key] or {}).get(stat), ".1f") for e in entries]))
    for key, name, fmt in (
        ("frontend_cpu_us_per_token", "frontend CPU us/token", ".1f"),
        ("engine_cpu_us_per_token", "engine CPU us/token", ".1f"),
        ("pair_over_inprocess", "pair / in-process tok/s", ".3f"),
    ):
        if any(key in e for e in entries):
            rows.append((name, [_num(e.get(key), fmt) for e in entries]))

    width = max(len(name) for name, _ in rows)
    cols = [max(len(row[1][i]) for row in rows) for i in range(len(entries))]
    lines = [
        f"model {report['model']} at {report['target']}; workload {report['workload']} "
        f"({report['num_requests']} requests, max concurrency {report['max_concurrency'] or 'none'})"
    ]
    for name, cells in rows:
        lines.append(f"{name:<{width}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells, cols)))
    if "inprocess" in report:
        ip = report["inprocess"]
        lines.append(
            f"in-process engine: {ip['output_tok_per_s']:.1f} output tokens/s, "
            f"{ip['total_tok_per_s']:.1f} total tokens/s, {ip['wall_s']:.2f} s"
        )
    if sum(math.isfinite(e["rate"]) for e in entries) >= 1:
        sat = report.get("saturation_rate")
        lines.append(f"saturation: {_rate_label(sat)}" if sat is not None else "saturation: not reached")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    entries = report["results"]
    if len({e["rate"] for e in entries}) >= 2:
        fig = _sweep(plt, report)
    else:
        fig = _cdf(plt, entries[0])
    for ax in fig.axes:
        if ax.get_yscale() == "log":  # 1-2-5 labels in plain numbers
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
    fig.suptitle(f"{report['model']}: {report['workload']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _sweep(plt, report: dict):
    """TTFT / ITL / E2E percentiles and achieved throughput against the offered rate."""
    entries = sorted(report["results"], key=lambda e: e["rate"])
    finite = [e["rate"] for e in entries if math.isfinite(e["rate"])]
    inf_x = max(finite, default=1.0) * 1.25  # where "all at once" sits on the rate axis
    xs = [e["rate"] if math.isfinite(e["rate"]) else inf_x for e in entries]
    ticks = [(x, _rate_label(e["rate"]).replace(" req/s", "")) for x, e in zip(xs, entries)]
    sat = report.get("saturation_rate")

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, name) in zip(axes.flat, LATENCIES):
        for stat, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ys = [(e[key] or {}).get(stat, math.nan) for e in entries]
            ax.plot(xs, ys, style, label=stat)
        ax.set_yscale("log")
        ax.set_ylabel(f"{name} (ms)")
    ax = axes.flat[3]
    ax.plot(xs, [e["req_per_s"] for e in entries], "o-", label="achieved (requests / wall time)")
    ax.plot(
        xs,
        [e["completion_req_per_s"] if math.isfinite(e["completion_req_per_s"]) else math.nan for e in entries],
        "s--",
        label="completions / completion span",
    )
    if finite:
        ax.plot([0, max(finite)], [0, max(finite)], color="grey", lw=0.8, label="offered")
    ax.set_ylabel("requests/s")
    for ax in axes.flat:
        ax.set_xticks([x for x, _ in ticks], [t for _, t in ticks], fontsize=8)
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_xlim(0, inf_x * 1.08)
        ax.grid(alpha=0.3)
        if sat is not None:
            ax.axvline(sat, color="red", lw=1, alpha=0.7)
        ax.legend(fontsize=7)
    if sat is not None:
        axes.flat[3].annotate(
            f"saturation ~{sat:g} req/s", (sat, 0), xytext=(4, 8), textcoords="offset points", color="red", fontsize=8
        )
    return fig


def _cdf(plt, entry: dict):
    """Latency CDFs of one rate's requests."""
    import numpy as np

    ok = [r for r in entry["_results"] if r.code == "OK"]
    samples = {
        "ttft_ms": [r.ttft for r in ok if r.ttft is not None],
        "itl_ms": [x for r in ok for x in r.itl],
        "e2e_ms": [r.e2e for r in ok],
    }
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for ax, (key, name) in zip(axes, LATENCIES):
        a = np.sort(np.asarray(samples[key]) * 1e3)
        if len(a):
            ax.step(a, np.arange(1, len(a) + 1) / len(a), where="post")
            for p in (50, 99):
                v = float(np.percentile(a, p))
                ax.axvline(v, color="grey", lw=0.8, ls="--")
                ax.annotate(
                    f"p{p} {v:.1f}",
                    (v, 0.05 if p == 50 else 0.15),
                    fontsize=7,
                    xytext=(3, 0),
                    textcoords="offset points",
                )
        ax.set_xlabel(f"{name} (ms)")
        ax.set_xlim(left=0)
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    axes[0].set_title(f"{_rate_label(entry['rate'])}, {entry['num_completed']} requests", fontsize=9)
    return fig
