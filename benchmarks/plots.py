"""Plots from the benchmark results: ``docs/shard_time.png`` and ``docs/step_time.png``.

    .venv/bin/python benchmarks/plots.py

Reads ``benchmarks/results/shard_time.json`` (from ``shard_time.py``) and
``benchmarks/results/step_time.json`` (from ``step_time.py``); plots whichever exist.
Needs matplotlib (``pip install -e '.[bench]'``); uses the Agg backend (no display).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import DOCS, load_result as _load, ratio_median  # noqa: E402


def plot_shard_time(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = res["layers"]
    med = [res["median_s"][str(n)] for n in layers]
    lo = [min(r["total"] for r in res["runs"][str(n)]) for n in layers]
    hi = [max(r["total"] for r in res["runs"][str(n)]) for n in layers]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    # stages in pipeline order, stacked bottom-up; stages under 2% of the total are lumped together
    stages = res.get("stages") or list(res["stage_median_s"][str(layers[0])])
    def vals(s):
        return [res["stage_median_s"][str(n)].get(s, 0.0) for n in layers]
    big = [s for s in stages if max(v / m for v, m in zip(vals(s), med)) >= 0.02]
    small = [s for s in stages if s not in big]
    series = [(s, vals(s)) for s in big]
    if small:
        series.append((" + ".join(small), [sum(x) for x in zip(*[vals(s) for s in small])]))
    bottom = [0.0] * len(layers)
    colors = plt.get_cmap("tab10").colors
    handles = []
    for i, (s, v) in enumerate(series):
        top = [b + x for b, x in zip(bottom, v)]
        handles.append(ax.fill_between(layers, bottom, top, alpha=0.35, color=colors[i % 10],
                                       label=f"stage: {s}", linewidth=0))
        bottom = top
    ax.errorbar(layers, med, yerr=[[m - l for m, l in zip(med, lo)], [h - m for m, h in zip(med, hi)]],
                fmt="o", color="black", capsize=3, label=f"total (median of {res['rounds']}, min-max)")
    fit = res["fit"]
    xs = [0, max(layers)]
    ax.plot(xs, [fit["a"] + fit["b"] * x for x in xs], "--", color="black", linewidth=1,
            label=f"fit {fit['a']:.2f} s + {fit['b']:.3f} s/layer (r²={fit['r2']:.4f})")
    ax.set_xlabel("decoder layers (Llama-3-8B width)")
    ax.set_ylabel("fxshard.shard() wall time [s]")
    ax.set_title(f"fxshard.shard(): meta-device Llama, training, TP={res['tp']} (fake process group)", fontsize=10)
    ax.set_xticks(layers)
    ax.set_xlim(0, max(layers) + 1)
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    h, lab = ax.get_legend_handles_labels()
    n_st = len(series)  # stage patches listed top-down, like the stack
    order = list(range(n_st, len(h))) + list(range(n_st - 1, -1, -1))
    ax.legend([h[i] for i in order], [lab[i] for i in order], fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_step_time(res: dict, path: str) -> None:
    """One group of bars per case: each contender's median step time over Megatron eager's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = res["cases"]
    names = ["fxshard", "fxshard-nooverlap", "fxshard-nobucket", "megatron", "dtensor", "fxshard-compiled",
             "megatron-compiled"]
    colors = {"fxshard": "#1f77b4", "fxshard-nooverlap": "#c5b0d5", "fxshard-nobucket": "#9edae5", "megatron": "#2ca02c",
              "dtensor": "#ff7f0e",
              "fxshard-compiled": "#aec7e8", "megatron-compiled": "#98df8a"}
    fig, ax = plt.subplots(figsize=(10, 4), dpi=120)
    width = 0.8 / len(names)
    for j, n in enumerate(names):
        xs = [i for i, c in enumerate(cases.values()) if n in c["median_s"]]
        ys = [ratio_median(c["per_round_s"][n], c["per_round_s"]["megatron"]) for c in cases.values()
              if n in c["median_s"]]
        if xs:
            ax.bar([x + (j - len(names) / 2 + 0.5) * width for x in xs], ys, width, label=n, color=colors[n])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([k.replace("/", "\n") for k in cases], fontsize=7)
    ax.set_ylabel("step time / Megatron eager")
    cfg = res["config"]
    ax.set_title(f"Training step, torch test Transformer ({cfg['n_layers']} layers, dim {cfg['dim']}), gloo; "
                 f"{res['rounds']} interleaved rounds; bars: median of per-round ratios", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> list[str]:
    os.makedirs(DOCS, exist_ok=True)
    written = []
    shard = _load("shard_time.json")
    if shard is not None:
        path = os.path.join(DOCS, "shard_time.png")
        plot_shard_time(shard, path)
        written.append(path)
    step = _load("step_time.json")
    if step is not None:
        path = os.path.join(DOCS, "step_time.png")
        plot_step_time(step, path)
        written.append(path)
    return written


if __name__ == "__main__":
    for p in main(sys.argv[1:]):
        print(f"wrote {p}")
