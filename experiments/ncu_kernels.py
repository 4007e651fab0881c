"""One launch of each Mosaic GPU kernel case, for Nsight Compute's hardware counters (the H200 lease runs
on Firecracker, where ``ncu`` reads them; on gVisor it cannot).

Each case is one jitted call that launches exactly the Mosaic GPU kernels it names, in the order printed;
everything else it launches (input generation, routing glue, the split merge) is XLA or Pallas-Triton and
``-k regex:mosaic_gpu`` leaves it out. Cases:

* ``moe_*``: the grouped INT4 GEMM of ``probe_moe_mgpu --plan width`` (one tile of N tokens per expert,
  gate+up with the SiLU·up epilogue) over ``--moe-experts`` experts, full and with a stage probed away,
  on random weights and on weights that are all q = 0.
* ``layer_m1``: the routed experts of one layer at one token (gate+up, then down: two kernels).
* ``att_*``: the MLA attention kernel at the memory-bound decode points of issue #6, or at ``--att-points``,
  once per ``--att-kernels`` entry (``bench_tree_attention --kernel`` names: an A/B of a kernel's options).

    ncu --clock-control none -k regex:mosaic_gpu --csv --page details --log-file $OUT/ncu.csv \\
        --section SpeedOfLight --section WarpStateStats ... python experiments/ncu_kernels.py

Without ncu it runs the same calls once each (a smoke test on a GPU). ``parse_ncu_csv`` turns the log
into one record per launch.

Where each kernel's warps wait, instruction by instruction (warp stall sampling):

    ncu --clock-control none -k regex:narrow_body --section SourceCounters --section WarpStateStats \
        -o $OUT/narrow python experiments/ncu_kernels.py --what attention
    ncu -i $OUT/narrow.ncu-rep --page source --csv --print-source sass > $OUT/src.csv
    PYTHONPATH=. python experiments/ncu_kernels.py --summarize-source $OUT/src.csv --commit C --out $OUT

(``ncu_source.json``: the summaries under ``kernels``, with the hardware, JAX version and commit of the run;
run it on the device, in the same lease as the profile.)

The CSV holds every SASS instruction of every launch (MBs); ``summarize_source_csv`` keeps per launch the
stall reasons' shares, ``dump_isa.wgmma_waits`` (HGMMAs, ``WARPGROUP.DEPBAR``s and the HGMMA pairs with a
wait between: one per pair means ptxas serialised the wgmmas) and the instructions with the most samples,
each with the one before it (a ``@!P1 BRA`` after a ``SYNCS...TRYWAIT`` is a wait on an mbarrier).
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import os

import jax
import jax.numpy as jnp

D, F, TOPK = 7168, 2048, 8
MOE_CASES = (  # (tokens per tile N, probe, operand values)
    (8, "", "random"), (16, "", "random"), (32, "", "random"), (32, "", "zero_weights"),
    (16, "stream_only", "random"), (16, "no_weight_load", "random"), (32, "no_weight_load", "random"))
ATT_CASES = ((1, 8, 16, 8192), (1, 8, 1, 65536), (8, 8, 1, 65536), (4, 8, 16, 8192), (8, 8, 16, 8192))  # T,H,B,P


def moe_cases(n_experts: int):
    """(name, thunk) per ``MOE_CASES`` entry: the gate+up GEMM over n_experts tiles."""
    from experiments.probe_moe_mgpu import ZERO_WORD, random_fragments
    from pallas_kernels import int4_moe_mgpu as K

    w, s = random_fragments(jax.random.key(0), n_experts, 2 * F, D)
    te = jnp.arange(n_experts, dtype=jnp.int32)
    cases = []
    for n, probe, data in MOE_CASES:
        x = jax.random.normal(jax.random.key(n), (n_experts * n, D), jnp.float32).astype(jnp.bfloat16)
        xg = K.to_chunks(x, 128)
        wd = jnp.full_like(w, ZERO_WORD) if data == "zero_weights" else w
        fn = jax.jit(functools.partial(K.grouped_int4_matmul, tokens_per_tile=n, mma_in_flight=0, probe=probe,
                                       out_layout="tokens", epilogue="silu_mul"))
        cases.append((f"moe_gate_up_n{n}_{probe or 'full'}_{data}", functools.partial(fn, xg, wd, s, te)))
    return cases


def layer_m1_case(n_experts: int):
    """The routed experts of one layer at M = 1 over n_experts random experts (8 of them busy)."""
    from experiments.bench_moe import random_weights, routing
    from pallas_kernels.int4_moe_mgpu import routed_experts_tiled
    from pallas_kernels.int4_tiles import TiledInt4

    ct = random_weights(jax.random.key(1), e=n_experts).to_compressed_tensors()
    w13 = TiledInt4.from_compressed_tensors(ct[0], ct[1], pair_gate_up=True)
    w2 = TiledInt4.from_compressed_tensors(ct[2], ct[3])
    ids, wts = routing(1, "uniform", seed=1, e=n_experts)
    x = jax.random.normal(jax.random.key(2), (1, D), jnp.float32).astype(jnp.bfloat16)
    fn = jax.jit(functools.partial(routed_experts_tiled, use_kernel=True))
    return [("layer_m1_gate_up+down", functools.partial(fn, x, ids, wts, w13, w2))]


def attention_cases(points=ATT_CASES, kernels=("mgpu",)):
    """(name, thunk) per (T, H, B, P) point and ``bench_tree_attention`` --kernel entry (``kernel_fn``);
    the name carries the entry where it is not the default ``mgpu``."""
    from experiments.bench_tree_attention import L, SCALE, kernel_fn, make_inputs

    cases = []
    for t, h, b, p in points:
        q, caches, plen, tkv, mask = make_inputs(jax.random.key(t * 7 + b), h, b, t, p, 1)
        for kernel in kernels:
            fn = jax.jit(functools.partial(kernel_fn(kernel), scale=SCALE, kv_lora_rank=L))
            tag = "" if kernel == "mgpu" else f"_{kernel}"
            cases.append((f"att_t{t}_h{h}_b{b}_p{p}{tag}", functools.partial(fn, q, caches[0], plen, tkv, mask)))
    return cases


def parse_ncu_csv(text: str) -> list[dict]:
    """An ncu CSV log -> one dict per launch: {"id", "kernel", metric name: value (float where numeric)}.
    Takes ``--page details`` (one row per metric: "Metric Name", "Metric Value") or ``--page raw`` (one
    row per launch, a column per metric, a row of units under the header). Lines before the CSV header
    (ncu's messages, the program's output) are skipped."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError('no ncu CSV header (a line starting with "ID") in the log')
    rows = list(csv.DictReader(io.StringIO("\n".join(ln for ln in lines[start:] if ln.startswith('"')))))

    def number(value: str):
        try:
            return float(value.replace(",", ""))
        except ValueError:
            return value

    launches: dict[str, dict] = {}
    details = rows and "Metric Name" in rows[0]
    for row in rows:
        if not row["ID"].strip().isdigit():  # raw page: the units row
            continue
        rec = launches.setdefault(row["ID"], {"id": int(row["ID"]), "kernel": row.get("Kernel Name", "")})
        if details:
            rec[row["Metric Name"]] = number(row.get("Metric Value", ""))
        else:
            rec.update({k: number(v) for k, v in row.items() if k not in ("ID", "Kernel Name")})
    return sorted(launches.values(), key=lambda r: r["id"])


