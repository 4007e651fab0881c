"""Shared benchmark plumbing: timing, measured roofline, and result files with provenance.

Every benchmark writes ``experiments/results/<name>.json`` (or ``$OUT``-style ``--out`` path) with
hardware, JAX version, commit, config and the median of repeats, and prints a table. Traced device times
(``traced_call_time``) are the median over ``repeats`` traces of a chain of calls.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax.monitoring: one per XLA compile
L2_BYTES = 60 * 2**20  # above the H100's and the H200's 50 MB L2, so copies counted against it are enough on both


def git_commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def int_options(text: str, sep: str = ",") -> dict:
    """'k=v<sep>k=v...' -> {k: int(v)} for a benchmark's keyword options on the command line: 'None' -> None,
    'a/b' -> (a, b). ValueError for a pair without '=' or a value that is not such."""
    def value(v):
        return None if v == "None" else tuple(int(x) for x in v.split("/")) if "/" in v else int(v)
    pairs = [kv.split("=") for kv in text.split(sep) if kv]
    if any(len(kv) != 2 for kv in pairs):
        raise ValueError(f"options {text!r} must be k=v pairs joined by {sep!r}")
    return {k: value(v) for k, v in pairs}


def int_points(text: str, size: int) -> list[tuple[int, ...]]:
    """'a,b,c;d,e,f' -> [(a, b, c), (d, e, f)]: a benchmark's --points, each of ``size`` integers. ValueError
    for a point of another length or a value that is not an integer."""
    points = [tuple(int(v) for v in pt.split(",")) for pt in text.split(";")]
    if any(len(pt) != size for pt in points):
        raise ValueError(f"points {text!r} must be {size} integers each")
    return points


def hardware() -> dict[str, Any]:
    dev = jax.devices()[0]
    return {
        "platform": dev.platform,
        "device_kind": getattr(dev, "device_kind", "unknown"),
        "device_count": jax.device_count(),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
        **({"xla_flags": os.environ["XLA_FLAGS"]} if os.environ.get("XLA_FLAGS") else {}),  # an A/B's setting
    }


MATMUL_PRECISIONS = ("default", "tensorfloat32", "float32")
DECODE_PRECISION_HELP = ("JAX matmul precision for f32 models. 'default' is TF32 on NVIDIA GPUs, whose rounding "
                         "differs between AR's and the verify batch's shapes and can flip near-tie greedy tokens "
                         "(seen on an H200); 'float32' keeps greedy output == AR. No effect on CPU.")


def add_matmul_precision_arg(parser, default: str, help: str = DECODE_PRECISION_HELP) -> None:
    """``--matmul-precision`` for a script; apply it with ``jax.default_matmul_precision(args.matmul_precision)``."""
    parser.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default=default, help=help)


def add_trace_args(parser) -> None:
    """``--calls`` and ``--trace-repeats`` for a benchmark timed by ``traced_call_time``; read them back with
    ``trace_args``."""
    parser.add_argument("--calls", type=int, default=None,
                        help="dependent calls in each traced chain (default 8; 2 with --smoke)")
    parser.add_argument("--trace-repeats", type=int, default=None,
                        help="traces of each chain, the median quoted (default 3; 1 with --smoke)")


def trace_args(parser, args) -> tuple[int, int]:
    """(calls, repeats) from ``add_trace_args``' flags; a parser error where either is below 1. A smoke run checks
    its points' plumbing and results, so 2 calls traced once do: each trace costs a test process that has compiled
    much ~0.3 s more than a fresh one (session 65)."""
    calls = args.calls if args.calls is not None else (2 if args.smoke else 8)
    repeats = args.trace_repeats if args.trace_repeats is not None else (1 if args.smoke else 3)
    if calls < 1 or repeats < 1:
        parser.error(f"--calls {calls} and --trace-repeats {repeats} must be at least 1")
    return calls, repeats


def block(x):
    return jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def time_fn(fn: Callable, *args, repeats: int = 20, warmup: int = 2) -> dict[str, float]:
    """Median/min wall time in seconds of ``fn(*args)`` (results blocked on), after warmup calls."""
    for _ in range(warmup):
        block(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        block(fn(*args))
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "repeats": repeats}


def tie_to(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a`` plus a zero XLA cannot prove zero, computed from ``b``: work on ``a`` then depends on ``b``.
    In a ``dependent_chain`` the arguments other than x are the same in every call, so XLA computes what
    depends only on them once for the whole chain (common subexpressions: an MoE layer's sort by expert
    of fixed routing ids ran once for 8 calls until session 8). Tying them to x makes each call redo it.
    The zero is ``first != first`` (NaN) where ``b`` is floating and ``first == max`` where it is an integer
    (XLA folds ``i != i`` to false for integers: until session 37 a tie to prefix lengths was no tie)."""
    first = b.ravel()[0]
    never = first != first if jnp.issubdtype(b.dtype, jnp.floating) else first == jnp.iinfo(b.dtype).max
    return a + never.astype(a.dtype)


