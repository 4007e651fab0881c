"""Probe for the INT4 MoE Pallas kernels: dumps XLA/Triton PTX for one config (M=1).

    XLA_FLAGS=--xla_dump_to=DIR PYTHONPATH=. python3 experiments/moe_probe.py [dequant] [M] [E]
"""
import argparse
import functools

import jax
import jax.numpy as jnp

from experiments.bench_moe import random_weights, routing
from pallas_kernels.int4_moe import int4_moe

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("dequant", nargs="?", default="asm", choices=["asm", "magic", "int"])
ap.add_argument("M", nargs="?", type=int, default=1, help="tokens")
ap.add_argument("E", nargs="?", type=int, default=16, help="experts")
args = ap.parse_args()
if args.M < 1 or args.E < 1:
    ap.error(f"M and E must be >= 1, got M={args.M}, E={args.E}")
mode, m, e = args.dequant, args.M, args.E
w = random_weights(jax.random.key(0), e, 7168, 2048)
ids, rw = routing(m, "uniform", 0, e=e)
x = jax.random.normal(jax.random.key(1), (m, 7168), jnp.bfloat16)
y = jax.jit(functools.partial(int4_moe, dequant=mode))(x, ids, rw, w)
print("probe ok", y.shape, float(jnp.abs(y.astype(jnp.float32)).mean()))
