"""What single-purpose XLA kernels reach at the sizes of issue #6's points (the size ceiling of each point).

The issue asks the tree-verify attention for >= 80 % of the copy's bandwidth where it is memory-bound and
>= 50 % of the bf16 peak where it is compute-bound, at every point of its grid. This benchmark asks how much of
either a kernel that does nothing else gets at each point's own size:

* ``read``: the B cache prefixes the op reads (B x P x C bf16, nearly all of the point's bytes), masked by the
  prefix lengths and summed in f32, as XLA fuses it (over the keys and columns: the faster of the two sums
  tried in session 37, by 1-1.3 µs at 1K-8K). ``read_pct_bw``: its bytes over its time, in % of the copy
  (PyTorch's, measured in the same run, as ``bench_tree_attention`` quotes).
* ``gemm``: the attention's two products as XLA runs them on cuBLAS, without the softmax: scores = q . k^T
  over the B prefixes into bf16 [B, T*H, P], then scores . k over all C columns (the op's value product reads
  the first L = 512; this one C = 576, and its FLOPs count them). Only where the scores fit in 2 GiB (the
  grid's largest points are far from their goals' edge). ``gemm_pct_peak``: its FLOPs over its time, in % of
  the bf16 peak measured in the same run.

A point's ``ceiling_pct`` is the read's % where the op is memory-bound, the products' % where compute-bound.
Where it falls short of the goal, no kernel of that kind reaches the goal at that size on this GPU, and
neither would the op, which does both in one launch and merges its splits in a second one. These are
ceilings, not bounds: a fused kernel can overlap the read with the products, and a different reduction could
read faster than XLA's, so a point with a ceiling below the goal shows the goal is beyond what the
GPU's own libraries reach there, not that it is impossible.

Timing: a chain of 8 calls, each one's prefix lengths depending on the last one's output (``bench_tree_attention``'s
``chained``), rotating over its cache copies (at B·P <= 6.8K the 8 copies read fit the L2: ``chain_cache_bytes``);
from the profiler's trace, per call, the summed durations of the op's own kernels (reductions for the read;
cuBLAS's and XLA's GEMM kernels for the products, without the casts and masks between them): gaps and glue
left out, so the ceilings lean high. Every kernel the chain ran is recorded per row.

``--against JSON...`` takes the op's grid results (``bench_tree_attention --points issue``) and prints each
point's op % beside its ceiling and what holds it below the goal: ``size`` where the ceiling does,
``kernel`` where only the op does.

    PYTHONPATH=. python experiments/bench_attention_ceiling.py --out $OUT --against \\
        experiments/results/bench_tree_attention_s36_issue_h8.json \\
        experiments/results/bench_tree_attention_s36_issue_rest.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments import bench_util  # noqa: E402
from experiments.bench_tree_attention import (C, GOALS, ISSUE_GRID, chained, floor_share,  # noqa: E402
                                              next_point_fits, point_inputs, render_goal_map, roofline, rows_of)

GEMM_SCORES_LIMIT = 2 << 30  # bytes of bf16 scores
SMOKE_POINTS = [(8, 1, 1, 256), (8, 2, 8, 128)]
OP_KERNELS = {"read": re.compile("reduce", re.I),
              "gemm": re.compile("gemm|xmma|cutlass|nvjet|cublas|dot|matmul|sm90", re.I)}


def read_prefixes(q, cache, plen, tkv, mask):
    """Each of the B prefixes summed over its keys and columns in f32: [B, 1, 1, 1]."""
    del q, tkv, mask
    keep = jnp.arange(cache.shape[1])[None, :, None] < plen[:, None, None]
    return jnp.where(keep, cache, 0).astype(jnp.float32).sum(axis=(1, 2))[:, None, None, None]


def gemm_pair(q, cache, plen, tkv, mask):
    """q . k^T into bf16 scores, then scores . k over all C columns: [B, T, H, C] bf16 (no softmax; the
    prefix lengths mask the scores' keys)."""
    del tkv, mask
    B, T, H, _ = q.shape
    q = bench_util.tie_to(q, plen)  # else XLA computes the chain's equal q . k^T once per cache copy, not per call
    s = jnp.einsum("bnc,bkc->bnk", q.reshape(B, T * H, C), cache, preferred_element_type=jnp.float32)
    s = jnp.where(jnp.arange(cache.shape[1])[None, None, :] < plen[:, None, None], s, 0.0).astype(q.dtype)
    o = jnp.einsum("bnk,bkc->bnc", s, cache, preferred_element_type=jnp.float32)
    return o.astype(q.dtype).reshape(B, T, H, C)


def op_seconds(totals, kind: str) -> float | None:
    """The summed seconds per call of the kernels ``OP_KERNELS[kind]`` names, of ``bench_util.kernel_totals``'
    [name, launches, seconds] per call; None where none is named."""
    picked = [t for n, _, t in totals if OP_KERNELS[kind].search(n)]
    return sum(picked) if picked else None


def op_time(fn, inputs, kind: str, calls: int = 8) -> dict:
    """{"ms": the op's device time per call, "timed": how, "kernels": [name, launches, µs] per call of everything
    the chain ran}, from one profiler trace: the summed durations of the kernels whose names ``OP_KERNELS[kind]``
    matches, over the calls (XLA fuses the chain's first call apart from the others, so the kernels differ from
    call to call; the gaps between kernels and the chain's tie are left out); on a CPU host (smoke) or where no
    name matches, the chain's span per call."""
    q, caches, plen, tkv, mask = inputs
    events = bench_util.trace_kernel_events(chained(jax.jit(fn), calls), (q, caches, plen, tkv, mask))
    totals = bench_util.kernel_totals(bench_util.launches_by_name(events), calls)
    op_s = op_seconds(totals, kind)
    if op_s is not None and jax.default_backend() == "gpu":
        ms, how = op_s * 1e3, "op kernels"
    else:
        ms, how = (events[-1][1] + events[-1][2] - events[0][1]) / calls / 1e6, "chain span"
    return dict(ms=ms, timed=how, kernels=[[n, k, round(t * 1e6, 2)] for n, k, t in totals])


def ceiling_point(H, B, T, P, bw, peak) -> dict:
    """One point's row: the read's and the products' times and shares, and the ceiling of its bound."""
    nbytes, flops, bound, floor_s = roofline(H, B, T, P, bw, peak)
    cache_bytes = 2 * B * P * C
    inputs, copies = point_inputs(H, B, T, P)
    row = dict(H=H, B=B, T=T, P=P, bound=bound, bytes=nbytes, flops=flops, floor_ms=floor_s * 1e3, cache_copies=copies)
    read = op_time(read_prefixes, inputs, "read")
    row.update(read_ms=read["ms"], read_pct_bw=100 * cache_bytes / (read["ms"] / 1e3) / bw, read_timed=read["timed"],
               read_kernels=read["kernels"])
    if 2 * B * T * H * P <= GEMM_SCORES_LIMIT:
        try:
            g = op_time(gemm_pair, inputs, "gemm")
        except Exception as e:  # noqa: BLE001 - the read stands; the row says why the products have no time
            row["gemm_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        else:
            gemm_flops = 2 * B * T * H * P * (C + C)
            row.update(gemm_ms=g["ms"], gemm_flops=gemm_flops, gemm_timed=g["timed"], gemm_kernels=g["kernels"],
                       gemm_pct_peak=100 * gemm_flops / (g["ms"] / 1e3) / peak)
    row["ceiling_pct"] = row["read_pct_bw"] if bound == "memory" else row.get("gemm_pct_peak")
    return row


def op_rows_of(paths, kernel: str = "mgpu") -> list[dict]:
    """The op's grid rows in ``paths`` (``rows_of``: a later file's row replaces an earlier one's) of one kernel
    entry: an A/B file also holds a variant's rows at the same points, which must not stand in for the op's."""
    return [r for r in rows_of(paths) if r.get("kernel") == kernel]


def verdicts(ceilings, op_rows) -> list[dict]:
    """Per point in both: the op's % of its floor (``op_ms``, else ``ms``) beside the ceiling, and ``holds``:
    "met" (the op reaches the goal), "size" (the ceiling is below the goal too), "kernel" (only the op is),
    "?" (no ceiling)."""
    ops = {(r["H"], r["B"], r["T"], r["P"]): r for r in op_rows if "error" not in r and floor_share(r) is not None}
    out = []
    for c in ceilings:
        op = ops.get((c["H"], c["B"], c["T"], c["P"]))
        if op is None or "error" in c:
            continue
        op_pct = floor_share(op)
        goal = GOALS[op["bound"]]
        ceiling = c.get("ceiling_pct")
        holds = "met" if op_pct >= goal else "?" if ceiling is None else "size" if ceiling < goal else "kernel"
        out.append(dict(H=c["H"], B=c["B"], T=c["T"], P=c["P"], bound=op["bound"], op_pct=op_pct, ceiling_pct=ceiling,
                        goal=goal, holds=holds, op_ms=op.get("op_ms", op["ms"]), read_ms=c.get("read_ms"),
                        gemm_ms=c.get("gemm_ms")))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="bench_attention_ceiling")
    ap.add_argument("--points", default=None, help="'H,B,T,P;...' (default: the issue's grid)")
    ap.add_argument("--against", nargs="+", default=None, metavar="JSON",
                    help="the op's grid results: print each point's op %% beside its ceiling (a later file's row "
                         "replaces an earlier one's at the same point)")
    ap.add_argument("--only", nargs="+", default=None, metavar="JSON",
                    help="print --against's comparison from these ceiling results and exit; no device work (a later "
                         "file's row replaces an earlier one's at the same point)")
    ap.add_argument("--op-kernel", default="mgpu",
                    help="--against's kernel entry (bench_tree_attention --kernel): the op's default, 'mgpu'")
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--commit", default=None, help="code commit to record (the device copy has no .git)")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny points, yardsticks assumed")
    args = ap.parse_args()
    op_rows = op_rows_of(args.against or [], args.op_kernel)
    if args.against and not op_rows:
        ap.error(f"--against: no rows of kernel {args.op_kernel!r} in {args.against}")
    rows = []
    if args.only:
        report(rows_of(args.only), op_rows)
        return 0
    try:
        points = bench_util.int_points(args.points, 4) if args.points else SMOKE_POINTS if args.smoke else ISSUE_GRID
    except ValueError:
        ap.error(f"--points takes integers 'H,B,T,P;...', got {args.points!r}")
    if op_rows:  # the points where the op misses its goal first: a run cut short by its budget keeps those
        missed = {(r["H"], r["B"], r["T"], r["P"]) for r in op_rows
                  if "error" not in r and floor_share(r) is not None and floor_share(r) < GOALS[r["bound"]]}
        points = sorted(points, key=lambda pt: pt not in missed)
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    if args.smoke:
        bw, peak = 1e11, 1e12
    else:
        bw = max(bench_util.measure_torch_copy_bandwidth() or 0.0, bench_util.measure_copy_bandwidth())
        peak = max(bench_util.measure_bf16_peak(), bench_util.measure_traced_bf16_peak())
    print(f"copy {bw / 1e12:.2f} TB/s, bf16 peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    t_start = time.time()
    for H, B, T, P in points:
        if not next_point_fits(time.time() - t_start, [r["wall_s"] for r in rows], args.budget_s):
            print("budget reached; skipping the rest", flush=True)
            break
        t0 = time.time()
        try:
            row = ceiling_point(H, B, T, P, bw, peak)
        except Exception as e:  # noqa: BLE001 - record and go on
            row = dict(H=H, B=B, T=T, P=P, error=f"{type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc(limit=2)
        row["wall_s"] = round(time.time() - t0, 1)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("read_kernels", "gemm_kernels")}), flush=True)
        bench_util.write_result(args.name, dict(copy_bw_Bps=bw, bf16_peak_flops=peak, goals=GOALS,
                                                code_commit=args.commit, rows=rows), out_dir=args.out)
    report(rows, op_rows)
    return 0


def report(rows, op_rows):
    good = [r for r in rows if "error" not in r]
    bench_util.print_table(good, ["H", "B", "T", "P", "bound", "floor_ms", "read_ms", "read_pct_bw", "gemm_ms",
                                  "gemm_pct_peak", "ceiling_pct"])
    print()
    print(render_goal_map([dict(r, kernel="size ceiling") for r in good], pct=lambda r: r.get("ceiling_pct")))
    if op_rows:
        v = verdicts(good, op_rows)
        print()
        bench_util.print_table([r for r in v if r["holds"] != "met"],
                               ["H", "B", "T", "P", "bound", "op_ms", "op_pct", "ceiling_pct", "goal", "holds"])
        counts = {k: sum(r["holds"] == k for r in v) for k in ("met", "size", "kernel", "?")}
        print(f"\n{len(v)} points: goal met at {counts['met']}; below it, held by the size at {counts['size']}, by the "
              f"op alone at {counts['kernel']}, no ceiling at {counts['?']}")


if __name__ == "__main__":
    sys.exit(main())
