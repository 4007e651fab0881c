"""Bytes per device for full Kimi K2.6 (+ the DFlash drafter) on a mesh, from abstract shapes only.

    python experiments/plan_memory.py --mesh 1x8 [--capacity 65536] [--streams 8] [--hbm-gib 140]
    python experiments/plan_memory.py --config TARGET_DIR [--drafter DRAFTER_DIR] ...

The built-in K2.6 preset plans the K2.6 DFlash drafter's preset beside it; ``--config`` plans its target with the
``--drafter`` directory's drafter (checked against it), or alone.

Nothing is allocated and no accelerator is needed: shapes come from nnx.eval_shape and placement from the
logical-axis sharding rules applied to the mesh shape (``ddtree_jax.memory_plan``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddtree_jax.config import ModelConfig, k26_config  # noqa: E402
from ddtree_jax.hf_loader import hf_model_config  # noqa: E402
from ddtree_jax.memory_plan import CATEGORIES, parse_mesh, plan_memory  # noqa: E402

GIB = 2**30


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fmt(n: float) -> str:
    return f"{n / GIB:10.3f} GiB"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", default="1x8", help="DATAxMODEL mesh shape, e.g. 1x8 or 2x4")
    parser.add_argument("--capacity", type=positive_int, default=65536, help="cache capacity in tokens per stream")
    parser.add_argument("--streams", type=positive_int, default=1,
                        help="concurrent streams (split over the data axis)")
    parser.add_argument("--hbm-gib", type=float, default=140.0, help="usable memory per device (H200: ~140 GiB)")
    parser.add_argument("--config", help="an HF config.json directory instead of the built-in K2.6 preset (with its "
                        "*.safetensors, the router's dtype is read from them; else f32)")
    parser.add_argument("--drafter", help="with --config: the drafter's HF directory (its config.json), planned "
                        "beside the target (default with --config: the target alone)")
    parser.add_argument("--no-drafter", action="store_true", help="target only")
    parser.add_argument("--json", help="also write the plan as JSON to this path")
    args = parser.parse_args(argv)
    if args.drafter and (args.no_drafter or not args.config):
        parser.error("--drafter plans a drafter beside --config's target: give --config, and not --no-drafter")
    if args.hbm_gib <= 0:
        parser.error(f"--hbm-gib must be > 0, got {args.hbm_gib}")

    mesh_shape = parse_mesh(args.mesh)
    if args.config and glob.glob(os.path.join(args.config, "*.safetensors")):
        cfg = hf_model_config(args.config)  # the router's dtype as the checkpoint stores it
    else:  # a config.json alone: the router in f32, as transformers keeps it
        cfg = ModelConfig.from_hf_dir(args.config) if args.config else k26_config()
    drafter_cfg, drafter_note = None, "none"
    if args.drafter:
        from ddtree_jax.drafter import DrafterConfig, check_drafter_target
        drafter_cfg = DrafterConfig.from_hf_dir(args.drafter)
        check_drafter_target(drafter_cfg, cfg)
        drafter_note = f"DFlashDrafter({args.drafter}), abstract"
    elif args.config and not args.no_drafter:  # the K2.6 preset drafter fits only the K2.6 target
        drafter_note = "none (give --drafter to plan one beside --config's target)"
    elif not args.no_drafter:
        from ddtree_jax.drafter import k26_drafter_config
        drafter_cfg, drafter_note = k26_drafter_config(), "DFlashDrafter(k26_drafter_config()), abstract"
    try:
        plan = plan_memory(cfg, mesh_shape, drafter_cfg=drafter_cfg)
        plan.cache_bytes(args.capacity, args.streams)
    except ValueError as e:  # a mesh axis that does not divide a weight, or the streams over the data axis
        parser.error(f"--mesh {args.mesh} with --streams {args.streams}: {e}")
    n_dev = mesh_shape["data"] * mesh_shape["model"]

    print(f"mesh data={mesh_shape['data']} x model={mesh_shape['model']} ({n_dev} devices); "
          f"target dtype {cfg.dtype}, experts {'INT4 g%d' % cfg.quant.group_size if cfg.quant else cfg.dtype}")
    print(f"{'weights':<26}{'total':>14}{'per device':>16}")
    for cat in CATEGORIES:
        v = plan.weights[cat]
        print(f"  {cat:<24}{_fmt(v['total'])}  {_fmt(v['per_device'])}")
    tw = {k: sum(v[k] for v in plan.weights.values()) for k in ("total", "per_device")}
    int4 = {k: plan.weights["experts_int4"][k] + plan.weights["expert_scales"][k] for k in ("total", "per_device")}
    print(f"  {'target (INT4 experts)':<24}{_fmt(int4['total'])}  {_fmt(int4['per_device'])}")
    print(f"  {'target (rest, ' + cfg.dtype + ')':<24}{_fmt(tw['total'] - int4['total'])}  "
          f"{_fmt(tw['per_device'] - int4['per_device'])}")
    print(f"  {'target total':<24}{_fmt(tw['total'])}  {_fmt(tw['per_device'])}")
    dw = {"total": 0, "per_device": 0}
    if plan.drafter_weights:
        dw = {k: sum(v[k] for v in plan.drafter_weights.values()) for k in ("total", "per_device")}
        print(f"  {'drafter':<24}{_fmt(dw['total'])}  {_fmt(dw['per_device'])}   ({drafter_note})")
    else:
        print(f"  drafter: {drafter_note}")
    c, dc = plan.cache_per_token, plan.drafter_cache_per_token or {"total": 0, "per_device": 0}
    print(f"cache per token per stream: target latent {c['total']:,} B total / {c['per_device']:,} B per device; "
          f"drafter K/V {dc['total']:,} B total / {dc['per_device']:,} B per device")
    weights_dev = tw["per_device"] + dw["per_device"]
    cache_dev = plan.cache_bytes(args.capacity, args.streams)
    free = args.hbm_gib * GIB - weights_dev
    per_token_dev = c["per_device"] + dc["per_device"]
    local_streams = -(-args.streams // mesh_shape["data"])
    print(f"streams={args.streams} x capacity={args.capacity}: caches {_fmt(cache_dev)} per device; "
          f"weights + caches {_fmt(weights_dev + cache_dev)} of {args.hbm_gib:.0f} GiB per device")
    if free <= 0:
        print(f"the weights alone take {_fmt(weights_dev)} per device, more than --hbm-gib {args.hbm_gib:g}: "
              "they do not fit this mesh")
    else:
        print(f"left after weights: {_fmt(free)} per device -> at most {int(free // per_token_dev):,} cached "
              f"tokens per device ({int(free // per_token_dev) // local_streams:,} per stream for {local_streams} "
              "local streams), before activations/workspace")
    result = {"mesh": mesh_shape, "weights": plan.weights, "drafter_weights": plan.drafter_weights,
              "cache_per_token": c, "drafter_cache_per_token": dc, "capacity": args.capacity,
              "streams": args.streams, "weights_per_device": weights_dev, "caches_per_device": cache_dev,
              "drafter_source": drafter_note}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
