"""Probe for the INT4 MoE Pallas kernels: dumps XLA/Triton PTX for one config (M=1).

    XLA_FLAGS=--xla_dump_to=DIR PYTHONPATH=. python3 experiments/moe_probe.py [dequant] [M] [E]
"""
import functools
import sys

import jax
import jax.numpy as jnp

from experiments.bench_moe import random_weights, routing
from pallas_kernels.int4_moe import int4_moe

mode = sys.argv[1] if len(sys.argv) > 1 else "asm"
m = int(sys.argv[2]) if len(sys.argv) > 2 else 1
e = int(sys.argv[3]) if len(sys.argv) > 3 else 16
w = random_weights(jax.random.key(0), e, 7168, 2048)
ids, rw = routing(m, "uniform", 0, e=e)
x = jax.random.normal(jax.random.key(1), (m, 7168), jnp.bfloat16)
y = jax.jit(functools.partial(int4_moe, dequant=mode))(x, ids, rw, w)
print("probe ok", y.shape, float(jnp.abs(y.astype(jnp.float32)).mean()))
