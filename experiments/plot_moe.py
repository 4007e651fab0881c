"""Plot ms per MoE call vs M from bench_moe JSON (kernels, twin, ragged_dot, bandwidth floor, goal).

--merge: more rows of the main run (other M of the same commit), drawn as the main file's. Of the Mosaic
GPU rows only the default configuration is drawn where a file has it: "mgpu[]", or the configurations named
by --kernel-impls (e.g. a run that timed today's default under an explicit name).

The plot in experiments/results (session 15; session 13's default faint)::

    python3 experiments/plot_moe.py experiments/results/bench_moe_s15_lop3.json \\
        experiments/results/bench_moe_s13_defaults.json experiments/results/bench_moe_h200.json \\
        -o experiments/results/bench_moe_h200.png
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


IMPLS = (("mgpu", "D-", "Mosaic GPU kernel, layout tiles"), ("pallas", "o-", "Pallas-Triton kernel, layout planar"),
         ("twin", "s-", "XLA twin"), ("ragged_dot_bf16", "^-", "XLA ragged_dot bf16"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("main")
    ap.add_argument("extra", nargs="*", help="more result files (earlier runs), drawn faint")
    ap.add_argument("--merge", action="append", default=[], help="more rows of the main run (same commit)")
    ap.add_argument("--kernel-impls", default="mgpu[]",
                    help="comma list of the Mosaic GPU configurations drawn as the kernel (default: mgpu[])")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args()
    kernel_impls = set(args.kernel_impls.split(","))
    d = json.load(open(args.main))
    for path in args.merge:
        more = json.load(open(path))
        if more.get("commit") != d.get("commit"):
            raise SystemExit(f"{path} is from commit {more.get('commit')}, the main file from {d.get('commit')}")
        d["rows"] = d["rows"] + more["rows"]
    bw = d.get("ref_bw_Bps") or d["torch_copy_bw_Bps"]
    rows = [r for r in d["rows"] if r.get("phase", "table") == "table"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, kind in zip(axes, ("uniform", "skewed")):
        rr = [r for r in rows if r["routing"] == kind]
        ms_m = sorted({r["M"] for r in rr})
        floor = {r["M"]: r["GB"] * 1e9 / bw * 1e3 for r in rr}
        ax.plot(ms_m, [floor[m] for m in ms_m], "k--", label=f"floor: weight bytes / copy BW ({bw / 1e12:.2f} TB/s)")
        ax.plot(ms_m, [floor[m] / 0.85 for m in ms_m], "k:", label="goal: 85 % of copy BW")
        series = 0  # one colour per (file, implementation) in both panels, whatever rows a panel lacks
        for path, faint in [(args.main, False)] + [(x, True) for x in args.extra]:
            e = d if path == args.main else json.load(open(path))
            stem = path.rsplit("/", 1)[-1].removesuffix(".json")
            for impl, style, lab in IMPLS:
                color, series = f"C{series % 10}", series + 1
                table = [r for r in e["rows"] if r.get("phase", "table") == "table" and r["routing"] == kind]
                chosen = [r for r in table if r["impl"] in kernel_impls] if impl == "mgpu" else []
                pts = sorted((r["M"], r["ms"]) for r in chosen or [r for r in table if r["impl"].startswith(impl)])
                if pts:
                    ax.plot(*zip(*pts), style, color=color, alpha=0.45 if faint else 1.0, label=f"{lab} ({stem})")
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
