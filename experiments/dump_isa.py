"""Compiler reports for a Mosaic GPU kernel: runs one configuration with Mosaic GPU's dump switches on (PTX,
ptxas's resource report, SASS) so that registers, spills and the wgmma (HGMMA) sequence can be read.

    PYTHONPATH=. python experiments/dump_isa.py --out $OUT moe [--n 8] [--gemm gate_up]
    PYTHONPATH=. python experiments/dump_isa.py --out $OUT attention [--t 4] [--h 8] [--kwargs stages=3]

``moe``: the INT4 grouped GEMM (``int4_moe_mgpu``). ``attention``: the MLA attention op at T nodes, H heads,
B = 2 streams over a 1024-slot cache (the narrow kernel where T*H <= 32, else the 64-row one).
Writes the dumps under --out/isa (Mosaic GPU writes them; names follow the kernel), each kernel's SASS
to --out/<kernel>.sass.txt, and a summary to --out/dump_isa.json: per kernel's SASS the instruction counts,
the HGMMAs and how many ``WARPGROUP.DEPBAR`` waits sit between them (one after every HGMMA means ptxas
serialised them), the spills per warpgroup and loop (``spills_by_region``), and the tail of ptxas's report
(its "wgmma serialization" warnings included). Where Mosaic GPU dumps PTX but no SASS (JAX 0.11 on the
H200), the SASS comes from the PTX through ``ptxas`` and ``cuobjdump``/``nvdisasm`` found on the PATH.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import os
import re
import shutil
import subprocess

SASS_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


def _int_kwargs(text: str) -> dict:
    """'k=v,...' -> {k: int(v)} ("None" -> None; 'a/b' -> a tuple of ints). bench_util imports jax, so it is
    imported here, after main has set Mosaic GPU's dump switches."""
    from experiments.bench_util import int_options
    return int_options(text, ",")


def run_moe(args):
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
    return jax.jit(lambda *a: K.grouped_int4_matmul(*a, tokens_per_tile=args.n, **_int_kwargs(args.kwargs)))(
        xg, w, s, te)


def run_attention(args):
    import jax

    from experiments.bench_tree_attention import L, SCALE, make_inputs
    from pallas_kernels import mla_attention_mgpu as M
    from pallas_kernels.mla_attention_narrow import split_attention_narrow

    q, caches, plen, tkv, mask = make_inputs(jax.random.key(0), args.h, 2, args.t, 1024, 1)
    kw = _int_kwargs(args.op_kwargs)
    if args.kwargs and args.wide_kwargs:
        raise SystemExit("--kwargs (the narrow kernel) and --wide-kwargs (the 64-row one) exclude each other")
    if args.kwargs:  # options of the narrow kernel
        kw["kernel"] = functools.partial(split_attention_narrow, **_int_kwargs(args.kwargs))
    if args.wide_kwargs:
        kw["kernel"] = functools.partial(M.split_attention, **_int_kwargs(args.wide_kwargs))
    fn = jax.jit(functools.partial(M.tree_attention_mgpu, scale=SCALE, kv_lora_rank=L, **kw))
    return fn(q, caches[0], plen, tkv, mask)


def sass_from_ptx(ptx_path: str, ptxas: str, disassembler: str, arch: str = "sm_90a") -> str:
    """The SASS text of a PTX file: ``ptxas`` to a cubin beside it, then ``cuobjdump -sass`` or ``nvdisasm``."""
    cubin = os.path.splitext(ptx_path)[0] + ".cubin"
    subprocess.run([ptxas, f"--gpu-name={arch}", ptx_path, "-o", cubin], check=True, capture_output=True)
    flag = "-sass" if os.path.basename(disassembler).startswith("cuobjdump") else "-c"
    return subprocess.run([disassembler, flag, cubin], check=True, capture_output=True, text=True).stdout


