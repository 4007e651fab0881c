"""Where the attention kernels' programs spend their time, from Mosaic GPU's on-device profiler.

Both Mosaic GPU attention kernels take ``profile_dir`` and ``profile_regions`` and then record named regions per
warpgroup and write a Chrome trace per call: ``split_attention_narrow`` (one consumer: ``q_wait``; per key block
``k_wait``, ``scores``, ``softmax``, ``pv``; then ``epilogue``) and the 64-row ``split_attention`` (consumer 0:
``k_wait``, ``scores``, ``softmax``, ``handoff``, ``pv``; consumer 1: ``k_wait``, with a tail ``tail_scores`` and
``tail_softmax``, then ``p_wait``, ``pv``; then each ``epilogue``, of ``store_smem`` and ``store_gmem`` after the
wait for the other consumer); the producer's ``slot_wait``. A kernel's ``profile_names`` keeps only those regions
(``--variants``), so that a 64-row program's many blocks fit its shared memory. This script runs
``tree_attention_mgpu`` at each point (T, H, B, P: random inputs, the prefix P long in a cache of P slots, the
tree latents padded as the model hands them over, the default kernel and split count), keeps the last call's
trace and condenses it per program:

* ``sm``: the SM it ran on; ``start_us``: its start (globaltimer) after the kernel's first program;
* ``fill_us``: from its start to the end of consumer 0's first ``k_wait`` (the query and first key block's copies);
* per block after the first (medians over the program's blocks), each region of consumer 0 (``scores_us``...)
  and of consumer 1 (``c1_pv_us``...), and ``block`` (one iteration of consumer 0); ``iterations_us``, each of
  consumer 0's iterations (k_wait to k_wait), and ``loop_us``, from the end of its first ``k_wait`` to its
  epilogue;
* once a program: ``Init`` (Mosaic GPU's barrier set-up), ``q_wait``, ``epilogue`` and its parts (``normalize``,
  ``store_smem``, ``store_gmem``), where recorded; ``end_us`` = start + the last event of any consumer (clock
  cycles at ``--clock-ghz``);
* the producer's ``slot_wait`` total.

The table gives, over programs, the median (and max where it sets the kernel's end). Region times are SM clock
cycles converted at ``--clock-ghz``; a program's start is the globaltimer (ns), so start skew is exact while
durations depend on the clock assumed.

    PYTHONPATH=. python experiments/profile_timeline.py --points "1,8,16,8192;9,8,16,8192" --out DIR
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

from experiments import bench_util
from experiments.bench_tree_attention import L, SCALE, make_inputs
from pallas_kernels import mla_attention_mgpu as M
from pallas_kernels.mgpu_attention_parts import PROFILE_REGIONS
from pallas_kernels.mla_attention_narrow import NARROW_MAX_ROWS, split_attention_narrow

EPILOGUE_PARTS = ("normalize", "store_smem", "store_gmem")
PEER_MERGE_PARTS = ("peer_wait", "peer_lse", "peer_copy", "merge")  # split 1's merge with split 0 (peer_merge)
ONCE_PER_PROGRAM = ("Init", "q_wait", "epilogue", *EPILOGUE_PARTS, *PEER_MERGE_PARTS)  # "Init": Mosaic GPU's own
PER_BLOCK = (("k_wait", "scores", "softmax", "handoff", "pv"),  # each warpgroup's regions per key block: consumer 0,
             ("k_wait", "tail_scores", "tail_softmax", "p_wait", "pv"),  # consumer 1 of the 64-row kernel,
             ("slot_wait",))  # the producer


def regions_of(events: list[dict]) -> list[tuple[str, float, float]]:
    """One trace's B/E events -> (name, begin_ts, end_ts) in order of their begin (ts in the dump's units)."""
    open_, out = {}, []
    for ev in events:
        if ev["ph"] == "B":
            open_.setdefault(ev["name"], []).append(ev["ts"])
        else:
            out.append((ev["name"], open_[ev["name"]].pop(), ev["ts"]))
    return sorted(out, key=lambda r: r[1])


def program_timelines(trace: dict, clock_ghz: float, warpgroups: int = 2) -> list[dict]:
    """Per program (``warpgroups`` traces: the consumers, then the producer), the figures of the module
    docstring, in µs. Consumer 0's regions are named as recorded (``scores_us``), consumer c's prefixed
    (``c1_scores_us``).

    The dump's ts is (globaltimer ns at the warpgroup's start + clock cycles since its first event) / 1e3."""
    by_tid: dict[int, list] = {}
    sm_of: dict[int, int] = {}
    for ev in trace["traceEvents"]:
        by_tid.setdefault(ev["tid"], []).append(ev)
        sm_of[(ev["tid"] - 1) // warpgroups] = ev["pid"] - 1  # the dump's pid is 1 + the SM's id
    programs: dict[int, dict] = {}
    for tid, events in by_tid.items():
        program, wg = divmod(tid - 1, warpgroups)
        programs.setdefault(program, {})[wg] = regions_of(events)
    out = []
    for program, wgs in sorted(programs.items()):
        consumers = [wgs.get(c, []) for c in range(warpgroups - 1)]
        prod = wgs.get(warpgroups - 1, [])
        if not consumers[0]:
            continue
        t0 = min(cons[0][1] for cons in consumers if cons)  # start_ns / 1e3: the first event is at cycle 0
        us = lambda ts: (ts - t0) / clock_ghz  # noqa: E731 - (ts - t0) * 1e3 cycles since the first event -> µs
        rec = {"program": program, "sm": sm_of[program], "start_ns": t0 * 1e3,
               "busy_us": max(us(cons[-1][2]) for cons in consumers if cons),
               "slot_wait_us": sum(us(e) - us(b) for n, b, e in prod if n == "slot_wait") if prod else 0.0}
        for c, cons in enumerate(consumers):
            prefix = f"c{c}_" if c else ""
            blocks = [r for r in cons if r[0] not in ONCE_PER_PROGRAM]
            for name in dict.fromkeys(n for n, _, _ in blocks):
                vals = [us(e) - us(b) for n, b, e in blocks if n == name]
                rec[f"{prefix}{name}_us"] = statistics.median(vals[1:]) if len(vals) > 1 else vals[0]
            once = {}
            for n, b, e in cons:
                if n in ONCE_PER_PROGRAM:
                    once.setdefault(n, (b, e))
            rec[f"{prefix}epilogue_us"] = None
            rec.update({f"{prefix}{n}_us": us(e) - us(b) for n, (b, e) in once.items()})
            epi = once.get("epilogue")
            if c == 0:
                k_waits = [(b, e) for n, b, e in blocks if n == "k_wait"]
                iters = [us(k_waits[i + 1][0]) - us(k_waits[i][0]) for i in range(len(k_waits) - 1)]
                rec.update(blocks=len(k_waits), fill_us=us(k_waits[0][1]) if k_waits else None,
                           block_us=statistics.median(iters[1:]) if len(iters) > 1 else None,
                           loop_us=(us(epi[0]) - us(k_waits[0][1])) if epi and k_waits else None,
                           iterations_us=[round(v, 4) for v in iters])
        out.append(rec)
    first = min(r["start_ns"] for r in out)
    for r in out:
        r["start_us"] = (r["start_ns"] - first) / 1e3
        r["end_us"] = r["start_us"] + r["busy_us"]
    return out


def summarize(programs: list[dict]) -> dict:
    """Over programs: the median of every figure, and the max of the start, end and block count."""
    keys = list(dict.fromkeys(k for r in programs for k, v in r.items()
                              if (k.endswith("_us") or k == "blocks") and not isinstance(v, list)))
    row = {}
    for k in keys:
        vals = [r[k] for r in programs if r.get(k) is not None]
        row[k] = statistics.median(vals) if vals else None
    row.update(programs=len(programs), max_start_us=max(r["start_us"] for r in programs),
               max_end_us=max(r["end_us"] for r in programs), max_blocks=max(r["blocks"] for r in programs))
    return row


def regions_needed(names, blocks: int) -> int:
    """The profiler's regions a warpgroup records over ``blocks`` key blocks when the kernel records ``names``
    (None: all): one for the trace's header (3 of a region's 4 words: start time, SM, count), Mosaic GPU's
    ``Init``, each once-a-program region, and per block the most any one warpgroup records. (Without the header's
    share a run that records only once-a-program regions overflows: "Insufficient space to capture a full trace",
    session 41.)"""
    names = set(PROFILE_REGIONS if names is None else names)
    per_block = max(len(names & set(wg)) for wg in PER_BLOCK)
    return 2 + len(names & set(ONCE_PER_PROGRAM)) + per_block * blocks


def run_point(T: int, H: int, B: int, P: int, clock_ghz: float, calls: int = 3, **kernel_kw) -> dict:
    """Profile ``tree_attention_mgpu`` at one point, its kernel (narrow where T*H <= NARROW_MAX_ROWS, else the
    64-row one) taking ``kernel_kw``."""
    q, caches, plen, tkv, mask = make_inputs(jax.random.key(0), H, B, T, P, 1, padded_tree=True)
    narrow = T * H <= NARROW_MAX_ROWS
    NS = M.splits_for(B, T, H, P)
    blocks = -(-(P // 64 + tkv.shape[1] // 64) // NS) + 1
    with tempfile.TemporaryDirectory() as d:
        kernel = functools.partial(split_attention_narrow if narrow else M.split_attention, profile_dir=d,
                                   profile_regions=regions_needed(kernel_kw.get("profile_names"), blocks),
                                   **kernel_kw)
        f = jax.jit(functools.partial(M.tree_attention_mgpu, scale=SCALE, kv_lora_rank=L, num_splits=NS,
                                      kernel=kernel))
        for _ in range(calls):
            jax.block_until_ready(f(q, caches[0], plen, tkv, mask))
        files = sorted(glob.glob(os.path.join(d, "*.json")), key=os.path.getmtime)
        if not files:
            raise RuntimeError("the profiler wrote no trace")
        with open(files[-1]) as fh:
            trace = json.load(fh)
    programs = program_timelines(trace, clock_ghz, warpgroups=2 if narrow else 3)
    return dict(T=T, H=H, B=B, P=P, kernel="narrow" if narrow else "wide", num_splits=NS, kernel_kw=kernel_kw,
                **summarize(programs), per_program=programs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="1,8,16,8192;4,8,16,8192;1,8,1,65536;4,8,1,65536",
                    help="'T,H,B,P;...'")
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock assumed for region durations")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="profile_timeline")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--variants", default="{}",
                    help="JSON list of kernel keyword dicts to run at every point (A/B in one run)")
    args = ap.parse_args(argv)
    try:
        points = bench_util.int_points(args.points, 4)
    except ValueError:
        ap.error(f"--points takes integers 'T,H,B,P;...', got {args.points!r}")
    if jax.default_backend() != "gpu":
        ap.error("the profiler runs inside the Mosaic GPU kernel: a Hopper GPU is needed")
    variants = json.loads(args.variants)
    variants = variants if isinstance(variants, list) else [variants]
    rows = [run_point(*p, clock_ghz=args.clock_ghz, **kw) for p in points for kw in variants]
    for r in rows:
        r["variant"] = json.dumps(r["kernel_kw"], sort_keys=True).replace(" ", "").replace('"', "")
    bench_util.write_result(args.name, dict(clock_ghz=args.clock_ghz, code_commit=args.commit, rows=rows),
                            out_dir=args.out)
    front = ["variant", "kernel", "T", "H", "B", "P", "num_splits", "programs", "max_blocks", "max_start_us",
             "fill_us", "block_us"]
    back = ["epilogue_us", "c1_epilogue_us", "slot_wait_us", "end_us", "max_end_us"]
    parts = tuple(f"{n}_us" for n in EPILOGUE_PARTS)
    regions = [k for k in dict.fromkeys(k for r in rows for k in r) if k.endswith("_us") and k not in front + back
               and not k.startswith(("start", "busy", "max_")) and not k.endswith(parts)]
    bench_util.print_table(rows, front + regions + back)
    return 0


if __name__ == "__main__":
    sys.exit(main())
