"""Would the target's MoE layers under one ``lax.scan`` compile in less time than unrolled? The target's verify
forward compiled both ways from abstract weights, at several layer counts (issue #7: at 61 unrolled layers each
engine program compiled for minutes before ``model.apply_layer``, ``compile_mesh.py``).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. \\
        python experiments/probe_layer_scan.py --mesh 1x8 --layers 4,16,61      # CPU, 8 host devices
    PYTHONPATH=. python experiments/probe_layer_scan.py --mesh 1x8 --mock-gpus --layers 4,61 --out DIR  # one GPU

``unrolled`` is ``KimiModel.__call__``: a Python loop over the layers, each its own weights in the program (since
session 68 each layer called through ``model.apply_layer``, so one body per layer structure is traced and lowered,
and XLA inlines it at every call). ``scan`` (``scanned_forward``) runs the dense layers as they are and then one
``lax.scan`` over the MoE layers, whose weights are stacked on a leading axis (``stack_states``): the layer's body
is compiled once. The two give the same logits and latents (``tests/test_probe_layer_scan.py``). Weights, experts
repacked for the Mosaic GPU kernel, are abstract; nothing runs. Per layer count and variant: seconds to lower and to
compile, and XLA's scratch bytes (``--hlo-dir``: the compiled programs, to see what the loop copies).

``--run`` makes random weights on the one device and times both variants' verify forward (device time from
profiler traces of dependent forwards on a GPU, wall time elsewhere), beside the floor of copying every MoE layer's
weights other than its experts out of the stack (``copy_floor_ms``):

    PYTHONPATH=. python experiments/probe_layer_scan.py --run --mesh 1x1 --layers 3 --streams 1,8 --out DIR

Session 68 (H100): at 61 layers the scan compiles for the mock 1x8 mesh in 1.1 + 4.1 s, and XLA:GPU feeds the MoE
kernels their layer of the stacked experts in place (a dynamic-slice fusion around each Mosaic call). But it copies
the layer's attention, router and shared-expert weights out of the stack every step: run, the scan took 0.24 ms
more per MoE layer (1 / 8 streams: 3.19 / 7.01 ms against 2.72 / 6.51 for 1 dense + 2 MoE layers), what those
copies cost. ``apply_layer`` brought the unrolled compile down instead (16 layers: 18.2 + 42.6 s before, 1.8 + 17.5
s after), so the model keeps one module per layer and no scan.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from ddtree_jax.cache import LatentCache, init_cache  # noqa: E402
from ddtree_jax.engine import place_caches  # noqa: E402
from ddtree_jax.memory_plan import array_bytes, parse_mesh  # noqa: E402
from ddtree_jax.model import ForwardOutput, KimiModel, Runtime  # noqa: E402
from pallas_kernels.int4_tiles import TiledInt4  # noqa: E402
from ddtree_jax.rope import rope_cos_sin  # noqa: E402
from ddtree_jax.sharding import DEFAULT_RULES, make_mesh, shard_state  # noqa: E402
from experiments.bench_engine import random_verify_inputs  # noqa: E402
from experiments.bench_mesh import model_configs, random_target  # noqa: E402
from experiments.bench_util import measure_copy_bandwidth, time_fn, traced_call_time  # noqa: E402
from experiments.compile_mesh import abstract_models, memory_row, mock_gpus, report  # noqa: E402

VARIANTS = ("unrolled", "scan")


def stack_states(states):
    """One state from several of one structure, each leaf stacked on a new leading axis (its sharding, where the
    leaves are abstract and sharded, unsplit along it)."""
    def stack(*leaves):
        first = leaves[0]
        if isinstance(first, jax.ShapeDtypeStruct):
            sharding = first.sharding
            if isinstance(sharding, NamedSharding):
                sharding = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
            return jax.ShapeDtypeStruct((len(leaves),) + tuple(first.shape), first.dtype, sharding=sharding)
        return jnp.stack(leaves)
    return jax.tree.map(stack, *states)


def split_for_scan(model: KimiModel):
    """(the model without its MoE layers, the MoE layer's graph, the MoE layers' stacked state)."""
    first = model.cfg.first_k_dense_replace
    moe = list(model.layers)[first:]
    layer_def, _ = nnx.split(moe[0])
    stacked = stack_states([nnx.split(layer)[1] for layer in moe])
    head = nnx.merge(*nnx.split(model))  # a copy whose layer list is cut to the dense ones
    head.layers = nnx.List(list(head.layers)[:first])
    return head, layer_def, stacked


def scanned_forward(head: KimiModel, layer_def, stacked, tokens, positions, cache: LatentCache, tree_mask,
                    runtime: Runtime = Runtime()) -> ForwardOutput:
    """``KimiModel.__call__`` (no taps, logits at every row) with the MoE layers under one ``lax.scan``."""
    cfg = head.cfg
    x = head.embed_tokens(tokens)
    cos, sin = rope_cos_sin(positions, cfg.rope, cfg.qk_rope_head_dim)
    block_kv = []
    for i, layer in enumerate(head.layers):
        x, kv = layer(x, cos, sin, cache.kv[i], cache.lengths, tree_mask, runtime)
        block_kv.append(kv)

    first = len(block_kv)

    def body(x, layer_in):  # the cache indexed in the loop, not sliced before it (a GPU kernel reads it in place)
        state, index = layer_in
        kv_layer = jax.lax.dynamic_index_in_dim(cache.kv, index, keepdims=False)
        return nnx.merge(layer_def, state)(x, cos, sin, kv_layer, cache.lengths, tree_mask, runtime)

    moe_layers = cache.kv.shape[0] - first
    x, moe_kv = jax.lax.scan(body, x, (stacked, first + jnp.arange(moe_layers, dtype=jnp.int32)))
    block_kv = jnp.concatenate([jnp.stack(block_kv), moe_kv]) if block_kv else moe_kv
    return ForwardOutput(logits=head.head(head.norm(x)), block_kv=block_kv, taps=None)


def abstract_inputs(cfg, streams: int, tree: int, prefix: int, runtime: Runtime):
    """A verify step's abstract inputs: ``streams`` trees of ``tree`` nodes over ``prefix`` committed tokens."""
    cache = jax.eval_shape(lambda: init_cache(cfg, streams, prefix + tree))
    cache, _ = place_caches(cache, None, runtime)
    ints = jax.ShapeDtypeStruct((streams, tree), jnp.int32)
    return ints, ints, cache, jax.ShapeDtypeStruct((streams, tree, tree), jnp.bool_)


