"""Where the 64-row attention kernel loses its time at the memory-bound points: the kernel rebuilt one part at a
time, each rung timed like the kernel.

    PYTHONPATH=. python experiments/probe_attention_ladder.py --out DIR [--points 16,8192] [--layouts tile2,slot3]

The question behind it (issue #6): at T*H = 64 query rows the op misses 80 % of the bandwidth at two points that
a plain read passes (16 streams over 8K: a read reaches 97-98 %, the kernel alone 79.6-79.9 %), and its block loop
already streams at the DRAM's pace (session 40's profile). The profiles located the loss around the loop: the
first block lands 2.7 µs later than in the narrow kernel, the epilogue takes 2.1 µs against 0.6. Probes that moved
one part at a time (the query tile's order or multicast, the first block alone, the output's waits) did not
change the total. This ladder adds the kernel's parts one by one to the copy pipeline, in the kernel's grid
(one program per stream and split, ``splits_for`` and ``split_range`` as the op plans them), with its shared
memory (query tile, two 72 KB key slots, the probability tile: one program per SM) and its three warpgroups:

* ``copy``: the producer streams the key blocks through the two slots; each consumer waits for a block and frees
  it. At the end each consumer writes its [64, 256] half of the output (zeros), as the kernel writes partials;
* ``query``: + the 64 x 576 query tile copied first, awaited by both consumers before their first block;
* ``scores``: + consumer 0's q·kᵀ per block (wgmma over the 576 columns), its row max carried to the output;
* ``softmax``: + consumer 0's online softmax, p (bf16) and the rescale handed to consumer 1 through shared memory
  (consumer 1 waits for them every block, then frees its slot);
* ``pv``: + both consumers' p·v into [64, 256] f32 accumulators (consumer 0's issued before the hand-over), the
  output normalised: the kernel without masks, the partial block or the tree.

``--layouts`` adds the rungs in shared-memory layouts without the query tile (``LAYOUTS``): q·kᵀ reads the current
key block as its query, so the tile's 72 KB can hold a third key slot (``slot3``; ``slot2`` is the control).

Points of one grid size (the same B * splits programs) with different blocks a program give each rung a fixed cost
and a cost per block (``fixed_and_per_block``, printed after the rungs), e.g. ``--points
"16,2048;16,8192;16,32768;1,32768;1,65536;1,131072"`` (128 programs of 4-64 blocks).

Beside the rungs, ``split_attention`` itself on the same blocks (the prefix one block short, one tree block of
64 keys all visible), and the floor (the keys' bytes over PyTorch's copy bandwidth). Per rung the traced time of
the Mosaic GPU kernel (the median of its launches over a chain of calls), its share of the floor and what the rung
added. The calls rotate over enough copies of the keys to read more than twice the L2 (``bench_util.rotating_copies``):
until session 56 they read one copy, and at 4 blocks a program (38 MB of keys, within the L2) the H200's copy rung
ran at 92-96 % of the floor against 78-80 % at 8 blocks, off the line the larger points fit.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from experiments import bench_util  # noqa: E402
from pallas_kernels.mgpu_attention_parts import plgpu, stream_key_blocks  # noqa: E402
from pallas_kernels.mla_attention_plan import split_range, splits_for  # noqa: E402
from pallas_kernels.tree_attention import _LOG2E  # noqa: E402

RUNGS = ("copy", "query", "scores", "softmax", "pv")
C, L, ROWS, BK = 576, 512, 64, 64
LH = L // 2
SCALE = 0.14468                   # K2.6's softmax scale, as the benchmarks use it
SCALE_LOG2 = SCALE * _LOG2E
DEFAULT_POINTS = "16,8192;1,65536;4,65536"
# layout -> (key slots, query from the current key slot): "tile2" is the kernel's shared memory (the query tile and
# two key slots). "slot2" and "slot3" drop the query tile: q.k^T reads the current key block as its query (the same
# [64, 576] operand from shared memory, the same work, wrong numbers), and the outputs are staged in the key slots
# once both consumers' loops are done. They ask what the query tile's 72 KB would buy as a third key slot, were the
# query held elsewhere (in registers, split over the two consumers).
LAYOUTS = {"tile2": (2, False), "slot2": (2, True), "slot3": (3, True)}


def ladder_kernel(B: int, S: int, rung: str, layout: str = "tile2"):
    """(q [B, 64, C] bf16, kv [B, S, C] bf16) -> out [NS, B, 64, L] bf16: the rung's kernel over each stream's
    S / 64 key blocks in NS splits (``splits_for`` at T = 1, H = 64), in one of ``LAYOUTS`` of shared memory."""
    if rung not in RUNGS:
        raise ValueError(f"rung {rung!r} is not one of {RUNGS}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {tuple(LAYOUTS)}")
    if B < 1 or S < BK or S % BK:
        raise ValueError(f"B={B}, S={S}: need B >= 1 and S a positive multiple of {BK}")
    stages, query_in_slot = LAYOUTS[layout]
    if query_in_slot and rung == "query":
        raise ValueError(f"layout {layout!r} has no query tile: its rungs are {RUNGS[:1] + RUNGS[2:]}")
    level = RUNGS.index(rung)
    with_query, with_scores, with_softmax, with_pv = (level >= i for i in range(1, 5))
    with_query = with_query and not query_in_slot
    NS, total = splits_for(B, 1, 64, S, BK), S // BK
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def body(q_ref, kv_ref, o_ref, *scratch):
        if query_in_slot:  # the outputs reuse the key slots' memory, once both loops are done
            (k_smem, o_smem), p_smem, stat_smem, k_bars, consumed_bars, bars, loops_done = scratch
            q_smem = None
        else:  # the output reuses the query tile's memory, as in the kernel
            (q_smem, o_smem), k_smem, p_smem, stat_smem, k_bars, consumed_bars, bars, loops_done = scratch
        q_bar, p_ready, p_free, done_bar = (bars.at[i] for i in range(4))
        b, sp, wg = (lax.axis_index(n) for n in ("stream", "split", "wg"))
        lo, _, hi = split_range(total, 0, sp, NS)
        n = hi - lo

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            if with_query:
                plgpu.copy_gmem_to_smem(q_ref.at[b], q_smem, q_bar)
            stream_key_blocks(kv_ref, kv_ref, b, lo, 0, n, n, k_smem, k_bars, consumed_bars, stages, BK)

        def consumer(half):
            plgpu.set_max_registers(232, action="increase")
            if with_query:
                plgpu.barrier_wait(q_bar)
            scores_here = half == 0

            def loop(acc_ref):
                def step(j, carry):
                    m, l = carry
                    slot = lax.rem(j, stages)
                    plgpu.barrier_wait(k_bars.at[slot])
                    values = k_smem.at[slot, :, pl.ds(half * LH, LH)]
                    if with_scores and scores_here:
                        def qk(s_ref):
                            query = k_smem.at[slot] if query_in_slot else q_smem
                            plgpu.wgmma(s_ref, query, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                            return s_ref[...]

                        s = pl.run_scoped(qk, plgpu.ACC((ROWS, BK), jnp.float32)) * SCALE_LOG2
                        m_new = jnp.maximum(m, s.max(axis=1))
                        if with_softmax:
                            alpha = jnp.exp2(m - m_new)
                            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                            l = l * alpha + p.sum(axis=1)
                            p16 = p.astype(jnp.bfloat16)
                            if with_pv:  # consumer 0's p.v issued before the hand-over (the kernel's pv_first)
                                acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alpha, acc_ref.shape, [0])
                                plgpu.wgmma(acc_ref, p16, values)

                            @pl.when(j > 0)
                            def _():
                                plgpu.barrier_wait(p_free)

                            p_smem[...] = p16
                            stat_smem[0] = alpha
                            plgpu.commit_smem()
                            plgpu.barrier_arrive(p_ready)
                        m = m_new
                    elif with_softmax and not scores_here:
                        plgpu.barrier_wait(p_ready)
                        if with_pv:
                            alpha = plgpu.load(stat_smem.at[0], (), layout=row_layout)
                            acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alpha, acc_ref.shape, [0])
                            plgpu.wgmma(acc_ref, p_smem, values)
                    if with_pv:
                        plgpu.wgmma_wait(0)
                    if with_softmax and not scores_here:
                        plgpu.barrier_arrive(p_free)
                    plgpu.barrier_arrive(consumed_bars.at[slot])
                    return m, l

                m0 = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout)
                l0 = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), row_layout)
                m, l = lax.fori_loop(0, n, step, (m0, l0))
                return acc_ref[...], m, l

            acc, m, l = pl.run_scoped(loop, plgpu.ACC((ROWS, LH), jnp.float32))
            if query_in_slot:  # the key slots are free for the outputs only when both loops are done
                plgpu.barrier_arrive(loops_done)
                plgpu.barrier_wait(loops_done)
            # consumer 0 leaves the query tile first (the kernel's store_early): consumer 1 writes after it
            if scores_here:
                stat_smem[1] = l
                plgpu.commit_smem()
                plgpu.barrier_arrive(done_bar)
            else:
                plgpu.barrier_wait(done_bar)
                l = plgpu.load(stat_smem.at[1], (), layout=row_layout)
            if with_pv:
                out = acc * lax.broadcast_in_dim(1.0 / jnp.where(l == 0.0, 1.0, l), acc.shape, [0])
            elif with_scores and scores_here:  # keep q.k live: the row max in every column
                out = lax.broadcast_in_dim(jnp.where(m == -jnp.inf, 0.0, m), acc.shape, [0])
            else:
                out = acc
            o_smem[half] = out.astype(jnp.bfloat16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[half], o_ref.at[sp, b, :, pl.ds(half * LH, LH)])
            plgpu.wait_smem_to_gmem(0)

        for half in range(2):
            pl.when(wg == half)(functools.partial(consumer, half))

    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    key_slots = plgpu.SMEM((stages, BK, C), jnp.bfloat16, transforms=swizzled)
    out_tiles = plgpu.SMEM((2, ROWS, LH), jnp.bfloat16, transforms=swizzled)
    if query_in_slot:
        shared = (plgpu.RefUnion(key_slots, out_tiles),)
    else:
        shared = (plgpu.RefUnion(plgpu.SMEM((ROWS, C), jnp.bfloat16, transforms=swizzled), out_tiles), key_slots)
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((NS, B, ROWS, L), jnp.bfloat16),
        scratch_types=(
            *shared,
            plgpu.SMEM((ROWS, BK), jnp.bfloat16, transforms=swizzled),
            plgpu.SMEM((2, ROWS), jnp.float32),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_barriers=4),  # the query tile's, p ready, p free, consumer 0 done
            plgpu.Barrier(num_arrivals=2),  # both consumers' loops done (the slot layouts' outputs wait for it)
        ),
        grid=(B, NS), grid_names=("stream", "split"), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0))


def real_kernel(B: int, S: int):
    """``split_attention`` on the ladder's blocks: the prefix one block short of S, one tree block of the cache's
    last 64 keys, every row seeing all of them; the same splits."""
    from pallas_kernels.mla_attention_mgpu import split_attention

    NS = splits_for(B, 1, 64, S, BK)
    plen = jnp.full((B,), S - BK, jnp.int32)
    bits = jnp.full((B, BK // 32, ROWS), -1, jnp.int32)

    def fn(q, kv):
        o, _ = split_attention(q, kv, plen, kv[:, S - BK:], bits, scale=SCALE,
                               kv_lora_rank=L, num_splits=NS)
        return o
    return fn


def point_bytes(B: int, S: int) -> int:
    """The floor's bytes at T = 1, H = 64 over S keys, as ``bench_tree_attention.roofline`` counts them."""
    from experiments.bench_tree_attention import roofline
    return roofline(ROWS, B, 1, S, 1.0, 1.0)[0]


