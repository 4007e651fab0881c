"""Projected full-size K2.6 decode on an 8-GPU mesh from per-layer measurements on 1 and 2 GPUs, or of one
device's share of the layer on one GPU (issue #7).

    PYTHONPATH=. python experiments/project_k26.py \
        --one experiments/results/bench_layer_h200.json [more files of other M] \
        --two experiments/results/bench_layer_h200x2_mesh1x2.json [...] \
        [--eval experiments/results/eval_grid_h200.json] [--gpus 8] [--figure span|busy] [--out DIR]
    PYTHONPATH=. python experiments/project_k26.py --local bench_layer_full_local8.json [...] \
        --allreduce-us 0,10,20 --allreduce-gbps 300 [--eval ...] [--figure span|busy] [--out DIR]

A projection, not a measurement. It is only as good as these assumptions, which the output repeats.
The fit (--one / --two):
- Per MoE layer at G GPUs, t_G(M) = a(M) + b(M) / G, fitted exactly through the measured 1- and 2-GPU
  times of the whole layer (``bench_layer.py`` part "layer"). a holds what sharding does not divide
  (launches, small ops, the collectives as they cost at G = 2), b what it does (weight bytes). At G = 8
  the collectives span 8 GPUs, so a is a lower bound there.
One device's share (--local):
- Per MoE layer at G GPUs, t_G(M) = the layer as one device of a 1xG mesh computes it (``bench_layer.py
  --local-of G``: its heads, shared-expert width and experts, the router and replicated projections whole,
  the busiest device's experts for uniform random routing), timed alone on one GPU, plus the
  layer's all-reduces (``allreduce_time``, a ring model): ALLREDUCES_PER_LAYER latencies at each assumed
  --allreduce-us, and 2 (G - 1) / G of ALLREDUCED_ROWS_PER_TOKEN x M x D f32 values through each device at an
  assumed --allreduce-gbps. They were not measured on G GPUs. Devices that wait for the busiest at each
  all-reduce are assumed not to add more.
Both:
- A step of M tokens costs num_layers * t_G(M): the dense first layer is counted as a MoE layer (about
  equal at one token: a device's dense share is 99 MB, a MoE layer's 91 MB when its busiest device holds 3 of
  the 8 experts; an upper bound once that device holds 4 or more); the LM head, the embedding and the
  drafter are left out (a lower bound for the step).
- Between measured M the time is interpolated linearly; outside them nothing is projected.
- ``--figure busy`` fits the summed kernel time (of the device with the longest span) instead of the
  trace's span (traced inputs only): the layer as if the GPU never waited between kernels, so the fitted
  times are lower bounds. Session 10 needed it: on two H200s the traced spans were 2-8x the kernels'
  time, idle gaps that the one-GPU runs do not have.
- AR tok/s = 1 / step(1). DDTree at S streams and budget B verifies M = S (B + 1) tokens per step and
  accepts S * tau(B) tokens, tau measured with the shipped trained pair (a 30M-parameter target on
  Python code; K2.6 with a trained K2.6 drafter will differ).
"""

from __future__ import annotations

import argparse
import json
import sys

from experiments import bench_util

K26_LAYERS = 61
# a MoE layer's collectives on a ("data", "model") mesh at the default rules: one all-reduce of the attention's
# output and one of the routed and shared experts' shares, summed first (``moe.routed_experts``; the compiled HLO
# on host devices, tests/test_bench_layer.py counts them)
ALLREDUCES_PER_LAYER = 2
ALLREDUCED_ROWS_PER_TOKEN = 2  # f32 rows of D values a token sends through them: the attention's, the experts'


FIGURES = {"span": "us", "busy": "busy_us"}


