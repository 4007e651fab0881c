"""Compiler reports for the Mosaic GPU INT4 GEMM: runs one configuration with Mosaic GPU's dump switches on
(PTX, ptxas's resource report, SASS) so that registers, spills and the wgmma (HGMMA) sequence can be read.

    PYTHONPATH=. python experiments/dump_moe_isa.py --out $OUT [--n 8] [--gemm gate_up]

Writes the dumps under --out/isa (Mosaic GPU writes them; names follow the kernel) and a summary of the
SASS (instruction counts of interest) to --out/dump_moe_isa.json.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--gemm", default="gate_up", choices=["gate_up", "down"])
    ap.add_argument("--chunk", type=int, default=64, help="activation chunk width (columns per wgmma)")
    ap.add_argument("--kwargs", default="", help="k=v,... passed to grouped_int4_matmul (ints)")
    args = ap.parse_args(argv)
    dump = os.path.join(args.out, "isa")
    os.makedirs(dump, exist_ok=True)
    for flag in ("MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_SASS"):
        os.environ.setdefault(flag, "1")
    os.environ["MOSAIC_GPU_DUMP_TO"] = dump

    import jax
    import jax.numpy as jnp

    from pallas_kernels import int4_moe_mgpu as K

    o, i = (4096, 7168) if args.gemm == "gate_up" else (7168, 2048)
    e = 4
    w = jax.lax.bitcast_convert_type(jax.random.bits(jax.random.key(0), (e, o // 128, (i // K.STEP) * 32, 128),
                                                     jnp.uint32), jnp.int32)
    s = jnp.full((e, o // 128, i // K.GROUP, 128), 0.01, jnp.bfloat16)
    te = jnp.arange(e, dtype=jnp.int32)
    xg = K.to_chunks(jnp.ones((e * args.n, i), jnp.bfloat16), args.chunk)
    kwargs = {k: None if v == "None" else int(v) for k, v in (kv.split("=") for kv in args.kwargs.split(",") if kv)}
    out = jax.jit(lambda *a: K.grouped_int4_matmul(*a, tokens_per_tile=args.n, **kwargs))(xg, w, s, te)
    jax.block_until_ready(out)
    files = sorted(glob.glob(os.path.join(dump, "*")))
    summary = {"files": [os.path.basename(f) for f in files], "config": vars(args)}
    for f in files:
        text = open(f, errors="replace").read()
        if f.endswith(".sass") or "sass" in os.path.basename(f).lower():
            ops = collections.Counter(m.group(1) for m in re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text, re.M))
            summary.setdefault("sass", {})[os.path.basename(f)] = {k: v for k, v in ops.most_common(60)}
        if "ptxas" in os.path.basename(f).lower():
            summary.setdefault("ptxas", {})[os.path.basename(f)] = text[-3000:]
    with open(os.path.join(args.out, "dump_moe_isa.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "sass"}, indent=1)[:4000])
    for name, ops in summary.get("sass", {}).items():
        print(name, {k: v for k, v in ops.items() if any(t in k for t in ("GMMA", "BAR", "DEPBAR", "WARPSYNC", "LDS", "LDL", "STL", "SYNCS"))})


if __name__ == "__main__":
    main()
