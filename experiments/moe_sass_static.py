"""Static look at the INT4 MoE Triton kernels without a GPU: registers, shared memory, inner-loop SASS mix.

    # 1. with the project's JAX: write the Pallas-generated Triton IR (K2.6 dims, M=256) to DIR
    PYTHONPATH=. python3 experiments/moe_sass_static.py dump DIR [design ...]
    # 2. with a pip `triton` (3.6 here; XLA's bundled Triton does the real compile, so this is an estimate)
    python3 experiments/moe_sass_static.py analyze DIR

`analyze` compiles each .ttir for sm_90a (4 warps, 3 stages), runs the bundled ptxas -v and cuobjdump, and
counts the instructions of the longest loop (the K-block loop): wgmma (HGMMA) and its waits, shared-memory
layout conversions (STS/LDSM), global loads (LDG, cp.async LDGSTS), barriers.
"""

import collections
import functools
import os
import re
import subprocess
import sys


def dump(out_dir, designs):
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import pallas_call_registration as reg

    from pallas_kernels.int4_moe import Int4ExpertWeights, int4_moe

    lower = reg.lowering.lower_jaxpr_to_triton_module
    mods = []

    def capture(*a, **k):
        res = lower(*a, **k)
        with res.module.context:
            mods.append(res.module.operation.get_asm(enable_debug_info=False))
        return res

    reg.lowering.lower_jaxpr_to_triton_module = capture
    e, d, f, m, k = 384, 7168, 2048, 256, 8
    sd = jax.ShapeDtypeStruct
    wts = Int4ExpertWeights(w13=sd((e, 2 * f, d // 8), jnp.int32), w13_scale=sd((e, d // 32, 2 * f), jnp.bfloat16),
                            w2=sd((e, d, f // 8), jnp.int32), w2_scale=sd((e, f // 32, d), jnp.bfloat16))
    args = (sd((m, d), jnp.bfloat16), sd((m, k), jnp.int32), sd((m, k), jnp.float32), wts)
    os.makedirs(out_dir, exist_ok=True)
    for design in designs or ["planes", "join"]:
        mods.clear()
        jax.jit(functools.partial(int4_moe, design=design)).trace(*args).lower(lowering_platforms=("cuda",))
        for i, text in enumerate(mods):
            with open(os.path.join(out_dir, f"{design}_{'gate_up' if i == 0 else 'down'}.ttir"), "w") as fh:
                fh.write(text)


def loop_mix(sass_text):
    ins = [(int(mm.group(1), 16), mm.group(2)) for mm in
           (re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);", line) for line in sass_text.splitlines()) if mm]
    best = []
    for addr, txt in ins:
        tgt = re.search(r"BRA .*0x([0-9a-f]+)", txt)
        if tgt and int(tgt.group(1), 16) < addr:
            body = [t for a, t in ins if int(tgt.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in best)
    ops["wgmma_waits"] = sum("WARPGROUP.DEPBAR" in t for t in best)
    return len(best), ops


def analyze(out_dir):
    import triton
    from triton.backends.compiler import GPUTarget

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in sorted(n for n in os.listdir(out_dir) if n.endswith(".ttir")):
        path = os.path.join(out_dir, name)
        kern = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
        with open(path + ".ptx", "w") as fh:
            fh.write(kern.asm["ptx"])
        res = subprocess.run([os.path.join(bindir, "ptxas"), "-arch=sm_90a", "-v", path + ".ptx", "-o", path + ".o"],
                             capture_output=True, text=True)
        regs = re.search(r"Used (\d+) registers", res.stderr)
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", path + ".o"], capture_output=True,
                              text=True).stdout
        n, ops = loop_mix(sass)
        keys = ["HGMMA", "wgmma_waits", "FFMA", "HFMA2", "HMUL2", "PRMT", "LOP3", "STS", "LDSM", "LDS", "LDG",
                "LDGSTS", "BAR"]
        print(f"{name}: {regs.group(1) if regs else '?'} regs, {kern.metadata.shared} B smem; K-block loop {n} "
              "instrs: " + ", ".join(f"{k} {ops[k]}" for k in keys))


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("dump", "analyze") or (sys.argv[1] == "analyze" and len(sys.argv) > 3):
        sys.exit("usage: moe_sass_static.py dump DIR [design ...] | analyze DIR  (see the module docstring)")
    if sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3:])
    else:
        analyze(sys.argv[2])
