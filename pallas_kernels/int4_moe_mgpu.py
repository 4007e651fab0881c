"""Grouped INT4 x bf16 GEMM for the routed experts on Hopper: Pallas Mosaic GPU (wgmma) + pure-JAX twin.

Dimension letters: E experts, O output rows of one expert matrix, I input columns, G scale group (32),
N tokens per tile (the widest, with ragged tiles), NT tiles, P expert-sorted token rows (NT N with one
width, tile t holding rows [t N, (t+1) N); ragged tiles, ``tile_rows``: tile t holds rows [tile_rows[0, t],
tile_rows[0, t] + tile_rows[1, t])), R rows per program (64 or 128), S = 256 input columns per pipeline step
(8 scale groups), C activation columns per wgmma (32, 64 or 128).

    out[o, r0_t + j] = sum_i  dequant(W[e_t])[o, i] * x[r0_t + j, i],     e_t = tile_expert[t]

(r0_t the first row of tile t) with f32 accumulation and W dequantised to bf16 as q * scale (q in [-8, 7],
one bf16 scale per row and group of 32 columns). Tiles with e_t < 0 are skipped (their output columns are
left unwritten). The output is out [O, P] (``out_layout="rows"``) or its transpose [P, O] (``"tokens"``:
token rows, what the MoE layer uses, so no XLA transpose follows either GEMM), or with the SiLU·up
epilogue h in the down GEMM's activation layout.

Activations come chunk-major, x_chunks [I/C, P, C] (``to_chunks``; the MoE layer gathers the sorted token
rows straight into it), so that chunk c of a step is a whole [N, C] tile (2C-byte rows, swizzled) for
wgmma's B operand. The weights come in the "tiles" layout of ``pallas_kernels.int4_tiles`` (groups or
fragments order).

Kernel
------
One program per (tile, row block, K split): grid (NT, O/R, split), one warpgroup. A pipelined loop over
the I/S steps copies (TMA) the weight slab, its scales and the token tile into shared memory, ``stages``
deep; per step and chunk the warpgroup loads C/32 [R, 32] int4 groups into registers, upcasts them to
bf16, multiplies each row by its scale and issues one wgmma (A from registers: the weight rows; B from
shared memory: the tokens, "swap AB", so one token per expert wastes no weight traffic) into an [R, N]
f32 accumulator, stored as is or (token rows) shuffled into the transposed wgmma layout and stored as
an [N, R] box. Several programs share an SM (44 KB of shared memory each at R=128, N=8, 2 stages: the
output tile reuses the pipeline's buffers once they are drained; registers: ``mma_in_flight``), which
hides the latency of each program's dequantise-then-multiply chain. On the H200 the copy pipeline alone
streams at 93-97 % of the PyTorch copy and the wgmma instructions are what is left
(experiments/results/probe_moe_mgpu_anatomy_h200.json).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.int4_moe import default_tile
from pallas_kernels.int4_tiles import FRAG_ROWS, GROUP, PAIR_BLOCK, STEP, TiledInt4, _check_dims, dequantize_expert
from pallas_kernels.moe_routing import METHODS, check_moe_inputs, route_narrow, route_per_pair, route_ragged

try:  # Mosaic GPU is importable on CPU builds too (lowering works anywhere; running needs an sm_90 GPU).
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.mosaic import gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, vector
except ImportError:  # pragma: no cover
    plgpu = None

SMEM_LIMIT = 227 * 1024  # per block on sm_90


def smem_bytes(rows: int, n: int, stages: int) -> int:
    """Shared memory of one program: ``stages`` x (weight slab + scales + token tile) while the pipeline runs,
    then the f32 output tile in the same bytes (a later scope), so the larger of the two."""
    return max(stages * (rows * STEP // 2 + (STEP // GROUP) * rows * 2 + STEP * n * 2), rows * n * 4)


# ----------------------------------------------------------------------------------------------
# Pure-JAX twin
# ----------------------------------------------------------------------------------------------
CHUNKS = (32, 64, 128)  # activation chunk widths C: scale groups per wgmma = C / 32
RAGGED_MAX_TILE = 64  # widest N with ragged tiles: the kernel compiles one branch per width 8, 16, ..., N


def _check_mma_in_flight(mma_in_flight, chunk: int) -> None:
    if mma_in_flight is not None and (not isinstance(mma_in_flight, int) or not 0 <= mma_in_flight < STEP // chunk):
        raise ValueError(f"mma_in_flight must be None or an int in [0, {STEP // chunk}) (chunks of {chunk} columns "
                         f"per step), got {mma_in_flight!r}")


PROBES = ("", "no_scale", "mma_once", "stream_only", "no_weight_load", "wide_load", "one_scale_load")


def _check_schedule(in_dim: int, chunk: int, split: int, mma_in_flight, overlap: bool, auto_barriers: bool,
                    probe: str) -> None:
    """The schedule options of ``grouped_int4_matmul`` (and its twin, which checks them and computes the same)."""
    if probe not in PROBES:
        raise ValueError(f"unknown probe {probe!r}")
    _check_mma_in_flight(mma_in_flight, chunk)
    if overlap and not auto_barriers:
        raise ValueError("overlap=True needs auto_barriers: the next copy into a slot must wait for every warp's reads")
    if not isinstance(split, int) or split < 1 or (in_dim // STEP) % split:
        raise ValueError(f"split={split!r} must be a positive int dividing the {in_dim // STEP} pipeline steps")


def check_grouped_args(x_chunks, w, s, tile_expert, n: int, tile_rows=None) -> tuple[bool, int, int]:
    """Validates the arguments of ``grouped_int4_matmul`` (and its twin) statically; returns
    (fragment order?, I, O). Raises ValueError naming the mismatch."""
    if len(x_chunks.shape) != 3 or x_chunks.shape[2] not in CHUNKS:
        raise ValueError(f"x_chunks must be [I/C, P, C] with C in {CHUNKS}, got {tuple(x_chunks.shape)}")
    nc, p, chunk = x_chunks.shape
    if len(w.shape) != 4 or len(s.shape) != 4:
        raise ValueError(f"tiled weights must be rank 4, got {tuple(w.shape)} and scales {tuple(s.shape)}")
    fragments = w.dtype == jnp.int32
    if not fragments and w.dtype != jnp.int4:
        raise ValueError(f"tiled weights must be int4 (groups order) or int32 (fragments order), got {w.dtype}")
    e_n, nb, kr, step = w.shape
    rows = s.shape[-1]
    slab = (32, 128) if fragments else (rows, STEP)
    in_dim, out_dim = nc * chunk, nb * rows
    if (fragments and rows != FRAG_ROWS) or rows not in (64, 128):
        raise ValueError(f"scales end in {rows} rows per block; expected 64 or 128 (128 for fragments)")
    if tuple(s.shape) != (e_n, nb, in_dim // GROUP, rows) or step != slab[1] or kr != in_dim // STEP * slab[0]:
        raise ValueError(f"weights {w.dtype} {tuple(w.shape)} / scales {tuple(s.shape)} do not match activations "
                         f"of width {in_dim}")
    _check_dims(out_dim, in_dim, rows)
    widest = RAGGED_MAX_TILE if tile_rows is not None else 256
    if n % 8 or not 8 <= n <= widest:
        raise ValueError(f"tokens_per_tile={n} must be a multiple of 8 in [8, {widest}]"
                         + (" with ragged tiles (one kernel branch per width)" if tile_rows is not None else ""))
    if len(tile_expert.shape) != 1:
        raise ValueError(f"tile_expert must be [NT], got {tuple(tile_expert.shape)}")
    nt = tile_expert.shape[0]
    if tile_rows is not None:
        if tuple(tile_rows.shape) != (2, nt) or tile_rows.dtype != jnp.int32:
            raise ValueError(f"tile_rows must be int32 [2, NT] = [2, {nt}] (first row, width), got "
                             f"{tile_rows.dtype} {tuple(tile_rows.shape)}")
    elif p % n or nt != p // n:
        raise ValueError(f"tile_expert must be [P/N] = [{p // n}] with N={n} dividing P={p}, got {nt} tiles")
    return fragments, in_dim, out_dim


def grouped_int4_matmul_ref(x_chunks, w, s, tile_expert, tile_rows=None, *, tokens_per_tile: int,
                            out_layout: str = "rows", epilogue: str = "none", out_dtype=jnp.float32, stages: int = 2,
                            split: int = 1, mma_in_flight: int | None = None, overlap: bool = False,
                            auto_barriers: bool = True, dependent_launch: bool = False, probe: str = ""):
    """Twin of ``grouped_int4_matmul`` (same signature): x_chunks [I/C, P, C] (``to_chunks``; bf16, or f32
    for f32 models on CPU), w/s tiled weights, tile_expert int32 [NT] -> out f32 [O, P] (out_layout "rows")
    or [P, O] ("tokens"); columns (rows) of skipped tiles (expert < 0) are zero here. Expert ids >= E are
    the caller's error (``moe_routing`` never makes them). epilogue "silu_mul" (token rows only, C >= 64, w a
    gate/up stack paired in 64-row blocks, ``TiledInt4.from_compressed_tensors(..., pair_gate_up=True)``):
    h = silu(gate) * up in x_chunks.dtype instead, as chunks [O/2/C, P, C] (the down GEMM's input).
    tile_rows int32 [2, NT] (ragged tiles, ``route_ragged``): tile t holds rows [tile_rows[0, t],
    tile_rows[0, t] + tile_rows[1, t]), its width a multiple of 8 in [8, N] and the used tiles' rows
    disjoint within [0, P) (anything else is the caller's error, as expert ids >= E are). out_dtype: of
    the f32 products (``_check_out_dtype``: bfloat16 only for token rows with no epilogue and no split).
    The schedule's options (``stages``, ``split``, ``mma_in_flight``, ``overlap``, ``auto_barriers``,
    ``dependent_launch``) are checked as the kernel checks them and do not change the result; a ``probe``, whose
    results are wrong on purpose, is refused."""
    n = tokens_per_tile
    del stages, dependent_launch
    _check_out_layout(out_layout)
    _, i, o = check_grouped_args(x_chunks, w, s, tile_expert, n, tile_rows)
    _check_schedule(i, x_chunks.shape[-1], split, mma_in_flight, overlap, auto_barriers, probe)
    if probe:
        raise ValueError(f"probe={probe!r} times a kernel that computes something else on purpose; the twin has none")
    _check_epilogue(epilogue, out_layout, s, x_chunks.shape[-1], split)
    _check_out_dtype(out_dtype, out_layout, epilogue, split)
    nc, p, chunk = x_chunks.shape
    x = jnp.swapaxes(x_chunks, 0, 1).reshape(p, nc * chunk)
    pad = n if tile_rows is not None else 0  # a ragged tile reads N rows from its first: room past P
    x = jnp.pad(x, ((0, pad), (0, 0)))

    def body(t, carry):  # skipped tiles do no work; an expert is dequantised once per run
        out, prev, wt = carry
        e = tile_expert[t]
        row0, width = (tile_rows[0, t], tile_rows[1, t]) if tile_rows is not None else (t * n, n)
        wt = lax.cond((e >= 0) & (e != prev), lambda: dequantize_expert(w, s, e, x.dtype), lambda: wt)

        def tile_product(out):
            yt = jnp.dot(wt, lax.dynamic_slice_in_dim(x, row0, n).T, preferred_element_type=jnp.float32)
            keep = lax.dynamic_slice_in_dim(out, row0, n, 1)  # a ragged tile's rows past its width
            yt = jnp.where(jnp.arange(n) < width, yt, keep)
            return lax.dynamic_update_slice_in_dim(out, yt, row0, 1)

        out = lax.cond(e >= 0, tile_product, lambda out: out, out)
        return out, jnp.where(e >= 0, e, prev), wt

    carry = (jnp.zeros((o, p + pad), jnp.float32), jnp.int32(-1), jnp.zeros((o, i), x.dtype))
    out = lax.fori_loop(0, tile_expert.shape[0], body, carry)[0][:, :p]
    if epilogue == "silu_mul":
        gate, up = gate_and_up(out.T, PAIR_BLOCK)
        return to_chunks(silu_mul(gate, up).astype(x_chunks.dtype), chunk)
    return out.T.astype(out_dtype) if out_layout == "tokens" else out




def _check_out_layout(out_layout: str) -> None:
    if out_layout not in ("rows", "tokens"):
        raise ValueError(f"out_layout must be 'rows' ([O, P]) or 'tokens' ([P, O]), got {out_layout!r}")


def _check_out_dtype(out_dtype, out_layout: str, epilogue: str, split: int = 1) -> None:
    """f32 products, or bf16 ones for token rows with no epilogue and no split-K (the down GEMM's pair rows:
    half the bytes written by the kernel and read by the combine; each expert's output rounded to bf16, as
    a bf16 model's expert computes it)."""
    dtype = jnp.dtype(out_dtype)
    if dtype == jnp.float32:
        return
    if dtype != jnp.bfloat16 or out_layout != "tokens" or epilogue != "none" or split != 1:
        raise ValueError(f"out_dtype must be float32, or bfloat16 with token rows, no epilogue and split=1; got "
                         f"{dtype} with out_layout={out_layout!r}, epilogue={epilogue!r}, split={split}")


def _check_epilogue(epilogue: str, out_layout: str, s, chunk: int, split: int = 1) -> None:
    if epilogue == "none":
        return
    if epilogue != "silu_mul":
        raise ValueError(f"epilogue must be 'none' or 'silu_mul', got {epilogue!r}")
    if out_layout != "tokens" or split != 1 or s.shape[-1] != FRAG_ROWS or chunk < PAIR_BLOCK:
        raise ValueError(f"epilogue 'silu_mul' needs token rows, split=1, chunks of >= {PAIR_BLOCK} columns and "
                         f"{FRAG_ROWS}-row blocks (a gate/up stack paired in {PAIR_BLOCK}-row blocks); got "
                         f"out_layout={out_layout!r}, split={split}, chunk {chunk}, {s.shape[-1]}-row blocks")


def gate_and_up(gu, block: int):
    """[P, 2F] gate/up outputs -> (gate [P, F], up [P, F]): the first F columns and the rest (block 0), or
    for a stack paired in ``block``-row blocks, alternate blocks of columns."""
    p, o = gu.shape
    f = o // 2
    if not block:
        return gu[:, :f], gu[:, f:]
    pairs = gu.reshape(p, f // block, 2, block)
    return pairs[:, :, 0].reshape(p, f), pairs[:, :, 1].reshape(p, f)


def silu_mul(gate, up):
    """silu(gate) * up in f32, as g / (1 + exp(-g)) * u: the kernel's epilogue and the twin's."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    return gate / (1.0 + jnp.exp(-gate)) * up


# ----------------------------------------------------------------------------------------------
# Mosaic GPU kernel
# ----------------------------------------------------------------------------------------------
def _words_layout():
    """A 32-column group's [512] int32 fragment words as loaded: two 8-byte vectors per thread."""
    return plgpu.Layout.WG_STRIDED((FRAG_ROWS * GROUP // 8,), 2)


def _load_words(words_ref, load: bool = True, vec_size: int = 2):
    """One 32-column group of a fragment-ordered slab ([512] int32 words in shared memory) -> its words in
    registers (two 8-byte loads per thread; ``_words_layout``). ``load=False`` (the "no_weight_load" probe,
    wrong results): one broadcast 4-byte load per thread instead, varied per register so nothing folds.
    ``vec_size=4`` (the "wide_load" probe, wrong results): one 16-byte load per thread, the words of a
    different thread order in the same registers (what a 16-byte fragment order would cost to load)."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=plgpu.ShapeDtypeStruct(
        (FRAG_ROWS * GROUP // 8,), jnp.int32, layout=_words_layout()))
    def load_words(ctx, ref):
        del ctx
        if load and vec_size == 4:
            wide = mgpu.FragmentedArray.load_strided(ref, is_signed=True, vec_size=4).registers[0]
            regs = np.array([mgpu.utils.vector_slice(wide, slice(2 * h, 2 * h + 2)) for h in range(2)], dtype=object)
            return mgpu.FragmentedArray(_registers=regs, _layout=_words_layout().to_mgpu(), _is_signed=True)
        if load:
            return mgpu.FragmentedArray.load_strided(ref, is_signed=True, vec_size=2)
        i32 = ir.IntegerType.get_signless(32)
        w0 = memref.load(ref, [mgpu.c(0, ir.IndexType.get())])
        regs = np.array([vector.broadcast(ir.VectorType.get((2,), i32), arith.xori(w0, mgpu.c(h + 1, i32)))
                         for h in range(2)], dtype=object)
        return mgpu.FragmentedArray(_registers=regs, _layout=_words_layout().to_mgpu(), _is_signed=True)

    return load_words(words_ref)


def _mask_or(word, mask, magic):
    """(word & mask) | magic in one LOP3. Written as PTX ``and`` and ``or`` with immediate constants, ptxas
    emits two LOP3s (one instruction holds one 32-bit immediate): 801 instructions per pipeline step at N = 16
    instead of 674 (ptxas 13.0, sm_90a; the ALU pipe was 72 % busy in Nsight Compute,
    experiments/results/ncu_s15_h200.json). With the constants as register operands it is one."""
    i32 = ir.IntegerType.get_signless(32)
    return llvm.inline_asm(i32, [word, mask, magic], "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r")


def _upcast_words(words):
    """A group's fragment words in registers (``_load_words``) -> the bf16 [128, 32] wgmma A operand (layout
    WGMMA), unscaled: per pair of values a shift, a mask-and-or (``_mask_or``; 0x4300 exponent: bf16 128 + u)
    and a bf16x2 subtraction of 136; no register shuffles (the values already sit where the wgmma fragment
    wants them)."""
    @plgpu.inline_mgpu(arg_types=(_words_layout(),), return_type=plgpu.ShapeDtypeStruct(
        (FRAG_ROWS, GROUP), jnp.bfloat16, layout=plgpu.Layout.WGMMA))
    def build(ctx, loaded):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        pair_ty = ir.VectorType.get((2,), ir.BF16Type.get())
        mask, magic = mgpu.c(0x000F000F, i32), mgpu.c(0x43004300, i32)
        bias = mgpu.utils.bitcast(mgpu.c(0x43084308, i32), pair_ty)  # (136, 136)
        regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((FRAG_ROWS, GROUP)), dtype=object)
        for h in range(2):  # 64-row half
            for i in range(2):  # 8-row sub-tile
                word = mgpu.utils.bitcast(mgpu.utils.vector_slice(loaded.registers[h], slice(i, i + 1)), i32)
                for j in range(4):  # 8-column tile
                    shifted = word if j == 0 else arith.shrui(word, mgpu.c(4 * j, i32))
                    pair = _mask_or(shifted, mask, magic)
                    regs[h, j, 0, 0, i, 0, 0, 0, 0] = arith.subf(mgpu.utils.bitcast(pair, pair_ty), bias)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return build(words)


def _fragment_operand(words_ref, load: bool = True, vec_size: int = 2):
    """One 32-column group of a fragment-ordered slab in shared memory -> its unscaled bf16 [128, 32] wgmma
    A operand: ``_upcast_words`` of ``_load_words`` (whose probe options these are)."""
    return _upcast_words(_load_words(words_ref, load, vec_size))


def scale_rows(wg, scale_ref):
    """Inside a Mosaic GPU kernel: a dequantised group wg [R, 32] (layout WGMMA) times its rows' bf16 scales
    (scale_ref: [R] in shared memory)."""
    sg = plgpu.load(scale_ref, (), layout=plgpu.Layout.WGMMA.reduce(1))
    return wg * lax.broadcast_in_dim(sg, wg.shape, [0])


def tile_product(x_ref, w_ref, s_ref, *, n_rows: int, row0, first_step, steps: int, chunk: int, stages: int,
                 mma_in_flight: int | None = None, overlap: bool = False, probe: str = ""):
    """Inside a Mosaic GPU kernel: one expert row block times one token tile, [R, n_rows] f32 (layout WGMMA).

    x_ref: the chunk-major activations in global memory [I/C, P, C]; w_ref / s_ref: the expert's row block
    of a tiled stack ([KR, 128] words in fragments order or [KR, S] int4 in groups order; scales [I/G, R]);
    the tile's rows are [row0, row0 + n_rows) of P and the pipeline runs ``steps`` steps of
    S columns from ``first_step``. The options are ``grouped_int4_matmul``'s."""
    fragments = w_ref.dtype == jnp.int32
    rows = s_ref.shape[-1]
    slab = (32, 128) if fragments else (rows, STEP)
    gps, gpc, cps = STEP // GROUP, chunk // GROUP, STEP // chunk  # scale groups per step, per chunk; chunks per step

    def acc_scope(acc_ref):
        def step_body(_, w_smem, s_smem, x_smem):
            if probe == "stream_only":
                return
            w_groups = w_smem.reshape(gps, 512) if fragments else w_smem.reshape(gps, rows, GROUP)

            def group_operand(g):  # scale group g of the step: bf16 [R, 32], layout WGMMA
                if fragments:
                    wg = _fragment_operand(w_groups.at[g], load=probe != "no_weight_load",
                                           vec_size=4 if probe == "wide_load" else 2)
                else:
                    wq = plgpu.load(w_groups.at[g], (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
                    wg = plgpu.layout_cast(wq, plgpu.Layout.WGMMA).astype(jnp.bfloat16)
                if probe == "no_scale":
                    return wg
                return scale_rows(wg, s_smem.at[0 if probe == "one_scale_load" else g])

            total = None
            for c in range(cps):  # one wgmma per chunk of gpc scale groups
                wc = _concat([group_operand(c * gpc + j) for j in range(gpc)], axis=1)
                if probe == "mma_once":
                    total = wc if total is None else total + wc
                    continue
                plgpu.wgmma(acc_ref, wc, plgpu.transpose_ref(x_smem.at[c], (1, 0)))
                if mma_in_flight is not None and c < cps - 1:
                    plgpu.wgmma_wait(mma_in_flight)
            if probe == "mma_once":
                plgpu.wgmma(acc_ref, total, plgpu.transpose_ref(x_smem.at[0], (1, 0)))
            plgpu.wgmma_wait(cps if overlap else 0)

        plgpu.emit_pipeline(
            step_body, grid=(steps,),
            in_specs=[
                plgpu.BlockSpec(slab, lambda k: (k + first_step, 0)),
                plgpu.BlockSpec((gps, rows), lambda k: (k + first_step, 0)),
                plgpu.BlockSpec((cps, n_rows, chunk), lambda k: (k + first_step, 0, 0),
                                transforms=(plgpu.TilingTransform((8, min(chunk, 64))),
                                            plgpu.SwizzleTransform(min(2 * chunk, 128))),
                                delay_release=1 if overlap else 0),
            ],
            max_concurrent_steps=stages,
        )(w_ref, s_ref, x_ref.at[:, pl.ds(row0, n_rows), :])
        return acc_ref[...]

    return pl.run_scoped(acc_scope, plgpu.ACC((rows, n_rows), jnp.float32))


def grouped_int4_matmul(x_chunks, w, s, tile_expert, tile_rows=None, *, tokens_per_tile: int,
                        out_layout: str = "rows", epilogue: str = "none", out_dtype=jnp.float32, stages: int = 2,
                        split: int = 1, mma_in_flight: int | None = None, overlap: bool = False,
                        auto_barriers: bool = True, dependent_launch: bool = False, probe: str = ""):
    """Pallas Mosaic GPU kernel (H100/H200). Same contract as ``grouped_int4_matmul_ref``, except that the
    output columns (rows) of skipped tiles are left unwritten (garbage: the MoE layer reads only the rows
    of real pairs), and with
    ``split`` > 1 the result is the f32 sum over ``split`` partial products (split-K:
    more programs when few tiles are busy; summed in XLA).

    ``out_layout="tokens"`` stores each [R, N] accumulator transposed (a register shuffle into the
    transposed wgmma layout, then a [N, R] TMA box), so the output is [P, O]: token rows, which the
    layer's next steps read without an XLA transpose; ``out_dtype`` bfloat16 stores them as bf16
    (``_check_out_dtype``).

    ``tile_rows`` int32 [2, NT] (ragged tiles, ``route_ragged``; N <= ``RAGGED_MAX_TILE``): tile t holds
    rows [tile_rows[0, t], + tile_rows[1, t]), a width that is a multiple of 8 in [8, N], so that an
    expert's last tile is no wider than its pairs need rounded up to 8 (on the H200 each 8 tokens of tile
    width cost a fixed share of tensor time per weight byte: experiments/results/probe_moe_mgpu_width_h200.json);
    the kernel branches per program between the N / 8 widths (a tile of any other width is skipped).
    ``epilogue="silu_mul"`` (token rows, split 1, a gate/up stack paired in 64-row blocks so that each
    128-row program holds the gate and up rows of the same 64 f): each program's accumulator halves give
    h = silu(gate) * up in registers, stored as bf16 chunks [O/2/C, P, C], the down GEMM's input.

    The activations' chunk width C (``to_chunks``: 32, 64 or 128 columns) sets the wgmma size: each wgmma
    takes C / 32 dequantised scale groups as one [R, C] A operand (fewer, longer wgmmas for wider chunks;
    the epilogue needs C >= 64 and writes h in the same chunks).
    ``mma_in_flight``: after each chunk's wgmma, wait until at most this many chunks are still in
    flight (their A operands are registers, held until the wgmma completes), so that fewer dequantised
    groups are live at once: fewer registers per thread, more programs per SM. None: wait once, at the end
    of the step (the whole step's operands live).
    ``overlap``: keep one step's wgmmas in flight while the next step is dequantised (the token tile
    is released a step late); otherwise each step waits for its own wgmmas. ``auto_barriers=False`` drops
    Mosaic GPU's warpgroup barriers before a pipeline slot is refilled (``unsafe_no_auto_barriers``); safe
    only because each step ends with ``wgmma_wait(0)``, hence refused together with ``overlap``.
    ``dependent_launch`` (a probe of programmatic dependent launch, off by default): every program
    first waits for the grids before it to complete (``griddepcontrol.wait``: nothing is read before), then
    lets the next grid launch (``griddepcontrol.launch_dependents``), so that a next kernel launched with
    CUDA's programmatic stream serialization can be resident and past its launch while this one runs.
    Without that launch attribute both instructions do nothing; whether XLA sets it for a Mosaic GPU
    kernel is what the probe is for (the result is the same either way).
    ``probe`` (benchmarks only, wrong results): "no_scale" skips the per-group scale multiply; "mma_once"
    adds the eight dequantised groups of a step (bf16 adds) and issues one wgmma for them; "stream_only"
    runs the copy pipeline with an empty step (what the memory side alone costs); "no_weight_load" (fragments
    order) upcasts a broadcast word instead of loading the slab's words from shared memory (what those loads
    cost: experiments/results/probe_moe_mgpu_s14_width_h200.json); "wide_load" loads them with one 16-byte
    load per thread instead of two 8-byte ones (the words land in the wrong registers); "one_scale_load"
    multiplies every group of a step by group 0's scales (one scale load per step instead of eight). (Another, the A
    operand through shared memory, ran 35 % slower at 09fd4cc:
    experiments/results/probe_moe_mgpu_smem_a_h200.json.)"""
    if plgpu is None:
        raise RuntimeError("jax.experimental.pallas.mosaic_gpu is not available in this JAX")
    n = tokens_per_tile
    _check_out_layout(out_layout)
    fragments, in_dim, out_dim = check_grouped_args(x_chunks, w, s, tile_expert, n, tile_rows)
    chunk = x_chunks.shape[2]
    _check_schedule(in_dim, chunk, split, mma_in_flight, overlap, auto_barriers, probe)
    _check_epilogue(epilogue, out_layout, s, chunk, split)
    _check_out_dtype(out_dtype, out_layout, epilogue, split)
    out_dtype = jnp.dtype(out_dtype)
    tokens_out = out_layout == "tokens"
    fused = epilogue == "silu_mul"
    if x_chunks.dtype != jnp.bfloat16:
        raise ValueError(f"the kernel takes bf16 activations, got {x_chunks.dtype}")
    p = x_chunks.shape[1]
    e_n, nb, kr, step = w.shape
    rows = s.shape[-1]
    kps = in_dim // STEP // split
    smem = smem_bytes(rows, n, stages)
    if smem > SMEM_LIMIT:
        raise ValueError(f"tiles of {n} tokens, rows={rows}, stages={stages} need {smem} bytes of shared memory "
                         f"(limit {SMEM_LIMIT}): fewer tokens per tile or stages")
    nt = tile_expert.shape[0]
    ragged = tile_rows is not None

    def int4_gemm_body(te_ref, tr_ref, x_ref, w_ref, s_ref, o_ref):
        if dependent_launch:  # wait before the first read (tile_expert too), then free the next grid's launch
            plgpu.griddepcontrol_wait()
            plgpu.griddepcontrol_launch_dependents()
        t = lax.axis_index("tile")
        b = lax.axis_index("rows")
        sp = lax.axis_index("split")
        e = te_ref[t]

        def program(n_rows, row0):  # one tile: n_rows tokens, rows [row0, row0 + n_rows)
            acc = tile_product(x_ref, w_ref.at[e, b], s_ref.at[e, b], n_rows=n_rows, row0=row0,
                               first_step=sp * kps, steps=kps, chunk=chunk, stages=stages,
                               mma_in_flight=mma_in_flight, overlap=overlap, probe=probe)

            def store(o_smem):  # a scope after the pipeline's: the output tile reuses its shared memory
                if fused:  # rows [0, 64) are gate, [64, 128) up of the same f: the same registers of each thread
                    gate, up = acc[:PAIR_BLOCK], acc[PAIR_BLOCK:]
                    h = silu_mul(gate, up).astype(jnp.bfloat16)
                    o_smem.transpose((1, 0))[...] = plgpu.layout_cast(h, plgpu.Layout.WGMMA_TRANSPOSED)
                    plgpu.commit_smem()
                    per_chunk = chunk // PAIR_BLOCK  # this program's 64 f are (part of) one chunk of h
                    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b // per_chunk, pl.ds(row0, n_rows),
                                                             pl.ds((b % per_chunk) * PAIR_BLOCK, PAIR_BLOCK)])
                elif tokens_out:
                    # ref.transpose, not plgpu.transpose_ref: JAX 0.11's transpose_ref asks a plain scratch ref
                    # for a memory_space attribute it no longer has
                    o_smem.transpose((1, 0))[...] = plgpu.layout_cast(acc.astype(out_dtype),
                                                                      plgpu.Layout.WGMMA_TRANSPOSED)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[sp, pl.ds(row0, n_rows), pl.ds(b * rows, rows)])
                else:
                    o_smem[...] = acc
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[sp, pl.ds(b * rows, rows), pl.ds(row0, n_rows)])
                plgpu.wait_smem_to_gmem(0)

            pl.run_scoped(store, plgpu.SMEM((n_rows, PAIR_BLOCK), jnp.bfloat16) if fused else
                          plgpu.SMEM((n_rows, rows), out_dtype) if tokens_out else
                          plgpu.SMEM((rows, n_rows), jnp.float32))

        if ragged:  # one branch per width; each tile runs the one its width names
            row0, width = tr_ref[0, t], tr_ref[1, t]
            for n_rows in range(8, n + 1, 8):
                pl.when((e >= 0) & (width == n_rows))(functools.partial(program, n_rows, row0))
        else:
            pl.when(e >= 0)(lambda: program(n, t * n))

    kernel = plgpu.kernel(
        int4_gemm_body,
        out_type=jax.ShapeDtypeStruct((out_dim // 2 // chunk, p, chunk), jnp.bfloat16) if fused else
        jax.ShapeDtypeStruct((split,) + ((p, out_dim) if tokens_out else (out_dim, p)), out_dtype),
        grid=(nt, nb, split), grid_names=("tile", "rows", "split"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                             unsafe_no_auto_barriers=not auto_barriers),
    )
    out = kernel(tile_expert, tile_rows if ragged else jnp.zeros((2, 1), jnp.int32), x_chunks, w, s)
    if fused:
        return out
    return out[0] if split == 1 else out.sum(0)


def to_chunks(x, chunk: int) -> jax.Array:
    """Token rows [P, I] -> chunk-major [I/C, P, C] (the activation layout of the kernel; C in ``CHUNKS``)."""
    p, i = x.shape
    if chunk not in CHUNKS or i % chunk:
        raise ValueError(f"chunk width must be one of {CHUNKS} dividing I={i}, got {chunk}")
    return jnp.swapaxes(x.reshape(p, i // chunk, chunk), 0, 1)


GATHERS = ("elements", "words")
LAUNCHES = ("two", "one")


def gather_token_chunks(x, row_token, chunk: int, gather: str = "words") -> jax.Array:
    """x [M, I], row_token int32 [P] (M: a zero row) -> the gathered rows in chunk-major layout [I/C, P, C].
    "words" moves bf16 pairs as uint32 (half the elements for XLA's gather to index; bf16 x only, other
    dtypes take "elements"). On the H200 (session 10, traced, the routed-expert layer at K2.6 dims, uniform
    routing: experiments/results/bench_moe_s10_gather.json) the layer's XLA glue went 77 -> 58 us at
    M = 256 and 268 -> 194 us at M = 1024; the same bits either way."""
    if gather not in GATHERS:
        raise ValueError(f"gather must be one of {GATHERS}, got {gather!r}")
    m, i = x.shape
    padded = jnp.concatenate([x, jnp.zeros((1, i), x.dtype)])
    if gather == "elements" or x.dtype != jnp.bfloat16:
        return to_chunks(padded, chunk)[:, row_token]
    chunks = to_chunks(padded, chunk)  # [I/C, M + 1, C]
    words = lax.bitcast_convert_type(chunks.reshape(i // chunk, m + 1, chunk // 2, 2), jnp.uint32)
    return lax.bitcast_convert_type(words[:, row_token], jnp.bfloat16).reshape(i // chunk, -1, chunk)


def _concat(parts, axis: int):
    """bf16 WGMMA-layout operands -> their concatenation along rows (axis 0, in 64-row blocks) or columns
    (axis 1, in 8-column tiles); no instructions: the parts' registers are renumbered (e.g. [R, 32] groups:
    8-column tile j of part k becomes tile 4 k + j)."""
    if len(parts) == 1:
        return parts[0]
    shape = list(parts[0].shape)
    shape[axis] *= len(parts)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) * len(parts), return_type=plgpu.ShapeDtypeStruct(
        tuple(shape), jnp.bfloat16, layout=plgpu.Layout.WGMMA))
    def concat(ctx, *arrays):
        del ctx
        regs = np.concatenate([a.registers for a in arrays], axis=axis)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return concat(*parts)


# ----------------------------------------------------------------------------------------------
# The routed-expert layer on tiled stacks
# ----------------------------------------------------------------------------------------------
def tiled_default_tile(m: int, k: int, e: int) -> int:
    """Tokens per tile N of the Mosaic GPU path: about the mean pairs per active expert, a power of two in
    [8, 64] (on the H200 a larger N costs more per weight byte; 8 is the smallest wgmma N)."""
    return default_tile(m, k, e, smallest=8, largest=64)


NUM_SMS_H200 = 132
TILE_WIDTHS = ("one", "ragged")  # routed_experts_tiled(widths=): route_narrow, route_ragged


def default_widths(m: int, k: int, e: int, shards: int = 1) -> tuple[str, int]:
    """(widths, N) of ``routed_experts_tiled`` by default for M tokens, top-K, E local experts of
    ``shards`` devices' (expert parallelism: about Q = M K / shards pairs are local): one width of
    ``tiled_default_tile`` while the pairs are fewer than the experts (Q < E: an expert rarely has more than
    8), else ragged tiles of at most 16 tokens while the experts average at most 8 pairs (Q <= 8 E), else
    at most 32. A wider N costs
    shared memory for every tile, so fewer programs share an SM; a narrower one splits more experts, and
    each extra tile streams its expert's weights again. On the H200 (traced, ms, against session 12's
    two-width layout in the same runs: experiments/results/bench_moe_s13_ragged*.json): N <= 16 took
    2.080 / 1.205 at M = 90 uniform / skewed (2.074 / 1.224) and 2.370 at 256 uniform (2.397); N <= 32 took
    2.719 / 2.856 at 512 (2.728 / 2.992) and 3.008 / 3.822 at 1024 (3.176 / 4.054). The other bound won
    three of those cases: N <= 32 at 90 skewed (1.176) and 256 skewed (1.985 against 2.180), N <= 16 at
    512 uniform (2.671). N <= 64 lost at every M (2.811 at 256); N <= 16 at 1024 split most experts in
    two (4.875)."""
    pairs = -(-m * k // shards)
    if pairs < e:
        return "one", tiled_default_tile(pairs, 1, e)
    return "ragged", 16 if pairs <= 8 * e else 32


def default_split(m: int, k: int, e: int, leaf: TiledInt4, num_sms: int = NUM_SMS_H200, shards: int = 1) -> int:
    """Split-K for one GEMM of the layer: 2 where the busy programs (at most min(ceil(M*K / shards), E)
    busy tiles x O/R row blocks) would not give each of ``num_sms`` SMs one, else 1 (e.g. a device's few
    experts at one token under expert parallelism: ``shards`` devices share the experts, so one expects
    1/shards of the pairs on each). At M = 1 on one H200 (256 busy gate+up programs) split 2 no
    longer helps in device time (gate+up 41.2-41.6 us unsplit, 41.8-42.3 split in two, traced:
    experiments/results/probe_moe_mgpu_anatomy_h200.json, probe_moe_mgpu_inflight_h200.json), and
    unsplit it takes the SiLU·up epilogue; the wall-clock chains of session 4 had shown 65 -> 51 us."""
    steps = leaf.shape[2] // STEP
    return 2 if busy_programs(m, k, e, leaf, shards) < num_sms and steps % 2 == 0 else 1


def busy_programs(m: int, k: int, e: int, leaf: TiledInt4, shards: int = 1) -> int:
    """Programs of one unsplit GEMM of the layer that have work: at most min(ceil(M*K / shards), E) busy
    tiles (one per pair at worst) x the stack's O/R row blocks."""
    return min(-(-m * k // shards), e) * (leaf.shape[1] // leaf.rows)


RESIDENT_ALL_IN_FLIGHT = 3  # programs per SM with every chunk in flight (162-165 registers x 128 threads)


def default_mma_in_flight(m: int, k: int, chunk: int, leaf: TiledInt4 | None = None, e: int | None = None,
                          split: int = 1, num_sms: int = NUM_SMS_H200, shards: int = 1) -> int | None:
    """wgmma chunks left in flight after each chunk (``grouped_int4_matmul(mma_in_flight=)``) for one GEMM of
    the layer: None (one wait per step) below 64 routed pairs (M <= 7 at top-8) where the GEMM's busy
    programs (``busy_programs`` times ``split``; all of them when ``leaf`` is not given) fit
    in one wave at ``RESIDENT_ALL_IN_FLIGHT`` programs per SM; else two scale groups' worth (64 // chunk).
    On the H200 with 32-column chunks (experiments/results/probe_moe_mgpu_inflight_h200.json; ptxas: 162 ->
    82 registers at N=8 with 2 in flight, 186 -> 90 at N=32 with 1): at M=1 a wait per group cost 2-5 %;
    from M=9 on, 2 in flight gained 0-3 % at N=8 and 5-15 % at N=16 and 32. With 128-column chunks, 0 in
    flight was the best of None / 0 / 1 at every M >= 9 (probe_moe_mgpu_chunks_h200.json). At M = 1 since
    the one-LOP3 dequant (experiments/results/bench_moe_s15_m1.json): 0 in flight took the down GEMM's 448
    programs from 26.1 to 22.1 us (four programs per SM instead of three: one wave instead of 1.13) and
    gate+up's 256 from 36.0 to 38.3 (one wave either way)."""
    if m * k >= 64:
        return 64 // chunk
    if leaf is None:
        return None
    busy = busy_programs(m, k, e if e is not None else leaf.shape[0], leaf, shards) * split
    return None if busy <= RESIDENT_ALL_IN_FLIGHT * num_sms else 64 // chunk


def uses_per_pair(m: int, routing: str = "auto") -> bool:
    """Whether ``routed_experts_tiled(routing=)`` lays out one tile per pair: asked for, or "auto" at M = 1."""
    return routing == "per_pair" or (routing == "auto" and m == 1)


def tile_layout(m: int, k: int, e: int, widths: str | None = None, tile: int | None = None,
                per_pair: bool = False, shards: int = 1) -> tuple[str, int]:
    """(widths, N) that ``routed_experts_tiled`` runs for these arguments: ``default_widths`` for what is
    not given (one width of ``tiled_default_tile`` over the local pairs with per-pair tiles, or where
    another layout is asked for than the default's)."""
    one_width = tiled_default_tile(-(-m * k // shards), 1, e)
    auto_widths, auto_tile = ("one", one_width) if per_pair else default_widths(m, k, e, shards)
    widths = widths or auto_widths
    return widths, (auto_tile if widths == auto_widths else one_width) if tile is None else tile


def check_kernel_config(w13: TiledInt4, w2: TiledInt4, n: int, stages: int, split13: int, split2: int,
                        ragged: bool = False) -> None:
    """Raises ValueError for a tile size, pipeline depth or split-K (one per GEMM) the kernel cannot run
    on these stacks (checked on every platform, so the CPU twin refuses what the GPU kernel would)."""
    widest = RAGGED_MAX_TILE if ragged else 256
    if n % 8 or not 8 <= n <= widest:
        raise ValueError(f"tile={n} must be a multiple of 8 in [8, {widest}]"
                         + (" with ragged tiles" if ragged else ""))
    for leaf, split in ((w13, split13), (w2, split2)):
        if smem_bytes(leaf.rows, n, stages) > SMEM_LIMIT:
            raise ValueError(f"tile={n}, stages={stages} need {smem_bytes(leaf.rows, n, stages)} bytes of shared "
                             f"memory at {leaf.rows} rows (limit {SMEM_LIMIT})")
        if not isinstance(split, int) or split < 1 or (leaf.shape[2] // STEP) % split:
            raise ValueError(f"split={split!r} must be a positive int dividing the {leaf.shape[2] // STEP} pipeline "
                             f"steps of a [{leaf.shape[1]}, {leaf.shape[2]}] stack")


def routed_experts_tiled(x, expert_ids, expert_weights, w13: TiledInt4, w2: TiledInt4, *,
                         expert_offset: int | jax.Array = 0, out_dtype=None, use_kernel: bool = False,
                         tile: int | None = None, stages: int = 2, split: int | None = None,
                         mma_in_flight: int | None | str = "auto", chunk: int = 128, widths: str | None = None,
                         routing: str = "auto", gather: str = "words", expert_shards: int = 1,
                         dependent_launch: bool = False, launch: str = "two", down_blocks: int = 4):
    """Routed experts of one MoE layer on tiled INT4 stacks: the Mosaic GPU kernel (``use_kernel``) or its
    twin, around the same XLA routing and combine.

    x [M, D] (bf16 for the kernel), expert_ids int32 [M, K] (global ids), expert_weights f32 [M, K],
    w13 [E, 2F, D] (gate rows, then up rows), w2 [E, D, F], holding experts expert_offset ..
    expert_offset + E - 1 (pairs routed elsewhere contribute nothing) -> y [M, D] in ``out_dtype``
    (default x.dtype; summed in f32). tile: tokens per tile N (default from M, 8..64).

    The pairs are laid out by expert in tiles of N rows (``moe_routing.route_narrow``); kernel 1 gives gate and up
    [P, 2F] in f32 (token rows: ``out_layout="tokens"``), XLA forms h = silu(gate) * up in x.dtype (or,
    for a w13 stored with gate/up rows paired and no split-K, kernel 1's epilogue does and gives h in the
    down GEMM's chunk layout), kernel 2 gives [P, D]; each token gathers its K pair rows, weights and adds
    them (``_gather_combine``). Tiles past the busy ones are skipped by the kernel; their unwritten rows are
    never gathered. The token rows are gathered straight into the kernel's chunk layout (``gather_token_chunks``).
    split: split-K of both GEMMs (default: ``default_split`` for each). mma_in_flight: the kernel's (an int,
    or None) for both GEMMs, default ("auto") ``default_mma_in_flight`` of each. chunk: activation chunk
    width C (``CHUNKS``; scale groups per wgmma = C / 32); 128 by default: on the H200 the layer took
    75.0 / 432 / 2106 / 2661 / 3319 us at M = 1 / 9 / 90 / 256 / 1024 against 76.7 / 447 / 2177 / 2760 /
    3684 with C = 32, mostly from the XLA transposes it removes
    (experiments/results/bench_moe_h200_chunks.json). widths: "one" (every tile N = ``tile`` wide,
    ``route_narrow``) or "ragged" (tiles of at most N, an expert's last one as wide as
    its pairs rounded up to 8, ``route_ragged``); default and the default N: ``default_widths``. The down
    GEMM's pair rows are bf16 for bf16 x where it has no split-K (each expert's output rounded as a bf16
    model's expert rounds it), else f32. routing: ``moe_routing``'s method ("auto", "sort" or "compare"; the
    same layout either way), or "per_pair" (``route_per_pair``: a tile per pair, no grouping); "auto" takes
    "per_pair" for one token (M = 1), else ``moe_routing``'s choice. gather: ``gather_token_chunks``'.
    expert_shards: how many devices share the experts under expert parallelism (this call holds one
    share); ``default_split``'s and ``default_widths``' estimates of the local pairs use it.
    dependent_launch: both GEMMs' ``grouped_int4_matmul(dependent_launch=)`` (a probe; the twin ignores
    it). launch: "two" (the gate+up GEMM, then the down GEMM) or "one" (``int4_moe_fused``: one launch
    whose programs each run gate+up for 64 f and that block's share of the down GEMM; XLA sums the
    shares; per-pair tiles and a paired gate/up stack only; ``down_blocks``: its 128-row blocks of W2 per
    pipeline step; on the H200 at M = 1 it took 71.9 us against 71.2 for two launches: see that module).
    """
    m, d, k = check_moe_inputs(x, expert_ids, expert_weights, w13.shape[2])
    e_n, f = w13.shape[0], w2.shape[2]
    if w13.shape != (e_n, 2 * f, d) or w2.shape != (e_n, d, f):
        raise ValueError(f"w13 {w13.shape} / w2 {w2.shape} do not match x [M, {d}]")
    if use_kernel and x.dtype != jnp.bfloat16:
        raise ValueError(f"the Mosaic GPU kernel takes bf16 activations, got {x.dtype}")
    if routing not in METHODS + ("per_pair",):
        raise ValueError(f"routing must be one of {METHODS + ('per_pair',)}, got {routing!r}")
    per_pair = uses_per_pair(m, routing)
    if launch not in LAUNCHES:
        raise ValueError(f"launch must be one of {LAUNCHES}, got {launch!r}")
    if launch == "one" and (not per_pair or w13.gate_up_block != PAIR_BLOCK):
        raise ValueError("launch='one' needs per-pair tiles (routing='per_pair', or 'auto' at M = 1) and a w13 "
                         f"paired in {PAIR_BLOCK}-row blocks; got routing={routing!r} at M = {m}, gate_up_block="
                         f"{w13.gate_up_block}")
    if widths not in (None,) + TILE_WIDTHS:
        raise ValueError(f"widths must be None or one of {TILE_WIDTHS}, got {widths!r}")
    if per_pair and widths not in (None, "one"):
        raise ValueError(f"per-pair tiles (routing='per_pair', the default at M = 1) have one width: widths="
                         f"{widths!r} needs a grouped routing")
    if not isinstance(expert_shards, int) or expert_shards < 1:
        raise ValueError(f"expert_shards must be a positive int, got {expert_shards!r}")
    widths, n = tile_layout(m, k, e_n, widths, tile, per_pair, expert_shards)
    split13, split2 = (split, split) if split is not None else (
        default_split(m, k, e_n, w13, shards=expert_shards), default_split(m, k, e_n, w2, shards=expert_shards))
    check_kernel_config(w13, w2, n, stages, split13, split2, ragged=widths == "ragged")  # every platform: one contract
    if chunk not in CHUNKS or d % chunk or f % chunk:
        raise ValueError(f"chunk={chunk} must be one of {CHUNKS} dividing D={d} and F={f}")
    if mma_in_flight == "auto":
        inflight13, inflight2 = (default_mma_in_flight(m, k, chunk, leaf, e_n, sp, shards=expert_shards)
                                 for leaf, sp in ((w13, split13), (w2, split2)))
    else:
        inflight13 = inflight2 = mma_in_flight
    _check_mma_in_flight(inflight13, chunk)
    _check_mma_in_flight(inflight2, chunk)
    tile_rows = None
    if per_pair:
        row_token, tile_expert, pair_row = route_per_pair(expert_ids - expert_offset, e_n, n)
    elif widths == "ragged":
        row_token, tile_expert, tile_rows, pair_row = route_ragged(expert_ids - expert_offset, e_n, n, routing)
    else:
        row_token, _, tile_expert, _, pair_row = route_narrow(expert_ids - expert_offset, expert_weights, e_n, n,
                                                              routing)
    xs = gather_token_chunks(x, row_token, chunk, gather)  # [D/C, P, C]
    pair_dtype = jnp.bfloat16 if x.dtype == jnp.bfloat16 and split2 == 1 else jnp.float32
    if launch == "one":
        from pallas_kernels.int4_moe_fused import fused_int4_moe, fused_int4_moe_ref  # (it builds on this module)
        fused = fused_int4_moe if use_kernel else fused_int4_moe_ref
        partials = fused(xs, w13.packed, w13.scale, w2.packed, w2.scale, tile_expert, tokens_per_tile=n,
                         stages=stages, down_blocks=down_blocks)  # [F/64, NT, D]
        y_tiles = jnp.sum(partials, axis=0).astype(jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32)
        return _gather_combine(y_tiles, pair_row // n, expert_weights, out_dtype or x.dtype)
    matmul = grouped_int4_matmul if use_kernel else grouped_int4_matmul_ref
    mm = lambda *a, split, inflight, epilogue="none", out_dtype=jnp.float32: matmul(  # noqa: E731
        *a, tokens_per_tile=n, out_layout="tokens", epilogue=epilogue, stages=stages,
        split=split, mma_in_flight=inflight, out_dtype=out_dtype, dependent_launch=dependent_launch)
    if w13.gate_up_block and split13 == 1 and chunk >= PAIR_BLOCK:  # SiLU·up in the gate+up GEMM's epilogue
        h = mm(xs, w13.packed, w13.scale, tile_expert, tile_rows, split=1, inflight=inflight13,
               epilogue="silu_mul")  # [F/C, P, C]
    else:
        gu = mm(xs, w13.packed, w13.scale, tile_expert, tile_rows, split=split13, inflight=inflight13)  # [P, 2F] f32
        gate, up = gate_and_up(gu, w13.gate_up_block)
        h = to_chunks((jax.nn.silu(gate) * up).astype(x.dtype), chunk)  # [F/C, P, C]
    y_pairs = mm(h, w2.packed, w2.scale, tile_expert, tile_rows, split=split2, inflight=inflight2,
                 out_dtype=pair_dtype)  # [P, D]
    return _gather_combine(y_pairs, pair_row, expert_weights, out_dtype or x.dtype)


def _gather_combine(y_pairs, pair_row, expert_weights, dtype):
    """y_pairs [P, D] (f32 or bf16), pair_row int32 [M, K] (P: no row), expert_weights [M, K] -> y [M, D]: each
    token's pair rows, weighted and summed in f32 (k in order). A gather, not a scatter: rows that no pair
    names (padding, skipped tiles: unwritten by the kernel) are never read."""
    p = y_pairs.shape[0]
    rows = y_pairs[jnp.minimum(pair_row, p - 1)].astype(jnp.float32)  # [M, K, D]
    weighted = rows * expert_weights.astype(jnp.float32)[..., None]
    return jnp.sum(jnp.where((pair_row < p)[..., None], weighted, 0.0), axis=1).astype(dtype)


def routed_experts(x, expert_ids, expert_weights, w13: TiledInt4, w2: TiledInt4, *,
                   expert_offset: int | jax.Array = 0, out_dtype=None, **tuning):
    """Dispatcher: the Mosaic GPU kernel when lowered for CUDA with bf16 activations (it needs a Hopper
    GPU, sm_90), the twin on any other platform or dtype. Same contract as ``routed_experts_tiled``; the
    choice is made per lowering platform (``lax.platform_dependent``), so one jitted program serves a CPU
    host and the H200."""
    offset = jnp.asarray(expert_offset, jnp.int32)
    twin = functools.partial(routed_experts_tiled, out_dtype=out_dtype, use_kernel=False, **tuning)
    if x.dtype != jnp.bfloat16:
        return twin(x, expert_ids, expert_weights, w13, w2, expert_offset=offset)
    kernel = functools.partial(routed_experts_tiled, out_dtype=out_dtype, use_kernel=True, **tuning)
    return lax.platform_dependent(
        x, expert_ids, expert_weights, w13, w2, offset,
        cuda=lambda *a: kernel(*a[:5], expert_offset=a[5]),
        default=lambda *a: twin(*a[:5], expert_offset=a[5]))