def compile_variant(variant: str, target: KimiModel, inputs, runtime: Runtime, hlo_path: str | None = None) -> dict:
    """Lowers and compiles the variant's forward (logits and latents) for the abstract inputs; with ``hlo_path``
    the compiled HLO is written there."""
    if variant == "unrolled":
        gdef, state = nnx.split(target)

        def fn(state, tokens, positions, cache, mask):
            out = nnx.merge(gdef, state)(tokens, positions, cache, mask, runtime=runtime)
            return out.logits, out.block_kv
        args = (state,)
    else:
        head, layer_def, stacked = split_for_scan(target)
        head_def, head_state = nnx.split(head)

        def fn(head_state, stacked, tokens, positions, cache, mask):
            out = scanned_forward(nnx.merge(head_def, head_state), layer_def, stacked, tokens, positions, cache, mask,
                                  runtime)
            return out.logits, out.block_kv
        args = (head_state, stacked)
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args, *inputs)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t1
    if hlo_path:
        with open(hlo_path, "w") as fh:
            fh.write(compiled.as_text())
    return {"variant": variant, "lower_s": t1 - t0, "compile_s": compile_s, **memory_row(compiled)}


def dense_bytes(layer_state) -> int:
    """Bytes of one layer's weights other than its routed experts (what a scan's loop slices for XLA's ops)."""
    leaves = jax.tree.leaves(layer_state, is_leaf=lambda v: isinstance(v, TiledInt4))
    return sum(array_bytes(leaf.shape, leaf.dtype) for leaf in leaves if not isinstance(leaf, TiledInt4))


def time_variants(cfg, streams: int, tree: int, prefix: int, calls: int) -> list[dict]:
    """Both variants' verify forward run on the one device over the same random weights and inputs: device time
    per forward from profiler traces of ``calls`` dependent forwards (wall time off GPU), and the time of the
    copies and slices among its kernels (the scan's copies of a layer's weights out of the stack)."""
    vocab = cfg.vocab_size

    def next_tokens(out):  # an int output the next forward's tokens can take
        return (jnp.argmax(out.logits, -1) % vocab).astype(jnp.int32)

    def unrolled(tokens, model, positions, cache, mask):
        return next_tokens(model(tokens, positions, cache, mask))

    target = random_target(cfg)
    tokens, *rest = random_verify_inputs(np.random.default_rng(0), cfg, streams, tree, prefix)
    rows = [time_forward("unrolled", unrolled, (tokens, target, *rest), calls)]
    head, layer_def, stacked = split_for_scan(target)
    del target  # the per-layer weights go once stacked (the stack is a copy)

    def scanned(tokens, head, stacked, positions, cache, mask):
        return next_tokens(scanned_forward(head, layer_def, stacked, tokens, positions, cache, mask))

    rows.append(time_forward("scan", scanned, (tokens, head, stacked, *rest), calls))
    one_layer = jax.tree.map(lambda a: a[0], stacked)
    for row in rows:
        row.update(streams=streams, tree=tree, dense_MB_per_layer=dense_bytes(one_layer) / 1e6)
    return rows


