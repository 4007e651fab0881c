"""Plot ms per MoE call vs M from bench_moe JSON (kernel, twin, ragged_dot, bandwidth floor).

    python3 experiments/plot_moe.py experiments/results/bench_moe_h200.json [extra.json ...] -o out.png
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("main")
    ap.add_argument("extra", nargs="*", help="more result files: their table-less kernel rows are drawn as points")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args()
    d = json.load(open(args.main))
    bw = d.get("ref_bw_Bps") or d["torch_copy_bw_Bps"]
    rows = [r for r in d["rows"] if r.get("phase", "table") == "table"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, kind in zip(axes, ("uniform", "skewed")):
        rr = [r for r in rows if r["routing"] == kind]
        ms_m = sorted({r["M"] for r in rr})
        floor = {r["M"]: r["GB"] * 1e9 / bw * 1e3 for r in rr}
        ax.plot(ms_m, [floor[m] for m in ms_m], "k--", label=f"floor: weight bytes / copy BW ({bw / 1e12:.2f} TB/s)")
        ax.plot(ms_m, [floor[m] / 0.85 for m in ms_m], "k:", label="goal: 85 % of copy BW")
        for impl, style in (("pallas", "o-"), ("twin", "s-"), ("ragged_dot_bf16", "^-")):
            pts = sorted((r["M"], r["ms"]) for r in rr if r["impl"].startswith(impl))
            if pts:
                lab = {"pallas": "Pallas kernel, design=join (run 4)", "twin": "XLA twin",
                       "ragged_dot_bf16": "XLA ragged_dot bf16"}[impl]
                ax.plot(*zip(*pts), style, label=lab)
        if kind == "uniform":
            for path in args.extra:
                e = json.load(open(path))
                pts = sorted((r["M"], r["ms"]) for r in e["rows"]
                             if r["impl"] == "pallas[dequant=asm]" and r["routing"] == "uniform")
                if pts:
                    ax.plot(*zip(*pts), "D", ms=8, mfc="none",
                            label="Pallas kernel, design=planes (run 2; routing glue of then)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens M")
        ax.set_title(f"K2.6 routed experts, INT4 g32, one H200, {kind} routing")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("ms per MoE call")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