def wgmma_waits(instructions: list[str]) -> dict:
    """In SASS instructions in address order: the HGMMAs, the ``WARPGROUP.DEPBAR`` waits, and the HGMMA pairs
    with a wait between them (a wait after every HGMMA: ptxas serialised the wgmmas)."""
    hgmma = [n for n, ins in enumerate(instructions) if "HGMMA" in ins]
    waits = [n for n, ins in enumerate(instructions) if "WARPGROUP.DEPBAR" in ins]
    between = sum(any(a < w < b for w in waits) for a, b in zip(hgmma, hgmma[1:]))
    return {"hgmma": len(hgmma), "warpgroup_depbar": len(waits), "hgmma_pairs_with_a_wait_between": between}


SASS_ADDR = re.compile(r"^\s+/\*([0-9a-f]+)\*/")
SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH_TARGET = re.compile(r"\bBRA\s+(?:`\((\.L_x_\d+)\)|(0x[0-9a-f]+))")
REGISTER = re.compile(r"\bR(\d+)\b")
LOOP_MIN_INSTRUCTIONS = 32  # shorter backward branches are barrier-wait spins


def label_addresses(lines: list[str]) -> dict[str, int]:
    """nvdisasm's branch labels (``.L_x_13:``) -> the address of the instruction that follows each."""
    out, pending = {}, []
    for ln in lines:
        if (label := SASS_LABEL.match(ln)):
            pending.append(label.group(1))
        elif (addr := SASS_ADDR.match(ln)):
            out.update({name: int(addr.group(1), 16) for name in pending})
            pending = []
    return out


def spills_by_region(instructions: list[str], labels: dict[str, int] | None = None) -> list[dict]:
    """In SASS instructions in address order: the local-memory spills (STL stores, LDL loads) between one
    ``USETMAXREG`` (a warpgroup's register budget, ``setmaxnreg``) and the next, so that a spill can be
    placed in the producer's or a consumer's code (a warpgroup's code follows its setmaxnreg in Mosaic GPU's
    layout; the region before the first is the kernel's prologue). Per region also the highest register
    it names (ptxas keeps a region within its setmaxnreg budget) and its loops: each backward branch of at
    least ``LOOP_MIN_INSTRUCTIONS`` instructions and no EXIT between its target and itself (ptxas puts the
    barrier waits' retries past the kernel's end, jumping back), with the spills in that range (a spill
    outside the per-block loops costs once a program, not once a block). ``labels``: nvdisasm's branch
    labels (``label_addresses``); cuobjdump's branches name addresses."""
    labels = labels or {}
    regions, current = [], {"setmaxnreg": "(prologue)", "instructions": 0, "STL": 0, "LDL": 0}
    spans, branches = [], []  # (first index, last index) of each region; (index, target address) of each BRA
    addrs = [int(a.group(1), 16) if (a := SASS_ADDR.match(ins)) else None for ins in instructions]
    start = 0
    for n, ins in enumerate(instructions):
        op = SASS_OP.match(ins).group(1)
        if op.startswith("USETMAXREG"):
            regions.append(current)
            spans.append((start, n))
            start = n
            current = {"setmaxnreg": " ".join(ins.split("*/", 1)[-1].split()), "instructions": 0, "STL": 0,
                       "LDL": 0}
        current["instructions"] += 1
        for kind in ("STL", "LDL"):
            current[kind] += op.startswith(kind)
        if op == "BRA" and (target := BRANCH_TARGET.search(ins)):
            branches.append((n, labels.get(target.group(1)) if target.group(1) else int(target.group(2), 16)))
    regions.append(current)
    spans.append((start, len(instructions)))
    for region, (lo, hi) in zip(regions, spans):
        regs = [int(r) for ins in instructions[lo:hi] for r in REGISTER.findall(ins.split("*/", 1)[-1])]
        region["max_register"] = max(regs, default=None)
        region["loops"] = []
        for n, target in branches:
            if not lo <= n < hi or target is None or addrs[n] is None or target > addrs[n]:
                continue
            body = [k for k in range(lo, n + 1) if addrs[k] is not None and addrs[k] >= target]
            if len(body) < LOOP_MIN_INSTRUCTIONS:
                continue
            ops = [SASS_OP.match(instructions[k]).group(1) for k in body]
            if "EXIT" in ops:  # an out-of-line wait's jump back from past the kernel's end, not a loop
                continue
            region["loops"].append({"first": hex(target), "last": hex(addrs[n]), "instructions": len(body),
                                    "STL": sum(o.startswith("STL") for o in ops),
                                    "LDL": sum(o.startswith("LDL") for o in ops)})
    return regions