def assumptions(kind: str) -> str:
    """The module docstring's assumptions of the fit ("fit") or of one device's share ("local"), then those of
    both."""
    text = __doc__.split("assumptions, which the output repeats.")[1]
    fit_part, rest = text.split("One device's share (--local):")
    local_part, both = rest.split("Both:")
    own = fit_part.split("The fit (--one / --two):")[1] if kind == "fit" else local_part
    return (own.strip() + "\n" + both.strip()).replace("ALLREDUCES_PER_LAYER", str(ALLREDUCES_PER_LAYER)).replace(
        "ALLREDUCED_ROWS_PER_TOKEN", str(ALLREDUCED_ROWS_PER_TOKEN))


def layer_times(result: dict, figure: str = "span") -> dict[int, float]:
    """M -> µs of the whole layer in a bench_layer result: the trace's span ("span"; a fori_loop result's
    time) or the summed kernel time of the device with the longest span ("busy")."""
    if figure not in FIGURES:
        raise ValueError(f"figure must be one of {sorted(FIGURES)}, got {figure!r}")
    rows = [r for r in result["rows"] if r["part"] == "layer"]
    if not rows:
        raise ValueError(f"{result.get('name', 'result')} holds no 'layer' rows")
    if any(FIGURES[figure] not in r for r in rows):
        raise ValueError(f"{result.get('name', 'result')} has no {FIGURES[figure]!r} in its layer rows: "
                         f"figure={figure!r} needs traced results of session 10 or later")
    return {r["M"]: r[FIGURES[figure]] for r in rows}


SETTINGS = ("size", "prefix", "dtype", "mesh", "local_of")  # the bench_layer config that combined inputs must share


def settings_of(result: dict) -> dict:
    """The run settings of a bench_layer result that change the layer timed (absent keys read as None)."""
    return {k: result.get("config", {}).get(k) for k in SETTINGS}


def combine_results(results: list[dict], names: list[str], allow_mixed: bool = False) -> dict:
    """Several bench_layer results of one mesh (e.g. M = 1, 9, 65 from one device call and M = 90 from
    another) as one: their layer rows, each tagged with its file's commit; ``commit`` is the sorted set of
    commits joined by "+" (so differing commits across files count as mixed). Raises ValueError if the
    files time the layer differently, measure the same M twice, or (unless ``allow_mixed``) differ in
    ``SETTINGS``."""
    if len(results) == 1:
        return results[0]
    timings = {timing_of(r) for r in results}
    if len(timings) > 1:
        raise ValueError(f"{names} time the layer differently ({sorted(timings)}): measure them the same way")
    settings = [settings_of(r) for r in results]
    if not allow_mixed and any(s != settings[0] for s in settings):
        raise ValueError(f"{names} were run with different settings ({settings}): combine runs of one size, "
                         "prefix, dtype and mesh (or pass allow_mixed / --allow-mixed)")
    rows, seen = [], {}
    for result, name in zip(results, names):
        for row in result["rows"]:
            if row["part"] == "layer" and row["M"] in seen:
                raise ValueError(f"M={row['M']} is in both {seen[row['M']]} and {name}")
            if row["part"] == "layer":
                seen[row["M"]] = name
            rows.append(dict(row, commit=result.get("commit")))
    commits = sorted({str(r.get("commit")) for r in results})
    return dict(results[0], name="+".join(names), commit="+".join(commits), rows=rows)


def fit(one: dict[int, float], two: dict[int, float]) -> dict[int, tuple[float, float]]:
    """M -> (a, b) with t_G = a + b / G through t_1 and t_2, for the M measured on both."""
    common = sorted(set(one) & set(two))
    if not common:
        raise ValueError(f"no M measured on both 1 GPU ({sorted(one)}) and 2 GPUs ({sorted(two)})")
    return {m: (2 * two[m] - one[m], 2 * (one[m] - two[m])) for m in common}


