"""DDTree's ranking steps on the device: ``ddtree_jax.topk.top_k`` by each method at the draft's vocabulary
and at the build's beams, the log-softmax before them, ``build_tree`` whole, and the verify's target sample
plain and truncated by top-k / top-p (``ddtree_jax.sampling``, each top-p method), the sample with one key per
stream against one for the batch, and the engine's optional token scores (``ddtree_jax.scores``), by the device
time per call
from a profiler trace (a chain of ``--calls`` dependent calls, 8 by default, traced ``--trace-repeats`` times, 3 by
default, the median quoted; ``bench_util.traced_call_time``; each call's span holds the chain's one-element tie,
~1 µs). The floor of a vocabulary point is its bytes read once (M x W
f32) over PyTorch's copy bandwidth (XLA's a+1 copy, ``bench_util.measure_copy_bandwidth``, where PyTorch
or CUDA is missing, and on a CPU).

    PYTHONPATH=. python experiments/bench_top_k.py --out DIR

Rows M are streams x the draft depth (7 for a block of 8): 7, 28 and 112 for 1, 4 and 16 streams. Every
method's result is checked against ``lax.top_k`` (values and indices) and every build against the "sort"
build before it is timed. On a CPU (``--smoke``) the shapes shrink, and each chain is 2 calls traced once.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ddtree_jax import sampling, topk  # noqa: E402
from ddtree_jax.processors import TokenHistory, check_logit_bias, process_logits, processing_for  # noqa: E402
from ddtree_jax.stopping import check_id_sequences  # noqa: E402
from ddtree_jax.stream_settings import (stream_allowed_ids, stream_sequences, stream_logit_bias,  # noqa: E402
                                        uniform_settings)
from ddtree_jax.scores import token_scores  # noqa: E402
from ddtree_jax.stop_strings import StopStringTabler, advance, start_states  # noqa: E402
from ddtree_jax.tree import build_tree, chain_tree, sample_target_tokens  # noqa: E402
from experiments import bench_util  # noqa: E402

VOCAB, DEPTH, BUDGET = 163840, 7, 32


def chunked_log_softmax(logits: jax.Array, chunk: int) -> jax.Array:
    """log_softmax over the last axis of [M, W] with its max and sum taken per chunk first, then over
    chunks: M x W / chunk partial reductions instead of M long ones."""
    m, w = logits.shape
    parts = logits.reshape(m, w // chunk, chunk)
    part_max = jnp.max(parts, axis=-1)
    row_max = jnp.max(part_max, axis=-1, keepdims=True)
    part_sum = jnp.sum(jnp.exp(parts - row_max[..., None]), axis=-1)
    return logits - row_max - jnp.log(jnp.sum(part_sum, axis=-1, keepdims=True))


def all_equal(got, want) -> bool:
    """Every array of ``got`` equal to the matching one of ``want`` (pytrees of the same structure)."""
    return all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def as_one(out) -> jax.Array:
    """A function's outputs as one f32 array, for the dependent chain."""
    leaves = jax.tree.leaves(out)
    return jnp.concatenate([x.astype(jnp.float32).ravel() for x in leaves])


def timed(fn, args, calls: int = 8, repeats: int = 3) -> dict:
    """``fn(*args)``'s device time per call: a chain of ``calls`` dependent calls traced ``repeats`` times."""
    t = bench_util.traced_call_time(lambda *a: as_one(fn(*a)), args, calls=calls, repeats=repeats)
    return {"us": t["span_s"] * 1e6, "us_repeats": [round(x * 1e6, 2) for x in t["span_repeats_s"]],
            "launches": sum(k[1] for k in t["kernels"]),
            "kernels": [[n[:60], k, round(s * 1e6, 2)] for n, k, s in t["kernels"][:6]]}


