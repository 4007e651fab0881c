"""Where one full-size K2.6 MoE decoder layer spends its time, measured inside one compiled program.

    PYTHONPATH=. python experiments/bench_layer.py --out DIR            # H200
    PYTHONPATH=. python experiments/bench_layer.py --size tiny          # CPU smoke run

One MoE decoder layer (MLA over a --prefix latent cache, noaux_tc router, 384 INT4 experts in the
Mosaic GPU kernel layout, shared expert) with random weights made on the device. For M tokens per
step it times each part as the 61 layers of a decode step run it, inside one program, each call's
activations feeding the next: on a GPU ``us`` is the device time per call from a profiler trace of
--calls unrolled calls (``bench_util.traced_call_time``); ``us_loop`` (the figure before session 6, and
``us`` on CPU) is the wall time of a jitted ``fori_loop`` of --iters calls over --iters, which holds the
loop's own per-iteration cost (~30 µs on the H200: ``elementwise``, x + 1e-6 x, measures it). Parts: the whole
layer; attention (input norm, MLA projections, absorbed attention, output projection, residual);
MoE (post norm, router, routed experts, shared expert, residual); the router alone; the routed experts
alone (routing fixed); the shared expert alone. Also the layer as one dispatched call (as
``bench_engine.py --sections kernel`` times it). Floors: bytes the part must read / copy bandwidth.
Every part routes the M tokens by uniform random ids, K distinct experts a token (``uniform_routing``),
whatever the random router picks, and its floor counts the experts those ids touch. Before session 70 the
layer took the router's picks, fewer experts than the floors counted by ``expert_share`` (up to 123 % of the
"floor" at M = 90 on an H100).

``--mesh DxM`` places the layer on a (data, model) mesh of D*M devices by the project's sharding rules
(routed experts split over "model", attention heads and FFN width too) and runs it sharded (the
Runtime carries the mesh); it then also reports the weight bytes each device actually holds against
the memory planner's prediction (``memory_plan.param_bytes``), and the floors count one device's bytes (its
shards, replicated weights whole, the busiest device's experts; before session 70 replicated ones were divided
too). On CPU:
``XLA_FLAGS=--xla_force_host_platform_device_count=8 ... --size tiny --mesh 1x4``.

``--local-of G`` times, on one device, what one device of a 1xG mesh computes of the layer
(``abstract_layer``): every weight cut to its shard's shape (H / G heads, the shared expert's FFN width / G,
E / G experts; the router, q_a, kv_a and the norms whole), so it holds exactly the planner's bytes per device.
The routed experts are the busiest device's for uniform random routing ids, K distinct a token
(``busiest_device``: the most distinct experts), whatever the router picks. The layer's two all-reduces
(``project_k26.ALLREDUCES_PER_LAYER``)
are left out, so its activations are not the sharded layer's, only its work; ``project_k26.py --local`` adds
them at assumed costs. For issue #7 while no G-GPU machine is lent.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from ddtree_jax.config import QuantConfig, k26_config, tiny_config  # noqa: E402
from ddtree_jax.hf_loader import ShapeOnlyRngs  # noqa: E402
from ddtree_jax.layers import dot  # noqa: E402
from ddtree_jax.memory_plan import held_bytes_per_device, param_bytes, parse_mesh, shard_shape  # noqa: E402
from ddtree_jax.model import DecoderLayer, Runtime, causal_mask  # noqa: E402
from ddtree_jax.sharding import DEFAULT_RULES, make_mesh, shard_state  # noqa: E402
from ddtree_jax.moe import default_routed_fn, prepare_for_kernels, route, routed_experts  # noqa: E402
from ddtree_jax.rope import rope_cos_sin  # noqa: E402
from experiments.bench_engine import bytes_of, random_state  # noqa: E402
from experiments.bench_moe import routing  # noqa: E402
from experiments.bench_util import (measure_copy_bandwidth, measure_torch_copy_bandwidth, parse_settings,  # noqa: E402
                                    print_table, tie_to, time_fn, traced_call_time, write_result)


PARTS = ("layer", "attention", "moe", "router", "router_sort", "router_compare", "router_logits", "router_logits_bf16",
         "router_logits_bf16_pad", "router_logits_x9", "routed_experts", "shared_expert", "elementwise", "dispatched")


def layer_config(size: str):
    if size == "full":
        return k26_config(dtype="bfloat16")
    return tiny_config(dtype="bfloat16", quant=QuantConfig(group_size=32), hidden_size=256, moe_intermediate_size=256)


def abstract_layer(cfg, local_of: int | None = None):
    """(graphdef, abstract state) of the first MoE layer; with ``local_of`` G, of what one device of a 1xG mesh
    holds of it under ``DEFAULT_RULES``: every array cut to its shard's shape (``memory_plan.shard_shape``; a mesh
    axis that does not divide is refused), under a graphdef built for H / G heads, so the attention reshapes to
    its local heads. The experts are the first E / G of the stack (routed by ``expert_offset``), the shared
    expert's FFN width is cut, and what the rules replicate (the router, q_a, kv_a, the norms) stays whole."""
    idx = cfg.first_k_dense_replace
    gdef, abstract = nnx.split(nnx.eval_shape(lambda: DecoderLayer(cfg, idx, ShapeOnlyRngs())))
    if not local_of:
        return gdef, abstract
    if cfg.num_heads % local_of:
        raise ValueError(f"--local-of {local_of} does not divide the {cfg.num_heads} heads")
    local_cfg = dataclasses.replace(cfg, num_heads=cfg.num_heads // local_of)
    gdef = nnx.graphdef(nnx.eval_shape(lambda: DecoderLayer(local_cfg, idx, ShapeOnlyRngs())))
    mesh_shape = {"data": 1, "model": local_of}

    def local(variable):
        axes = variable.get_metadata()["logical_axes"]
        cut = lambda a: jax.ShapeDtypeStruct(shard_shape(a.shape, axes, mesh_shape, DEFAULT_RULES, exact=True),  # noqa: E731
                                             a.dtype)
        return variable.replace(jax.tree.map(cut, variable.get_value()))

    return gdef, jax.tree.map(local, abstract, is_leaf=lambda v: isinstance(v, nnx.Variable))


def build_layer(size: str, local_of: int | None = None):
    """(config, the first MoE layer with random weights in the kernels' layout); ``local_of``: one device's
    share of it (``abstract_layer``)."""
    cfg = layer_config(size)
    gdef, abstract = abstract_layer(cfg, local_of)
    layer = prepare_for_kernels(nnx.merge(gdef, random_state(abstract, 0)))
    return cfg, layer


def busiest_device(ids, num_experts: int, devices: int) -> dict:
    """Routing ids [M, K] over experts split evenly over ``devices`` (expert parallelism): per device the
    distinct experts the tokens touch and the (token, expert) pairs it computes, and the device with the most
    distinct experts (the most weight bytes read; ties: the most pairs, then the lowest index), whose share of
    a layer at small M the all-reduce after it waits for."""
    ids = np.asarray(ids)
    owner = ids // (num_experts // devices)
    distinct = [int(np.unique(ids[owner == d]).size) for d in range(devices)]
    pairs = [int((owner == d).sum()) for d in range(devices)]
    device = max(range(devices), key=lambda d: (distinct[d], pairs[d], -d))
    return {"device": device, "distinct": distinct, "pairs": pairs}


def distinct_ids(cfg, m: int) -> np.ndarray:
    """Routing ids [M, K] as a router picks them, K distinct experts a token, uniform over the experts
    (``bench_moe.routing``'s uniform draw)."""
    return np.asarray(routing(m, "uniform", 2, cfg.n_routed_experts, cfg.num_experts_per_tok)[0])


def uniform_routing(cfg, layer, m: int, rt: Runtime = Runtime(), local_of: int | None = None,
                    moe_tuning: dict | None = None) -> tuple[Runtime, dict]:
    """``rt`` with a ``routed_fn`` that routes the M tokens by ``distinct_ids``, whatever the router picks (the
    router still runs, and its weights are used), the ids tied to the activations so each call redoes the sort;
    and the load of the devices that split the experts (``busiest_device``: one device, the mesh's experts axis,
    or ``local_of``). A random router's picks are not uniform (it touched fewer experts than uniform ids would,
    so the floors overstated its reads), so every run routes this way since session 70.
    With ``local_of`` G (a layer built by ``abstract_layer(cfg, G)``, no mesh) it computes the busiest device's
    share alone (its ``expert_offset``); under a mesh, each device its own (the offset ``routed_experts`` passes).
    ``moe_tuning``: keyword arguments for the routed-expert function (``routed_experts_tiled``'s split, tile, ...)
    in place of its defaults, to compare a setting inside the layer."""
    ids = jnp.asarray(distinct_ids(cfg, m), jnp.int32)
    devices = local_of or (rt.mesh.shape[rt.rules.mesh_axis("experts")] if rt.mesh is not None else 1)
    load = busiest_device(ids, cfg.n_routed_experts, devices)
    base = functools.partial(default_routed_fn(layer.mlp.w13.get_value(), expert_shards=devices), **(moe_tuning or {}))
    fixed = {"expert_offset": load["device"] * (cfg.n_routed_experts // devices)} if local_of else {}

    def routed_fn(x, _ids, weights, w13, w2, **offset):
        return base(x, tie_to(ids, x), weights, w13, w2, **fixed, **offset)

    return dataclasses.replace(rt, routed_fn=routed_fn), load


def parts(cfg, layer, m: int, prefix: int, rt: Runtime = Runtime()):
    """name -> (step(state, x, aux) -> next x, aux) for one step of M tokens."""
    cos, sin = rope_cos_sin(prefix + jnp.arange(m)[None], cfg.rope, cfg.qk_rope_head_dim)
    # an engine's cache: capacity a multiple of 64 (Engine's is), so the Mosaic GPU attention kernel takes it
    # (it needs S % 8 == 0; before session 8 the capacity was prefix + m and the layer ran the Triton kernel)
    capacity = -(-(prefix + m) // 64) * 64
    kv = 0.1 * jax.random.normal(jax.random.key(1), (1, capacity, cfg.latent_dim), jnp.float32)
    kv = kv.astype(jnp.dtype(cfg.dtype))
    lengths, mask = jnp.array([prefix]), causal_mask(1, m)
    moe = layer.mlp
    weights = route(jnp.zeros((m, cfg.hidden_size), jnp.float32) + 0.01 * jnp.arange(m)[:, None],
                    moe.router.get_value(), moe.router_bias.get_value(), cfg)[1]
    ids = jnp.asarray(distinct_ids(cfg, m), jnp.int32)  # what ``uniform_routing``'s routed_fn uses
    flat = lambda x: x.reshape(m, cfg.hidden_size)  # noqa: E731

    def router(lay, x, top_k_method):
        weights = route(flat(x), lay.mlp.router.get_value(), lay.mlp.router_bias.get_value(), cfg, top_k_method)[1]
        return x + (1e-6 * weights.sum()).astype(x.dtype)

    def router_logits(lay, x, weight, padded=False, **precision):  # the router's dot alone (``route``'s first
        xs = flat(x).astype(weight.dtype)  # line), by variant; padded: through ``layers.dot``
        logits = dot(xs, weight, "md,ed->me", out_dtype=jnp.float32) if padded else jnp.einsum(
            "md,ed->me", xs, weight, preferred_element_type=jnp.float32, **precision)
        return x + (1e-6 * logits.sum()).astype(x.dtype)

    def routed(mod, x, aux):  # ids tied to x: each step sorts them (fixed ids would be sorted once per chain)
        y = routed_experts(flat(x), tie_to(aux[0], x), aux[1], mod.w13.get_value(), mod.w2.get_value(),
                           mesh=rt.mesh, rules=rt.rules, routed_fn=rt.routed_fn)
        return x + y.reshape(x.shape).astype(x.dtype)

    return {
        "layer": (lambda lay, x, aux: lay(x, cos, sin, aux, lengths, mask, rt)[0], kv),
        "attention": (lambda lay, x, aux: x + lay.attn(lay.input_norm(x), cos, sin, aux, lengths, mask, rt)[0], kv),
        "moe": (lambda lay, x, aux: x + lay.mlp(lay.post_norm(x), mesh=rt.mesh, rules=rt.rules,
                                                routed_fn=rt.routed_fn).astype(x.dtype), None),
        "router": (lambda lay, x, aux: router(lay, x, "auto"), None),  # the model's default top-k
        "router_sort": (lambda lay, x, aux: router(lay, x, "sort"), None),  # the two top-k methods (A/B)
        "router_compare": (lambda lay, x, aux: router(lay, x, "compare"), None),
        # the router's dot in f32 (HIGHEST: how an f32 model runs it, and a bf16 one did before session 33), with
        # bf16 operands and f32 accumulation (how a bf16 model runs it now: exactly the same products
        # for a bf16 checkpoint and bf16 activations), and XLA's 9-pass bf16 algorithm for f32 (GPU only)
        "router_logits": (lambda lay, x, aux: router_logits(lay, x, aux, precision=jax.lax.Precision.HIGHEST),
                          moe.router.get_value().astype(jnp.float32)),
        "router_logits_bf16": (lambda lay, x, aux: router_logits(lay, x, aux),
                               moe.router.get_value().astype(jnp.bfloat16)),
        "router_logits_x9": (lambda lay, x, aux: router_logits(
            lay, x, aux, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X9),
                             moe.router.get_value().astype(jnp.float32)),
        # the bf16 dot through ``layers.dot``: on CUDA one token runs padded to two rows (XLA turns a one-row dot
        # into a multiply and a reduce); the same as router_logits_bf16 from two tokens on
        "router_logits_bf16_pad": (lambda lay, x, aux: router_logits(lay, x, aux, padded=True),
                                   moe.router.get_value().astype(jnp.bfloat16)),
        "routed_experts": (lambda lay, x, aux: routed(lay.mlp, x, aux), (ids, weights)),
        "shared_expert": (lambda lay, x, aux: x + lay.mlp.shared(x).astype(x.dtype), None),
        "elementwise": (lambda lay, x, aux: x + 1e-6 * x, None),
    }


def weight_bytes_per_device(state, mesh_shape) -> dict:
    """Weight bytes each device holds (its addressable shards) against the memory planner's
    per-device prediction for the same state and mesh shape."""
    held = held_bytes_per_device(state)
    planned = sum(v["per_device"] for v in param_bytes(state, mesh_shape, DEFAULT_RULES).values())
    return {"held_max": max(held.values()), "held_min": min(held.values()), "planned_per_device": planned,
            "devices": len(held)}


def looped(gdef, step, iters: int):
    def run(state, x, aux):
        lay = nnx.merge(gdef, state)
        return jax.lax.fori_loop(0, iters, lambda i, x: step(lay, x, aux), x)
    return jax.jit(run)


def unrolled(gdef, step):
    """A chain builder for ``traced_call_time``: n unrolled steps, each feeding the next."""
    def chain(_, n):
        def run(state, x, aux):
            lay = nnx.merge(gdef, state)
            for _ in range(n):
                x = step(lay, x, aux)
            return x
        return jax.jit(run)
    return chain


def write_hlo(text: str, path: str) -> None:
    """One compiled program's optimized HLO, gzipped (a full layer's chain is megabytes of text)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with gzip.open(path, "wt") as f:
        f.write(text)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--size", choices=["full", "tiny"], default="full")
    p.add_argument("--ms", default="1,65")
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--commit", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--mesh", default=None, help="DATAxMODEL, e.g. 1x2: run the layer sharded over that mesh")
    p.add_argument("--local-of", type=int, default=None, metavar="G",
                   help="time on one device what one device of a 1xG mesh computes (abstract_layer): its heads, "
                        "shared-expert width and experts, routed as the busiest device's; the collectives left out")
    p.add_argument("--calls", type=int, default=8, help="unrolled steps of the traced chain")
    p.add_argument("--no-loop", action="store_true", help="on a GPU, skip the fori_loop timing (us_loop): half the run")
    p.add_argument("--parts", default="", help=f"comma list of the parts to time ({', '.join(PARTS)}; dispatched: "
                   "the layer as one dispatched call); default all")
    p.add_argument("--moe-tuning", default="", metavar="K=V,...",
                   help="routed_experts_tiled keyword arguments in place of its defaults, e.g. split=1 (ints, None); "
                   "the result file's name carries them")
    p.add_argument("--hlo", action="store_true", help="also write each traced chain's optimized HLO to "
                   "OUT/hlo_<name>_<part>_M<m>.txt.gz (its fusions are the trace's kernel names; no extra compile)")
    args = p.parse_args(argv)
    if args.hlo and not args.out:
        p.error("--hlo needs --out")
    try:
        moe_tuning = parse_settings(args.moe_tuning, "--moe-tuning")
    except ValueError as e:
        p.error(str(e))
    wanted = {v for v in args.parts.split(",") if v}
    if wanted - set(PARTS):
        p.error(f"unknown parts {sorted(wanted - set(PARTS))}; known: {sorted(PARTS)}")
    if args.local_of is not None and (args.local_of < 2 or args.mesh):
        p.error(f"--local-of takes a device count of at least 2, without --mesh; got {args.local_of}"
                + (f" with --mesh {args.mesh}" if args.mesh else ""))
    traced = jax.default_backend() == "gpu"  # a CPU trace holds host thunks, not a device timeline
    started = time.perf_counter()  # the script's own seconds per phase go to the log (device time is scarce)
    bandwidth = measure_torch_copy_bandwidth() or measure_copy_bandwidth()
    try:
        cfg, layer = build_layer(args.size, args.local_of)
    except ValueError as e:
        p.error(str(e))
    gdef, state = nnx.split(layer)
    rt, memory = Runtime(), None
    if args.local_of:
        memory = {"held": bytes_of(state), "planned_per_device": sum(v["per_device"] for v in param_bytes(
            abstract_layer(cfg)[1], {"data": 1, "model": args.local_of}, DEFAULT_RULES).values())}
        print("one device's weights", memory, flush=True)
    if args.mesh:
        mesh_shape = parse_mesh(args.mesh)
        mesh = make_mesh(**mesh_shape)
        rt = Runtime(mesh=mesh, rules=DEFAULT_RULES)
        state = shard_state(state, mesh, DEFAULT_RULES)
        layer = nnx.merge(gdef, state)
        memory = weight_bytes_per_device(state, mesh_shape)
        print("weights per device", memory, flush=True)
    print(f"setup {time.perf_counter() - started:.1f} s (copy bandwidth, weights, repack)", flush=True)
    # the bytes one device holds (under a mesh: of its shards, the busiest device's; the shards are even)
    on_device = lambda tree: max(held_bytes_per_device(tree).values())  # noqa: E731
    moe_bytes = on_device(nnx.state(layer.mlp))
    rest_bytes = on_device(state) - moe_bytes  # the attention and the norms
    attention_bytes = on_device(nnx.state(layer.attn))
    shared_bytes = on_device(nnx.state(layer.mlp.shared))
    experts_bytes = bytes_of((layer.mlp.w13.get_value(), layer.mlp.w2.get_value()))  # the stack, every device's
    # the router's weight and bias as stored, read in full by every token (replicated)
    router_all_bytes = on_device((layer.mlp.router.get_value(), layer.mlp.router_bias.get_value()))
    router_bytes = layer.mlp.router.get_value().size * 4  # the router's dot alone: its weight as f32
    rows = []

    def save(rows):
        payload = {"config": {"size": args.size, "prefix": args.prefix, "iters": args.iters, "repeats": args.repeats,
                              "calls": args.calls, "traced": traced, "loop": not (traced and args.no_loop),
                              "dtype": cfg.dtype, "mesh": args.mesh, "local_of": args.local_of,
                              "moe_tuning": moe_tuning, "hidden_size": cfg.hidden_size},
                   "copy_bw_Bps": bandwidth, "rows": rows, "weights_per_device": memory}
        if args.commit:
            payload["commit"] = args.commit
        print("wrote", write_result(result_name(), payload, args.out), flush=True)

    def result_name():  # a tuned run gets its own file beside the default's
        return f"bench_layer_{args.size}" + (f"_mesh{args.mesh}" if args.mesh else "") \
            + (f"_local{args.local_of}" if args.local_of else "") \
            + "".join(f"_{k}{v}" for k, v in moe_tuning.items())

    for m in [int(v) for v in args.ms.split(",")]:
        x = (0.1 * jax.random.normal(jax.random.key(m), (1, m, cfg.hidden_size), jnp.float32)).astype(cfg.dtype)
        rt_m, load = uniform_routing(cfg, layer, m, rt, args.local_of, moe_tuning)
        # the busiest device's distinct experts, of those its stack holds (all E, E / G with --local-of)
        routed_bytes = load["distinct"][load["device"]] / layer.mlp.w13.get_value().shape[0] * experts_bytes
        print(f"M={m}: device {load['device']} is the busiest: distinct experts per device {load['distinct']}, "
              f"pairs {load['pairs']}", flush=True)
        kv_bytes = (args.prefix + m) * cfg.latent_dim * jnp.dtype(cfg.dtype).itemsize
        # per device: its shards of the other weights, the busiest device's routed experts, the latent cache whole
        floors = {"layer": rest_bytes + shared_bytes + routed_bytes + router_all_bytes + kv_bytes,
                  "attention": attention_bytes + kv_bytes,
                  "moe": shared_bytes + routed_bytes + router_all_bytes, "routed_experts": routed_bytes,
                  "shared_expert": shared_bytes, "router_logits": router_bytes, "router_logits_x9": router_bytes,
                  "router_logits_bf16": router_bytes / 2, "router_logits_bf16_pad": router_bytes / 2}
        for name, (step, aux) in parts(cfg, layer, m, args.prefix, rt_m).items():
            if wanted and name not in wanted:
                continue
            if rt.mesh is not None:  # inputs on every device up front: else each call copies them over (P2P)
                x, aux = jax.device_put((x, aux), NamedSharding(rt.mesh, PartitionSpec()))
            fn = looped(gdef, step, args.iters)
            part_started = time.perf_counter()
            try:
                t_loop = None if traced and args.no_loop else \
                    time_fn(fn, state, x, aux, repeats=args.repeats)["median_s"] / args.iters
                program = unrolled(gdef, step)(None, args.calls)  # one jitted chain: --hlo reads its compile
                trace = traced_call_time(None, (state, x, aux), args.calls, chain=lambda *_: program) \
                    if traced else None
                if args.hlo:  # on a GPU the compile the trace made; on a CPU one more compile
                    write_hlo(program.lower(state, x, aux).compile().as_text(),
                              os.path.join(args.out, f"hlo_{result_name()}_{name}_M{m}.txt.gz"))
            except Exception as e:  # noqa: BLE001 - keep the other parts
                print(f"{name} M={m} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            t = trace["span_s"] if trace else t_loop
            row = {"M": m, "part": name, "us": 1e6 * t, "us_loop": t_loop and 1e6 * t_loop}
            row["routing"] = load
            if trace:  # where the part's device time goes: its slowest kernels, µs per call (per device)
                row["kernels"] = [[k, launches, round(1e6 * sec, 2)] for k, launches, sec in trace["kernels"][:40]]
                row.update(us_repeats=[round(1e6 * v, 2) for v in trace["span_repeats_s"]],
                           busy_us=1e6 * trace["busy_s"], idle_us=1e6 * trace["idle_s"],
                           span_per_device_us=[round(1e6 * v, 2) for v in trace["span_per_device_s"]],
                           largest_gaps_us=trace["largest_gaps_us"])
            if name in floors:
                row["floor_us"] = 1e6 * floors[name] / bandwidth
                row["pct_of_bw"] = 100 * row["floor_us"] / row["us"]
            row["script_s"] = round(time.perf_counter() - part_started, 1)  # compiles included
            rows.append(row)
            print({k: v for k, v in row.items() if k != "kernels"}, flush=True)
            save(rows)  # after every part, so that a run cut short keeps what it measured
        if wanted and "dispatched" not in wanted:
            continue
        single = jax.jit(lambda st, x, aux: parts(cfg, nnx.merge(gdef, st), m, args.prefix, rt_m)["layer"][0](
            nnx.merge(gdef, st), x, aux))
        kv = parts(cfg, layer, m, args.prefix, rt_m)["layer"][1]
        t_single = time_fn(single, state, x, kv, repeats=args.repeats)["median_s"]
        rows.append({"M": m, "part": "layer, one dispatched call", "us": 1e6 * t_single,
                     "floor_us": 1e6 * floors["layer"] / bandwidth,
                     "pct_of_bw": 100 * floors["layer"] / bandwidth / t_single})
        print(rows[-1], flush=True)
        save(rows)
    print_table(rows, ["M", "part", "us", "us_loop", "floor_us", "pct_of_bw"])


if __name__ == "__main__":
    main()
