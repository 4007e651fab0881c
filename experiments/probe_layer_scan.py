"""Would the target's MoE layers under one ``lax.scan`` compile in less time than unrolled? The target's verify
forward compiled both ways from abstract weights, at several layer counts (issue #7: at 61 unrolled layers each
engine program compiles for minutes, ``compile_mesh.py``).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. \\
        python experiments/probe_layer_scan.py --mesh 1x8 --layers 4,16,61      # CPU, 8 host devices
    PYTHONPATH=. python experiments/probe_layer_scan.py --mesh 1x8 --mock-gpus --layers 4,61 --out DIR  # one GPU

``unrolled`` is ``KimiModel.__call__``: a Python loop over the layers, each its own weights in the program. ``scan``
(``scanned_forward``) runs the dense layers as they are and then one ``lax.scan`` over the MoE layers, whose weights
are stacked on a leading axis (``stack_states``): the layer's body is traced and compiled once. The two give the
same logits and latents (``tests/test_probe_layer_scan.py``). Weights, experts repacked for the Mosaic GPU kernel,
are abstract; nothing runs. Per layer count and variant: seconds to lower and to compile, and XLA's scratch bytes
(``--hlo-dir``: the compiled programs, to see what the loop copies).

On 8 CPU devices (session 67) the scan compiled the full 61-layer forward 16x sooner than the unrolled loop, but its
loop copies each layer's packed experts out of the stack (a 0.7 GB dynamic-slice per layer and device) and converts
every layer's expert scales to f32 before the loop, the twins' way: where the kernels take one layer's weights as
their operands, a scan would need them to read the stack in place at the layer's index.

The model, its loaders and its checkpoints keep one module per layer; stacking them is what adopting the scan would
take, and this probe measures whether it would pay first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from ddtree_jax.cache import LatentCache, init_cache  # noqa: E402
from ddtree_jax.engine import place_caches  # noqa: E402
from ddtree_jax.memory_plan import parse_mesh  # noqa: E402
from ddtree_jax.model import ForwardOutput, KimiModel, Runtime  # noqa: E402
from ddtree_jax.rope import rope_cos_sin  # noqa: E402
from ddtree_jax.sharding import DEFAULT_RULES, make_mesh, shard_state  # noqa: E402
from experiments.bench_mesh import model_configs  # noqa: E402
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

    def body(x, layer_in):
        state, cache_kv = layer_in
        return nnx.merge(layer_def, state)(x, cos, sin, cache_kv, cache.lengths, tree_mask, runtime)

    x, moe_kv = jax.lax.scan(body, x, (stacked, cache.kv[len(block_kv):]))
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="1x8", help="DATAxMODEL, e.g. 1x8")
    p.add_argument("--mock-gpus", action="store_true", help="as compile_mesh.py's: one GPU stands in for the mesh")
    p.add_argument("--size", choices=["full", "tiny"], default="full")
    p.add_argument("--layers", default="4,61", help="comma-separated target layer counts")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tree", type=int, default=9, help="tree nodes per stream (budget + 1)")
    p.add_argument("--prefix", type=int, default=4096)
    p.add_argument("--hlo-dir", default=None, help="write each compiled program's HLO here (layers_variant.hlo.txt)")
    p.add_argument("--commit", default=None, help="commit to record (the device copy has no .git)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        mesh_shape = parse_mesh(args.mesh)
        layer_counts = [int(v) for v in args.layers.split(",")]
    except ValueError as e:
        p.error(str(e))
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        p.error(f"--variants: choose from {', '.join(VARIANTS)}")
    if min(layer_counts) < 2 or min(args.streams, args.tree, args.prefix) < 1:
        p.error("--layers need at least 2 (a dense layer and a MoE one); --streams, --tree, --prefix at least 1")
    needed = mesh_shape["data"] * mesh_shape["model"]
    if args.mock_gpus:
        mock_gpus(needed)
    if needed > len(jax.devices()):
        p.error(f"--mesh {args.mesh} needs {needed} devices; this process sees {len(jax.devices())}")
    runtime = Runtime(mesh=make_mesh(**mesh_shape), rules=DEFAULT_RULES)
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
    rows = []
    for layers in layer_counts:
        cfg, dcfg = model_configs(args.size, layers)
        target, _ = abstract_models(cfg, dcfg)
        target = nnx.merge(nnx.graphdef(target), shard_state(nnx.state(target), runtime.mesh, runtime.rules))
        inputs = abstract_inputs(cfg, args.streams, args.tree, args.prefix, runtime)
        for variant in variants:
            hlo = os.path.join(args.hlo_dir, f"{layers}_{variant}.hlo.txt") if args.hlo_dir else None
            rows.append({"layers": layers, **compile_variant(variant, target, inputs, runtime, hlo)})
            print(rows[-1], flush=True)
    payload = {"config": vars(args), "mesh_shape": mesh_shape, "platform": jax.devices()[0].platform, "rows": rows,
               "code_commit": args.commit}
    report(f"probe_layer_scan_{args.size}_{args.mesh}", payload, args.out)
    return rows


if __name__ == "__main__":
    main()