def bench_vocab(rows, timer, m_list, w, k, chunks, bw):
    rng = np.random.default_rng(0)
    for m in m_list:
        values = jnp.asarray(np.asarray(jax.nn.log_softmax(jnp.asarray(rng.standard_normal((m, w)) * 3, jnp.float32))))
        want = jax.lax.top_k(values, k)
        variants = [("sort", {})] + [("chunked", {"chunk": c}) for c in chunks]
        for method, kw in variants:
            fn = jax.jit(lambda v, method=method, kw=kw: topk.top_k(v, k, method, **kw))
            got = fn(values)
            same = all_equal(got, want)
            row = {"part": "top_k vocab", "M": m, "N": w, "K": k, "method": method, "chunk": kw.get("chunk"),
                   "exact": same, **timer(fn, (values,))}
            if bw:
                row["floor_us"] = m * w * 4 / bw * 1e6
            rows.append(row)
            print(row, flush=True)


def bench_beams(rows, timer, shapes):
    rng = np.random.default_rng(1)
    for m, n, k in shapes:
        values = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
        for method in ("sort", "compare"):
            fn = jax.jit(lambda v, method=method: topk.top_k(v, k, method))
            same = all_equal(fn(values), jax.lax.top_k(values, k))
            row = {"part": "top_k beam", "M": m, "N": n, "K": k, "method": method, "exact": same,
                   **timer(fn, (values,))}
            rows.append(row)
            print(row, flush=True)


def bench_log_softmax(rows, timer, m_list, w, chunks, bw):
    rng = np.random.default_rng(2)
    for m in m_list:
        logits = jnp.asarray(rng.standard_normal((m, w)) * 3, jnp.float32)
        want = jax.nn.log_softmax(logits, axis=-1)
        variants = [("jax.nn", None)] + [("chunked", c) for c in chunks]
        for name, c in variants:
            fn = jax.jit(lambda x, c=c: jax.nn.log_softmax(x, axis=-1) if c is None else chunked_log_softmax(x, c))
            err = float(jnp.max(jnp.abs(fn(logits) - want)))
            row = {"part": "log_softmax", "M": m, "N": w, "method": name, "chunk": c, "max_abs_err": err,
                   **timer(fn, (logits,))}
            if bw:
                row["floor_us"] = 2 * m * w * 4 / bw * 1e6  # read the logits, write the log-probs
            rows.append(row)
            print(row, flush=True)


def bench_build(rows, timer, streams, w, depth, budget):
    rng = np.random.default_rng(3)
    for b in streams:
        logits = jnp.asarray(rng.standard_normal((b, depth, w)) * 3, jnp.float32)
        roots = jnp.asarray(rng.integers(0, w, b), jnp.int32)
        trees = {}
        for method in ("sort", "auto"):
            fn = jax.jit(lambda x, r, method=method: build_tree(jax.nn.log_softmax(x, -1), r, budget, method))
            tree = fn(logits, roots)
            trees[method] = tree
            fields = ("tokens", "parents", "depths", "logprob")
            same = all_equal([getattr(tree, f) for f in fields], [getattr(trees["sort"], f) for f in fields])
            row = {"part": "build_tree from logits", "M": b * depth, "N": w, "K": budget, "method": method,
                   "exact": same, **timer(fn, (logits, roots))}
            rows.append(row)
            print(row, flush=True)


SAMPLE_SETTINGS = [("categorical", 0, 1.0, 0.0, "auto"), ("top_k", 50, 1.0, 0.0, "auto"),
                   ("top_p", 0, 0.95, 0.0, "sort"), ("top_p", 0, 0.95, 0.0, "search"),
                   ("top_k+top_p", 50, 0.95, 0.0, "auto"), ("min_p", 0, 1.0, 0.05, "auto")]
SEARCH_FANOUTS = (2, 4, 16, 64)


