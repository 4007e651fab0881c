"""The engine's programs for K2.6 on a mesh, compiled ahead of time from abstract weights: compile seconds and XLA's
bytes per device (arguments, outputs, scratch) against the planner, with no weights and without the mesh's GPUs.

    # one H200 standing in for eight (XLA's mock GPU client: 8 devices, one of them addressable; nothing runs)
    PYTHONPATH=. python experiments/compile_mesh.py --mesh 1x8 --mock-gpus --layers 4,61 --out DIR
    # CPU: the plumbing, on 8 host devices
    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. \\
        python experiments/compile_mesh.py --mesh 1x8 --size tiny

The target and drafter are ``nnx.eval_shape``'s (ShapeDtypeStruct leaves, the INT4 experts repacked for the GPU
kernel), an ``Engine`` holds them on the mesh, and ``Engine.lower_prefill`` /
``Engine.lower_dispatch`` lower the prefill of ``--streams`` prompts of ``--prompt-len`` tokens and one dispatch of
DDTree rounds at ``--budget`` over a ``--capacity``-token cache. Each program: seconds to lower and to compile,
``memory_analysis()`` (argument, output, alias and scratch bytes of one device; live = argument + output - alias +
scratch, what the program holds at once) and, for the arguments, the
planner's bytes per device of the weights and caches they hold (``memory_plan.plan_memory``).

``--mock-gpus`` sets JAX's ``mock_num_gpu_processes`` to the mesh's size before the backend starts: XLA's GPU client
then presents that many processes of one local GPU each (mock NCCL), so an 8-GPU program compiles on one GPU. It
cannot run there, and nothing here runs: this measures what issue #7's machine will pay before its first step. It
also turns XLA's autotuning shared across processes off (``--xla_gpu_shard_autotuning=false``), which otherwise
waits for the mock processes. XLA's scheduler and rematerialisation take the one real GPU's memory as each
device's, so on an H100 the full model's 79 GB of arguments per device pass their limit (a logged error).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ddtree_jax.drafter import DFlashDrafter  # noqa: E402
from ddtree_jax.engine import Engine, EngineConfig, abstract_outputs  # noqa: E402
from ddtree_jax.hf_loader import ShapeOnlyRngs  # noqa: E402
from ddtree_jax.memory_plan import parse_mesh, plan_memory  # noqa: E402
from ddtree_jax.model import KimiModel, Runtime  # noqa: E402
from ddtree_jax.moe import prepare_for_kernels  # noqa: E402
from ddtree_jax.sharding import DEFAULT_RULES, make_mesh  # noqa: E402
from experiments.bench_mesh import model_configs  # noqa: E402
from experiments.bench_util import print_table, write_result  # noqa: E402

GB = 1e9
PROGRAMS = ("prefill", "dispatch")


def abstract_models(cfg, dcfg):
    """The target, its experts repacked for the Mosaic GPU kernel as ``bench_mesh.build`` does (their twins run
    off CUDA), and the drafter, as modules of ShapeDtypeStruct leaves: no weights are made."""
    return (nnx.eval_shape(lambda: prepare_for_kernels(KimiModel(cfg, ShapeOnlyRngs()))),
            nnx.eval_shape(lambda: DFlashDrafter(dcfg, ShapeOnlyRngs())))


def mock_gpus(count: int) -> None:
    """XLA's mock GPU client with ``count`` processes of one local GPU each (``count`` devices, one addressable):
    programs for that many GPUs compile here and cannot run. Call before anything starts the backend."""
    jax.config.update("mock_num_gpu_processes", count)
    # XLA shares GPU autotuning among a program's processes; mock ones never answer, and the first compile waited
    # for them (session 67, H100: no output in 170 s at 4 layers; 26 s with this flag).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_shard_autotuning=false").strip()


def report(name: str, payload: dict, out: str | None) -> str:
    """Writes the JSON (``bench_util.write_result``) and prints ``payload["rows"]`` as one table of all their keys
    (but those of lists and dicts: those stay in the JSON)."""
    path = write_result(name, payload, out)
    rows = payload["rows"]
    print_table(rows, list(dict.fromkeys(k for r in rows for k, v in r.items() if not isinstance(v, (list, dict)))))
    print(f"wrote {path}")
    return path


def memory_row(compiled) -> dict:
    """XLA's bytes of one device for a compiled program, in GB (None where the backend reports none)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    row = {f"{name}_GB": getattr(stats, f"{name}_size_in_bytes") / GB for name in ("argument", "output", "alias",
                                                                                   "temp")}
    row["live_GB"] = row["argument_GB"] + row["output_GB"] - row["alias_GB"] + row["temp_GB"]
    return row


