"""Where a narrow attention kernel's programs spend their time, from Mosaic GPU's on-device profiler.

``split_attention_narrow(..., profile_dir=D, profile_regions=R)`` records named regions per warpgroup (the
consumer's ``q_wait``; per key block ``k_wait``, ``scores``, ``softmax``, ``pv``; then ``epilogue``; the
producer's ``slot_wait``) and writes a Chrome trace per call. This script runs the kernel at each point (T, H,
B, P: random inputs, the prefix P long in a cache of P slots, the tree latents padded as the model hands them
over, the default split count), keeps the last call's trace and condenses it per program:

* ``sm``: the SM it ran on; ``start_us``: its start (globaltimer) after the kernel's first program;
* ``fill_us``: from its start to the end of its first ``k_wait`` (the query and first key block's copies);
* per block after the first (medians over the program's blocks): ``k_wait``, ``scores``, ``softmax``, ``pv``,
  and ``block`` (one iteration);
* ``epilogue_us`` and its parts (``normalize``, ``store_smem``, ``store_gmem``); ``end_us`` = start + the
  consumer's last event (clock cycles at ``--clock-ghz``);
* the producer's ``slot_wait`` total.

The table gives, over programs, the median (and max where it sets the kernel's end). Region times are SM clock
cycles converted at ``--clock-ghz``; a program's start is the globaltimer (ns), so start skew is exact while
durations depend on the clock assumed.

    PYTHONPATH=. python experiments/profile_narrow_timeline.py --points "1,8,16,8192;4,8,16,8192" --out DIR
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp

from experiments import bench_util
from experiments.bench_tree_attention import C, L, SCALE, make_inputs
from pallas_kernels import mla_attention_mgpu as M
from pallas_kernels.mla_attention_narrow import split_attention_narrow

BLOCK_REGIONS = ("k_wait", "scores", "softmax", "pv")
EPILOGUE_PARTS = ("normalize", "store_smem", "store_gmem")


def regions_of(events: list[dict]) -> list[tuple[str, float, float]]:
    """One trace's B/E events -> (name, begin_ts, end_ts) in order of their begin (ts in the dump's units)."""
    open_, out = {}, []
    for ev in events:
        if ev["ph"] == "B":
            open_.setdefault(ev["name"], []).append(ev["ts"])
        else:
            out.append((ev["name"], open_[ev["name"]].pop(), ev["ts"]))
    return sorted(out, key=lambda r: r[1])


def program_timelines(trace: dict, clock_ghz: float, traces_per_program: int = 2) -> list[dict]:
    """Per program (consumer and producer warpgroups), the figures of the module docstring, in µs.

    The dump's ts is (globaltimer ns at the warpgroup's start + clock cycles since its first event) / 1e3."""
    by_tid: dict[int, list] = {}
    sm_of: dict[int, int] = {}
    for ev in trace["traceEvents"]:
        by_tid.setdefault(ev["tid"], []).append(ev)
        sm_of[(ev["tid"] - 1) // traces_per_program] = ev["pid"] - 1  # the dump's pid is 1 + the SM's id
    programs: dict[int, dict] = {}
    for tid, events in by_tid.items():
        program, wg = divmod(tid - 1, traces_per_program)
        programs.setdefault(program, {})[wg] = regions_of(events)
    out = []
    for program, wgs in sorted(programs.items()):
        cons, prod = wgs.get(0, []), wgs.get(1, [])
        if not cons:
            continue
        t0 = cons[0][1]  # start_ns / 1e3: the first event is at cycle 0
        us = lambda ts: (ts - t0) / clock_ghz  # noqa: E731 - (ts - t0) * 1e3 cycles since the first event -> µs
        blocks = [r for r in cons if r[0] in BLOCK_REGIONS]
        per_block = {name: [us(e) - us(b) for n, b, e in blocks if n == name] for name in BLOCK_REGIONS}
        k_waits = [(b, e) for n, b, e in blocks if n == "k_wait"]
        iters = [us(k_waits[i + 1][0]) - us(k_waits[i][0]) for i in range(len(k_waits) - 1)]
        epi = [(b, e) for n, b, e in cons if n == "epilogue"]
        parts = {n: us(e) - us(b) for n, b, e in cons if n in EPILOGUE_PARTS}
        rec = {"program": program, "sm": sm_of[program], "start_ns": t0 * 1e3, "blocks": len(k_waits),
               "fill_us": us(k_waits[0][1]) if k_waits else None,
               "epilogue_us": (us(epi[0][1]) - us(epi[0][0])) if epi else None,
               "busy_us": us(cons[-1][2]),
               "slot_wait_us": sum(us(e) - us(b) for n, b, e in prod if n == "slot_wait") if prod else 0.0,
               "block_us": statistics.median(iters[1:]) if len(iters) > 1 else None,
               **{f"{n}_us": parts.get(n) for n in EPILOGUE_PARTS}}
        for name, vals in per_block.items():
            rec[f"{name}_us"] = statistics.median(vals[1:]) if len(vals) > 1 else (vals[0] if vals else None)
        out.append(rec)
    first = min(r["start_ns"] for r in out)
    for r in out:
        r["start_us"] = (r["start_ns"] - first) / 1e3
        r["end_us"] = r["start_us"] + r["busy_us"]
    return out


def summarize(programs: list[dict]) -> dict:
    def med(key):
        vals = [r[key] for r in programs if r.get(key) is not None]
        return statistics.median(vals) if vals else None
    keys = ["start_us", "fill_us", "block_us", *(f"{n}_us" for n in BLOCK_REGIONS), "epilogue_us",
            *(f"{n}_us" for n in EPILOGUE_PARTS), "busy_us",
            "end_us", "slot_wait_us", "blocks"]
    row = {k: med(k) for k in keys}
    row.update(programs=len(programs), max_start_us=max(r["start_us"] for r in programs),
               max_end_us=max(r["end_us"] for r in programs), max_blocks=max(r["blocks"] for r in programs))
    return row


def run_point(T: int, H: int, B: int, P: int, clock_ghz: float, calls: int = 3, **kernel_kw) -> dict:
    q, caches, plen, tkv, mask = make_inputs(jax.random.key(0), H, B, T, P, 1, padded_tree=True)
    V = T * H
    qr = q.reshape(B, V, C)
    keys, bits = M.tree_inputs(tkv, mask, H, V, 64)
    NS = M.splits_for(B, T, H, P)
    blocks = -(-(P // 64 + keys.shape[1] // 64) // NS) + 1
    with tempfile.TemporaryDirectory() as d:
        f = jax.jit(functools.partial(split_attention_narrow, scale=SCALE, kv_lora_rank=L, num_splits=NS,
                                      valid_rows=V, profile_dir=d, profile_regions=8 + 4 * blocks, **kernel_kw))
        for _ in range(calls):
            jax.block_until_ready(f(qr, caches[0], plen, keys, bits))
        files = sorted(glob.glob(os.path.join(d, "*.json")), key=os.path.getmtime)
        if not files:
            raise RuntimeError("the profiler wrote no trace")
        with open(files[-1]) as fh:
            trace = json.load(fh)
    programs = program_timelines(trace, clock_ghz)
    return dict(T=T, H=H, B=B, P=P, V=V, num_splits=NS, kernel_kw=kernel_kw, **summarize(programs),
                per_program=programs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="1,8,16,8192;4,8,16,8192;1,8,1,65536;4,8,1,65536",
                    help="'T,H,B,P;...'")
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock assumed for region durations")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="profile_narrow_timeline")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--variants", default="{}",
                    help="JSON list of split_attention_narrow keyword dicts to run at every point (A/B in one run)")
    args = ap.parse_args(argv)
    points = [tuple(int(v) for v in p.split(",")) for p in args.points.split(";")]
    if any(len(p) != 4 for p in points):
        ap.error(f"--points takes 'T,H,B,P;...', got {args.points!r}")
    if jax.default_backend() != "gpu":
        ap.error("the profiler runs inside the Mosaic GPU kernel: a Hopper GPU is needed")
    variants = json.loads(args.variants)
    variants = variants if isinstance(variants, list) else [variants]
    rows = [run_point(*p, clock_ghz=args.clock_ghz, **kw) for p in points for kw in variants]
    for r in rows:
        r["variant"] = json.dumps(r["kernel_kw"], sort_keys=True).replace(" ", "").replace('"', "")
    bench_util.write_result(args.name, dict(clock_ghz=args.clock_ghz, code_commit=args.commit, rows=rows),
                            out_dir=args.out)
    bench_util.print_table(rows, ["variant", "T", "H", "B", "P", "num_splits", "programs", "max_blocks", "max_start_us",
                                  "fill_us", "block_us", "k_wait_us", "scores_us", "softmax_us", "pv_us",
                                  "epilogue_us", "normalize_us", "store_smem_us", "store_gmem_us", "slot_wait_us",
                                  "end_us", "max_end_us"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
