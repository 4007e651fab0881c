"""Runs the test suite on a GPU machine in N pytest processes side by side (the device image has no
pytest-xdist), then prints one table and writes OUT/suite.json.

    PYTHONPATH=. python experiments/gpu_suite.py --out $OUT --groups 6 \\
        --timeout-s 540 -- tests --ignore=tests/test_int4.py --ignore=tests/test_notebook.py

(the H200's image lacks compressed-tensors and nbformat, which those two files import). Everything after
``--`` goes to ``pytest --collect-only`` as it is; the collected test ids are cut into contiguous runs of
equal length, so that a file's tests mostly stay in one process and its jitted functions compile once. The
processes run with XLA_PYTHON_CLIENT_PREALLOCATE=false, so that they share the GPU, and DDTREE_REQUIRE_GPU=1, so
that a process that cannot start the GPU fails its collection instead of skipping the GPU tests (unless the caller
sets either).
Dealt round-robin instead, every process compiled every file's functions: in session 35 eight such
processes finished 230 of 560 tests in 530 s. Each group writes OUT/pytest_gK.txt (``-v``: a line per
test) and a JUnit XML; a group that outlives --timeout-s is killed, its finished tests are read from its
log, and the rest count as "not run". Eight contiguous groups left 146 of 560 tests unfinished at 505 s on
the H200 machine's 16 cores, where session 34's six groups ended within 478 s: six is the default. The
device's transport brings back a few files only: run this as a step of ``experiments/lease.py --pack``.
Exit status 1 when any test failed, errored or did not run, or any pytest process exited non-zero (killed
ones included); 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict

ROOTDIR = ["--rootdir", "."]


def collect(pytest_args: list[str]) -> list[str]:
    """Test ids that ``pytest --collect-only`` finds for pytest_args, relative to the current directory (the
    rootdir of every pytest this script starts); RuntimeError with pytest's output if collection fails or
    finds tests outside the current directory."""
    args = [a for a in pytest_args if a not in ("-q", "--quiet")]  # a second -q lists files, not test ids
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *ROOTDIR, *args],
                          capture_output=True, text=True)
    ids = [line for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if done.returncode != 0 or not ids:
        raise RuntimeError(f"collection failed (rc={done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    outside = [i for i in ids if i.startswith("::")]
    if outside:
        raise RuntimeError(f"{len(outside)} tests lie outside the current directory {os.getcwd()}: run from "
                           "a directory that holds the test files")
    return ids


def deal(ids: list[str], groups: int) -> list[list[str]]:
    """Contiguous runs in collection order, lengths differing by at most one; empty groups dropped."""
    if groups < 1:
        raise ValueError(f"--groups must be at least 1, got {groups}")
    size, extra = divmod(len(ids), groups)
    bounds = [k * size + min(k, extra) for k in range(groups + 1)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def read_junit(path: str) -> list[dict]:
    """One record per testcase: id, file, seconds, outcome (passed / failed / error / skipped)."""
    records = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
        file = case.get("classname", "").replace(".", "/") + ".py"
        records.append({"id": f"{file}::{case.get('name')}", "file": file,
                        "seconds": float(case.get("time", 0)), "outcome": outcome})
    return records


VERBOSE_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


def read_log(path: str) -> list[dict]:
    """Outcomes from a ``pytest -v`` log (a group killed before its JUnit XML was written); no seconds."""
    outcomes = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "error",
                "XFAIL": "skipped", "XPASS": "passed"}
    records = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = VERBOSE_LINE.match(line)
            if m:  # a test that errors in teardown after passing has two lines: the later one wins
                test = m.group(1)
                records[test] = {"id": test, "file": test.split("::")[0], "seconds": 0.0,
                                 "outcome": outcomes[m.group(2)]}
    return list(records.values())


def run_groups(groups: list[list[str]], out: str, timeout_s: float) -> list[dict]:
    """Starts one pytest per group, waits for all (killing those past timeout_s); one record per group."""
    procs, start = [], time.monotonic()
    # each process would otherwise take 75 % of the GPU's memory at its first op, and a process whose GPU backend
    # then fails to start would skip its GPU tests as if there were no GPU (session 48: 13 tests failed out of
    # memory, 32 skipped); tests/conftest.py refuses to skip them under DDTREE_REQUIRE_GPU. The caller's values stand.
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "DDTREE_REQUIRE_GPU": "1", **os.environ}
    for k, ids in enumerate(groups):
        log = open(os.path.join(out, f"pytest_g{k}.txt"), "w")
        xml = os.path.join(out, f"junit_g{k}.xml")
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *ROOTDIR, f"--junitxml={xml}", *ids]
        procs.append((k, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log, xml, len(ids)))
    results = []
    for k, proc, log, xml, n in procs:
        left = max(1.0, timeout_s - (time.monotonic() - start))
        try:
            rc, killed = proc.wait(timeout=left), False
        except subprocess.TimeoutExpired:
            proc.kill()
            rc, killed = proc.wait(), True
        log.close()
        cases = read_junit(xml) if os.path.exists(xml) else read_log(log.name)
        results.append({"group": k, "rc": rc, "killed": killed, "tests": n, "cases": cases,
                        "seconds": round(time.monotonic() - start, 1)})
    return results


def summarize(results: list[dict]) -> dict:
    counts, failures, per_file = defaultdict(int), [], defaultdict(float)
    for r in results:
        counts["not run"] += r["tests"] - len(r["cases"])
        for c in r["cases"]:
            counts[c["outcome"]] += 1
            per_file[c["file"]] += c["seconds"]
            if c["outcome"] in ("failed", "error"):
                failures.append(c["id"])
    return {"counts": dict(counts), "failures": failures,
            "file_seconds": dict(sorted(per_file.items(), key=lambda kv: -kv[1])),
            "groups": [{k: r[k] for k in ("group", "rc", "killed", "tests", "seconds")} for r in results]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--timeout-s", type=float, default=540.0)
    parser.add_argument("pytest_args", nargs="*", default=["tests"])
    args = parser.parse_args(argv)
    if args.timeout_s <= 0:
        parser.error(f"--timeout-s must be positive, got {args.timeout_s}")
    if args.groups < 1:  # before the collection, which takes a while
        parser.error(f"--groups must be at least 1, got {args.groups}")
    os.makedirs(args.out, exist_ok=True)
    groups = deal(collect(args.pytest_args), args.groups)
    summary = summarize(run_groups(groups, args.out, args.timeout_s))
    with open(os.path.join(args.out, "suite.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for g in summary["groups"]:
        print(f"group {g['group']}: {g['tests']} tests, rc={g['rc']}{' KILLED' if g['killed'] else ''},"
              f" {g['seconds']} s")
    for test in summary["failures"]:
        print("FAILED", test)
    print(" | ".join(f"{k} {v}" for k, v in sorted(summary["counts"].items())))
    # pytest exits 0 only when every test passed or skipped; a killed group has rc -9
    bad = summary["failures"] or summary["counts"].get("not run", 0) or any(g["rc"] for g in summary["groups"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
