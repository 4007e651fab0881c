"""Runs a device lease's steps one after another, each under its own time limit, so that one slow step
cannot take the others' time. Every step's output goes to OUT/<name>.txt. A summary (return code, seconds,
last line) goes to OUT/lease.json after every step and is printed as a table at the end.

    PYTHONPATH=. python experiments/lease.py --out $OUT \\
        --step "pytest:200:python -m pytest -q -m gpu tests/test_moe_routing.py" \\
        --step "layer:280:python experiments/bench_layer.py --ms 1,9 --no-loop --out $OUT"

A step is NAME:SECONDS:COMMAND (a shell command, run from the current directory). --budget-s caps the
total: a step that would start with less time left than its own limit gets the time left, or is
skipped if under 10 s. --pack FILE.tar.gz (or OUT/FILE.tar.gz) moves everything the steps left under
OUT (logs, results, subfolders) into that one archive at the end, beside lease.json: for a transport that
brings back only a few files. Without --pack, where the steps left more than --max-files files under OUT
(default 8, what the device transport brings back), they are packed into lease_pack.tar.gz all the same, so
that none is lost.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def parse_step(text: str) -> tuple[str, float, str]:
    """NAME:SECONDS:COMMAND -> (name, seconds, command); ValueError naming what is wrong."""
    parts = text.split(":", 2)
    if len(parts) != 3 or not parts[2].strip():
        raise ValueError(f"step {text!r} must be NAME:SECONDS:COMMAND")
    name, seconds, command = parts
    if not NAME.match(name):
        raise ValueError(f"step name {name!r} must be letters, digits, '_', '.' or '-' (it names a file)")
    try:
        limit = float(seconds)
    except ValueError:
        raise ValueError(f"step {name!r}: time limit {seconds!r} is not a number of seconds") from None
    if limit <= 0:
        raise ValueError(f"step {name!r}: time limit must be positive, got {limit}")
    return name, limit, command


def run_steps(steps, out_dir: str, budget_s: float | None = None) -> list[dict]:
    """Runs (name, seconds, command) steps in order; returns one record per step (also in OUT/lease.json)."""
    os.makedirs(out_dir, exist_ok=True)
    start, records = time.monotonic(), []

    def record(rec):
        records.append(rec)
        with open(os.path.join(out_dir, "lease.json"), "w") as f:
            json.dump(records, f, indent=1)
        print(f"[{rec['step']}] rc={rec['rc']} {rec['seconds']} s: {rec['last']}", flush=True)

    for name, limit, command in steps:
        left = None if budget_s is None else budget_s - (time.monotonic() - start)
        if left is not None and left < 10:
            record({"step": name, "rc": None, "seconds": 0.0, "last": f"skipped: {left:.0f} s of budget left"})
            continue
        limit = limit if left is None else min(limit, left)
        t0 = time.monotonic()
        with open(os.path.join(out_dir, f"{name}.txt"), "w") as log:
            # its own process group, so that a timeout stops the command's children too (a benchmark the
            # shell started would otherwise keep the GPU)
            proc = subprocess.Popen(command, shell=True, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "timeout"
        with open(os.path.join(out_dir, f"{name}.txt")) as log:
            lines = [ln.strip() for ln in log.read().splitlines() if ln.strip()]
        record({"step": name, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "limit_s": limit,
                "last": lines[-1][:160] if lines else ""})
    return records


def count_files(out_dir: str) -> int:
    """Regular files under ``out_dir``, at any depth."""
    return sum(len(files) for _, _, files in os.walk(out_dir))


def pack(out_dir: str, archive: str) -> list[str]:
    """Moves every entry of ``out_dir`` except lease.json into ``out_dir/archive`` (gzip tar); returns the
    archived names."""
    names = sorted(n for n in os.listdir(out_dir) if n not in ("lease.json", archive))
    with tarfile.open(os.path.join(out_dir, archive), "w:gz") as tar:
        for name in names:
            tar.add(os.path.join(out_dir, name), arcname=name)
    for name in names:
        path = os.path.join(out_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return names


def archive_name(pack: str, out_dir: str) -> str:
    """--pack's archive as a name inside ``out_dir``: NAME.tar.gz, or a path to it whose folder is ``out_dir``
    itself (``$OUT/NAME.tar.gz``); ValueError for anything else."""
    folder, name = os.path.split(pack)
    if folder and os.path.realpath(folder) != os.path.realpath(out_dir):
        raise ValueError(f"--pack {pack!r} must be NAME.tar.gz or a path to it directly inside --out {out_dir!r}")
    if not NAME.match(name) or not name.endswith(".tar.gz"):
        raise ValueError(f"--pack {pack!r} must name a file NAME.tar.gz (letters, digits, '_', '.', '-')")
    return name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--step", action="append", default=[], help="NAME:SECONDS:COMMAND (repeatable)")
    ap.add_argument("--budget-s", type=float, default=None, help="total seconds for all steps")
    ap.add_argument("--pack", default=None,
                    help="archive NAME.tar.gz (or OUT/NAME.tar.gz): move OUT's other files into it")
    ap.add_argument("--max-files", type=int, default=8,
                    help="without --pack: more files than this under OUT are packed into lease_pack.tar.gz (0: never)")
    args = ap.parse_args(argv)
    if args.max_files < 0:
        ap.error(f"--max-files must be 0 (no limit) or positive, got {args.max_files}")
    if not args.step:
        ap.error("give at least one --step")
    if args.pack is not None:
        try:
            args.pack = archive_name(args.pack, args.out)
        except ValueError as e:
            ap.error(str(e))
    try:
        steps = [parse_step(s) for s in args.step]
    except ValueError as e:
        ap.error(str(e))
    names = [s[0] for s in steps]
    if len(set(names)) != len(names):
        ap.error(f"step names must be distinct, got {names}")
    records = run_steps(steps, args.out, args.budget_s)
    archive = args.pack
    left = count_files(args.out)
    if archive is None and args.max_files and left > args.max_files:
        archive = "lease_pack.tar.gz"
        print(f"{left} files under {args.out}, more than --max-files {args.max_files}: packing them")
    if archive:
        print(f"packed {len(pack(args.out, archive))} entries into {os.path.join(args.out, archive)}")
    print(f"\n{'step':16s} {'rc':>8s} {'seconds':>8s}  last line")
    for r in records:
        print(f"{r['step']:16s} {str(r['rc']):>8s} {r['seconds']:8.1f}  {r['last'][:90]}")
    return 0 if all(r["rc"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
