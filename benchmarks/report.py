"""Markdown tables from ``benchmarks/results/*.json`` (what the README's Benchmarks section shows).

    .venv/bin/python benchmarks/report.py
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import fmt_bytes, load_result as _load  # noqa: E402


def md(rows, header) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def step_time(r) -> str:
    cols = ["fxshard", "megatron", "dtensor", "fxshard-compiled", "megatron-compiled"]
    ratio_cols = ["fxshard/megatron", "fxshard-nooverlap/megatron", "fxshard/fxshard-nooverlap", "fxshard-nobucket/megatron",
                  "fxshard/dtensor", "fxshard-compiled/megatron-compiled", "fxshard-compiled/megatron"]
    rows = []
    for name, c in r["cases"].items():
        rows.append([name] + [f"{c['median_s'][n] * 1e3:.0f}" if n in c["median_s"] else "-" for n in cols]
                    + [f"**{c['ratios'][k]:.2f}**" if k in c["ratios"] else "-" for k in ratio_cols])
    return (md(rows, ["case"] + [f"{n} ms" for n in cols] + ratio_cols) +
            f"\n\n{r['rounds']} rounds x {r['steps_per_round']} steps per contender per case, interleaved; ratios are "
            f"medians of per-round ratios; load average at start {r['machine']['load_avg_at_start'][0]:.1f}; "
            f"run took {r['wall_s']:.0f} s (commit {r['machine'].get('commit', '?')}).")


def profile(r) -> str:
    names = [n for n in ("megatron", "megatron-graph", "megatron-graph-fx", "megatron-graph-core", "fxshard", "dtensor")
             if n in r["median_s"]]
    ops = r["aten_ops_per_step"]
    base = r["median_s"]["megatron"]
    rows = [[n, f"{r['median_s'][n] * 1e3:.1f}", f"{r['median_s'][n] / base:.2f}x",
             str(sum(ops[n].values())) if n in ops else "-"] for n in names]
    loo = r["leave_one_out_saved_s"]
    rows2 = [[k.replace("core, keep ", ""), f"{v * 1e3:+.1f}"] for k, v in loo.items() if k.startswith("core, keep")]
    return (md(rows, ["contender (compute only)", "median ms/step", "vs megatron", "aten ops/step"]) +
            f"\n\nPrice of decomposing everything (megatron-graph-core / megatron-graph): "
            f"**{r['decomposition_cost_ratio']:.2f}x**; of fxshard's table (megatron-graph-fx / megatron-graph): "
            f"**{r['fx_table_cost_ratio']:.2f}x**; fxshard / megatron-graph-fx: **{r['fxshard_over_graph_fx']:.2f}x**.\n\n" +
            md(rows2, ["fused kernel kept out of the decomposition table", "ms/step saved"]) +
            f"\n\n(all fused kernels kept: {loo['megatron-graph'] * 1e3:+.1f} ms/step; run took {r['wall_s']:.0f} s)")


def comm(r) -> str:
    def cell(t):
        return ", ".join(f"{k} {v['count']}x {fmt_bytes(v['bytes'])}" for k, v in sorted(t.items())) or "-"
    rows = []
    for k, v in r["summary"].items():
        ph = v["phases"]
        rows.append([k, cell(ph["forward"]), cell(ph["backward"]), cell(ph.get("optimizer", {})), v["count"],
                     fmt_bytes(v["bytes"])])
    return md(rows, ["contender (source)", "forward (+loss)", "backward", "optimizer", "collectives", "bytes"])


def shard_time(r) -> str:
    rows = []
    f = r["fit"]
    for n in r["layers"]:
        m = r["median_s"][str(n)]
        st = r["stage_median_s"][str(n)]
        rows.append([n, r["runs"][str(n)][0]["joint_nodes"], f"{m:.1f}", f"{m / n:.2f}",
                     f"{(m - f['a'] - f['b'] * n) / (f['a'] + f['b'] * n) * 100:+.0f}%",
                     f"{st.get('trace forward', 0):.1f}", f"{st.get('trace joint', 0):.1f}",
                     f"{st.get('shard joint', 0):.1f}", f"{st.get('shard inference', 0):.1f}"])
    marg = ", ".join(f"{k}: {v:.2f}" for k, v in r["marginal_s_per_layer"].items())
    return (md(rows, ["layers", "joint graph nodes", "median s", "s/layer", "vs fit", "trace fwd s", "trace joint s",
                      "shard joint s", "shard inference s"]) +
            f"\n\nLeast squares: t = {f['a']:.2f} s + **{f['b']:.2f} s/layer** x layers, r² = {f['r2']:.4f}; "
            f"marginal s/layer between depths: {marg}. Median of {r['rounds']} rounds; run took {r['wall_s']:.0f} s.")


def memory(r) -> str:
    out = []
    for scen, full in (("seed000", r["seed000_full_bytes"]), ("meta+safetensors", r["checkpoint_bytes"])):
        rows = []
        for k, m in r["summary"].items():
            if not k.startswith(scen + " / "):
                continue
            _, c, rank = k.split(" / ")
            rows.append([c, rank.split()[-1], fmt_bytes(m["param_bytes"]), fmt_bytes(m["setup_growth"]),
                         fmt_bytes(m["setup_anon_growth"]), f"{m['setup_anon_growth'] / full:.2f}",
                         fmt_bytes(m["train_peak"]), "yes" if m["slices_ok"] else "NO"])
        out.append(f"*{scen}* (full parameters {fmt_bytes(full)}):\n\n" + md(
            rows, ["contender", "rank", "param bytes", "setup peak RSS growth", "setup private growth",
                   "private / full", "peak RSS incl. training", "shards = file slices"]))
    return "\n\n".join(out) + f"\n\n(medians of {r['rounds']} runs; run took {r['wall_s']:.0f} s)"


def main() -> None:
    for name, fn in (("step_time.json", step_time), ("profile_step.json", profile), ("comm.json", comm),
                     ("shard_time.json", shard_time), ("memory.json", memory)):
        r = _load(name)
        if r is not None:
            print(f"<!-- {name} -->\n{fn(r)}\n")


if __name__ == "__main__":
    main()