def interpolate(at: dict[int, float], m: int) -> float:
    """The value at M of points measured at some M: exact where measured, linear between them; ValueError
    outside the measured range (no extrapolation)."""
    ms = sorted(at)
    if not ms[0] <= m <= ms[-1]:
        raise ValueError(f"M={m} is outside the measured range [{ms[0]}, {ms[-1]}]")
    if m in at:
        return at[m]
    hi = next(k for k in ms if k > m)
    lo = max(k for k in ms if k < m)
    return at[lo] + (at[hi] - at[lo]) * (m - lo) / (hi - lo)


def layer_time(coeffs: dict[int, tuple[float, float]], m: int, gpus: int) -> float:
    """Projected µs per layer at M tokens on ``gpus`` GPUs: the fit at measured M, linear between them.
    Raises ValueError outside the measured range (no extrapolation)."""
    return interpolate({k: a + b / gpus for k, (a, b) in coeffs.items()}, m)


def allreduce_time(m: int, hidden: int, gpus: int, latency_us: float, bus_gbps: float) -> float:
    """µs of a MoE layer's all-reduces at M tokens on G GPUs by the ring model: ALLREDUCES_PER_LAYER latencies,
    plus each device sending and receiving 2 (G - 1) / G of the ALLREDUCED_ROWS_PER_TOKEN * M * D f32 values at
    ``bus_gbps`` GB/s."""
    nbytes = ALLREDUCED_ROWS_PER_TOKEN * m * hidden * 4 * 2 * (gpus - 1) / gpus
    return ALLREDUCES_PER_LAYER * latency_us + nbytes / (bus_gbps * 1e3)


def local_layer_time(local: dict, m: int, latency_us: float, bus_gbps: float, figure: str = "span") -> float:
    """µs per layer at M tokens on G GPUs from one device's share of the layer timed alone (``bench_layer
    --local-of G``, the busiest device's experts), plus the all-reduces that the share leaves out
    (``allreduce_time``: assumed, not measured on G GPUs)."""
    config = local.get("config", {})
    return interpolate(layer_times(local, figure), m) + allreduce_time(m, config["hidden_size"], config["local_of"],
                                                                       latency_us, bus_gbps)


def taus(result: dict) -> dict[int, float]:
    """Budget -> tau of the DDTree rows (greedy) of an eval_grid result."""
    return {r["budget"]: r["tau"] for r in result["results"] if r["mode"] == "ddtree" and r["temperature"] == 0.0}


def timing_of(result: dict) -> str:
    """How a bench_layer result timed the layer: "traced" (device time of unrolled steps, since session 6)
    or "fori_loop" (wall time of a loop, ~30 µs of loop step per layer included)."""
    return "traced" if result.get("config", {}).get("traced") else "fori_loop"


def layer_commits(result: dict) -> dict[int, str | None]:
    """M -> the commit its layer row was measured at (a combined result tags each row; else the file's)."""
    return {r["M"]: r.get("commit", result.get("commit")) for r in result["rows"] if r["part"] == "layer"}


def check_comparable(one: dict, two: dict) -> None:
    """The fit's two inputs must time the layer the same way, come from the same code at every M fitted, and
    run the same layer (size, prefix, dtype) on one GPU and on a 1x2 mesh: otherwise b (what sharding divides)
    absorbs the difference (a faster kernel on one side reads as scaling)."""
    if timing_of(one) != timing_of(two):
        raise ValueError(f"the 1-GPU layer times are {timing_of(one)}, the 2-GPU ones {timing_of(two)}: "
                         "measure both the same way (or pass allow_mixed / --allow-mixed)")
    c1, c2 = layer_commits(one), layer_commits(two)
    for m in sorted(set(c1) & set(c2)):
        if c1[m] != c2[m]:
            raise ValueError(f"at M={m} the 1-GPU layer time comes from commit {c1[m]}, the 2-GPU one from "
                             f"{c2[m]}: measure both at one commit (or pass allow_mixed / --allow-mixed)")
    s1, s2 = settings_of(one), settings_of(two)
    if s1["mesh"] is not None or s2["mesh"] != "1x2":
        raise ValueError(f"the fit needs 1-GPU times (mesh null) and 1x2-mesh times; got mesh {s1['mesh']} and "
                         f"{s2['mesh']} (or pass allow_mixed / --allow-mixed)")
    differ = {k: (s1[k], s2[k]) for k in SETTINGS if k != "mesh" and s1[k] != s2[k]}
    if differ:
        raise ValueError(f"the 1- and 2-GPU layer times were run with different settings {differ} (1 GPU, 2 GPUs): "
                         "measure the same layer (or pass allow_mixed / --allow-mixed)")


