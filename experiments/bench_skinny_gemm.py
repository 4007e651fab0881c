"""The dense projections of a K2.6 layer and of the DFlash drafter at decode widths (M = 1-33 tokens) as XLA
runs them, each against its bytes-read floor: which formulation of ``x @ W`` streams the weight at the
copy's pace when only a few tokens multiply it.

    PYTHONPATH=. python experiments/bench_skinny_gemm.py --out DIR
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false PYTHONPATH=. python experiments/bench_skinny_gemm.py --out DIR2

Products: the dense ``x [M, K] @ W [K, N]`` and the absorbed MLA's w_uk and w_uv, batched over the 64 heads
(``ddtree_jax.model``'s specs with M tokens in place of b, t).

Variants (all bf16 operands, f32 accumulation, bf16 result, as ``ddtree_jax.layers.dot``; each where it
applies):
* ``kn``: the model's layout and spec (dense: W stored [K, N], ``einsum("mk,kn->mn")``);
* ``nk``: W stored [N, K], ``einsum("mk,nk->mn")``;
* ``split{S}``: W [K, N] seen as [S, K/S, N], S partial products (a batched dot: S times the programs
  along N) summed in f32: split-K written in XLA;
* ``pad{P}``: fewer than P token rows padded with zero rows to P, the result sliced back (XLA compiles a
  one-row dot as a matrix-vector product, tiled apart from M >= 2);
* ``hmajor`` (batched products): the weight stored with the head axis first.

Timing: device time per call from profiler traces of a chain of ``--calls`` dependent calls (8; 2 with
``--smoke``), the median of ``--trace-repeats`` traces (3; one with ``--smoke``; ``bench_util.traced_call_time``),
each call on the next of ``copies`` weight copies whose bytes together exceed 4x the 50 MB L2 (one layer's weights
are never in L2 when the next layer runs). Floor: the weight's bytes over PyTorch's device copy measured in the same
run. XLA_FLAGS as set for the process is recorded.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import bench_util  # noqa: E402

# Each product: (einsum spec with the tokens as x's first axis m, x's shape after m, the weight's shape).
# K2.6 attention (q_a, kv_a, q_b, o; the absorbed w_uk and w_uv, batched over the 64 heads), shared expert
# (gate, up, down), dense MLP (layer 0), DFlash drafter (q, k / v).
DENSE = "mk,kn->mn"
SHAPES = {
    "q_a": (DENSE, (7168,), (7168, 1536)), "kv_a": (DENSE, (7168,), (7168, 576)),
    "q_b": (DENSE, (1536,), (1536, 12288)), "o": (DENSE, (8192,), (8192, 7168)),
    "w_uk": ("mhn,lhn->mhl", (64, 128), (512, 64, 128)), "w_uv": ("mhl,lhv->mhv", (64, 512), (512, 64, 128)),
    "shared_gate": (DENSE, (7168,), (7168, 2048)), "shared_down": (DENSE, (2048,), (2048, 7168)),
    "dense_up": (DENSE, (7168,), (7168, 18432)), "dense_down": (DENSE, (18432,), (18432, 7168)),
    "drafter_q": (DENSE, (7168,), (7168, 8192)), "drafter_kv": (DENSE, (7168,), (7168, 1024)),
}
SMOKE_SHAPES = {"q_b": (DENSE, (64,), (64, 256)), "shared_down": (DENSE, (128,), (128, 64)),
                "w_uk": ("mhn,lhn->mhl", (4, 16), (32, 4, 16))}
L2_BYTES = 50 << 20


def variant_fn(name: str, spec: str = DENSE):
    """``fn(x, w)`` computing ``spec`` by a variant, and the weight's layout transform for it. ``nk`` and
    ``split{S}`` take the dense spec only, ``hmajor`` a spec with a batch axis (heads) shared by x and w."""
    def einsum(spec, x, w):
        return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    ins, out = spec.split("->")
    x_labels, w_labels = ins.split(",")
    batch = [c for c in w_labels if c in x_labels and c in out]
    if name == "kn":
        return lambda x, w: einsum(spec, x, w), lambda w: w
    if name.startswith("pad"):  # fewer than P token rows padded with zeros to P (XLA tiles M = 1 apart)
        rows = int(name[len("pad"):])

        def fn(x, w):
            m = x.shape[0]
            pads = [(0, max(0, rows - m))] + [(0, 0)] * (x.ndim - 1)
            return einsum(spec, jnp.pad(x, pads), w)[:m]
        return fn, lambda w: w
    if name == "hmajor" and batch:  # the shared (head) axis first in the weight
        moved = batch[0] + w_labels.replace(batch[0], "")
        order = [w_labels.index(c) for c in moved]
        return lambda x, w: einsum(f"{x_labels},{moved}->{out}", x, w), lambda w: jnp.transpose(w, order)
    if spec == DENSE and name == "nk":
        return lambda x, w: einsum("mk,nk->mn", x, w), lambda w: w.T
    if spec == DENSE and name.startswith("split"):
        s = int(name[len("split"):])

        def fn(x, w):
            k, n = w.shape
            parts = jnp.einsum("msk,skn->smn", x.reshape(x.shape[0], s, k // s), w.reshape(s, k // s, n),
                               preferred_element_type=jnp.float32)
            return parts.sum(0).astype(jnp.bfloat16)
        return fn, lambda w: w
    raise ValueError(f"unknown variant {name!r} for {spec!r}")


def known_variant(name: str) -> bool:
    """Whether ``name`` is a variant of ``variant_fn`` (kn, nk, hmajor, split{S} or pad{P}, S and P positive
    integers), whether or not it applies to a given product."""
    for prefix in ("split", "pad"):
        if name.startswith(prefix):
            return name[len(prefix):].isdigit() and int(name[len(prefix):]) > 0
    return name in ("kn", "nk", "hmajor")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", default="1,9,33")
    p.add_argument("--shapes", default=None, help=f"comma list of {', '.join(SHAPES)} (default: all; not with "
                   "--smoke, which runs its own tiny shapes)")
    p.add_argument("--variants", default="kn,nk,split2,split4,split8",
                   help="kn, nk, split{S}, pad{P}, hmajor (each where it applies to a product)")
    bench_util.add_trace_args(p)
    p.add_argument("--commit", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, each variant checked, timings meaningless")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if not known_variant(v)]
    if unknown:
        p.error(f"--variants: unknown {unknown}; known: kn, nk, split{{S}}, pad{{P}}, hmajor (S, P positive)")
    if args.smoke and args.shapes is not None:
        p.error("--smoke runs its own tiny shapes: leave out --shapes")
    calls, trace_repeats = bench_util.trace_args(p, args)
    names = (args.shapes or ",".join(SHAPES)).split(",")
    if any(n not in SHAPES for n in names):
        p.error(f"--shapes: unknown {[n for n in names if n not in SHAPES]}; known: {', '.join(SHAPES)}")
    shapes = SMOKE_SHAPES if args.smoke else {k: SHAPES[k] for k in names}
    bandwidth = (bench_util.measure_torch_copy_bandwidth() or bench_util.measure_copy_bandwidth()) \
        if not args.smoke else bench_util.measure_copy_bandwidth(1 << 24)
    rows = []

    def save(rows):
        config = {**vars(args), "calls": calls, "trace_repeats": trace_repeats,
                  "xla_flags": os.environ.get("XLA_FLAGS", "")}
        payload = {"config": config,
                   "copy_bandwidth_Bps": bandwidth, "rows": rows}
        if args.commit:
            payload["code_commit"] = args.commit
        return bench_util.write_result("bench_skinny_gemm" + ("_smoke" if args.smoke else ""), payload, args.out)

    path = save(rows)
    for name, (spec, x_tail, w_shape) in shapes.items():
        nbytes = int(np.prod(w_shape)) * 2
        copies = max(2, bench_util.rotating_copies(nbytes, reads_over_l2=4, l2_bytes=L2_BYTES))
        base = [jax.random.normal(jax.random.key(i), w_shape, jnp.float32).astype(jnp.bfloat16) * 0.02
                for i in range(copies)]
        applies = {}
        for variant in variants:
            try:
                applies[variant] = variant_fn(variant, spec)
            except ValueError:  # known (checked above), but not for this product
                print(f"{name}: variant {variant} does not apply to {spec}; skipped", flush=True)
                continue
            if variant.startswith("split") and w_shape[0] % int(variant[5:]):
                print(f"{name}: {variant} does not divide K = {w_shape[0]}; skipped", flush=True)
                del applies[variant]
        for m in [int(v) for v in args.ms.split(",")]:
            x = jax.random.normal(jax.random.key(100 + m), (m, *x_tail), jnp.float32).astype(jnp.bfloat16)
            want = np.asarray(jnp.einsum(spec, x, base[0], preferred_element_type=jnp.float32))
            for variant, (fn, layout) in applies.items():
                ws = [layout(w) for w in base]
                got = np.asarray(jax.jit(fn)(x, ws[0]).astype(jnp.float32))
                err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))
                t = bench_util.traced_call_time(fn, (x, *ws), calls, repeats=trace_repeats,
                                                chain=lambda f, n: bench_util.dependent_chain(f, n, rotate=True))
                floor_us = 1e6 * (nbytes + (x.size + want.size) * 2) / bandwidth
                us = 1e6 * t["span_s"]
                rows.append({"shape": name, "spec": spec, "x_shape": list(x.shape), "w_shape": list(w_shape), "M": m,
                             "variant": variant, "us": us, "floor_us": floor_us,
                             "us_repeats": [round(v * 1e6, 2) for v in t["span_repeats_s"]],
                             "pct_of_copy": 100 * floor_us / us, "max_rel_err": err, "copies": copies,
                             "kernels": [[kn[:70], c, round(s * 1e6, 2)] for kn, c, s in t["kernels"][:4]]})
                print({kk: v for kk, v in rows[-1].items() if kk != "kernels"}, flush=True)
                path = save(rows)  # after every point, so that a run cut short keeps what it measured
                del ws
    bad = [r for r in rows if r["max_rel_err"] > 1e-2]
    bench_util.print_table(rows, ["shape", "M", "variant", "us", "floor_us", "pct_of_copy", "max_rel_err"])
    print("wrote", path)
    if bad:
        raise SystemExit(f"{len(bad)} results differ from the reference dot by more than 1e-2")


if __name__ == "__main__":
    main()
