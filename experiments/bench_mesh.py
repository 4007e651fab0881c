"""K2.6 sharded over a (data, model) mesh, weights made on the devices: memory per device against the
planner, the verify step's time against tokens per step, and engine rounds (issue #7).

    PYTHONPATH=. python experiments/bench_mesh.py --mesh 1x8 --size full --eval \\
        experiments/results/eval_grid_h200.json --out DIR                          # 8 x H200
    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. \\
        python experiments/bench_mesh.py --mesh 1x8 --size tiny                    # CPU: the plumbing

Weights are random (``bench_engine.random_state``), every array made in its own shards: full K2.6 (~550 GB)
exists only spread over the mesh. The INT4 experts are then repacked for the kernels where they live
(``prepare_for_kernels``; on CPU the kernels' twins run). ``--layers`` takes fewer target layers (the drafter
taps the first ones); ``--size tiny`` is a small model whose heads, experts and vocabulary split 8 ways.

Sections (``--sections``):
  memory  bytes each device holds: target and drafter weights, and the latent and drafter caches of
          ``--cache-streams`` x ``--capacity`` tokens, against ``memory_plan.plan_memory`` for the same mesh
          (a mismatch is reported, not hidden); on GPUs also the allocator's bytes in use and peak.
  step    the target's verify forward at M tokens per step (``--ms``; M = streams x tree tokens as in
          ``bench_engine.verify_shape``) over a ``--prefix``-token cache: median of ``--repeats`` wall times of
          the jitted step, and its floor, the bytes one device reads (its weight shards, experts scaled by the
          share top-k routing touches at M tokens, and its streams' latent cache) / the measured copy bandwidth.
  engine  AR at one stream and DDTree at ``--budget`` for each of ``--streams`` (random prompts of
          ``--prompt-len``): ms per round. tokens/s = streams x tau / round time, tau from ``--eval`` (an
          eval_grid JSON of the shipped trained pair: stated as such) where it has the budget, else the random
          pair's own tau (meaningless: random weights).

JSON (hardware, JAX version, commit, config, every row) via ``bench_util.write_result``; a table per section.

Compile time at full size: the target's layers are unrolled in each program (one lowered body per layer
structure, ``model.apply_layer``). ``compile_mesh.py --mock-gpus`` compiled the engine's programs for this mesh on one
H100: at 61 layers the prefill in 6.2 + 73.4 s (lower + compile) and the dispatch in 7.5 + 68.1 s (session 68; the
prefill was still compiling 330 s into its step before ``apply_layer``). Expect over a minute per M and per stream
count: within one device call,
split the sections over lease steps (``experiments/lease.py``) with ``JAX_COMPILATION_CACHE_DIR`` set, and trim
``--ms`` / ``--streams`` (or ``--layers``) to the device time left.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ddtree_jax.config import QuantConfig, k26_config, tiny_config  # noqa: E402
from ddtree_jax.drafter import DFlashDrafter, k26_drafter_config, tiny_drafter_config  # noqa: E402
from ddtree_jax.engine import Engine, EngineConfig  # noqa: E402
from ddtree_jax.hf_loader import ShapeOnlyRngs  # noqa: E402
from ddtree_jax.memory_plan import held_bytes_per_device, parse_mesh, plan_memory  # noqa: E402
from ddtree_jax.model import KimiModel, Runtime  # noqa: E402
from ddtree_jax.moe import prepare_for_kernels  # noqa: E402
from ddtree_jax.sharding import DEFAULT_RULES, make_mesh  # noqa: E402
from experiments.bench_engine import random_state, random_verify_inputs, verify_shape, weight_share  # noqa: E402
from experiments.bench_util import (measure_copy_bandwidth, measure_torch_copy_bandwidth, print_table,  # noqa: E402
                                    time_fn, write_result)
from experiments.project_k26 import taus  # noqa: E402

GB = 1e9


def model_configs(size: str, layers: int | None):
    """(target, drafter) configs: full K2.6 (``layers`` of its 61, the drafter tapping the first ones) or a
    tiny model whose heads (8), kv heads (8), experts (16) and vocabulary split over 8 devices."""
    if size == "full":
        cfg = k26_config(dtype="bfloat16")
        if layers is not None and layers != cfg.num_layers:
            cfg = cfg.replace(num_layers=layers)
            taps = tuple(range(1, layers))[:6] or (0,)
            return cfg, dataclasses.replace(k26_drafter_config(dtype="bfloat16"), target_layer_ids=taps,
                                            num_target_layers=layers)
        return cfg, k26_drafter_config(dtype="bfloat16")
    cfg = tiny_config(dtype="float32", quant=QuantConfig(group_size=32), vocab_size=512,
                      num_layers=layers or 3, num_heads=8, n_routed_experts=16, hidden_size=256,
                      moe_intermediate_size=256)  # the smallest D, F the tiled INT4 layout takes
    return cfg, tiny_drafter_config(cfg, block_size=8, num_heads=8, num_kv_heads=8)


def random_target(cfg, mesh=None, seed: int = 0) -> KimiModel:
    """The target with random weights, its experts repacked for the kernels, made in its shards on ``mesh`` (or on
    the default device)."""
    target_def, target_abs = nnx.split(nnx.eval_shape(lambda: KimiModel(cfg, ShapeOnlyRngs())))
    return prepare_for_kernels(nnx.merge(target_def, random_state(target_abs, seed, mesh, DEFAULT_RULES)))


def build(cfg, dcfg, mesh):
    """Random target (experts repacked for the kernels) and drafter, made in their shards on ``mesh``."""
    drafter_def, drafter_abs = nnx.split(nnx.eval_shape(lambda: DFlashDrafter(dcfg, ShapeOnlyRngs())))
    drafter = nnx.merge(drafter_def, random_state(drafter_abs, 1, mesh, DEFAULT_RULES))
    return random_target(cfg, mesh), drafter


def bench_memory(target, drafter, cfg, dcfg, mesh, mesh_shape, args, rows):
    """Bytes on the fullest (and emptiest) device of the engine's weights and of the caches its prefill lays
    out for --cache-streams x --capacity, against the planner."""
    plan = plan_memory(cfg, mesh_shape, DEFAULT_RULES, drafter_cfg=dcfg)
    ecfg = EngineConfig(mode="ddtree", budget=args.budget, max_new_tokens=16, capacity=args.capacity,
                        rounds_per_dispatch=1)
    engine = Engine(target, drafter, ecfg, runtime=Runtime(mesh=mesh, rules=DEFAULT_RULES))
    state = engine.prefill([[2, 3, 4, 5]] * args.cache_streams)
    measured = {"target_weights": held_bytes_per_device(engine.target_state),
                "drafter_weights": held_bytes_per_device(engine.drafter_state),
                "caches": held_bytes_per_device((state.cache.kv, state.draft_cache.k, state.draft_cache.v))}
    planned = {"target_weights": sum(v["per_device"] for v in plan.weights.values()),
               "drafter_weights": sum(v["per_device"] for v in plan.drafter_weights.values()),
               "caches": plan.cache_bytes(args.capacity, args.cache_streams)}
    for part, per_device in measured.items():
        most = max(per_device.values())
        rows.append({"bench": "memory", "part": part, "measured_GB_max_device": most / GB,
                     "measured_GB_min_device": min(per_device.values()) / GB, "planned_GB": planned[part] / GB,
                     "matches_plan": most == planned[part]})
        print(rows[-1], flush=True)
    stats = [d.memory_stats() for d in mesh.devices.flat]
    if all(stats):  # GPUs: the allocator's own count (CPU devices keep none)
        rows.append({"bench": "memory", "part": "allocator_in_use",
                     "measured_GB_max_device": max(st.get("bytes_in_use", 0) for st in stats) / GB,
                     "peak_GB_max_device": max(st.get("peak_bytes_in_use", 0) for st in stats) / GB})
        print(rows[-1], flush=True)


def step_floor_bytes(target, cfg, mesh_shape, m: int, streams: int, prefix: int) -> int:
    """Bytes the fullest device reads in a verify step of M tokens: its shards of the weights (the routed
    experts scaled by the share that M tokens' top-k touches under uniform routing, the embedding table by
    the M rows gathered: ``bench_engine.weight_share``) and its streams' latent cache (every device reads
    all of it: heads split, the latent shared)."""
    per_device = {}
    for path, variable in nnx.state(target).flat_state():
        share = weight_share(path, cfg, m)
        for dev, nbytes in held_bytes_per_device(variable.get_value()).items():
            per_device[dev] = per_device.get(dev, 0.0) + share * nbytes
    local_streams = -(-streams // mesh_shape["data"])
    cache = local_streams * prefix * cfg.num_layers * cfg.latent_dim * jnp.dtype(cfg.dtype).itemsize
    return int(max(per_device.values()) + cache)


def bench_step(target, cfg, mesh, mesh_shape, args, bandwidth, deadline, rows):
    """The target's verify forward at each M: median wall time and the per-device floor."""
    runtime = Runtime(mesh=mesh, rules=DEFAULT_RULES)
    gdef, gstate = nnx.split(target)
    fwd = jax.jit(lambda st, tok, pos, c, vis: nnx.merge(gdef, st)(tok, pos, c, vis, runtime=runtime).logits)
    rng = np.random.default_rng(3)
    for m in [int(v) for v in args.ms.split(",")]:
        if time.time() > deadline:
            print(f"step: skipping M={m} and up (time budget)", flush=True)
            break
        b, t = verify_shape(m)
        inputs = (gstate, *random_verify_inputs(rng, cfg, b, t, args.prefix, runtime))
        t0 = time.perf_counter()
        jax.block_until_ready(fwd(*inputs))
        compile_s = time.perf_counter() - t0
        seconds = time_fn(fwd, *inputs, repeats=args.repeats)["median_s"]
        floor = step_floor_bytes(target, cfg, mesh_shape, m, b, args.prefix) / bandwidth
        rows.append({"bench": "step", "M": m, "streams": b, "tree_tokens": t, "prefix": args.prefix,
                     "ms": 1e3 * seconds, "floor_ms": 1e3 * floor, "pct_of_floor": 100 * floor / seconds,
                     "compile_s": compile_s})
        print(rows[-1], flush=True)