def project(one: dict, two: dict, tau_by_budget: dict[int, float], gpus: int, layers: int = K26_LAYERS,
            streams=(1, 10), allow_mixed: bool = False, figure: str = "span") -> list[dict]:
    """AR and DDTree rows from the a + b / G fit through the 1- and 2-GPU layer times."""
    if not allow_mixed:
        check_comparable(one, two)
    coeffs = fit(layer_times(one, figure), layer_times(two, figure))
    return project_rows(lambda m: layer_time(coeffs, m, gpus), tau_by_budget, layers, streams)


def project_local(local: dict, latency_us: float, bus_gbps: float, tau_by_budget: dict[int, float],
                  layers: int = K26_LAYERS, streams=(1, 10), figure: str = "span") -> list[dict]:
    """AR and DDTree rows from one device's share of the layer (``local_layer_time``) on G = its
    ``config.local_of`` GPUs, the all-reduces at ``latency_us`` each and ``bus_gbps``."""
    config = local.get("config", {})
    if not config.get("local_of") or not config.get("hidden_size"):
        raise ValueError(f"{local.get('name', 'result')} is not a bench_layer --local-of result (with its "
                         "hidden_size)")
    if latency_us < 0 or bus_gbps <= 0:
        raise ValueError(f"the all-reduce latency must be >= 0 and its bandwidth > 0, got {latency_us} µs and "
                         f"{bus_gbps} GB/s")
    return project_rows(lambda m: local_layer_time(local, m, latency_us, bus_gbps, figure), tau_by_budget, layers,
                        streams)