def mosaic_us(result: dict) -> float:
    """The Mosaic GPU kernel's device µs per call in a ``traced_call_time`` result: the median of its launches'
    durations over the chain (``launches_us``; the chain's ties left out)."""
    names = [name for name in result["launches_us"] if "mosaic_gpu" in name]
    if len(names) != 1:
        raise RuntimeError(f"expected one Mosaic GPU kernel launched every call in the trace, got {result['kernels']}")
    return statistics.median(result["launches_us"][names[0]])


def fixed_and_per_block(rows: list[dict]) -> list[dict]:
    """A least-squares line of each rung's kernel µs against the blocks of its busiest program
    (ceil(S / 64 / splits)), per layout, rung and grid size (programs = B * splits), wherever a group holds at least
    two block counts: its fixed µs (the intercept) and µs per block, with the largest residual. Rows of one grid
    differ only in how many blocks each program streams, so the intercept is what a program costs before and after
    its blocks (launch, the first copies' latency, the first and last blocks' exposed work, the epilogue)."""
    groups: dict[tuple, list[tuple[int, float]]] = {}
    for r in rows:
        blocks = -(-(r["S"] // BK) // r["splits"])
        groups.setdefault((r["layout"], r["rung"], r["B"] * r["splits"]), []).append((blocks, r["kernel_us"]))
    fits = []
    for (layout, rung, programs), pts in groups.items():
        if len({b for b, _ in pts}) < 2:
            continue
        per_block, fixed = (float(c) for c in np.polyfit(*zip(*pts), 1))
        fits.append(dict(layout=layout, rung=rung, programs=programs, blocks=sorted({b for b, _ in pts}),
                         us_per_block=per_block, fixed_us=fixed,
                         max_residual_us=max(abs(t - fixed - per_block * b) for b, t in pts)))
    return fits


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default=DEFAULT_POINTS, help="'B,S;B,S...' streams and cache rows (S %% 64 == 0)")
    ap.add_argument("--rungs", default=",".join(RUNGS))
    ap.add_argument("--layouts", default="tile2", help=f"shared-memory layouts of the rungs, of {tuple(LAYOUTS)}")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None, help="folder for probe_attention_ladder.json")
    args = ap.parse_args(argv)
    rungs = [r for r in args.rungs.split(",") if r]
    if any(r not in RUNGS for r in rungs):
        ap.error(f"--rungs must name rungs of {RUNGS}")
    layouts = [name for name in args.layouts.split(",") if name]
    if not layouts or any(name not in LAYOUTS for name in layouts):
        ap.error(f"--layouts must name layouts of {tuple(LAYOUTS)}")
    points = bench_util.int_points(args.points, 2)
    if any(B < 1 or S < BK or S % BK for B, S in points):
        ap.error(f"--points: each S must be a positive multiple of {BK}")
    if jax.default_backend() != "gpu":
        raise SystemExit("probe_attention_ladder needs a Hopper GPU")
    bandwidth = bench_util.measure_torch_copy_bandwidth() or bench_util.measure_copy_bandwidth()
    rotating_chain = functools.partial(bench_util.dependent_chain, rotate=True)
    rows = []
    for B, S in points:
        kq, kk = jax.random.split(jax.random.key(B * S))
        q = jax.random.normal(kq, (B, ROWS, C), jnp.float32).astype(jnp.bfloat16)
        copies = bench_util.rotating_copies(B * S * C * 2)
        kvs = [jax.random.normal(k, (B, S, C), jnp.float32).astype(jnp.bfloat16) for k in jax.random.split(kk, copies)]
        kv = kvs[0]
        floor_us = point_bytes(B, S) / bandwidth * 1e6
        real = real_kernel(B, S)
        o_real = jax.jit(real)(q, kv)
        steps = [(layout, rung) for layout in layouts for rung in rungs
                 if not (LAYOUTS[layout][1] and rung == "query")] + [("kernel", "kernel")]
        previous = {}
        for layout, rung in steps:
            fn = real if rung == "kernel" else ladder_kernel(B, S, rung, layout)
            us = mosaic_us(bench_util.traced_call_time(fn, (q, *kvs), args.calls, chain=rotating_chain))
            row = dict(B=B, S=S, layout=layout, rung=rung, splits=splits_for(B, 1, 64, S, BK), cache_copies=copies,
                       kernel_us=us,
                       floor_us=floor_us, pct_floor=100 * floor_us / us,
                       added_us=us - previous[layout] if layout in previous else None)
            if rung == "pv" and layout == "tile2":  # the top rung computes the kernel's partials
                o = jax.jit(fn)(q, kv).astype(jnp.float32)
                ref = o_real.astype(jnp.float32)
                row["rel_err_vs_kernel"] = float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref))
            rows.append(row)
            previous[layout] = us
            print(row, flush=True)
    bench_util.print_table(rows, ["B", "S", "layout", "rung", "splits", "kernel_us", "added_us", "floor_us",
                                  "pct_floor", "rel_err_vs_kernel"])
    fits = fixed_and_per_block(rows)
    if fits:
        bench_util.print_table(fits, ["layout", "rung", "programs", "blocks", "us_per_block", "fixed_us",
                                      "max_residual_us"])
    if args.out:
        bench_util.write_result("probe_attention_ladder", dict(code_commit=args.commit, bandwidth_Bps=bandwidth,
                                                               rows=rows, fits=fits), args.out)
    return rows


if __name__ == "__main__":
    main()