def bench_sample(rows, timer, m_list, w, bw):
    """The verify's target sample (temperature 1) over [M, W] logits, plain and truncated: ``sampling.truncate``
    then one categorical draw, top-p alone by each method; then the search's nucleus edge alone at each of
    SEARCH_FANOUTS. The two methods' masses are sums in another order, so on these flat rows (~14K tokens in the
    nucleus) an edge may differ by a token: "rows_as_sort" counts the rows whose kept tokens (or edge) equal the
    sort's, "kept_diff" the kept tokens' count against the sort's, summed over the rows."""
    rng = np.random.default_rng(4)
    key = jax.random.key(0)
    for m in m_list:
        logits = jnp.asarray(rng.standard_normal((m, w)) * 3, jnp.float32)
        kept = {}
        for name, k, p, min_p, method in SAMPLE_SETTINGS:
            def truncated(x, k=k, p=p, method=method, min_p=min_p):
                return sampling.truncate(x, k, p, method, min_p)

            kept[name, method] = np.asarray(jax.jit(lambda x, f=truncated: jnp.isfinite(f(x)))(logits))
            fn = jax.jit(lambda x, f=truncated: jax.random.categorical(key, f(x), axis=-1))
            row = {"part": "sample", "M": m, "N": w, "K": k or None, "top_p": p, "min_p": min_p or None,
                   "method": f"{name} {method}",
                   "kept_mean": float(kept[name, method].sum(-1).mean()), **timer(fn, (logits,))}
            if name == "top_p":
                same_rows = (kept[name, method] == kept["top_p", "sort"]).all(-1)
                row["rows_as_sort"] = f"{int(same_rows.sum())}/{m}"
                row["kept_diff"] = int(kept[name, method].sum() - kept["top_p", "sort"].sum())
            if bw:
                row["floor_us"] = m * w * 4 / bw * 1e6  # the logits read once
            rows.append(row)
            print(row, flush=True)
        edge_by_sort = np.asarray(jax.jit(lambda x: sampling.nucleus_edge_by_sort(x, 0.95))(logits))
        for fanout in SEARCH_FANOUTS:  # the search's edge alone, by its thresholds a pass
            fn = jax.jit(lambda x, f=fanout: sampling.nucleus_edge_by_search(x, 0.95, f))
            same_rows = int((np.asarray(fn(logits)) == edge_by_sort).sum())
            row = {"part": "top_p edge", "M": m, "N": w, "top_p": 0.95, "method": f"search x{fanout}",
                   "passes": sampling.search_passes(fanout), "rows_as_sort": f"{same_rows}/{m}", **timer(fn, (logits,))}
            rows.append(row)
            print(row, flush=True)