def bench_rounds(target, drafter, cfg, mesh, args, tau_by_budget, deadline, rows):
    """AR at one stream, DDTree at --budget for each --streams: ms per round and tokens/s."""
    runtime = Runtime(mesh=mesh, rules=DEFAULT_RULES)
    rng = np.random.default_rng(0)
    runs = [("ar", 1, 1)] + [("ddtree", args.budget, int(s)) for s in args.streams.split(",")]
    for mode, budget, streams in runs:
        if time.time() > deadline:
            print(f"engine: skipping {mode} at {streams} streams (time budget)", flush=True)
            continue
        ecfg = EngineConfig(mode=mode, budget=budget, max_new_tokens=args.new_tokens,
                            capacity=args.prompt_len + args.new_tokens + 64, rounds_per_dispatch=args.new_tokens)
        engine = Engine(target, drafter if mode == "ddtree" else None, ecfg, runtime=runtime)
        prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(streams)]
        t0 = time.perf_counter()
        engine.generate(prompts)  # compiles
        compile_s = time.perf_counter() - t0
        res = engine.generate(prompts, seed=1)
        rounds = max(res["rounds"])
        ms_round = 1e3 * res["decode_s"] / max(rounds, 1)
        tau, tau_from = 1.0, "ar"
        if mode == "ddtree":
            tau, tau_from = ((tau_by_budget[budget], "eval (trained pair)") if budget in tau_by_budget
                             else (res["tau_mean"], "this run (random pair)"))
        rows.append({"bench": "engine", "mode": mode, "budget": budget if mode == "ddtree" else None,
                     "streams": streams, "M": streams * (budget + 1 if mode == "ddtree" else 1),
                     "ms_per_round": ms_round, "tau": tau, "tau_from": tau_from,
                     "tok_per_s": 1e3 * streams * tau / ms_round, "random_pair_tau": res["tau_mean"],
                     "compile_s": compile_s})
        print(rows[-1], flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="1x8", help="DATAxMODEL, e.g. 1x8")
    p.add_argument("--size", choices=["full", "tiny"], default="tiny")
    p.add_argument("--layers", type=int, default=None, help="target layers (default: all; tiny: 3)")
    p.add_argument("--sections", default="memory,step,engine")
    p.add_argument("--ms", default="1,9,33,65,264,528", help="tokens per step M of section step")
    p.add_argument("--prefix", type=int, default=1024, help="committed tokens per stream in section step")
    p.add_argument("--capacity", type=int, default=65536, help="cache capacity per stream in section memory")
    p.add_argument("--cache-streams", type=int, default=10, help="streams whose caches section memory allocates")
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--streams", default="1,10", help="DDTree stream counts of section engine")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--eval", default=None, help="eval_grid JSON: the trained pair's tau per budget")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--time-budget-s", type=float, default=1200)
    p.add_argument("--commit", default=None, help="commit to record (the device copy has no .git)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sections = args.sections.split(",")
    unknown = set(sections) - {"memory", "step", "engine"}
    if unknown:
        p.error(f"--sections: unknown {sorted(unknown)}")
    try:
        ms = [int(v) for v in args.ms.split(",")]
        streams = [int(v) for v in args.streams.split(",")]
    except ValueError:
        p.error(f"--ms {args.ms!r} and --streams {args.streams!r} must be comma-separated integers")
    for m in ms:
        if m < 1:
            p.error(f"--ms: M={m} must be at least 1")
        try:
            verify_shape(m)
        except ValueError as e:
            p.error(f"--ms: {e}")
    if min(streams) < 1 or args.repeats < 1:
        p.error("--streams values and --repeats must be at least 1")
    mesh_shape = parse_mesh(args.mesh)
    if mesh_shape["data"] * mesh_shape["model"] > len(jax.devices()):
        p.error(f"--mesh {args.mesh} needs {mesh_shape['data'] * mesh_shape['model']} devices; this machine has "
                f"{len(jax.devices())} (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    tau_by_budget = {}
    if args.eval:
        with open(args.eval) as fh:
            tau_by_budget = taus(json.load(fh))
    start = time.time()
    deadline = start + args.time_budget_s
    mesh = make_mesh(**mesh_shape)
    cfg, dcfg = model_configs(args.size, args.layers)
    big = args.size == "full"
    bandwidth = measure_torch_copy_bandwidth() or measure_copy_bandwidth(1 << 30 if big else 1 << 26)
    target, drafter = build(cfg, dcfg, mesh)
    jax.block_until_ready(jax.tree.leaves(nnx.state(target)))
    print(f"built on {args.mesh}: {cfg.num_layers} target layers, {time.time() - start:.0f}s; copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s", flush=True)
    rows = []
    runs = {"memory": lambda: bench_memory(target, drafter, cfg, dcfg, mesh, mesh_shape, args, rows),
            "step": lambda: bench_step(target, cfg, mesh, mesh_shape, args, bandwidth, deadline, rows),
            "engine": lambda: bench_rounds(target, drafter, cfg, mesh, args, tau_by_budget, deadline, rows)}
    for name in sections:
        try:
            runs[name]()
        except Exception as e:  # keep what was measured; report the failure
            rows.append({"bench": name, "error": f"{type(e).__name__}: {e}"[:500]})
            print(rows[-1], flush=True)
    payload = {"config": vars(args), "mesh_shape": mesh_shape, "num_layers": cfg.num_layers,
               "copy_bandwidth_Bps": bandwidth, "devices": [str(d) for d in mesh.devices.flat], "rows": rows,
               "code_commit": args.commit}
    path = write_result(f"bench_mesh_{args.size}_{args.mesh}", payload, args.out)
    for bench in ("memory", "step", "engine"):
        sel = [r for r in rows if r.get("bench") == bench]
        if sel:
            print(f"\n== {bench}")
            print_table(sel, list(dict.fromkeys(k for r in sel for k in r if k != "bench")))
    print(f"\nwrote {path}; total {time.time() - start:.0f}s")
    failed = [r["bench"] for r in rows if "error" in r]
    if failed:
        sys.exit(f"sections failed: {', '.join(failed)} (their error rows are in {path})")
    return rows


if __name__ == "__main__":
    main()