def _keep_sass(out: str, name: str, text: str) -> None:
    """The SASS text beside dump_isa.json (--out/<kernel>.sass.txt): the dump folder holds more files than a
    device call brings back, and the spills are read in the SASS."""
    with open(os.path.join(out, os.path.splitext(name)[0] + ".sass.txt"), "w") as fh:
        fh.write(text)


def sass_summary(text: str) -> dict:
    ops = collections.Counter(SASS_OP.findall(text))
    lines = [ln for ln in text.splitlines() if SASS_OP.match(ln)]
    return {"ops": dict(ops.most_common(60)), **wgmma_waits(lines),
            "spills_by_region": spills_by_region(lines, label_addresses(text.splitlines()))}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    sub = ap.add_subparsers(dest="what", required=True)
    moe = sub.add_parser("moe")
    moe.add_argument("--n", type=int, default=8)
    moe.add_argument("--gemm", default="gate_up", choices=["gate_up", "down"])
    moe.add_argument("--chunk", type=int, default=64, help="activation chunk width (columns per wgmma)")
    moe.add_argument("--kwargs", default="", help="k=v,... passed to grouped_int4_matmul (ints)")
    att = sub.add_parser("attention")
    att.add_argument("--t", type=int, default=4)
    att.add_argument("--h", type=int, default=8)
    att.add_argument("--kwargs", default="", help="k=v,... passed to the narrow kernel (ints; forces it)")
    att.add_argument("--wide-kwargs", default="", help="k=v,... passed to the 64-row kernel (ints, a/b for a "
                                                      "tuple; forces it)")
    att.add_argument("--op-kwargs", default="", help="k=v,... passed to tree_attention_mgpu (ints): tail=0")
    args = ap.parse_args(argv)
    dump = os.path.join(args.out, "isa")
    os.makedirs(dump, exist_ok=True)
    for flag in ("MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_SASS"):
        os.environ.setdefault(flag, "1")
    os.environ["MOSAIC_GPU_DUMP_TO"] = dump

    import jax

    jax.block_until_ready(run_moe(args) if args.what == "moe" else run_attention(args))
    files = sorted(glob.glob(os.path.join(dump, "*")))
    summary = {"files": [os.path.basename(f) for f in files], "config": vars(args)}
    ptxas = shutil.which("ptxas")
    disassembler = shutil.which("cuobjdump") or shutil.which("nvdisasm")
    for f in files:
        name = os.path.basename(f)
        if name.endswith("mlir-passes.log"):  # tens of MB of pass-by-pass IR
            continue
        text = open(f, errors="replace").read()
        if f.endswith(".sass") or "sass" in name.lower():
            summary.setdefault("sass", {})[name] = sass_summary(text)
            _keep_sass(args.out, name, text)
        elif f.endswith(".ptx") and not any("sass" in g.lower() for g in files):
            if ptxas and disassembler:
                sass = sass_from_ptx(f, ptxas, disassembler)
                summary.setdefault("sass", {})[name] = sass_summary(sass)
                _keep_sass(args.out, name, sass)
            else:
                summary.setdefault("sass", {})[name] = {"error": "no SASS dumped, and ptxas or cuobjdump/nvdisasm "
                                                                 "is not on the PATH"}
        if "ptxas" in name.lower():
            summary.setdefault("ptxas", {})[name] = text[-3000:]
    with open(os.path.join(args.out, "dump_isa.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "sass"}, indent=1)[:4000])
    for name, s in summary.get("sass", {}).items():
        print(name, s.get("error") or f"HGMMA {s['hgmma']}, pairs with a wait between "
                                      f"{s['hgmma_pairs_with_a_wait_between']}")
        for region in s.get("spills_by_region", []):
            print("  ", region)


if __name__ == "__main__":
    main()