def bench_keys(rows, timer, shapes, w, bw):
    """The verify's plain sample (temperature 1) over [B, T, W] logits with one key for the batch against one key
    per stream (``tree.sample_target_tokens``' [B] keys: a vmap of the draw over streams, what the engine does),
    and with logit processing before it (``processors.process_logits`` over a chain of T nodes, 1 % of the
    vocabulary in the prompt and 1 % in the output): the repetition penalty alone, then with the frequency and
    presence penalties, a 16-token logit bias and min_new_tokens over 2 EOS ids; a 16-token logit bias alone, the
    same for every stream (constants) and each stream's own ([B, 16] pairs), the latter also as the scatter into
    the logits that the engine did before session 63 (it now adds dense rows); 1024 allowed ids per stream (a dense
    mask row); 8 two-token bad words, the same for every stream and each stream's own. Then top-k 50 and top-p 0.9, as
    Python numbers (one program per value) and as one per stream ([B] arrays: one program for any values)."""
    rng = np.random.default_rng(5)
    bias = tuple((int(i), -1.0) for i in rng.choice(w, 16, replace=False))
    for b, t in shapes:
        repetition = (processing_for(uniform_settings(b, repetition_penalty=1.3)),
                      jax.tree.map(jnp.asarray, uniform_settings(b, repetition_penalty=1.3)))
        numbers = dict(repetition_penalty=1.3, frequency_penalty=0.3, presence_penalty=0.2, min_new_tokens=4)
        everything = (processing_for(uniform_settings(b, **numbers), logit_bias=bias, eos_ids=(0, 1)),
                      jax.tree.map(jnp.asarray, uniform_settings(b, **numbers)))
        logits = jnp.asarray(rng.standard_normal((b, t, w)) * 3, jnp.float32)
        per_stream = jax.random.split(jax.random.key(0), b)
        history = TokenHistory(prompt_seen=jnp.asarray(rng.random((b, w)) < 0.01),
                               out_counts=jnp.asarray((rng.random((b, w)) < 0.01) * rng.integers(1, 4, (b, w)),
                                                      jnp.int32),
                               recent=jnp.asarray(rng.integers(0, w, (b, 1)), jnp.int32))  # K = 1: two-token words
        tokens = jnp.asarray(rng.integers(0, w, (b, t)), jnp.int32)
        chain = chain_tree(tokens[:, 1:], tokens[:, 0])
        num_out = jnp.full((b,), 2, jnp.int32)
        top_k, top_p = jnp.full((b,), 50, jnp.int32), jnp.full((b,), 0.9, jnp.float32)
        own = dataclasses.replace(uniform_settings(b), logit_bias=stream_logit_bias(
            [{int(i): -1.0 for i in rng.choice(w, 16, replace=False)} for _ in range(b)], b, w, (), check_logit_bias))
        allowed = dataclasses.replace(uniform_settings(b), allowed=stream_allowed_ids(
            [rng.choice(w, 1024, replace=False).tolist() for _ in range(b)], b, w, ()))
        words = [tuple(int(x) for x in rng.integers(0, w, 2)) for _ in range(8)]
        own_words = dataclasses.replace(uniform_settings(b), bad_words=stream_sequences(
            [[tuple(int(x) for x in rng.integers(0, w, 2)) for _ in range(8)] for _ in range(b)], b, w, (),
            check_id_sequences, "bad_words"))
        # Every array rides as an argument: closed over, XLA would fold the processing of constant trees.
        context = {"keys": per_stream, "history": history, "chain": chain, "num_out": num_out, "top_k": top_k,
                   "top_p": top_p, "plain": jax.tree.map(jnp.asarray, uniform_settings(b)),
                   "repetition": repetition[1], "everything": everything[1], "own": jax.tree.map(jnp.asarray, own),
                   "allowed": jax.tree.map(jnp.asarray, allowed), "own_words": jax.tree.map(jnp.asarray, own_words)}

        def processed(x, c, processing, settings):
            return sample_target_tokens(process_logits(x, processing, c[settings], c["history"], c["num_out"],
                                                       c["chain"]), 1.0, c["keys"])

        def scattered_bias(x, c):  # the per-stream bias as a scatter into the logits (the engine's before s63)
            x = jax.vmap(lambda row, ids, amounts: row.at[:, ids].add(amounts, mode="drop"))(
                x, c["own"].logit_bias.ids, c["own"].logit_bias.amounts)
            return sample_target_tokens(x, 1.0, c["keys"])

        fns = {"one key": lambda x, c: sample_target_tokens(x, 1.0, jax.random.key(0)),
               "key per stream": lambda x, c: sample_target_tokens(x, 1.0, c["keys"]),
               "key per stream + repetition penalty": lambda x, c: processed(x, c, repetition[0], "repetition"),
               "key per stream + all processing": lambda x, c: processed(x, c, everything[0], "everything"),
               "key per stream + 16-token logit bias": lambda x, c: processed(
                   x, c, processing_for(uniform_settings(b), logit_bias=bias), "plain"),
               "key per stream + 16-token logit bias per stream": lambda x, c: processed(
                   x, c, processing_for(own), "own"),
               "key per stream + 16-token logit bias per stream, scattered": scattered_bias,
               "key per stream + 1024 allowed ids per stream": lambda x, c: processed(
                   x, c, processing_for(allowed), "allowed"),
               "key per stream + 8 two-token bad words": lambda x, c: processed(
                   x, c, processing_for(uniform_settings(b), bad_words=words), "plain"),
               "key per stream + 8 two-token bad words per stream": lambda x, c: processed(
                   x, c, processing_for(own_words), "own_words"),
               "key per stream + top-k 50, top-p 0.9": lambda x, c: sample_target_tokens(x, 1.0, c["keys"], 50, 0.9),
               "key per stream + top-k 50, top-p 0.9 per stream": lambda x, c: sample_target_tokens(
                   x, 1.0, c["keys"], c["top_k"], c["top_p"], top_k_ceiling=64, top_k_in_every_row=True)}
        for name, fn in fns.items():
            row = {"part": "sample keys", "M": b * t, "B": b, "T": t, "N": w, "method": name,
                   **timer(jax.jit(fn), (logits, context))}
            if bw:
                row["floor_us"] = b * t * w * 4 / bw * 1e6
            rows.append(row)
            print(row, flush=True)


