"""Which source lines each kernel of a traced chain runs: a benchmark's kernel table (name, launches, µs per
call) joined to the optimized HLO of the same compile (``bench_layer.py --hlo``), so that a fusion named like
``loop_pad_fusion_39`` reads as the lines it runs (``layers.py:37 (rms_norm)``, ``rope.py:69
(apply_rope_interleaved)``).

    python experiments/hlo_kernels.py RESULT.json HLO.txt.gz --row part=layer,M=1 [--top 40] [--by-function]

--row picks the result's one row by its fields (``bench_layer``'s: part and M). The HLO must be the compile the
trace timed (``bench_layer --hlo`` writes it): another compile numbers its fusions differently.

For each kernel of the row: its µs per call, its HLO op (a fusion's kind, or a custom call's target), its
result shape, the ops inside a fusion (counted by kind; parameters, bitcasts, constants and tuples left out)
and the repository lines its ops came from (innermost frame in ``ddtree_jax`` or ``pallas_kernels``; by the
line's share of the fusion's ops). A trace names a kernel after its HLO instruction with '.' and '-' read as
'_'; a name the HLO does not hold (a Pallas kernel's own name, a cuBLAS kernel) prints as such.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench_util import parse_settings  # noqa: E402

TABLE_ROW = re.compile(r"^(\d+) (.*)$")
FIELD = re.compile(r"(\w+)=(-?\d+)")
COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
SKIPPED_OPS = {"parameter", "bitcast", "constant", "get-tuple-element", "tuple"}
ANCHOR_OPS = ("dot", "custom-call", "gather", "scatter", "sort")  # what a fusion is for, where it holds one
OWN_CODE = ("ddtree_jax/", "pallas_kernels/")


def kernel_key(name: str) -> str:
    """A kernel's or an HLO instruction's name as the trace writes it."""
    return name.replace(".", "_").replace("-", "_")


def parse_hlo(text: str) -> dict:
    """The optimized HLO text -> {"instructions": {key: record}, "computations": {name: [record]},
    "frames": {stack_frame_id: (file, function, line, parent_id)}}; a record is a dict of name, op, shape,
    calls (the fused computation, or None), target (a custom call's), frame (stack_frame_id or None)."""
    tables: dict[str, dict[int, str]] = {}
    section, computations, current = None, {}, None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = tables.setdefault(line, {})
            continue
        if section is not None:
            row = TABLE_ROW.match(line)
            if row:
                section[int(row.group(1))] = row.group(2)
                continue
            section = None
        head = COMPUTATION.match(line)
        if head and "=" not in line.split("(")[0]:
            current = computations.setdefault(head.group(1), [])
            continue
        ins = INSTRUCTION.match(line)
        if ins and current is not None:
            rest = ins.group(4)
            calls = re.search(r"calls=%([\w.\-]+)", rest)
            target = re.search(r'custom_call_target="([^"]+)"', rest)
            frame = re.search(r"stack_frame_id=(\d+)", rest)
            current.append({"name": ins.group(1), "shape": ins.group(2), "op": ins.group(3),
                            "calls": calls and calls.group(1), "target": target and target.group(1),
                            "frame": frame and int(frame.group(1))})
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    functions = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locations = {k: dict((a, int(b)) for a, b in FIELD.findall(v)) for k, v in tables.get("FileLocations", {}).items()}
    frames = {}
    for k, v in tables.get("StackFrames", {}).items():
        f = dict((a, int(b)) for a, b in FIELD.findall(v))
        loc = locations.get(f.get("file_location_id"), {})
        frames[k] = (files.get(loc.get("file_name_id"), "?"), functions.get(loc.get("function_name_id"), "?"),
                     loc.get("line", 0), f.get("parent_frame_id", 0))
    instructions = {kernel_key(r["name"]): r for recs in computations.values() for r in recs}
    return {"instructions": instructions, "computations": computations, "frames": frames}


def own_line(frames: dict, frame_id: int | None) -> str | None:
    """The innermost frame of ``frame_id``'s stack in the repository's library code, as 'file.py:line (function)'."""
    seen = set()
    while frame_id and frame_id in frames and frame_id not in seen:
        seen.add(frame_id)
        path, function, line, parent = frames[frame_id]
        if any(part in path for part in OWN_CODE):
            return f"{path.rsplit('/', 1)[-1]}:{line} ({function})"
        frame_id = parent
    return None


def describe(hlo: dict, kernel: str) -> dict:
    """One kernel name -> {op, shape, ops (Counter of the fused ops' kinds), lines (Counter of own_line), anchor (the
    line of its first dot, custom call, gather, scatter or sort, else its most frequent line; None without lines)};
    op is None where the HLO holds no instruction of that name."""
    rec = hlo["instructions"].get(kernel_key(kernel))
    if rec is None:
        return {"op": None, "shape": "", "ops": collections.Counter(), "lines": collections.Counter(), "anchor": None}
    inner = hlo["computations"].get(rec["calls"], []) if rec["calls"] else [rec]
    ops = collections.Counter(r["op"] for r in inner if r["op"] not in SKIPPED_OPS)
    lines = collections.Counter(filter(None, (own_line(hlo["frames"], r["frame"]) for r in inner)))
    if not lines and own_line(hlo["frames"], rec["frame"]):
        lines[own_line(hlo["frames"], rec["frame"])] += 1
    heavy = [own_line(hlo["frames"], r["frame"]) for r in inner if r["op"] in ANCHOR_OPS]
    anchor = next(filter(None, heavy), None) or (lines.most_common(1)[0][0] if lines else None)
    return {"op": rec["target"] or rec["op"], "shape": rec["shape"], "ops": ops, "lines": lines, "anchor": anchor}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a benchmark's JSON whose rows hold 'kernels' ([name, launches, µs]) ")
    ap.add_argument("hlo", help="the optimized HLO of the traced chain (.txt or .txt.gz)")
    ap.add_argument("--row", required=True, metavar="K=V,...", help="the row's fields, e.g. part=layer,M=1")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--by-function", action="store_true",
                    help="also sum the µs by each kernel's anchor function (its dot's, gather's, ...; else its most "
                         "frequent source line's)")
    args = ap.parse_args(argv)
    try:
        want = parse_settings(args.row, "--row")
    except ValueError as e:
        ap.error(str(e))
    with open(args.result) as f:
        rows = [r for r in json.load(f)["rows"] if all(r.get(k) == v for k, v in want.items())]
    if len(rows) != 1 or "kernels" not in rows[0]:
        ap.error(f"{args.result} has {len(rows)} rows with {want}" + (", without kernels" if rows else "")
                 + ": name one traced row")
    opener = gzip.open if args.hlo.endswith(".gz") else open
    with opener(args.hlo, "rt") as f:
        hlo = parse_hlo(f.read())
    total, by_function = 0.0, collections.defaultdict(lambda: [0.0, 0])
    print(f"{'µs':>7} {'launches':>8}  kernel / op / shape / fused ops / source lines")
    for name, launches, us in rows[0]["kernels"][:args.top]:
        d = describe(hlo, name)
        total += us
        function = re.sub(r":\d+ \((.*)\)$", r" \1", d["anchor"]) if d["anchor"] else name
        by_function[function][0] += us
        by_function[function][1] += launches
        ops = " ".join(f"{k}x{v}" if v > 1 else k for k, v in d["ops"].most_common(6))
        lines = "; ".join(line for line, _ in d["lines"].most_common(3))
        print(f"{us:7.2f} {launches:8}  {name}  [{d['op'] or 'not in the HLO'}] {d['shape'][:48]}")
        if ops or lines:
            print(f"{'':18}{ops}  <- {lines or '?'}")
    print(f"{total:7.2f} µs over the {min(args.top, len(rows[0]['kernels']))} kernels listed; the row's span "
          f"{rows[0]['us']:.2f}")
    if args.by_function:
        print(f"\n{'µs':>7} {'launches':>8}  function (a kernel's anchor line's; else its name)")
        for function, (us, launches) in sorted(by_function.items(), key=lambda kv: -kv[1][0]):
            print(f"{us:7.2f} {launches:8.3g}  {function}")


if __name__ == "__main__":
    main()