def time_forward(variant: str, fn, args, calls: int) -> dict:
    if jax.devices()[0].platform != "gpu":
        return {"variant": variant, "ms": 1e3 * time_fn(jax.jit(fn), *args, repeats=3, warmup=1)["median_s"]}
    trace = traced_call_time(fn, args, calls)
    # XLA runs the scan's slices of a layer's weights as memcpy launches (session 68: memcpy128, 8 a layer)
    copies = [k for k in trace["kernels"] if k[0].startswith("memcpy") or "slice" in k[0]]
    return {"variant": variant, "ms": 1e3 * trace["span_s"], "busy_ms": 1e3 * trace["busy_s"],
            "copy_ms": 1e3 * sum(k[2] for k in copies), "copy_launches": sum(k[1] for k in copies),
            "kernels": [[k, n, round(1e6 * sec, 2)] for k, n, sec in trace["kernels"][:30]]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="1x8", help="DATAxMODEL, e.g. 1x8 (1x1 with --run)")
    p.add_argument("--mock-gpus", action="store_true", help="as compile_mesh.py's: one GPU stands in for the mesh")
    p.add_argument("--run", action="store_true",
                   help="run both variants on one device with random weights and time them (no mesh)")
    p.add_argument("--size", choices=["full", "tiny"], default="full")
    p.add_argument("--layers", default="4,61", help="comma-separated target layer counts")
    p.add_argument("--variants", default=",".join(VARIANTS), help="compiled variants (--run times both)")
    p.add_argument("--streams", default="8", help="comma-separated stream counts")
    p.add_argument("--tree", type=int, default=9, help="tree nodes per stream (budget + 1)")
    p.add_argument("--prefix", type=int, default=4096)
    p.add_argument("--calls", type=int, default=4, help="--run: dependent forwards per trace")
    p.add_argument("--hlo-dir", default=None, help="write each compiled program's HLO here (layers_variant.hlo.txt)")
    p.add_argument("--commit", default=None, help="commit to record (the device copy has no .git)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        mesh_shape = parse_mesh(args.mesh)
        layer_counts = [int(v) for v in args.layers.split(",")]
        stream_counts = [int(v) for v in args.streams.split(",")]
    except ValueError as e:
        p.error(str(e))
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        p.error(f"--variants: choose from {', '.join(VARIANTS)}")
    if min(layer_counts) < 2 or min(*stream_counts, args.tree, args.prefix, args.calls) < 1:
        p.error("--layers need at least 2 (a dense layer and a MoE one); --streams, --tree, --prefix, --calls at "
                "least 1")
    needed = mesh_shape["data"] * mesh_shape["model"]
    if args.run and (args.mock_gpus or needed != 1 or args.hlo_dir):
        p.error("--run times one device's forwards: --mesh 1x1, and neither --mock-gpus nor --hlo-dir")
    if args.mock_gpus:
        mock_gpus(needed)
    if needed > len(jax.devices()):
        p.error(f"--mesh {args.mesh} needs {needed} devices; this process sees {len(jax.devices())}")
    payload = {"config": vars(args), "mesh_shape": mesh_shape, "platform": jax.devices()[0].platform,
               "code_commit": args.commit}
    rows = []
    if args.run:
        bandwidth = measure_copy_bandwidth()
        for layers, streams in ((ly, st) for ly in layer_counts for st in stream_counts):
            cfg, _ = model_configs(args.size, layers)
            moe_layers = cfg.num_layers - cfg.first_k_dense_replace
            for row in time_variants(cfg, streams, args.tree, args.prefix, args.calls):
                # the floor of copying every MoE layer's dense weights out of the stack (a read and a write)
                row = {"layers": layers, **row, "copy_floor_ms": 2e3 * moe_layers * row["dense_MB_per_layer"] * 1e6
                       / bandwidth}
                rows.append(row)
                print({k: v for k, v in row.items() if k != "kernels"}, flush=True)
        payload["copy_bandwidth_GBps"] = bandwidth / 1e9
        report(f"probe_layer_scan_run_{args.size}", {**payload, "rows": rows}, args.out)
        return rows
    runtime = Runtime(mesh=make_mesh(**mesh_shape), rules=DEFAULT_RULES)
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
    for layers, streams in ((ly, st) for ly in layer_counts for st in stream_counts):
        cfg, dcfg = model_configs(args.size, layers)
        target, _ = abstract_models(cfg, dcfg)
        target = nnx.merge(nnx.graphdef(target), shard_state(nnx.state(target), runtime.mesh, runtime.rules))
        inputs = abstract_inputs(cfg, streams, args.tree, args.prefix, runtime)
        for variant in variants:
            name = f"{layers}_{variant}" + (f"_{streams}" if len(stream_counts) > 1 else "")
            hlo = os.path.join(args.hlo_dir, f"{name}.hlo.txt") if args.hlo_dir else None
            rows.append({"layers": layers, "streams": streams,
                         **compile_variant(variant, target, inputs, runtime, hlo)})
            print(rows[-1], flush=True)
    report(f"probe_layer_scan_{args.size}_{args.mesh}", {**payload, "rows": rows}, args.out)
    return rows


if __name__ == "__main__":
    main()