def bench_scores(rows, timer, shapes, w, bw, tops=(0, 5, 20)):
    """What ``EngineConfig(logprobs=True, top_logprobs=n)`` adds to a round: the accepted path's R rows gathered
    from the verify's [B, T, W] logits and ``scores.token_scores`` over them (log-probability, n likeliest)."""
    rng = np.random.default_rng(6)
    for b, t, r in shapes:
        logits = jnp.asarray(rng.standard_normal((b, t, w)) * 3, jnp.float32)
        path = jnp.asarray(np.sort(rng.integers(0, t, (b, r)), axis=1), jnp.int32)
        tokens = jnp.asarray(rng.integers(0, w, (b, r)), jnp.int32)
        for top in tops:
            def fn(x, p, y, top=top):
                return token_scores(jnp.take_along_axis(x, p[:, :, None], axis=1), y, top)

            row = {"part": "scores", "M": b * r, "B": b, "T": t, "N": w, "K": top or None,
                   "method": f"path rows, top {top}", **timer(jax.jit(fn), (logits, path, tokens))}
            if bw:
                row["floor_us"] = b * r * w * 4 / bw * 1e6  # the path's rows read once
            rows.append(row)
            print(row, flush=True)


def bench_stops(rows, timer, streams, w, emitted=DEPTH + 1, strings=("</s>", "\n\nUser:", "<|im_end|>", "```\n")):
    """Stop strings (``stop_strings``): the host's tables over a made-up vocabulary of w tokens (lengths ~
    geometric, mean 6 bytes, 50 of 128 bytes), then a round's ``advance`` over ``emitted`` tokens per stream.
    The device part reads S * emitted gathered entries per stream: launch-bound, so no floor is quoted. Then what
    a prefill with per-stream stop strings adds on the host: the batch's tables stacked from strings already tabled
    (S and Q rounded up) and moved to the device."""
    rng = np.random.default_rng(7)
    lengths = np.minimum(rng.geometric(1 / 6, w), 64)
    lengths[:50] = 128
    token_bytes = [bytes(rng.integers(32, 127, n).tolist()) for n in lengths]
    t0 = time.perf_counter()
    tabler = StopStringTabler(token_bytes)
    tables = tabler.tables(strings)
    jax.block_until_ready(tables.next_state)
    build_s = time.perf_counter() - t0
    row = {"part": "stop tables (host)", "N": w, "K": len(strings), "method": "build_stop_tables",
           "us": build_s * 1e6, "table_mb": (tables.next_state.nbytes + tables.completes.nbytes) / 1e6}
    rows.append(row)
    print(row, flush=True)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        batch = tabler.tables(strings, round_up=True)
        jax.block_until_ready(batch.next_state)
        times.append(time.perf_counter() - t0)
    row = {"part": "stop tables (host)", "N": w, "K": len(strings), "method": "a batch's tables (kept strings)",
           "us": float(np.median(times)) * 1e6, "table_mb": (batch.next_state.nbytes + batch.completes.nbytes) / 1e6}
    rows.append(row)
    print(row, flush=True)
    for b in streams:
        tokens = jnp.asarray(rng.integers(0, w, (b, emitted)), jnp.int32)
        counts = jnp.asarray(rng.integers(1, emitted + 1, b), jnp.int32)
        fn = jax.jit(lambda states, t, c: advance(tables, states, t, c))
        row = {"part": "stop advance", "M": b * emitted, "B": b, "T": emitted, "N": w, "K": len(strings),
               "method": "advance", **timer(fn, (start_states(tables, b), tokens, counts))}
        rows.append(row)
        print(row, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="bench_top_k")
    ap.add_argument("--parts", default="vocab,beams,log_softmax,build,sample,keys,scores,stops")
    ap.add_argument("--commit", default=None, help="code commit to record (the device copy has no .git)")
    ap.add_argument("--smoke", action="store_true", help="CPU: small shapes")
    ap.add_argument("--sample-rows", default="33,132,260", help="the sample part's M values (comma-separated)")
    bench_util.add_trace_args(ap)
    args = ap.parse_args()
    parts = args.parts.split(",")
    unknown = set(parts) - {"vocab", "beams", "log_softmax", "build", "sample", "keys", "scores", "stops"}
    if unknown:
        ap.error(f"unknown --parts {sorted(unknown)}")
    calls, repeats = bench_util.trace_args(ap, args)
    timer = functools.partial(timed, calls=calls, repeats=repeats)
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    w = 4096 if args.smoke else VOCAB
    m_list = [7] if args.smoke else [7, 28, 112]
    chunks = [64, 128] if args.smoke else [64, 128, 256, 512, 1024]
    # the floors' yardstick: PyTorch's device copy, else (no PyTorch / CUDA, or --smoke) XLA's a+1 copy
    tbw = None if args.smoke else bench_util.measure_torch_copy_bandwidth()
    bw = tbw or bench_util.measure_copy_bandwidth(1 << 24 if args.smoke else 1 << 30)
    bw_source = "torch copy" if tbw else "XLA a+1 copy"
    rows, t0 = [], time.time()
    if "vocab" in parts:
        bench_vocab(rows, timer, m_list, w, BUDGET, chunks, bw)
    if "beams" in parts:
        beams = [(4, 130, 32), (1, 224, 32)] if args.smoke else [(m, n, 32) for n in (130, 224) for m in (1, 4, 16)]
        bench_beams(rows, timer, beams)
    if "log_softmax" in parts:
        bench_log_softmax(rows, timer, m_list, w, chunks, bw)
    if "build" in parts:
        bench_build(rows, timer, [4] if args.smoke else [1, 4, 16], w, DEPTH, BUDGET)
    if "sample" in parts:  # the verify's rows: DDTree-32 at 1 and 4 streams, DDTree-64 at 4
        bench_sample(rows, timer, [33] if args.smoke else [int(m) for m in args.sample_rows.split(",")], w, bw)
    if "keys" in parts:  # DDTree-32 and -64 trees at 1, 4 and 8 streams
        bench_keys(rows, timer, [(4, 33)] if args.smoke else [(1, 33), (4, 33), (4, 65), (8, 33)], w, bw)
    if "scores" in parts:  # paths of up to DEPTH + 1 rows
        paths = [(4, 33, DEPTH + 1)] if args.smoke else [(b, 33, DEPTH + 1) for b in (1, 4, 16)]
        bench_scores(rows, timer, paths, w, bw)
    if "stops" in parts:
        bench_stops(rows, timer, [4] if args.smoke else [1, 4, 16], w)
    payload = {"copy_bw_Bps": bw, "copy_bw_source": bw_source, "code_commit": args.commit, "calls": calls,
               "trace_repeats": repeats,
               "hardware": bench_util.hardware(),
               "jax": jax.__version__, "seconds": round(time.time() - t0, 1), "rows": rows}
    bench_util.write_result(args.name, payload, out_dir=args.out)
    bench_util.print_table(rows, ["part", "M", "B", "T", "N", "K", "top_p", "method", "min_p", "passes", "chunk",
                                  "exact", "rows_as_sort", "kept_diff", "us", "floor_us", "launches"])


if __name__ == "__main__":
    main()