def compile_programs(engine: Engine, prompts, programs) -> list[dict]:
    """Lowers and compiles the engine's prefill of ``prompts`` and, from its abstract outputs, one dispatch."""
    rows = []
    requests = engine.check_requests(prompts)
    t0 = time.perf_counter()
    lowered = engine.lower_prefill(requests)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    if "prefill" in programs:
        rows.append({"program": "prefill", "lower_s": t1 - t0, "compile_s": t2 - t1, **memory_row(compiled)})
    if "dispatch" in programs:
        state = abstract_outputs(compiled)
        t0 = time.perf_counter()
        lowered = engine.lower_dispatch(state)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        rows.append({"program": "dispatch", "lower_s": t1 - t0, "compile_s": time.perf_counter() - t1,
                     **memory_row(compiled)})
    return rows


def planned_argument_GB(cfg, dcfg, mesh_shape, streams: int, capacity: int) -> float:
    """The planner's bytes per device of what the programs take in bulk: weights and the two caches."""
    plan = plan_memory(cfg, mesh_shape, DEFAULT_RULES, drafter_cfg=dcfg)
    weights = sum(v["per_device"] for v in plan.weights.values())
    weights += sum(v["per_device"] for v in plan.drafter_weights.values())
    return (weights + plan.cache_bytes(capacity, streams)) / GB


def check_args(p, args) -> tuple[dict, list[int], list[str]]:
    try:
        mesh_shape = parse_mesh(args.mesh)
    except ValueError as e:
        p.error(f"--mesh: {e}")
    try:
        layers = [int(v) for v in args.layers.split(",")] if args.layers else [None]
    except ValueError:
        p.error(f"--layers {args.layers!r} must be comma-separated integers")
    if any(n is not None and n < 1 for n in layers):
        p.error("--layers values must be at least 1")
    programs = args.programs.split(",")
    if set(programs) - set(PROGRAMS) or not programs:
        p.error(f"--programs: choose from {', '.join(PROGRAMS)}")
    for name in ("streams", "prompt_len", "budget", "new_tokens", "capacity"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.prefill_chunk < 0:
        p.error(f"--prefill-chunk must be at least 1, or 0 for one block, got {args.prefill_chunk}")
    return mesh_shape, layers, programs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="1x8", help="DATAxMODEL, e.g. 1x8")
    p.add_argument("--mock-gpus", action="store_true",
                   help="present the mesh's GPUs through XLA's mock GPU client (one real GPU; compile only)")
    p.add_argument("--size", choices=["full", "tiny"], default="full")
    p.add_argument("--layers", default=None, help="comma-separated target layer counts (default: all)")
    p.add_argument("--programs", default=",".join(PROGRAMS))
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256, help="the engine's max_new_tokens")
    p.add_argument("--capacity", type=int, default=4096)
    p.add_argument("--prefill-chunk", type=int, default=2048, help="the engine's prefill block (0: one block)")
    p.add_argument("--commit", default=None, help="commit to record (the device copy has no .git)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    mesh_shape, layer_counts, programs = check_args(p, args)
    devices_needed = mesh_shape["data"] * mesh_shape["model"]
    if args.mock_gpus:
        mock_gpus(devices_needed)
    if devices_needed > len(jax.devices()):
        p.error(f"--mesh {args.mesh} needs {devices_needed} devices; this process sees {len(jax.devices())} "
                "(GPU: --mock-gpus; CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    platform = jax.devices()[0].platform
    runtime = Runtime(mesh=make_mesh(**mesh_shape), rules=DEFAULT_RULES)
    rows = []
    for layers in layer_counts:
        cfg, dcfg = model_configs(args.size, layers)
        start = time.perf_counter()
        target, drafter = abstract_models(cfg, dcfg)
        ecfg = EngineConfig(mode="ddtree", budget=args.budget, max_new_tokens=args.new_tokens,
                            capacity=args.capacity, prefill_chunk=args.prefill_chunk or None)
        engine = Engine(target, drafter, ecfg, runtime=runtime)
        prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.streams, args.prompt_len)).tolist()
        build_s = time.perf_counter() - start
        planned = planned_argument_GB(cfg, dcfg, mesh_shape, args.streams, args.capacity)
        for row in compile_programs(engine, prompts, programs):
            rows.append({"layers": cfg.num_layers, **row, "planned_weights_caches_GB": planned, "build_s": build_s})
            print(rows[-1], flush=True)
    payload = {"config": vars(args), "mesh_shape": mesh_shape, "platform": platform,
               "devices": len(jax.devices()), "addressable_devices": jax.local_device_count(), "rows": rows,
               "code_commit": args.commit}
    report(f"compile_mesh_{args.size}_{args.mesh}", payload, args.out)
    return rows


if __name__ == "__main__":
    main()
