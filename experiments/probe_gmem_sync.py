"""What a kernel pays for global counters: their zeroing before each call, one atomic per program, and a wait
for the other programs of its group (a barrier), on a Mosaic GPU kernel that does almost nothing else.

    PYTHONPATH=. python experiments/probe_gmem_sync.py --out DIR

The question behind it (issue #6): could the attention op's split merge move inside its kernel? Each program
would signal a per-stream counter when its partial is written, wait for the others of its stream, and merge a
slice of the rows, replacing the merge launch (1.7-2.9 µs plus ~0.4 idle). Pallas zero-fills a kernel's
global semaphores (``pl.get_global``) with an XLA op before every call; what that costs in a chain of calls
decides whether the design can pay at all. Every variant is one launch of ``programs`` programs, each
copying one 1 KB row through shared memory (in the same grid shape as the op at B = 16 or 1):

* ``plain``: the copy alone;
* ``signal``: plus one global counter per group, zeroed by Pallas, each program adding 1 to its group's;
* ``barrier``: plus each program waiting until its group's counter reaches the group's size.

Per call, from a profiler trace of a chain of dependent calls (``bench_util.traced_call_time``): the chain's
span (the same tie kernel between calls in every variant, so differences are the variants' own), the device's
busy time, and every device event by name (the zeroing shows as its own event). Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from experiments import bench_util  # noqa: E402

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

ROW = 256  # f32 values a program copies (1 KB)
VARIANTS = ("plain", "signal", "barrier")


def probe_kernel(programs: int, group: int, variant: str):
    """x [programs, ROW] f32 -> a copy of it, by one launch of ``programs`` programs in groups of ``group``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r} is not one of {VARIANTS}")
    if programs % group:
        raise ValueError(f"group={group} must divide programs={programs}")
    groups = programs // group

    def body(x_ref, o_ref, smem, bar):
        p = jax.lax.axis_index("p")
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(p, 1)], smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        plgpu.copy_smem_to_gmem(smem, o_ref.at[pl.ds(p, 1)])
        plgpu.wait_smem_to_gmem(0)
        if variant != "plain":
            counters = pl.get_global(plgpu.SemaphoreType.REGULAR((groups,)))
            mine = counters.at[p // group]
            plgpu.semaphore_signal(mine, 1, memory_scope="gpu")
            if variant == "barrier":
                plgpu.semaphore_wait(mine, group, decrement=False, memory_scope="gpu")

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((programs, ROW), jnp.float32),
                        scratch_types=(plgpu.SMEM((1, ROW), jnp.float32), plgpu.Barrier(num_barriers=1)),
                        grid=(programs,), grid_names=("p",))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="probe_gmem_sync")
    ap.add_argument("--programs", type=int, default=128)
    ap.add_argument("--groups", type=lambda text: [int(g) for g in text.split(",")], default=[8, 128],
                    help="group sizes (programs per counter), comma-separated")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="traced chains per variant (the median is quoted)")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    if plgpu is None or jax.default_backend() != "gpu":
        raise SystemExit("probe_gmem_sync needs a GPU and jax.experimental.pallas.mosaic_gpu")
    x = jnp.arange(args.programs * ROW, dtype=jnp.float32).reshape(args.programs, ROW)
    rows = []
    for group in args.groups:
        for variant in VARIANTS:
            fn = probe_kernel(args.programs, group, variant)
            y = fn(x)
            ok = bool(jnp.array_equal(y, x))
            spans, busy = [], []
            for _ in range(args.repeats):
                t = bench_util.traced_call_time(fn, (x,), calls=args.calls, repeats=1)  # repeated here
                spans.append(t["span_s"])
                busy.append(t["busy_s"])
            rows.append({"programs": args.programs, "group": group, "variant": variant, "copy_ok": ok,
                         "span_us": round(statistics.median(spans) * 1e6, 2),
                         "busy_us": round(statistics.median(busy) * 1e6, 2),
                         "spans_us": [round(s * 1e6, 2) for s in spans],
                         "kernels": t["kernels"], "launches_us": t["launches_us"],
                         "largest_gaps_us": t["largest_gaps_us"]})
            print(f"group {group:4d} {variant:8s} ok={ok} span {rows[-1]['span_us']:7.2f} us  "
                  f"busy {rows[-1]['busy_us']:7.2f} us  "
                  f"kernels {[(k[0][:40], round(k[2] * 1e6, 2)) for k in t['kernels']]}",
                  flush=True)
    payload = {"hardware": bench_util.hardware(), "commit": args.commit or bench_util.git_commit(),
               "config": {"programs": args.programs, "row_bytes": ROW * 4, "calls": args.calls,
                          "repeats": args.repeats}, "rows": rows}
    if args.out:
        print("wrote", bench_util.write_result(args.name, payload, args.out))
    bench_util.print_table(rows, ["group", "variant", "copy_ok", "span_us", "busy_us"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
