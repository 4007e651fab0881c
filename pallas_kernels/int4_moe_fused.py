"""The routed experts of one token in one Mosaic GPU launch (H100/H200): gate+up, SiLU·up and a split of the
down GEMM per program, + pure-JAX twin.

Dimension letters: E experts, D model width, F expert width, B = F/64 blocks of 64 f (one paired gate/up
row block of 128 rows each), NT tiles of N tokens (only a tile's first row is a real pair: the per-pair
layout of ``moe_routing.route_per_pair``), C activation chunk width.

    h_t[f]         = silu(gate_t[f]) * up_t[f]                  (bf16; gate/up = W13[e_t] x_t, f32 sums)
    partial[b, t]  = W2[e_t][:, 64 b : 64 b + 64] h_t[64 b : 64 b + 64]        (f32, [D])

so that sum_b partial[b, t] is tile t's down product (the expert's output for its pair).

Why: with two GEMM launches (``int4_moe_mgpu.routed_experts_tiled``) the down GEMM waits for the whole
gate+up GEMM, and its pipeline fill cannot overlap the first's tail. At one token (M = 1 on the H200,
session 10) the two kernels took 40 + 25 us for a 47 us floor. Here program (t, b) needs only its own 64
values of h, so each program runs gate+up for its block and goes straight on to its share of the down
GEMM: one launch, no dependency between programs; programs still in their first phase overlap those in
their second. The price is the partials: B x NT x D f32 (7.3 MB at M = 1 for K2.6, written here and summed
by XLA) instead of the NT x D down rows.

Measured (H200, M = 1, K2.6 dims, traced, against two launches in the same run,
experiments/results/bench_moe_s11_fused.json): the kernel takes 62.3 us against 39.0 + 25.3, but the layer
71.9 us against 71.2, since XLA's sum of the partials adds ~3 us of glue; so two launches stay the default
(``routed_experts_tiled(launch="two")``). The 256 programs all fit on the 132 SMs at once, so they run
phase 1 together and then phase 2 together: the hoped-for overlap of one program's phase 2 with another's
phase 1 does not happen. down_blocks 2 / 8 took 74.4 / 84.5 us, stages 3 72.6; the first form of phase 2
(each step's whole [512, N] tile transposed through shared memory) 86.4 (bench_moe_s11_m1.json).

Kernel
------
Grid (NT, B), one warpgroup. Phase 1 is ``int4_moe_mgpu.tile_product`` on row block b of the paired
gate/up stack (``TiledInt4.from_compressed_tensors(..., pair_gate_up=True)``: rows [0, 64) gate and
[64, 128) up of the same 64 f), then h = silu(gate) * up in registers, stored transposed to shared memory
as the down GEMM's B operand ([N, 64] bf16, swizzled). Phase 2 streams, for the program's 64 columns of
W2, ``down_blocks`` 128-row blocks per pipeline step (4 by default: 16 KB of words and 2 KB of scales, as
one gate+up step): the 64 f columns of a fragment-ordered slab are its rows [8 q, 8 q + 8) (q = b mod 4 the
64-column quarter of a 256-column step), so W2 is viewed as [E, D/128, B, 8, 128] words at no cost. Each step
dequantises its 2 x down_blocks groups, issues one [128 down_blocks, 64] x [64, N] wgmma, sums the
result's N columns in registers (the padding rows' h is exactly zero, so the sum is the first row's
product) and stores it with TMA from a two-slot staging buffer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.int4_moe_mgpu import (
    SMEM_LIMIT, _concat, _fragment_operand, check_grouped_args, grouped_int4_matmul_ref, scale_rows, silu_mul,
    smem_bytes, tile_product)
from pallas_kernels.int4_tiles import FRAG_ROWS, GROUP, PAIR_BLOCK, STEP, dequantize_expert

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

DOWN_BLOCKS = (2, 4, 8)  # choices of 128-row blocks of W2 per phase-2 pipeline step
WORD_ROWS = PAIR_BLOCK // GROUP * 4  # rows of a [32, 128]-word fragment slab that hold 64 columns (8)
STORE_BOX = 256  # widest TMA box dimension


def check_fused_args(x_chunks, w13, s13, w2, s2, tile_expert, n: int, down_blocks: int = 4) -> tuple[int, int]:
    """Validates ``fused_int4_moe``'s arguments statically; returns (D, F). Raises ValueError naming the
    mismatch."""
    fragments, d, two_f = check_grouped_args(x_chunks, w13, s13, tile_expert, n)
    if not fragments:
        raise ValueError("the fused kernel takes stacks in fragments order (int32 words), got int4 groups order")
    if x_chunks.shape[-1] < PAIR_BLOCK:
        raise ValueError(f"activation chunks must be >= {PAIR_BLOCK} columns (the paired gate/up epilogue), got "
                         f"{x_chunks.shape[-1]}")
    f = two_f // 2
    e_n = w13.shape[0]
    if w2.dtype != jnp.int32 or tuple(w2.shape) != (e_n, d // FRAG_ROWS, f // STEP * 32, 128) or \
            tuple(s2.shape) != (e_n, d // FRAG_ROWS, f // GROUP, FRAG_ROWS):
        raise ValueError(f"w2 {w2.dtype} {tuple(w2.shape)} / scales {tuple(s2.shape)} are not a fragments-order "
                         f"[{e_n}, {d}, {f}] stack (expected words {(e_n, d // FRAG_ROWS, f // STEP * 32, 128)})")
    if down_blocks not in DOWN_BLOCKS:
        raise ValueError(f"down_blocks must be one of {DOWN_BLOCKS}, got {down_blocks!r}")
    if (d // FRAG_ROWS) % down_blocks:
        raise ValueError(f"D={d} must be a multiple of {FRAG_ROWS * down_blocks}")
    return d, f


def fused_int4_moe_ref(x_chunks, w13, s13, w2, s2, tile_expert, *, tokens_per_tile: int, stages: int = 2,
                       down_blocks: int = 4):
    """Twin of ``fused_int4_moe`` (same signature): x_chunks [D/C, NT N, C] (tile t's pair in row t N),
    w13/s13 a paired gate/up stack and w2/s2 a down stack in fragments order, tile_expert int32 [NT] ->
    partials f32 [F/64, NT, D] (zero for skipped tiles, expert < 0). A tile's other N - 1 rows must be zero
    (the per-pair layout gathers the zero row there): the kernel sums all N products. stages, down_blocks:
    the kernel's (checked, else unused here)."""
    del stages
    n = tokens_per_tile
    d, f = check_fused_args(x_chunks, w13, s13, w2, s2, tile_expert, n, down_blocks)
    nt = tile_expert.shape[0]
    h = grouped_int4_matmul_ref(x_chunks, w13, s13, tile_expert, tokens_per_tile=n, out_layout="tokens",
                                epilogue="silu_mul")  # [F/C, NT N, C]
    h_first = jnp.swapaxes(h, 0, 1).reshape(nt, n, f)[:, 0].astype(jnp.float32)  # [NT, F]

    def tile_partials(e, hrow):
        w_down = dequantize_expert(w2, s2, jnp.maximum(e, 0), x_chunks.dtype).astype(jnp.float32)  # [D, F]
        blocks = w_down.reshape(d, f // PAIR_BLOCK, PAIR_BLOCK) * hrow.reshape(f // PAIR_BLOCK, PAIR_BLOCK)
        return jnp.where(e >= 0, jnp.sum(blocks, axis=-1).T, 0.0)  # [F/64, D]

    return jnp.swapaxes(lax.map(lambda a: tile_partials(*a), (tile_expert, h_first)), 0, 1)


def fused_smem_bytes(n: int, stages: int, down_blocks: int = 4) -> int:
    """Shared memory of one program: the larger of phase 1 (``smem_bytes``) and phase 2 (h, ``stages`` x
    (W2 words + scales) and the f32 result staged for its store)."""
    step2 = down_blocks * (WORD_ROWS * 128 * 4 + 2 * FRAG_ROWS * 2)
    return max(smem_bytes(FRAG_ROWS, n, stages), n * PAIR_BLOCK * 2 + stages * step2 +
               2 * down_blocks * FRAG_ROWS * 4)


def fused_int4_moe(x_chunks, w13, s13, w2, s2, tile_expert, *, tokens_per_tile: int, stages: int = 2,
                   down_blocks: int = 4):
    """Pallas Mosaic GPU kernel (H100/H200). Same contract as ``fused_int4_moe_ref``, except that the
    partials of skipped tiles are left unwritten (the caller reads only real pairs' rows)."""
    if plgpu is None:
        raise RuntimeError("jax.experimental.pallas.mosaic_gpu is not available in this JAX")
    n = tokens_per_tile
    d, f = check_fused_args(x_chunks, w13, s13, w2, s2, tile_expert, n, down_blocks)
    if x_chunks.dtype != jnp.bfloat16:
        raise ValueError(f"the kernel takes bf16 activations, got {x_chunks.dtype}")
    smem = fused_smem_bytes(n, stages, down_blocks)
    if smem > SMEM_LIMIT:
        raise ValueError(f"tiles of {n} tokens with stages={stages} need {smem} bytes of shared memory "
                         f"(limit {SMEM_LIMIT})")
    chunk = x_chunks.shape[-1]
    e_n = w13.shape[0]
    nt, nb = tile_expert.shape[0], f // PAIR_BLOCK
    d_blocks = d // FRAG_ROWS
    rows_per_step = down_blocks * FRAG_ROWS
    w2_view = w2.reshape(e_n, d_blocks, nb, WORD_ROWS, 128)  # f block b of row block j: [8, 128] words

    def body(te_ref, x_ref, w13_ref, s13_ref, w2_ref, s2_ref, o_ref):
        t = lax.axis_index("tile")
        b = lax.axis_index("fblock")
        e = te_ref[t]

        def program():
            acc = tile_product(x_ref, w13_ref.at[e, b], s13_ref.at[e, b], n_rows=n, row0=t * n, first_step=0,
                               steps=d // STEP, chunk=chunk, stages=stages)
            h = silu_mul(acc[:PAIR_BLOCK], acc[PAIR_BLOCK:]).astype(jnp.bfloat16)  # [64, N]

            def down(h_smem, out_smem):
                h_smem.transpose((1, 0))[...] = plgpu.layout_cast(h, plgpu.Layout.WGMMA_TRANSPOSED)
                plgpu.commit_smem()

                def step_body(idx, w_smem, s_smem):
                    groups = w_smem.reshape(2 * down_blocks, 512)
                    blocks = []
                    for i in range(down_blocks):
                        parts = [scale_rows(_fragment_operand(groups.at[2 * i + g]), s_smem.at[i, g]) for g in range(2)]
                        blocks.append(_concat(parts, axis=1))  # [128, 64]
                    a = _concat(blocks, axis=0)  # [512, 64]

                    def product(acc_ref):
                        plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(h_smem, (1, 0)))
                        plgpu.wgmma_wait(0)
                        return acc_ref[...]

                    y = pl.run_scoped(product, plgpu.ACC((rows_per_step, n), jnp.float32))
                    # the padding columns are exact zeros (their h is silu(0) * 0), so the row sums are column 0
                    first = jnp.sum(y, axis=1)  # [rows_per_step], layout WGMMA_ROW
                    slot = idx[0] % 2
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this slot's last store has read it
                    out_smem.at[slot][...] = first
                    plgpu.commit_smem()
                    col0 = idx[0] * rows_per_step
                    for c in range(0, rows_per_step, STORE_BOX):
                        plgpu.copy_smem_to_gmem(out_smem.at[slot, pl.ds(c, STORE_BOX)],
                                                o_ref.at[b, t, pl.ds(col0 + c, STORE_BOX)],
                                                commit_group=c + STORE_BOX >= rows_per_step)

                plgpu.emit_pipeline(
                    step_body, grid=(d_blocks // down_blocks,),
                    in_specs=[
                        plgpu.BlockSpec((down_blocks, None, WORD_ROWS, 128), lambda j: (j, b, 0, 0)),
                        plgpu.BlockSpec((down_blocks, 2, FRAG_ROWS), lambda j: (j, b, 0)),
                    ],
                    max_concurrent_steps=stages,
                )(w2_ref.at[e], s2_ref.at[e])
                plgpu.wait_smem_to_gmem(0)

            pl.run_scoped(down,
                          plgpu.SMEM((n, PAIR_BLOCK), jnp.bfloat16,
                                     transforms=(plgpu.TilingTransform((8, PAIR_BLOCK)), plgpu.SwizzleTransform(128))),
                          plgpu.SMEM((2, rows_per_step), jnp.float32))

        pl.when(e >= 0)(program)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((nb, nt, d), jnp.float32),
        grid=(nt, nb), grid_names=("tile", "fblock"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    return kernel(tile_expert, x_chunks, w13, s13, w2_view, s2)
