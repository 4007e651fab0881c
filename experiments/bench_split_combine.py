"""The split merge alone (``pallas_kernels.split_combine.combine_splits``) at the partial shapes the attention op
hands it, for A/Bs of its tiling: device time per call from a profiler trace, the bytes it moves and GB/s.

    PYTHONPATH=. python experiments/bench_split_combine.py --out DIR \\
        --variants '[{}, {"num_warps": 4}, {"block_cols": 128}]'

A point is T nodes x H heads, B streams, prefix P (cache capacity S = P, as in ``bench_tree_attention``):
its split count is ``splits_for`` (the op's default) and its rows those the attention kernel writes (the
real rows up to 63, one tile and a tail at 72, else whole 64-row tiles). The partials are random, with
some empty splits, L = 512, bf16; LSEs f32. Every variant's output is checked against the twin
(``combine_splits_ref``). In the op the partials were just written by the attention kernel, so they sit in
L2; here the chain reads the same partials every call, so they do too (8.4 MB at most, L2 is 50 MB).
On a CPU (``--smoke``) the points shrink and the kernel runs in interpret mode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments import bench_util  # noqa: E402
from pallas_kernels.mla_attention_plan import ROWS, splits_for, tail_rows_of, valid_rows_for  # noqa: E402
from pallas_kernels.split_combine import combine_splits, combine_splits_ref  # noqa: E402

L = 512
# (T, H, B, P): the op's memory-bound points under 80 % and the compute-bound one with the largest merge
POINTS = [(1, 8, 1, 65536), (4, 8, 1, 65536), (8, 8, 1, 65536), (9, 8, 1, 65536), (1, 64, 1, 65536),
          (1, 8, 16, 8192), (4, 8, 16, 8192), (8, 8, 16, 8192), (9, 8, 16, 8192), (256, 8, 1, 1024)]
SMOKE_POINTS = [(1, 8, 1, 2048), (9, 8, 2, 512)]


def partial_rows(T: int, H: int) -> int:
    """Rows of the partials the attention kernel writes for T x H query rows (``tree_attention_mgpu``)."""
    n = T * H
    if valid_rows_for(T, H) is not None or tail_rows_of(n):
        return n
    return -(-n // ROWS) * ROWS


def make_parts(seed: int, NS: int, B: int, V: int):
    rng = np.random.default_rng(seed)
    lse = (rng.standard_normal((NS, B, V)) * 3).astype(np.float32)
    lse[rng.random((NS, B, V)) < 0.05] = -np.inf  # an empty split here and there, as at a short prefix
    o = rng.standard_normal((NS, B, V, L)).astype(np.float32)
    o[np.isneginf(lse)] = 0.0
    return jnp.asarray(lse), jnp.asarray(o, jnp.bfloat16)


def bench_variant(lse, o, variant: dict, interpret: bool) -> dict:
    def merge(lse_parts, o_parts):
        out, tot = combine_splits(o_parts, lse_parts, interpret=interpret, **variant)
        return out

    out = jax.jit(merge)(lse, o)
    ref, _ = combine_splits_ref(o, lse)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    # interpret mode (--smoke, also on a GPU) has no kernel of that name: time the whole chain
    on_gpu = jax.default_backend() == "gpu" and not interpret
    t = bench_util.traced_call_time(merge, (lse, o), calls=8,
                                    op_kernels=(lambda name: "combine" in name) if on_gpu else None)
    return dict(us=t.get("op_span_s", t["busy_s"]) * 1e6, op_spans_us=t.get("op_spans_us"),
                max_abs_err=err)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="bench_split_combine")
    ap.add_argument("--variants", default="[{}]", help="JSON list of keyword dicts for combine_splits")
    ap.add_argument("--points", default=None, help="'T,H,B,P;...' (default: the op's points under its goal)")
    ap.add_argument("--commit", default=None, help="code commit to record (the device copy has no .git)")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny points, interpret mode")
    args = ap.parse_args()
    variants = json.loads(args.variants)
    if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
        ap.error(f"--variants must be a JSON list of dicts, got {args.variants!r}")
    try:
        points = bench_util.int_points(args.points, 4) if args.points else (SMOKE_POINTS if args.smoke else POINTS)
    except ValueError:
        ap.error(f"--points takes integers 'T,H,B,P;...', got {args.points!r}")
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    # the floors' yardstick: PyTorch's device copy, else (no PyTorch / CUDA, or --smoke) XLA's a+1 copy
    tbw = None if args.smoke else bench_util.measure_torch_copy_bandwidth()
    bw = tbw or bench_util.measure_copy_bandwidth(1 << 24 if args.smoke else 1 << 30)
    bw_source = "torch copy" if tbw else "XLA a+1 copy"
    rows = []
    for T, H, B, P in points:
        NS, V = splits_for(B, T, H, P), partial_rows(T, H)
        if NS < 2:
            print(f"T={T} H={H} B={B} P={P}: one split, no merge", flush=True)
            continue
        lse, o = make_parts(T * 1000 + B, NS, B, V)
        nbytes = o.size * 2 + lse.size * 4 + B * V * (L * 2 + 4)
        for variant in variants:
            t0 = time.time()
            try:
                r = bench_variant(lse, o, variant, interpret=args.smoke)
            except Exception as e:  # noqa: BLE001 - record and go on
                r = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            row = dict(T=T, H=H, B=B, P=P, NS=NS, V=V, bytes=nbytes, variant=json.dumps(variant), **r,
                       wall_s=round(time.time() - t0, 1))
            if "us" in row:
                row["GBps"] = nbytes / row["us"] / 1e3
                row["floor_us"] = nbytes / bw * 1e6
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "op_spans_us"}), flush=True)
            bench_util.write_result(args.name, dict(copy_bw_Bps=bw, copy_bw_source=bw_source, L=L,
                                                    code_commit=args.commit, rows=rows),
                                    out_dir=args.out)
    bench_util.print_table(rows, ["T", "H", "B", "P", "NS", "V", "variant", "us", "floor_us", "GBps", "max_abs_err"])


if __name__ == "__main__":
    main()