def summarize_source_csv(text: str, top: int = 8) -> list[dict]:
    """``ncu --page source --csv --print-source sass`` output -> one summary per launch (module docstring)."""
    from experiments.dump_isa import wgmma_waits

    launches, cur = [], None
    for row in csv.reader(io.StringIO(text)):
        if row and row[0] == "Kernel Name":
            cur = {"kernel": row[1] if len(row) > 1 else "", "header": None, "rows": []}
            launches.append(cur)
        elif cur is not None and row and row[0] == "Address":
            cur["header"] = row
        elif cur is not None and cur["header"] and len(row) == len(cur["header"]):
            cur["rows"].append(dict(zip(cur["header"], row)))
    if not launches:
        raise ValueError('no "Kernel Name" line: not the CSV of ncu --page source')
    summaries = []
    for launch in launches:
        rows, header = launch["rows"], launch["header"] or []
        count = lambda r, key: int(float(r.get(key) or 0))  # noqa: E731
        samples = [count(r, "Warp Stall Sampling (All Samples)") for r in rows]
        total = max(1, sum(samples))
        reasons = {h[len("stall_"):]: sum(count(r, h) for r in rows) for h in header
                   if h.startswith("stall_") and "Not Issued" not in h}
        order = sorted(range(len(rows)), key=lambda i: -samples[i])[:top]
        summaries.append({
            "kernel": launch["kernel"], "samples": sum(samples), "sass_instructions": len(rows),
            **wgmma_waits([r["Source"] for r in rows]),
            "stall_share_pct": {k: round(100 * v / total, 1)
                                for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]) if v},
            "top_instructions": [{"sass": rows[i]["Source"].strip(),
                                  "after": rows[i - 1]["Source"].strip() if i else "",
                                  "share_pct": round(100 * samples[i] / total, 1),
                                  "executed": count(rows[i], "Instructions Executed")} for i in order]})
    return summaries


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", default="moe,layer_m1,attention")
    ap.add_argument("--moe-experts", type=int, default=128,
                    help="experts (tiles) in the moe_* cases: fewer than 384 keeps ncu's memory save/restore small")
    ap.add_argument("--out", default=None, help="writes ncu_cases.json (the case order) here")
    ap.add_argument("--summarize-source", default=None, metavar="CSV",
                    help="only summarise this ncu --page source CSV (to --out/ncu_source.json and stdout)")
    ap.add_argument("--commit", default=None, help="code commit to record (the device copy of the tree has no .git)")
    ap.add_argument("--att-points", default=None, metavar="T,H,B,P;...",
                    help="the attention cases' points (default ATT_CASES)")
    ap.add_argument("--att-kernels", default="mgpu",
                    help="comma-separated bench_tree_attention --kernel entries, each run at every attention point: "
                         "mgpu,mgpu_wide:kernel.stages=3")
    args = ap.parse_args(argv)
    if args.summarize_source:
        with open(args.summarize_source) as fh:
            summary = summarize_source_csv(fh.read())
        if args.out:
            from experiments.bench_util import write_result
            write_result("ncu_source", {"code_commit": args.commit, "kernels": summary}, out_dir=args.out)
        print(json.dumps(summary, indent=1))
        return
    what = set(args.what.split(","))
    unknown = what - {"moe", "layer_m1", "attention"}
    if unknown:
        raise SystemExit(f"--what: unknown {sorted(unknown)}")
    cases = []
    if "moe" in what:
        cases += moe_cases(args.moe_experts)
    if "layer_m1" in what:
        cases += layer_m1_case(64)
    if "attention" in what:
        from experiments.bench_tree_attention import kernel_fn
        from experiments.bench_util import int_points
        try:
            points = int_points(args.att_points, 4) if args.att_points else ATT_CASES
            for kernel in args.att_kernels.split(","):
                kernel_fn(kernel)
        except ValueError as e:
            ap.error(f"--att-points / --att-kernels: {e}")
        cases += attention_cases(points, args.att_kernels.split(","))
    order = []
    for name, thunk in cases:
        jax.block_until_ready(thunk())
        order.append(name)
        print(f"case {len(order) - 1}: {name}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ncu_cases.json"), "w") as fh:
            json.dump(dict(jax=jax.__version__, devices=[str(d) for d in jax.devices()], cases=order), fh, indent=1)


if __name__ == "__main__":
    main()
