"""The table, the target ratios and the plot of ``benchmarks.capacity``."""

from __future__ import annotations

import math

SATURATED = ("64", "256")


def _cap(report: dict, setting: str, calls: str) -> float | None:
    point = report["capacity"].get(setting, {}).get(calls)
    return None if point is None else point["tok_per_s"]


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return math.inf if b == 0 else a / b


def ratios(report: dict) -> dict:
    """The issue's targets as ratios of one run (None where a figure is missing)."""
    points, out = report["points"], {}
    for calls in SATURATED:
        d, one = points.get("default", {}).get(calls), points.get("interval1", {}).get(calls)
        if not d:
            continue
        top_d = d[-1]  # the highest offered rate: both settings saturated
        entry = {
            "tok_per_s_default_over_interval1": _div(_cap(report, "default", calls), _cap(report, "interval1", calls)),
            "top_rate_tok_per_s_default_over_interval1": _div(top_d["tok_per_s"], one[-1]["tok_per_s"])
            if one
            else None,
            "top_rate_cpu_per_token_default_over_interval1": (
                _div(top_d["frontend_cpu_us_per_token"], one[-1]["frontend_cpu_us_per_token"]) if one else None
            ),
            "top_rate_tokens_per_message_default": top_d["tokens_per_message"],
            "workers2_over_default": _div(_cap(report, "workers2", calls), _cap(report, "default", calls)),
            "top_rate_workers2_over_default": (
                _div(points["workers2"][calls][-1]["tok_per_s"], top_d["tok_per_s"])
                if points.get("workers2", {}).get(calls)
                else None
            ),
        }
        out[calls] = entry
    for setting in [s for s in points if s.endswith("+http")]:
        grpc_setting = setting.removesuffix("+http")
        for calls, http_points in points[setting].items():
            grpc_points = points.get(grpc_setting, {}).get(calls)
            if not grpc_points:
                continue
            pairs = list(zip(http_points, grpc_points, strict=False))
            out.setdefault(calls, {}).update(
                {
                    f"http_over_grpc_{grpc_setting}": _div(
                        _cap(report, setting, calls), _cap(report, grpc_setting, calls)
                    ),
                    f"top_rate_http_over_grpc_{grpc_setting}": _div(
                        http_points[-1]["tok_per_s"], grpc_points[-1]["tok_per_s"]
                    ),
                    f"http_minus_grpc_itl_p99_ms_{grpc_setting}": [a["itl_p99_ms"] - b["itl_p99_ms"] for a, b in pairs],
                }
            )
    d, one = points.get("default", {}).get("1"), points.get("interval1", {}).get("1")
    if d and one:
        pairs = list(zip(d, one, strict=False))
        out["1"] = {
            "max_tokens_per_message_default": max(p["tokens_per_message"] for p in d),
            "itl_mean_default_over_interval1": [_div(a["itl_mean_ms"], b["itl_mean_ms"]) for a, b in pairs],
            "itl_p50_default_over_interval1": [_div(a["itl_p50_ms"], b["itl_p50_ms"]) for a, b in pairs],
        }
    return out


def _fmt(value, spec: str = ".0f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return format(value, spec)


def print_report(report: dict) -> None:
    for setting, steps in report.get("engine_steps", {}).items():
        if steps:
            print(f"token engine ({setting}): {steps['late']} of {steps['total']} steps ran late (several tokens each)")
    print(
        f"CPU: {report['cpu']}; load average before {report['load_average_before']}, after "
        f"{report['load_average_after']}; {report['duration_s']:.0f} s"
    )
    header = (
        "setting",
        "calls",
        "capacity tok/s",
        "tok/msg",
        "us/tok",
        "ITL p99 ms (+added)",
        "top offered",
        "top got",
        "top tok/msg",
        "top us/tok",
        "top ITL p99 ms",
    )
    rows = []
    for setting, by_calls in report["points"].items():
        for calls, points in by_calls.items():
            cap, top = report["capacity"][setting][calls], points[-1]
            rows.append(
                (
                    setting,
                    calls,
                    _fmt(cap and cap["tok_per_s"]),
                    _fmt(cap and cap["tokens_per_message"], ".2f"),
                    _fmt(cap and cap["frontend_cpu_us_per_token"], ".1f"),
                    f"{cap['itl_p99_ms']:.2f} (+{cap['added_itl_p99_ms']:.2f})" if cap else "-",
                    _fmt(top["offered_tok_per_s"]),
                    _fmt(top["tok_per_s"]),
                    _fmt(top["tokens_per_message"], ".2f"),
                    _fmt(top["frontend_cpu_us_per_token"], ".1f"),
                    _fmt(top["itl_p99_ms"], ".2f"),
                )
            )
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, *rows):
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True)))
    print()
    for calls, entry in report["ratios"].items():
        for key, value in entry.items():
            shown = [_fmt(v, ".2f") for v in value] if isinstance(value, list) else _fmt(value, ".2f")
            print(f"{calls:>4} calls  {key:<48} {shown}")


def plot(report: dict, path: str) -> None:
    """tokens/s received against frontend CPU per token (left) and the ITL p99 it adds (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cpu_ax, itl_ax) = plt.subplots(1, 2, figsize=(13, 5))
    markers = {"default": "o", "interval1": "s", "workers2": "^"}
    colors = {"1": "tab:gray", "16": "tab:blue", "64": "tab:orange", "256": "tab:red"}
    for setting, by_calls in report["points"].items():
        for calls, points in by_calls.items():
            x = [p["tok_per_s"] for p in points]
            style = dict(
                marker=markers.get(setting, "x"), color=colors.get(calls, "k"), label=f"{setting}, {calls} calls"
            )
            style["linestyle"] = {"default": "-", "interval1": ":", "workers2": "--"}.get(setting, "-")
            cpu_ax.plot(x, [p["frontend_cpu_us_per_token"] for p in points], **style)
            itl_ax.plot(x, [max(p["added_itl_p99_ms"], 0.1) for p in points], **style)
    cpu_ax.set(xlabel="output tokens/s received", ylabel="frontend CPU us per token", title="CPU per token")
    itl_ax.set(
        xlabel="output tokens/s received",
        ylabel="ms (log)",
        yscale="log",
        title="ITL p99 added by the frontend (ITL p99 - engine step); line: 5 ms",
    )
    itl_ax.axhline(5.0, color="k", linewidth=0.5)
    cpu_ax.set_ylim(bottom=0)
    itl_ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"Frontend capacity on {report['cpu']} (token engine, same cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