def rotating_copies(nbytes: int, reads_over_l2: int = 2, l2_bytes: int = L2_BYTES, most: int = 16) -> int:
    """How many copies of an input of ``nbytes`` a chain of calls rotates over (``dependent_chain(rotate=True)``)
    so that the copies together hold more than ``reads_over_l2`` times the L2: each call then reads its copy from
    DRAM, not from what the calls before it left in the L2. At least 1, at most ``most``."""
    if nbytes < 1 or reads_over_l2 < 1 or l2_bytes < 1 or most < 1:
        raise ValueError(f"rotating_copies: nbytes={nbytes}, reads_over_l2={reads_over_l2}, l2_bytes={l2_bytes}, "
                         f"most={most}: each must be positive")
    return min(most, -(-reads_over_l2 * l2_bytes // nbytes))


def dependent_chain(fn: Callable, n: int, rotate: bool = False) -> Callable:
    """A jitted program of n unrolled calls of ``fn(x, *rest)``, each call's x taking one element of the
    previous call's output (so no call can be hoisted, merged or reordered); returns every output.
    ``fn`` is jitted once, so the program holds one lowering called n times. ``rotate``: ``rest`` holds
    copies of fn's one other argument, call i taking ``rest[i % len(rest)]`` (weights read from DRAM on
    every call, not from L2)."""
    fn = jax.jit(fn)

    def run(x, *rest):
        outs = []
        for i in range(n):
            y = fn(x, rest[i % len(rest)]) if rotate else fn(x, *rest)
            outs.append(y)
            x = x.at[(0,) * x.ndim].set(y.ravel()[0].astype(x.dtype))
        return outs
    return jax.jit(run)


def dispatched_chain(fn: Callable, n: int) -> Callable:
    """n calls y = fn(y), each its own dispatch of the jitted ``fn`` reading the whole previous output, from
    Python (not one program: inside one, XLA may fuse an elementwise ``fn``'s calls, or recompute the element
    ``dependent_chain`` passes on, so that several calls share one read); returns every output. For device
    timing from a trace of calls long against a launch; ``fn``'s output must be a valid input."""
    fn = jax.jit(fn)

    def run(y):
        outs = []
        for _ in range(n):
            y = fn(y)
            outs.append(y)
        return outs
    return run


def chained_call_time(fn: Callable, args: tuple, n_long: int = 17, n_short: int = 1, repeats: int = 5) -> float:
    """Seconds per call of ``fn(*args)`` on the device: a ``dependent_chain`` of n_long calls and one of
    n_short, timed separately; their difference over the extra calls cancels the program's launch and
    dispatch costs. (On the H200 a fori_loop step costs ~30 us, the loop condition's trip to the host:
    as much as an M = 1 MoE GEMM, so loops are not used.)"""
    def median_s(n):
        return time_fn(dependent_chain(fn, n), *args, repeats=repeats, warmup=1)["median_s"]
    return (median_s(n_long) - median_s(n_short)) / (n_long - n_short)


def trace_kernel_events(program: Callable, args: tuple) -> list[tuple[str, int, int, str]]:
    """(name, start_ns, duration_ns, device) of the device kernels of one run of ``program(*args)`` (compiled
    and run once before), from a ``jax.profiler`` trace read back with ``ProfileData``: the GPU planes' stream
    lines (CUPTI's device timestamps; device: the plane's name), or on a CPU host the XLA client's thunk
    events (smoke runs; one device, "host")."""
    import glob
    import tempfile

    from jax.profiler import ProfileData

    block(program(*args))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            block(program(*args))
        data = ProfileData.from_file(glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)[0])
    events = [(e.name, e.start_ns, e.duration_ns, plane.name) for plane in data.planes
              if plane.name.startswith("/device:GPU") for line in plane.lines if line.name.startswith("Stream")
              for e in line.events]
    if not events:
        events = [(e.name, e.start_ns, e.duration_ns, "host") for plane in data.planes if plane.name == "/host:CPU"
                  for line in plane.lines if "PjRtCpuClient" in line.name for e in line.events
                  if e.duration_ns > 0 and not e.name.startswith(("Threadpool", "end:", "ThunkExecutor"))]
    return sorted(events, key=lambda e: e[1])


def largest_gaps(events, n: int) -> list[list]:
    """The ``n`` longest idle gaps of one device's (name, start_ns, duration_ns, ...) events sorted by start:
    [[µs, kernel before, kernel after], ...], longest first (overlapping kernels are no gap)."""
    gaps, end, before = [], None, None
    for name, start, dur, *_ in events:
        if end is not None and start > end:
            gaps.append([round((start - end) / 1e3, 2), before, name])
        if end is None or start + dur >= end:
            end, before = start + dur, name
    return sorted(gaps, key=lambda g: -g[0])[:n]


def op_spans(events, is_op: Callable[[str], bool], calls: int) -> list[float]:
    """Per call, the op's own device time in seconds: from its first kernel's start to its last kernel's end.
    ``events``: one device's (name, start_ns, duration_ns, ...) sorted by start; ``is_op`` picks the op's
    kernels by name, and every call must launch the same number of them, in order (a chain's calls do not
    overlap), so the k-th group of them is call k. What runs between calls (a chain's tie kernels, the launch
    gap before the op's first kernel) is outside every span; what runs between the op's own kernels is
    inside. ValueError when the op's launches do not split evenly into ``calls``."""
    ops = [e for e in events if is_op(e[0])]
    if not ops or len(ops) % calls:
        raise ValueError(f"{len(ops)} launches of the op's kernels do not split evenly into {calls} calls")
    k = len(ops) // calls
    groups = [ops[i * k:(i + 1) * k] for i in range(calls)]
    return [(max(s + d for _, s, d, *_ in g) - g[0][1]) / 1e9 for g in groups]


def launches_by_name(events) -> dict[str, list[int]]:
    """{kernel name: [duration_ns of each launch]} of (name, start_ns, duration_ns, ...) events."""
    per_name: dict[str, list[int]] = {}
    for name, _, dur, *_ in events:
        per_name.setdefault(name, []).append(dur)
    return per_name


def kernel_totals(per_name: dict[str, list[int]], per: int = 1) -> list[list]:
    """[name, launches / per, seconds / per] for each kernel of ``launches_by_name``, longest first."""
    return sorted(([n, len(d) / per, sum(d) / per / 1e9] for n, d in per_name.items()), key=lambda k: -k[2])


def traced_call_time(fn: Callable, args: tuple, calls: int = 8, chain: Callable = None,
                     gaps: int = 4, op_kernels: Callable[[str], bool] | None = None,
                     repeats: int = 3) -> dict[str, Any]:
    """Device time per call of ``fn(*args)`` from profiler traces of a chain of ``calls`` dependent calls
    (``chain(fn, calls)``, default ``dependent_chain``; a benchmark passes its own to rotate inputs), the
    chain traced ``repeats`` times (``median_of_traces``): span_s is the median over the traces of each
    one's span per call, span_repeats_s every trace's, and the other fields are those of the trace whose
    span is the median (the lower one for an even count). What follows describes one trace.

    Per device (each GPU's own timeline; devices' clocks are not compared): span (first kernel's start to
    last kernel's end), busy (summed kernel time) and idle (the gaps). Returned per call: span_s (the
    slowest device's span: the figure benchmarks quote), busy_s and idle_s (that device's),
    span_per_device_s, and over all devices' kernels, averaged per device: kernels (name, launches,
    seconds, slowest first) and launches_us (every launch's microseconds, for names launched every call).
    The host's work (dispatch, per-launch setup) shows only as idle gaps when the GPU waits for it:
    largest_gaps_us lists each device's ``gaps`` longest gaps over the whole chain (µs, the kernel
    before, the kernel after), to tell a launch skew at the start from waits between kernels.
    ``op_kernels`` (a predicate on kernel names): also op_span_s, the median over calls (of every trace) of
    the op's own span on the slowest device (``op_spans``: the chain's tie kernels and the gap before the op
    left out), and op_spans_us, every call's."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: trace the chain at least once")
    program = (chain or dependent_chain)(fn, calls)
    return median_of_traces([_trace_stats(trace_kernel_events(program, args), calls, gaps, op_kernels)
                             for _ in range(repeats)])


def median_of_traces(traces: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``traced_call_time`` result from several traces' (``_trace_stats``): the trace whose span_s is the
    median (the lower one for an even count), with span_s the median of all (``statistics.median``),
    span_repeats_s every trace's span_s in trace order, and repeats their count; op_span_s (where traced)
    the median over every call of every trace, op_spans_us those calls' µs."""
    spans = [t["span_s"] for t in traces]
    middle = sorted(range(len(traces)), key=lambda i: spans[i])[(len(traces) - 1) // 2]
    op = {}
    if "op_spans_us" in traces[0]:  # every call of every trace
        op_us = [us for t in traces for us in t["op_spans_us"]]
        op = {"op_span_s": statistics.median(op_us) / 1e6, "op_spans_us": op_us}
    return {**traces[middle], **op, "span_s": statistics.median(spans), "span_repeats_s": spans,
            "repeats": len(traces)}


def _trace_stats(events, calls: int, gaps: int, op_kernels) -> dict[str, Any]:
    """``traced_call_time``'s fields from one trace's kernel events."""
    if not events:
        raise RuntimeError("the profiler trace holds no kernel events")
    per_device: dict[str, list] = {}
    for ev in events:
        per_device.setdefault(ev[3], []).append(ev)
    spans = {dev: (evs[-1][1] + evs[-1][2] - evs[0][1], sum(e[2] for e in evs)) for dev, evs in per_device.items()}
    slowest = max(spans, key=lambda dev: spans[dev][0])
    span, busy = spans[slowest]
    per_name = launches_by_name(events)
    n_dev, per = len(per_device), calls * len(per_device)
    op = {}
    if op_kernels is not None:
        spans_s = op_spans(per_device[slowest], op_kernels, calls)
        op = {"op_span_s": float(np.median(spans_s)), "op_spans_us": [round(x * 1e6, 2) for x in spans_s]}
    return {**op, "calls": calls, "devices": n_dev, "span_s": span / calls / 1e9, "busy_s": busy / calls / 1e9,
            "idle_s": (span - busy) / calls / 1e9,
            "span_per_device_s": [spans[dev][0] / calls / 1e9 for dev in sorted(spans)],
            "largest_gaps_us": [largest_gaps(per_device[dev], gaps) for dev in sorted(per_device)],
            "kernels": kernel_totals(per_name, per),
            "launches_us": {n: [round(x / 1e3, 2) for x in d] for n, d in per_name.items() if len(d) >= calls}}


@contextlib.contextmanager
def counting_compiles():
    """Yields a list that collects the seconds of every XLA backend compile (in any thread) in the block."""
    seconds = []

    def listen(event, duration, **_):
        if event == BACKEND_COMPILE_EVENT:
            seconds.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seconds
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def measure_copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (reads + writes counted), the roofline we quote."""
    n = nbytes // 4
    x = jnp.arange(n, dtype=jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)  # one read + one write per element
    t = time_fn(copy, x, repeats=repeats)["median_s"]
    return 2 * nbytes / t


def measure_traced_copy_bandwidth(nbytes: int = 1 << 30, calls: int = 8) -> float:
    """Copy bandwidth in bytes/s (reads + writes) timed like the kernels: XLA's a+1 over ``nbytes``,
    device time from a profiler trace of a ``dispatched_chain`` (``traced_call_time``): 3.02 TB/s on an H100, beside
    PyTorch's 2.95-3.01. Until session 77 it was timed over a ``dependent_chain``, whose 8 a+1 calls XLA fused into
    one kernel reading the input once: 4.11 TB/s on the H100 (peak 3.35), 4.70-4.86 on the H200."""
    x = jnp.arange(nbytes // 4, dtype=jnp.float32)
    return 2 * nbytes / traced_call_time(lambda a: a + 1.0, (x,), calls, chain=dispatched_chain)["span_s"]


def measure_torch_copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float | None:
    """Device copy bandwidth (bytes/s, reads + writes) by PyTorch's CUDA copy, or None without CUDA.

    On the H200 this reaches ~4.2 TB/s where XLA's elementwise copy above reaches only ~2.7 TB/s; the
    benchmarks quote the PyTorch figure as the bandwidth roofline.
    """
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    bandwidth = 2 * nbytes * repeats / (start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return bandwidth


SMI_FIELDS = {"clocks.sm": "sm_mhz", "clocks.mem": "mem_mhz", "power.draw": "power_w", "temperature.gpu": "temp_c"}


def parse_smi_samples(text: str) -> dict[str, Any] | None:
    """nvidia-smi CSV lines (the ``SMI_FIELDS`` queried, no header, no units) -> the samples' count, and the
    median, mean and extremes of each field under its ``SMI_FIELDS`` name (SM clock and memory clock in MHz, power
    in W, temperature in C); None if no line parses."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            rows.append([float(p) for p in parts])
        except ValueError:
            continue
    rows = [r for r in rows if len(r) == len(SMI_FIELDS)]
    if not rows:
        return None
    out: dict[str, Any] = {"samples": len(rows)}
    for j, name in enumerate(SMI_FIELDS.values()):
        col = [r[j] for r in rows]
        out[name] = dict(median=statistics.median(col), mean=statistics.fmean(col), min=min(col), max=max(col))
    return out


def sustained_gpu_state(fn: Callable, args: tuple, seconds: float = 0.5, interval_ms: int = 20) -> dict | None:
    """Calls ``fn(*args)`` back to back for ``seconds`` while nvidia-smi samples the SM clock, memory clock,
    power and temperature every ``interval_ms``; returns ``parse_smi_samples`` of the samples, or None where
    nvidia-smi is missing. Tells whether a kernel's speed depends on the clock its data allows (dynamic
    power: random operands toggle more bits than zeros)."""
    block(fn(*args))
    query = f"--query-gpu={','.join(SMI_FIELDS)}"
    try:
        proc = subprocess.Popen(["nvidia-smi", query, "--format=csv,noheader,nounits", f"-lms={interval_ms}"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(5):
                out = fn(*args)
            block(out)
    finally:
        proc.terminate()
        text, _ = proc.communicate(timeout=10)
    return parse_smi_samples(text)


def square_operands(n: int) -> tuple[jax.Array, jax.Array]:
    """Two random bf16 [n, n] matrices (seeded by n): the peak's operands."""
    k1, k2 = jax.random.split(jax.random.key(n))
    return jax.random.normal(k1, (n, n), jnp.bfloat16), jax.random.normal(k2, (n, n), jnp.bfloat16)


def _best_square_matmul_rate(sizes: tuple[int, ...], seconds_per_product: Callable) -> float:
    """FLOP/s of the fastest square bf16 product [n, n] x [n, n] over ``sizes``, each timed by
    ``seconds_per_product(a, b)``."""
    best = 0.0
    for n in sizes:
        a, b = square_operands(n)
        best = max(best, 2 * n**3 / seconds_per_product(a, b))
        del a, b
    return best


def measure_bf16_peak(sizes: tuple[int, ...] = (8192, 16384), repeats: int = 5) -> float:
    """Dense bf16 matmul throughput in FLOP/s (the compute roofline we quote): the best over square
    [n, n] x [n, n] products with bf16 output (f32 accumulation), each timed as a chain of dependent
    products with the launch cost differenced out (``chained_call_time``). A single dispatched 8192
    product with an f32 output measured 538-639 TFLOP/s on the H200 from run to run, below what the
    attention kernel then reached, so it was not a ceiling."""
    return _best_square_matmul_rate(
        sizes, lambda a, b: chained_call_time(jnp.dot, (a, b), n_long=5, n_short=1, repeats=repeats))


def measure_traced_bf16_peak(sizes: tuple[int, ...] = (8192, 16384), calls: int = 8) -> float:
    """The same products timed like the kernels: device time per call from a profiler trace of a dependent
    chain (``traced_call_time``). ``measure_bf16_peak`` differences two wall-clock chains instead; on the
    H200 it read 710 and 800 TFLOP/s on one machine six minutes apart (session 23), this one 800-802, so
    benchmarks record both and quote the larger."""
    return _best_square_matmul_rate(sizes, lambda a, b: traced_call_time(jnp.dot, (a, b), calls)["span_s"])


def parse_settings(text: str, what: str = "setting") -> dict[str, Any]:
    """'split=1,mma_in_flight=None,widths=one' -> {"split": 1, "mma_in_flight": None, "widths": "one"}: a
    benchmark's keyword arguments from the command line (ints, None, else strings); ValueError naming ``what``
    for an item that is not KEY=VALUE."""
    settings: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"{what} item {item!r} is not KEY=VALUE")
        settings[key] = int(value) if value.lstrip("-").isdigit() else None if value == "None" else value
    return settings


def write_result(name: str, payload: dict[str, Any], out_dir: str | None = None) -> str:
    """Writes ``<out_dir>/<name>.json`` with provenance fields added; returns the path."""
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    head = git_commit()
    code = payload.get("code_commit")  # given by --commit where the checkout's git HEAD is stale (device)
    record = {
        "name": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": code or head,
        **({"checkout_git_head": head} if code and code != head else {}),
        "hardware": hardware(),
        **payload,
    }
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=_json_default)
    return path


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o)}")


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """Plain fixed-width table on stdout."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