def project_rows(layer_us_at, tau_by_budget: dict[int, float], layers: int, streams) -> list[dict]:
    """AR at one stream and DDTree at each stream count and budget: M, µs per layer (``layer_us_at(M)``; a
    ValueError there becomes the row's note), the step and tokens/s."""
    rows = []
    cases = [("AR", 1, None)] + [("DDTree", s, b) for s in streams for b in sorted(tau_by_budget)]
    for mode, s, budget in cases:
        m = s if budget is None else s * (budget + 1)
        row = dict(mode=mode, streams=s, budget=budget, M=m)
        try:
            t = layer_us_at(m)
        except ValueError as e:
            rows.append(dict(row, note=str(e)))
            continue
        tokens = s * (1.0 if budget is None else tau_by_budget[budget])
        step_ms = layers * t / 1e3
        rows.append(dict(row, layer_us=t, step_ms=step_ms, tokens_per_step=tokens, tok_s=tokens / step_ms * 1e3))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--one", nargs="+", help="bench_layer JSON on one GPU (several: their M combined)")
    ap.add_argument("--two", nargs="+", help="bench_layer JSON on a 1x2 mesh (likewise)")
    ap.add_argument("--local", nargs="+", help="instead of --one / --two: bench_layer --local-of G JSON (one device's "
                    "share of the layer), projected to G GPUs with --allreduce-us and --allreduce-gbps")
    ap.add_argument("--allreduce-us", default=None,
                    help="with --local: comma list of assumed latencies (µs) of one all-reduce on G GPUs, one "
                         "projection each")
    ap.add_argument("--allreduce-gbps", type=float, default=None,
                    help="with --local: the all-reduces' assumed bus bandwidth, GB/s (ring model, allreduce_time)")
    ap.add_argument("--eval", default=None, help="eval_grid JSON with the trained pair's tau per budget")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--allow-mixed", action="store_true",
                    help="fit inputs of different commits, timing methods or settings (size, prefix, dtype, "
                         "mesh) (recorded as such)")
    ap.add_argument("--figure", default="span", choices=sorted(FIGURES),
                    help="the layer time fitted: the trace's span, or each device's summed kernel time")
    args = ap.parse_args(argv)
    load = lambda p: json.load(open(p))  # noqa: E731
    if args.local:
        if args.one or args.two or args.allreduce_us is None or args.allreduce_gbps is None:
            ap.error("--local takes --allreduce-us and --allreduce-gbps, and neither --one nor --two")
        try:
            costs = [float(v) for v in args.allreduce_us.split(",")]
        except ValueError:
            ap.error(f"--allreduce-us must be a comma list of numbers, got {args.allreduce_us!r}")
        return main_local(args, combine_results([load(p) for p in args.local], args.local, args.allow_mixed), costs)
    if not (args.one and args.two) or args.allreduce_us is not None or args.allreduce_gbps is not None:
        ap.error("the fit takes --one and --two (and no --allreduce-us / --allreduce-gbps), or pass --local")
    one = combine_results([load(p) for p in args.one], args.one, args.allow_mixed)
    two = combine_results([load(p) for p in args.two], args.two, args.allow_mixed)
    tau = taus(load(args.eval)) if args.eval else {}
    rows = project(one, two, tau, args.gpus, allow_mixed=args.allow_mixed, figure=args.figure)
    payload = dict(kind="projection, not a measurement", gpus=args.gpus, layers=K26_LAYERS,
                   inputs=dict(one=args.one, two=args.two, eval=args.eval,
                               one_timing=timing_of(one), two_timing=timing_of(two),
                               one_commit=one.get("commit"), two_commit=two.get("commit"),
                               mixed=args.allow_mixed, figure=args.figure),
                   assumptions=assumptions("fit"),
                   fit={m: dict(a_us=a, b_us=b) for m, (a, b) in fit(layer_times(one, args.figure),
                                                                        layer_times(two, args.figure)).items()},
                   rows=rows)
    return write_projection(f"project_k26_{args.gpus}gpu", payload, args)


def main_local(args, local: dict, costs: list[float]) -> int:
    """``--local``: one projection per assumed all-reduce cost, from one device's share of the layer."""
    gpus = local.get("config", {}).get("local_of")
    tau = taus(json.load(open(args.eval))) if args.eval else {}
    rows = []
    for cost in costs:
        rows += [dict(r, allreduce_us=cost) for r in project_local(local, cost, args.allreduce_gbps, tau,
                                                                   figure=args.figure)]
    payload = dict(kind="projection, not a measurement", gpus=gpus, layers=K26_LAYERS,
                   inputs=dict(local=args.local, eval=args.eval, timing=timing_of(local), commit=local.get("commit"),
                               mixed=args.allow_mixed, figure=args.figure, allreduce_latencies_us=costs,
                               allreduce_bus_gbps=args.allreduce_gbps),
                   assumptions=assumptions("local"),
                   local_layer_us=layer_times(local, args.figure), rows=rows)
    return write_projection(f"project_k26_{gpus}gpu_local", payload, args, first=["allreduce_us"])


def write_projection(name: str, payload: dict, args, first=()) -> int:
    """Writes the payload as NAME[_FIGURE].json under --out and prints its rows (``first`` columns leading)."""
    suffix = "" if args.figure == "span" else f"_{args.figure}"
    print("wrote", bench_util.write_result(name + suffix, payload, args.out))
    bench_util.print_table(payload["rows"], [*first, "mode", "streams", "budget", "M", "layer_us", "step_ms",
                                             "tokens_per_step", "tok_s", "note"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
