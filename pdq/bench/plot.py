"""`--plot FILE.png`: throughput-latency curves, one line per strategy (and per baseline).

Each point is one run: x = achieved output tokens/s, y = a latency percentile; the points of
one strategy (its offered loads) are joined in order of offered load. Three panels: p99 TTFT,
p99 ITL and p50 e2e latency.
"""

import math
from pathlib import Path

PANELS = (("ttft_ms", "p99", "TTFT p99 (ms)"), ("itl_ms", "p99", "inter-token latency p99 (ms)"),
          ("e2e_ms", "p50", "e2e latency p50 (ms)"))
STYLE = {"continuous": "tab:green", "dynamic": "tab:orange", "static": "tab:red", "engine": "tab:blue",
         "hf": "tab:gray"}


def _load_key(run: dict) -> float:
    o = run["offered"]
    if o["concurrency"]:
        return o["concurrency"]
    return math.inf if o["rate_per_s"] is None else o["rate_per_s"]


def plot(runs: list[dict], path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["name"] for r in runs))
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4.2), constrained_layout=True)
    for ax, (field, q, label) in zip(axes, PANELS):
        for name in names:
            pts = sorted((r for r in runs if r["name"] == name), key=_load_key)
            xs = [r["output_tokens_per_s"] for r in pts]
            ys = [r[field][q] for r in pts]
            if not any(y is not None for y in ys):
                continue
            ax.plot(xs, ys, marker="o", label=name, color=STYLE.get(name),
                    linestyle="--" if name in ("hf", "engine") else "-")
            for r, x, y in zip(pts, xs, ys):
                if y is not None and len(pts) > 1:
                    ax.annotate(r["arrivals"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
