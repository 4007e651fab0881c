"""INT4 expert stacks in the layouts the Mosaic GPU MoE kernel streams (``pallas_kernels.int4_moe_mgpu``):
the one-time repack from compressed-tensors, its bit-exact inverse, and ``TiledInt4``, the stack as a
model parameter.

Dimension letters: E experts, O output rows of one expert matrix, I input columns, G scale group (32),
R rows per kernel program (64 or 128), S = 256 input columns per pipeline step (8 scale groups).

Weight layout ("tiles", made once at load time by ``tile_weights``)
-------------------------------------------------------------------
int4 values q (two's complement, i.e. compressed-tensors' stored nibble u = q + 8 with its top bit
flipped) in an array [E, O/R, (I/S)*R, S]: program-row block b, pipeline step k is the contiguous
[R, S] slab ``w[e, b, k*R:(k+1)*R]`` (R*S/2 bytes, one TMA box of 128-byte rows), and inside it the
bytes are ordered [S/G groups][R rows][G columns]. So after the copy, scale group g of the step is the
contiguous [R, G] block g of the shared-memory slab: 16 bytes per row, which the warpgroup reads
bank-conflict free straight into the wgmma int4 upcast register layout. Scales: bf16
[E, O/R, (I/S)*(S/G), R], step k's [S/G, R] block holds group-major row vectors.

Second order, "fragments" (the default where O % 128 == 0; ``tile_fragments``, int32 words
[E, O/128, (I/S)*32, 128], 128-row slabs only): each [32, 128]-word slab holds a [128, 256] weight slab so that
every thread of the warpgroup reads, per scale group, two words that already hold its wgmma A-fragment values in
register order (pairs at nibbles j and j + 4: one shift, one mask-and-or with the bf16 exponent of 128 and one bf16x2
subtraction per two values, no register shuffles; ``fragment_maps``, ``int4_moe_mgpu._fragment_operand``). The kernel
takes either order (by the weights' dtype). On the H200 the fragment order was 1-22 % faster than the
groups order, never slower (experiments/results/probe_moe_mgpu_fragments_h200.json).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.int4_moe import _expert_mesh, map_expert_stack

GROUP = 32
STEP = 256


def _check_dims(o: int, i: int, rows: int) -> None:
    if rows not in (64, 128):
        raise ValueError(f"rows per program must be 64 or 128, got {rows}")
    if o % rows or i % STEP:
        raise ValueError(f"O={o} must be a multiple of rows={rows} and I={i} a multiple of {STEP}")


# ----------------------------------------------------------------------------------------------
# The one-time repack: compressed-tensors (packed int32, u = q + 8) <-> tiles
# ----------------------------------------------------------------------------------------------
def unpack_compressed_tensors(packed) -> jax.Array:
    """int32 [..., O, I/8] (nibble n of word j = column 8j+n, value q+8) -> q int8 [..., O, I]."""
    shifts = jnp.arange(8, dtype=jnp.uint32) * 4
    u = (lax.bitcast_convert_type(packed, jnp.uint32)[..., None] >> shifts) & 0xF
    return (u.astype(jnp.int8) - 8).reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def pack_compressed_tensors(q) -> jax.Array:
    """Inverse of ``unpack_compressed_tensors``."""
    u = (q.astype(jnp.int32) + 8).astype(jnp.uint32).reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    word = jnp.sum(u << (jnp.arange(8, dtype=jnp.uint32) * 4), axis=-1, dtype=jnp.uint32)
    return lax.bitcast_convert_type(word, jnp.int32)


def tile_weights(q, scale, rows: int = 64):
    """q int8 [E, O, I] in [-8, 7], scale [E, O, I/G] -> (w int4 [E, O/R, (I/S)*R, S], s bf16 [E, O/R, I/G, R])."""
    e, o, i = q.shape
    _check_dims(o, i, rows)
    w = q.reshape(e, o // rows, rows, i // STEP, STEP // GROUP, GROUP).transpose(0, 1, 3, 4, 2, 5)
    w = w.reshape(e, o // rows, (i // STEP) * rows, STEP).astype(jnp.int4)
    return w, tile_scales(scale, rows)


def tile_scales(scale, rows: int):
    """Scales [E, O, I/G] -> bf16 [E, O/R, I/G, R] (both weight orders)."""
    e, o, groups = scale.shape
    return scale.reshape(e, o // rows, rows, groups).transpose(0, 1, 3, 2).astype(jnp.bfloat16)


def untile_weights(w, s):
    """Inverse of ``tile_weights``: -> (q int8 [E, O, I], scale bf16 [E, O, I/G])."""
    e, nb, kr, _ = w.shape
    rows = s.shape[-1]
    ks = kr // rows
    q = w.astype(jnp.int8).reshape(e, nb, ks, STEP // GROUP, rows, GROUP).transpose(0, 1, 4, 2, 3, 5)
    return q.reshape(e, nb * rows, ks * STEP), untile_scales(s)


def untile_scales(s):
    """Tiled scales [E, O/R, I/G, R] (either order) -> [E, O, I/G]."""
    e, nb, groups, rows = s.shape
    return s.transpose(0, 1, 3, 2).reshape(e, nb * rows, groups)


FRAG_ROWS = 128  # the "fragments" order is defined for 128-row slabs


@functools.lru_cache(maxsize=None)
def fragment_maps() -> tuple[np.ndarray, np.ndarray]:
    """(row, col) inside a [128, 256] slab of nibble n of word f, as int arrays [4096, 8].

    Word f = ((g * 2 + h) * 128 + t) * 2 + i belongs to thread t = 32 w + l of the warpgroup, 32-column
    group g, 64-row half h, row sub-tile i. It holds the four bf16 pairs that thread keeps in registers
    for the wgmma A operand (layout WGMMA: row 64 h + 16 w + 8 i + l // 4, columns 8 j + 2 (l % 4) + v):
    nibble j is pair j's first value (v = 0), nibble j + 4 its second (v = 1), so that
    ``(word >> 4 j) & 0x000F000F`` puts both values of pair j at bits 0 and 16."""
    f = np.arange(4096)
    i, t, h, g = f % 2, (f // 2) % 128, (f // 256) % 2, f // 512
    w, lane = t // 32, t % 32
    row = 64 * h + 16 * w + 8 * i + lane // 4
    n = np.arange(8)
    j, v = n % 4, n // 4
    col = 32 * g[:, None] + 8 * j[None, :] + 2 * (lane % 4)[:, None] + v[None, :]
    return np.broadcast_to(row[:, None], (4096, 8)).copy(), col


def tile_fragments(q, scale):
    """q int8 [E, O, I] in [-8, 7], scale [E, O, I/G] -> (words int32 [E, O/128, (I/S)*32, 128], s bf16
    [E, O/128, I/G, 128]): each [32, 128] word slab holds a [128, 256] weight slab in fragment order
    (``fragment_maps``), nibbles stored as u = q + 8 like compressed-tensors words."""
    e, o, i = q.shape
    _check_dims(o, i, FRAG_ROWS)
    rmap, cmap = fragment_maps()
    slabs = q.reshape(e, o // FRAG_ROWS, FRAG_ROWS, i // STEP, STEP).transpose(0, 1, 3, 2, 4)
    nibbles = slabs[..., rmap, cmap]  # [E, O/128, I/S, 4096 words, 8 nibbles]
    words = pack_compressed_tensors(nibbles.reshape(*nibbles.shape[:-2], -1))
    return words.reshape(e, o // FRAG_ROWS, (i // STEP) * 32, 128), tile_scales(scale, FRAG_ROWS)


def untile_fragments(words):
    """Inverse of ``tile_fragments`` for the weights: -> q int8 [E, O, I]."""
    e, nb, ks32, _ = words.shape
    rmap, cmap = fragment_maps()
    q = unpack_compressed_tensors(words.reshape(e, nb, ks32 // 32, 4096)).reshape(e, nb, ks32 // 32, 4096, 8)
    slabs = jnp.zeros((e, nb, ks32 // 32, FRAG_ROWS, STEP), jnp.int8).at[..., rmap, cmap].set(q)
    return slabs.transpose(0, 1, 3, 2, 4).reshape(e, nb * FRAG_ROWS, (ks32 // 32) * STEP)


def dequantize_expert(w, s, e, dtype=jnp.bfloat16) -> jax.Array:
    """Expert e (may be traced) of tiled weights -> [O, I] in ``dtype``: q * scale computed exactly in f32
    and rounded once (for bf16 scales and dtype this is the kernel's bf16 product, bit for bit)."""
    if w.dtype == jnp.int32:  # fragment order
        q, scale = untile_fragments(w[e][None])[0], untile_scales(s[e][None])[0]
    else:
        q, scale = untile_weights(w[e][None], s[e][None])
        q, scale = q[0], scale[0]
    o, i = q.shape
    deq = q.reshape(o, i // GROUP, GROUP).astype(jnp.float32) * scale.astype(jnp.float32)[:, :, None]
    return deq.reshape(o, i).astype(dtype)


PAIR_BLOCK = FRAG_ROWS // 2  # gate/up rows of one f block held by one 128-row program


# ----------------------------------------------------------------------------------------------
# One expert stack in the tiled layout
# ----------------------------------------------------------------------------------------------
def tiling_error(o: int, i: int, group: int, scale_dtype) -> str | None:
    """Why an [O, I] stack (scale groups of ``group``) cannot take the tiled layout, or None."""
    if group != GROUP:
        return f"group size {group} (the tiled kernel needs {GROUP})"
    if o % 64 or i % STEP:
        return f"shape [O={o}, I={i}] (the tiled kernel needs O % 64 == 0 and I % {STEP} == 0)"
    if jnp.dtype(scale_dtype) != jnp.bfloat16:
        return f"{jnp.dtype(scale_dtype)} scales (the tiled kernel multiplies in bf16)"
    return None


def gate_up_pair_rows(o: int, block: int) -> np.ndarray:
    """Natural row of each stored row of a gate/up stack of O = 2F rows paired in ``block``-row blocks:
    stored rows [2*block*j, 2*block*j + block) are gate rows [block*j, block*(j + 1)), the next ``block``
    the up rows of the same f (so one 2*block-row program holds both halves of silu(gate) * up)."""
    f = o // 2
    gate = np.arange(f).reshape(f // block, block)
    return np.stack([gate, f + gate], axis=1).reshape(-1).astype(np.int32)


def _expert_to_tiles(packed, scale, *, order: str, rows: int, pair: int):
    """One expert: compressed-tensors (packed [O, I/8], scale [O, I/G]) -> tiled (packed, scale)."""
    if pair:
        stored = jnp.asarray(gate_up_pair_rows(packed.shape[0], pair))
        packed, scale = packed[stored], scale[stored]
    tile = tile_fragments if order == "fragments" else functools.partial(tile_weights, rows=rows)
    w, s_t = tile(unpack_compressed_tensors(packed)[None], scale[None])
    return w[0], s_t[0]


def _expert_from_tiles(w, s_t, *, order: str, rows: int, pair: int):
    """Inverse of ``_expert_to_tiles``."""
    del rows
    q = untile_fragments(w[None]) if order == "fragments" else untile_weights(w[None], s_t[None])[0]
    packed, scale = pack_compressed_tensors(q[0]), untile_scales(s_t[None])[0]
    if pair:
        natural = jnp.asarray(np.argsort(gate_up_pair_rows(packed.shape[0], pair)).astype(np.int32))
        packed, scale = packed[natural], scale[natural]
    return packed, scale


@functools.partial(jax.jit, static_argnames=("to_tiles", "order", "rows", "pair", "mesh", "axis"))
def _convert(packed, scale, *, to_tiles: bool, order: str, rows: int, pair: int, mesh, axis):
    """A whole stack, one expert at a time, where it lives (``int4_moe.map_expert_stack``); compiled once
    per shape and order."""
    one = functools.partial(_expert_to_tiles if to_tiles else _expert_from_tiles, order=order, rows=rows, pair=pair)
    return map_expert_stack(one, packed, scale, mesh=mesh, axis=axis)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["packed", "scale"], meta_fields=["gate_up_block"])
@dataclasses.dataclass(frozen=True)
class TiledInt4:
    """One INT4 expert stack (W [E, O, I], PyTorch [out, in] per expert) in the tiled layout (module doc).

    order "groups": packed int4 [E, O/R, (I/S)*R, S]; order "fragments" (default where O % 128 == 0): packed int32
    [E, O/128, (I/S)*32, 128]. scale bf16 [E, O/R, I/G, R] in both; R = 128 where O allows, else 64. The
    expert axis leads both arrays, so expert-parallel sharding splits them like compressed-tensors ones,
    and a stack already split along experts is repacked where it lives. gate_up_block: 0, or for a gate/up
    stack stored paired (``gate_up_pair_rows``) the rows per half-block (64): the kernel's
    ``epilogue="silu_mul"`` needs it; the twin and the unfused path read the pairing from here.
    """
    packed: jax.Array
    scale: jax.Array
    gate_up_block: int = 0

    @property
    def rows(self) -> int:
        return self.scale.shape[-1]

    @property
    def shape(self) -> tuple[int, int, int]:
        """Logical [E, O, I] (as ``QuantArray.shape``)."""
        e, nb, groups, rows = self.scale.shape
        return e, nb * rows, groups * GROUP

    @property
    def order(self) -> str:
        """"groups" (int4 ``tile_weights``) or "fragments" (int32 words, ``tile_fragments``)."""
        return "fragments" if self.packed.dtype == jnp.int32 else "groups"

    @property
    def group_size(self) -> int:
        return GROUP

    @property
    def nbytes(self) -> int:
        return self.packed.size * jax.dtypes.itemsize_bits(self.packed.dtype) // 8 + self.scale.size * 2

    @classmethod
    def from_compressed_tensors(cls, packed, scale, order: str = "auto", pair_gate_up: bool = False) -> "TiledInt4":
        """One-time repack of packed int32 [E, O, I/8] (values q + 8), scale bf16 [E, O, I/32]; raises
        ValueError for stacks the layout cannot hold (``tiling_error``). Bit-exact inverse:
        ``to_compressed_tensors``. Repacks one expert at a time (small temporaries). ``order``:
        "fragments" (no register shuffles in the kernel, 1-22 % faster on the H200; needs O % 128 == 0),
        "groups", or "auto" (the default: fragments where O % 128 == 0, else groups). ``pair_gate_up``:
        a w13 stack (gate rows, then up rows) stored paired in 64-row blocks (``gate_up_pair_rows``) for
        the fused SiLU·up epilogue; needs O % 256 == 0 (128-row programs over whole pairs)."""
        if order not in ("auto", "groups", "fragments"):
            raise ValueError(f"unknown order {order!r}; expected 'auto', 'groups' or 'fragments'")
        if getattr(packed, "dtype", None) != jnp.int32 or len(packed.shape) != 3 or len(scale.shape) != 3:
            raise ValueError(f"expected packed int32 [E, O, I/8] and scale [E, O, I/G], got "
                             f"{getattr(packed, 'dtype', type(packed))} {tuple(packed.shape)} and {tuple(scale.shape)}")
        e, o, n = packed.shape
        i = n * 8
        if tuple(scale.shape[:2]) != (e, o) or i % scale.shape[2]:
            raise ValueError(f"scale {tuple(scale.shape)} does not match packed {tuple(packed.shape)}")
        problem = tiling_error(o, i, i // scale.shape[2], scale.dtype)
        if problem:
            raise ValueError(f"cannot tile: {problem}")
        rows = 128 if o % 128 == 0 else 64
        if order == "auto":
            order = "fragments" if rows == FRAG_ROWS else "groups"
        if order == "fragments" and rows != FRAG_ROWS:
            raise ValueError(f"cannot tile: the fragment order needs O % {FRAG_ROWS} == 0, got O={o}")
        if pair_gate_up and o % (2 * FRAG_ROWS):
            raise ValueError(f"cannot pair gate/up rows: O={o} must be a multiple of {2 * FRAG_ROWS}")
        pair = PAIR_BLOCK if pair_gate_up else 0
        mesh, axis = _expert_mesh(packed)
        w, s_t = _convert(jnp.asarray(packed), jnp.asarray(scale), to_tiles=True, order=order, rows=rows,
                          pair=pair, mesh=mesh, axis=axis)
        return cls(packed=w, scale=s_t, gate_up_block=pair)

    def to_compressed_tensors(self) -> tuple[jax.Array, jax.Array]:
        """(packed int32 [E, O, I/8], scale bf16 [E, O, I/32]) exactly as before the repack."""
        mesh, axis = _expert_mesh(self.packed)
        return _convert(self.packed, self.scale, to_tiles=False, order=self.order, rows=self.rows,
                        pair=self.gate_up_block, mesh=mesh, axis=axis)

    def dequantize_expert(self, e, dtype) -> jax.Array:
        """W_e [O, I] of expert ``e`` (may be traced) in ``dtype``, rows in natural order: the values of
        ``quant.dequantize_int4``."""
        w = dequantize_expert(self.packed, self.scale, e, dtype)
        if self.gate_up_block:
            w = w[jnp.asarray(np.argsort(gate_up_pair_rows(w.shape[0], self.gate_up_block)).astype(np.int32))]
        return w
