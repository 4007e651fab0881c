"""Routed experts of one MoE layer with INT4 (group-32, symmetric) weights: Pallas kernel + XLA twin.

Dimension letters: M tokens, K top-k, E experts, D model width, F expert FFN width, G scale group (32),
T tokens per tile, P = (number of tiles) * T padded (expert-sorted) token rows.

    y[m] = sum_k w[m, k] * down_e( silu(gate_e(x_m)) * up_e(x_m) ),   e = expert_ids[m, k]

with f32 accumulation; the intermediate h = silu(gate) * up is rounded to x.dtype (bf16 in production).

Weight layout ("planar", made once at load time by ``Int4ExpertWeights.from_compressed_tensors``)
-------------------------------------------------------------------------------------------
compressed-tensors stores a linear W [O, I] as int32 [O, I/8], word j holding columns 8j..8j+7 (nibble n
at bits 4n, value q + 8). We keep int32 words and the same bytes per row, but permute which column
each nibble holds: the I columns are cut into blocks of 8*W columns (W = words per block-row, 32 at
K2.6 dims, i.e. blocks of 256 columns) and

    word (block b, index w), nibble s  <->  column b*8W + s*W + w.

So extracting nibble s from a contiguous [rows, W] tile of words yields the contiguous column slice
[s*W, (s+1)*W) of the block ("nibble plane" s), and with W == G each plane is exactly one scale group.
Scales are stored group-major, [E, I/G, O], so one group's scales for a row block are one contiguous
load. The gate rows and the up rows of w13 (and their scales) are stored permuted by
``join_perm(F, W2)`` (for the "join" design below). ``to_compressed_tensors`` undoes all of it, bit-exact.
The model holds each stack as a ``PlanarInt4`` leaf (experts leading, so expert parallelism splits it);
``Int4ExpertWeights.from_leaves`` joins a layer's two leaves for the kernel without copying.

Kernel (Pallas, Triton backend)
-------------------------------
Routing metadata is computed in XLA (``moe_routing.route_narrow``): the M*K (token, slot) pairs are laid
out by expert and each expert's run is padded to a multiple of T rows, so that a tile of T rows belongs
to one expert (tile_expert[i] = -1 for unused tiles). Activations travel transposed ([D, P], [F, P]) so
the token tile is the N side of the dot and the weights are the M side ("swap AB": one token per expert
wastes no weight reads). Kernel 1 (grid tiles x F/BN1 x split-K) streams gate and up rows of the tile's
expert, does the SiLU*up epilogue and writes h^T [F, P]; kernel 2 (grid tiles x D/BN2 x split-K) streams
down rows and multiplies by the routing weight, writing y^T [D, P] (f32); XLA adds the pair rows into y
[M, D] (and split-K partial sums). No work is done for experts with no tokens. Under expert parallelism
the weights hold experts expert_offset .. expert_offset + E - 1; pairs routed to other experts get no
row. ``routed_experts`` runs the kernel when lowered for CUDA and the twin elsewhere
(``lax.platform_dependent``).

Two inner loops (``design=``), measured on one H200 (experiments/results/bench_moe_h200.md):
  "planes" (default): per 256-column block, eight K=32 dots, one per nibble plane, each scaled in f32 by
      the plane's per-row scale vector (exact post-scaling).
  "join": the eight planes are dequantised *with* their scales (bf16) and interleaved with three levels
      of register joins (stack on a new minor axis + merge) into one [rows, 256] operand whose column
      order is w*8 + s (``join_perm``); one K=256 dot per block. Activations are permuted alike in XLA
      and h comes out of kernel 1 already in kernel 2's order (the w13 row permutation). Slower on the
      H200 (1.7-1.8x at M >= 32): the joined operand's conversion to the dot layout dominates.

Dequantisation modes (``dequant=``): "asm" (GPU only: prmt + lop3 + a bf16x2 fma per two values, the
0x4300 magic-exponent trick; a second fma applies the scale in "join"), "magic" (jnp: nibble | 0x4B000000
bitcast to f32 minus 2^23+8, no int->float conversion), "int" (jnp shifts and an int->float convert).
"magic"/"int" run in interpret mode on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.sharding import NamedSharding, PartitionSpec

from pallas_kernels.moe_routing import check_moe_inputs, route_narrow
from pallas_kernels.tuning import tuning_int

try:  # Triton backend params (present in 0.10.2 and 0.11.x, deprecated in 0.11).
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
    pltriton = None

PACK = 8  # nibbles per int32 word


# ----------------------------------------------------------------------------------------------
# Weight container and the one-time repack
# ----------------------------------------------------------------------------------------------
def _block_words(in_dim: int, group: int) -> int:
    """Words per block-row W: W == group when possible (one scale group per nibble plane), else the
    largest power of two w <= group with group % w == 0 and in_dim % (8w) == 0 (tiny test shapes)."""
    w = group
    while w > 1 and (in_dim % (PACK * w) or group % w):
        w //= 2
    if in_dim % (PACK * w) or group % w:
        raise ValueError(f"in_dim {in_dim} and group {group} admit no planar block")
    return w


def _nibbles(words):
    """int32 [..., n] -> uint32 [..., n, 8] (nibble s at index s)."""
    u = jax.lax.bitcast_convert_type(words, jnp.uint32)
    return (u[..., None] >> (4 * jnp.arange(PACK, dtype=jnp.uint32))) & 0xF


def _pack_nibbles(nib):
    """uint32 [..., n, 8] -> int32 [..., n]."""
    w = jnp.sum(nib << (4 * jnp.arange(PACK, dtype=jnp.uint32)), axis=-1, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(w, jnp.int32)


def join_perm(n: int, bw: int) -> np.ndarray:
    """Column order of a joined operand: position b*8W + w*8 + s holds original column b*8W + s*W + w."""
    c = np.arange(n)
    b, r = c // (PACK * bw), c % (PACK * bw)
    return (b * PACK * bw + (r % PACK) * bw + r // PACK).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("bw",))
def _to_planar(packed, bw: int):
    """compressed-tensors int32 [O, I/8] -> planar int32 [O, I/8] (blocks of bw words)."""
    o, n = packed.shape
    nib = _nibbles(packed).reshape(o, n // bw, PACK, bw)  # canonical column order = (s, w) within block
    return _pack_nibbles(jnp.swapaxes(nib, -1, -2)).reshape(o, n)


@functools.partial(jax.jit, static_argnames=("bw",))
def _from_planar(planar, bw: int):
    o, n = planar.shape
    nib = _nibbles(planar).reshape(o, n // bw, bw, PACK)  # (w, s) -> columns s*bw + w
    return _pack_nibbles(jnp.swapaxes(nib, -1, -2).reshape(o, n, PACK))


def _gate_up_rows(o: int, row_bw: int) -> np.ndarray:
    """Natural row index of each stored row of a gate/up stack of O = 2F rows (``join_perm`` per half)."""
    f = o // 2
    perm = join_perm(f, row_bw)
    return np.concatenate([perm, f + perm]).astype(np.int32)


def _expert_to_planar(packed, scale, *, bw: int, row_bw: int):
    """One expert: compressed-tensors int32 [O, I/8], scale [O, I/G] -> planar [O, I/8], scale [I/G, O]."""
    if row_bw:
        rows = jnp.asarray(_gate_up_rows(packed.shape[0], row_bw))
        packed, scale = packed[rows], scale[rows]
    return _to_planar(packed, bw), scale.T


def _expert_from_planar(planar, scale_gm, *, bw: int, row_bw: int):
    """Inverse of ``_expert_to_planar``."""
    packed, scale = _from_planar(planar, bw), scale_gm.T
    if row_bw:
        inv = jnp.asarray(np.argsort(_gate_up_rows(planar.shape[0], row_bw)).astype(np.int32))
        packed, scale = packed[inv], scale[inv]
    return packed, scale


@functools.partial(jax.jit, static_argnames=("inverse", "bw", "row_bw", "mesh", "axis"))
def _convert_stack(packed, scale, *, inverse: bool, bw: int, row_bw: int, mesh, axis):
    """Converts a stack [E, ...] one expert at a time (lax.map: temporaries of one expert only). A stack
    split along experts over ``mesh`` axis ``axis`` is converted where it lives (shard_map), never gathered."""
    one = functools.partial(_expert_from_planar if inverse else _expert_to_planar, bw=bw, row_bw=row_bw)

    return map_expert_stack(one, packed, scale, mesh=mesh, axis=axis)


def map_expert_stack(one, packed, scale, *, mesh, axis):
    """(packed', scale') = one(packed_e, scale_e) for every expert e of a stack [E, ...], one expert at a
    time (lax.map: temporaries of one expert only); a stack split along experts over ``mesh`` axis
    ``axis`` is converted where it lives (shard_map), never gathered. Call inside jit."""
    def body(p, s):
        return jax.lax.map(lambda a: one(*a), (p, s))

    if mesh is None:
        return body(packed, scale)
    spec = PartitionSpec(axis)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec))(packed, scale)


def _expert_mesh(x):
    """(mesh, mesh axis) when ``x`` is placed by a NamedSharding split along its leading axis, else (None, None)."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and len(sharding.spec) and sharding.spec[0] is not None:
        return sharding.mesh, sharding.spec[0]
    return None, None


@functools.partial(jax.tree_util.register_dataclass, data_fields=["packed", "scale"],
                   meta_fields=["block_words", "row_block_words"])
@dataclasses.dataclass(frozen=True)
class PlanarInt4:
    """One INT4 expert stack (W [E, O, I], PyTorch [out, in] per expert) in the kernel's planar layout.

    packed  int32 [E, O, I/8]  planar nibble order in blocks of ``block_words`` words (module doc)
    scale         [E, I/G, O]  group-major; dtype kept from the checkpoint (bf16 for K2.6)
    row_block_words: 0 for a plain stack (w2); for a gate/up stack (w13, O = 2F, gate rows first) the
    rows of each half are stored in ``join_perm(F, row_block_words)`` order (the down stack's
    block_words), so that kernel 1 writes h in kernel 2's order. The expert axis stays leading, so
    expert-parallel sharding splits both arrays like the compressed-tensors ones.
    """
    packed: jax.Array
    scale: jax.Array
    block_words: int
    row_block_words: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical [E, O, I] (as ``QuantArray.shape``)."""
        return tuple(self.packed.shape[:-1]) + (self.packed.shape[-1] * PACK,)

    @property
    def group_size(self) -> int:
        return self.shape[-1] // self.scale.shape[-2]

    @property
    def nbytes(self) -> int:
        return self.packed.size * 4 + self.scale.size * self.scale.dtype.itemsize

    @classmethod
    def from_compressed_tensors(cls, packed, scale, *, gate_up: bool) -> "PlanarInt4":
        """One-time repack of packed int32 [E, O, I/8], scale [E, O, I/G] (compressed-tensors, stacked
        over experts; ``gate_up``: a w13 stack, gate rows then up rows). Bit-exact inverse:
        ``to_compressed_tensors``. Raises ValueError for shapes or group sizes the layout cannot hold."""
        if getattr(packed, "dtype", None) != jnp.int32 or len(packed.shape) != 3 or len(scale.shape) != 3:
            raise ValueError(f"expected packed int32 [E, O, I/8] and scale [E, O, I/G], got "
                             f"{getattr(packed, 'dtype', type(packed))} {tuple(packed.shape)} and {tuple(scale.shape)}")
        e, o, n = packed.shape
        i = n * PACK
        if tuple(scale.shape[:2]) != (e, o) or i % scale.shape[2]:
            raise ValueError(f"scale {tuple(scale.shape)} does not match packed {tuple(packed.shape)} "
                             f"(in-dim {i} must split into whole scale groups)")
        group = i // scale.shape[2]
        if group % PACK:
            raise ValueError(f"group_size {group} is not a multiple of {PACK}")
        if gate_up and o % 2:
            raise ValueError(f"a gate/up stack needs an even row count, got {o}")
        bw = _block_words(i, group)
        row_bw = _block_words(o // 2, group) if gate_up else 0
        mesh, axis = _expert_mesh(packed)
        planar, scale_gm = _convert_stack(jnp.asarray(packed), jnp.asarray(scale), inverse=False, bw=bw,
                                          row_bw=row_bw, mesh=mesh, axis=axis)
        return cls(packed=planar, scale=scale_gm, block_words=bw, row_block_words=row_bw)

    def to_compressed_tensors(self) -> tuple[jax.Array, jax.Array]:
        """(packed int32 [E, O, I/8], scale [E, O, I/G]) exactly as before the repack."""
        mesh, axis = _expert_mesh(self.packed)
        return _convert_stack(self.packed, self.scale, inverse=True, bw=self.block_words,
                              row_bw=self.row_block_words, mesh=mesh, axis=axis)

    def dequantize_expert(self, e, dtype) -> jax.Array:
        """W_e [O, I] of expert ``e`` (may be traced) in ``dtype``, rows in natural order: the same
        values as dequantising the compressed-tensors layout (``quant.dequantize_int4``)."""
        w = _dequant_planar(self.packed[e], self.scale[e], self.block_words, dtype)
        if self.row_block_words:
            w = w[jnp.asarray(np.argsort(_gate_up_rows(w.shape[0], self.row_block_words)).astype(np.int32))]
        return w


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["w13", "w13_scale", "w2", "w2_scale"],
                   meta_fields=["group_size", "w13_block_words", "w2_block_words"])
@dataclasses.dataclass(frozen=True)
class Int4ExpertWeights:
    """INT4 routed-expert weights of one layer in the kernel's planar layout (the kernel's argument).

    w13        int32 [E, 2F, D/8]   gate rows then up rows, each half in join_perm(F, w2_block_words) order
    w13_scale        [E, D/G, 2F]   group-major scales, rows ordered as w13
    w2         int32 [E, D, F/8]
    w2_scale         [E, F/G, D]
    The model stores the two stacks as ``PlanarInt4`` leaves (``leaves`` / ``from_leaves``, no copy).
    """
    w13: jax.Array
    w13_scale: jax.Array
    w2: jax.Array
    w2_scale: jax.Array
    group_size: int = 32
    w13_block_words: int = 32
    w2_block_words: int = 32

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def d_model(self) -> int:
        return self.w2.shape[1]

    @property
    def d_ff(self) -> int:
        return self.w13.shape[1] // 2

    @classmethod
    def from_leaves(cls, w13: PlanarInt4, w2: PlanarInt4) -> "Int4ExpertWeights":
        """One layer's weights from its gate/up and down stacks in kernel layout (no copy)."""
        if not (isinstance(w13, PlanarInt4) and isinstance(w2, PlanarInt4)):
            raise TypeError(f"expected two PlanarInt4 stacks, got {type(w13).__name__} and {type(w2).__name__}")
        e, two_f, d = w13.shape
        if (w2.shape != (e, d, two_f // 2) or not w13.row_block_words or w2.row_block_words
                or w13.row_block_words != w2.block_words or w13.group_size != w2.group_size):
            raise ValueError(f"w13 {w13.shape} (row blocks {w13.row_block_words}) and w2 {w2.shape} "
                             f"(row blocks {w2.row_block_words}) are not one layer's gate/up and down stacks")
        return cls(w13=w13.packed, w13_scale=w13.scale, w2=w2.packed, w2_scale=w2.scale,
                   group_size=w13.group_size, w13_block_words=w13.block_words, w2_block_words=w2.block_words)

    def leaves(self) -> tuple[PlanarInt4, PlanarInt4]:
        """(w13, w2) as PlanarInt4 stacks (no copy)."""
        return (PlanarInt4(self.w13, self.w13_scale, self.w13_block_words, self.w2_block_words),
                PlanarInt4(self.w2, self.w2_scale, self.w2_block_words))

    @classmethod
    def from_compressed_tensors(cls, w13_packed, w13_scale, w2_packed, w2_scale) -> "Int4ExpertWeights":
        """One-time repack. w13_packed int32 [E, 2F, D/8], w13_scale [E, 2F, D/G], w2_packed int32
        [E, D, F/8], w2_scale [E, D, F/G] (compressed-tensors layout, stacked over experts)."""
        return cls.from_leaves(PlanarInt4.from_compressed_tensors(w13_packed, w13_scale, gate_up=True),
                               PlanarInt4.from_compressed_tensors(w2_packed, w2_scale, gate_up=False))

    def to_compressed_tensors(self):
        """Inverse of ``from_compressed_tensors``: (w13_packed, w13_scale, w2_packed, w2_scale)."""
        w13, w2 = self.leaves()
        return (*w13.to_compressed_tensors(), *w2.to_compressed_tensors())

    def _w13_row_inverse(self):
        """Stored w13 row index of each natural (gate 0..F-1, up F..2F-1) row."""
        return jnp.asarray(np.argsort(_gate_up_rows(2 * self.d_ff, self.w2_block_words)).astype(np.int32))

    def nbytes_per_expert(self) -> int:
        return sum(a[0].size * a.dtype.itemsize for a in (self.w13, self.w13_scale, self.w2, self.w2_scale))


def kernel_tiling_error(weights: Int4ExpertWeights) -> str | None:
    """Why the GPU kernel cannot take these weights, or None when it can.

    The kernel is built (and measured) for group-32 scales; its per-plane dots need planar blocks of
    >= 16 words, i.e. D and F multiples of 128 (256 for one scale group per nibble plane, as at K2.6).
    """
    if weights.group_size != 32:
        return f"group_size {weights.group_size}: the INT4 GPU kernel takes group-32 scales only"
    if min(weights.w13_block_words, weights.w2_block_words) < 16:
        return (f"D={weights.d_model}, F={weights.d_ff}: planar blocks of {weights.w13_block_words}/"
                f"{weights.w2_block_words} words, the GPU kernel's dots need >= 16 (D and F multiples of 128)")
    return None


def _dequant_planar(planar, scale_gm, bw: int, dtype):
    """planar int32 [O, I/8], group-major scale [I/G, O] -> W [O, I] in ``dtype`` (canonical order)."""
    o, n = planar.shape
    nib = _nibbles(planar).reshape(o, n // bw, bw, PACK)
    q = jnp.swapaxes(nib, -1, -2).reshape(o, n * PACK).astype(jnp.int32) - 8
    s = jnp.swapaxes(scale_gm, 0, 1).astype(jnp.float32)  # [O, I/G]
    w = q.reshape(o, s.shape[1], -1).astype(jnp.float32) * s[:, :, None]
    return w.reshape(o, n * PACK).astype(dtype)


# ----------------------------------------------------------------------------------------------
# Tile size and the combine (XLA), shared by kernel and twin
# ----------------------------------------------------------------------------------------------
def default_tile(m: int, k: int, e: int, smallest: int = 16, largest: int = 64) -> int:
    """Tokens per tile: about the mean pairs per active expert, a power of two in [smallest, largest]
    (``smallest`` when there are no pairs)."""
    busy = min(e, m * k)
    mean = m * k / busy if busy else 0.0
    return int(min(largest, max(smallest, 1 << max(0, math.ceil(math.log2(max(mean, 1.0)))))))


def _combine(y_rows, row_token, m: int, dtype):
    """y_rows f32 [P, D] (already weighted) -> y [M, D]: sum of each token's pair rows."""
    y = jnp.zeros((m + 1, y_rows.shape[-1]), jnp.float32).at[row_token].add(y_rows)
    return y[:m].astype(dtype)


# ----------------------------------------------------------------------------------------------
# Pure-JAX twin (also the CPU production path)
# ----------------------------------------------------------------------------------------------
DEQUANT_MODES = ("asm", "magic", "int")
PROBES = ("", "dq_once", "no_dot", "glue")


def _kernel_tiling(m: int, k: int, weights: Int4ExpertWeights, tile, block_n1, block_n2, split1, split2,
                   design: str, dequant, probe: str) -> tuple[int, int, int, int, int]:
    """``int4_moe``'s tiling, checked: (T tokens per tile, gate/up rows and down rows per program, split1, split2).
    A row block left None is the largest power of two <= 64 dividing its dimension (F, or D), so weights that
    only the twin can take (``kernel_tiling_error``) tile too."""
    if design not in ("join", "planes"):
        raise ValueError(f"unknown design {design!r}")
    if dequant is not None and dequant not in DEQUANT_MODES:
        raise ValueError(f"unknown dequant mode {dequant!r}; expected None or one of {DEQUANT_MODES}")
    if probe not in PROBES:
        raise ValueError(f"unknown probe {probe!r}; expected one of {PROBES}")
    e_n, f, d = weights.num_experts, weights.d_ff, weights.d_model
    t = default_tile(m, k, e_n) if tile is None else tuning_int("tile", tile, positive=True)
    bn1 = math.gcd(f, 64) if block_n1 is None else tuning_int("block_n1", block_n1, positive=True)
    bn2 = math.gcd(d, 64) if block_n2 is None else tuning_int("block_n2", block_n2, positive=True)
    if f % bn1:
        raise ValueError(f"block_n1={bn1} must divide F={f}")
    if d % bn2:
        raise ValueError(f"block_n2={bn2} must divide D={d}")
    blocks1, blocks2 = d // (PACK * weights.w13_block_words), f // (PACK * weights.w2_block_words)
    busy = min(e_n, m * k)  # tiles expected to have work
    s1 = _default_split(busy * (f // bn1), blocks1) if split1 is None else tuning_int("split1", split1, positive=True)
    s2 = _default_split(busy * (d // bn2), blocks2) if split2 is None else tuning_int("split2", split2, positive=True)
    if blocks1 % s1:
        raise ValueError(f"split1={s1} must divide the {blocks1} K-blocks of the gate/up GEMM")
    if blocks2 % s2:
        raise ValueError(f"split2={s2} must divide the {blocks2} K-blocks of the down GEMM")
    return t, bn1, bn2, s1, s2


def int4_moe_ref(x, expert_ids, expert_weights, weights: Int4ExpertWeights, *, interpret: bool = False,
                 tile: int | None = None, block_n1: int | None = None, block_n2: int | None = None, num_warps: int = 4,
                 num_stages: int = 3, split1: int | None = None, split2: int | None = None,
                 dequant: str | None = None, design: str = "planes", probe: str = "",
                 expert_offset: int | jax.Array = 0, out_dtype=None):
    """XLA twin of ``int4_moe``, same signature: same routing and tiling, one loop step per non-empty tile; an
    expert's weights are dequantised once per run of tiles (cached in the loop carry), never for idle experts.

    x [M, D], expert_ids int32 [M, K] (global ids), expert_weights f32 [M, K] -> y [M, D] in
    ``out_dtype`` (default x.dtype; the sum over experts is f32 either way). ``weights`` hold experts
    expert_offset .. expert_offset + E - 1; pairs routed elsewhere contribute nothing. The kernel's tuning
    (``block_n*``, ``split*``, ``design``) is checked as the kernel checks it and does not change the result
    (nor do ``interpret``, ``num_warps``, ``num_stages``, a known ``dequant``); a ``probe``, wrong on purpose, is
    refused. M = 0 tokens give y [0, D].
    """
    del interpret, num_warps, num_stages
    m, d, k = check_moe_inputs(x, expert_ids, expert_weights, weights.d_model)
    e_n, f = weights.num_experts, weights.d_ff
    t = _kernel_tiling(m, k, weights, tile, block_n1, block_n2, split1, split2, design, dequant, probe)[0]
    if probe:
        raise ValueError(f"probe={probe!r} times a kernel that computes something else on purpose; the twin has none")
    if m == 0:
        return jnp.zeros((0, d), out_dtype or x.dtype)
    row_token, row_weight, tile_expert, num_tiles, _ = route_narrow(expert_ids - expert_offset, expert_weights, e_n, t)
    x_pad = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])[row_token]  # [P, D]
    dt = x.dtype

    inv = weights._w13_row_inverse()

    def deq(e):
        w13 = _dequant_planar(weights.w13[e], weights.w13_scale[e], weights.w13_block_words, dt)[inv]
        w2 = _dequant_planar(weights.w2[e], weights.w2_scale[e], weights.w2_block_words, dt)
        return w13, w2

    def body(i, carry):
        y, prev_e, w13, w2 = carry
        e = tile_expert[i]
        w13, w2 = jax.lax.cond(e != prev_e, lambda: deq(e), lambda: (w13, w2))
        xt = jax.lax.dynamic_slice_in_dim(x_pad, i * t, t)  # [T, D]
        gu = jnp.dot(xt, w13.T, preferred_element_type=jnp.float32)  # [T, 2F]
        g, u = gu[:, :f], gu[:, f:]
        h = (g * jax.nn.sigmoid(g) * u).astype(dt)
        yt = jnp.dot(h, w2.T, preferred_element_type=jnp.float32)  # [T, D]
        yt = yt * jax.lax.dynamic_slice_in_dim(row_weight, i * t, t)[:, None]
        y = y.at[jax.lax.dynamic_slice_in_dim(row_token, i * t, t)].add(yt)
        return y, e, w13, w2

    init = (jnp.zeros((m + 1, d), jnp.float32), jnp.int32(-1),
            jnp.zeros((2 * f, d), dt), jnp.zeros((d, f), dt))
    y = jax.lax.fori_loop(0, num_tiles, body, init)[0]
    return y[:m].astype(out_dtype or dt)


# ----------------------------------------------------------------------------------------------
# Pallas kernels (Triton backend)
# ----------------------------------------------------------------------------------------------
def _asm_plane(words, s: int, scale=None):
    """GPU: nibble plane s of int32 words [R, W] -> bf16 [R, W]: q in [-8, 7], times scale [R, W] if given.

    Two words per asm instance: prmt gathers byte s//2 of each word into halves 0 and 1 (shift by 4 for
    odd s), lop3 keeps the nibbles and ORs in bf16 128.0, a bf16x2 fma subtracts 136 (exact), a second
    fma multiplies by the scale pair (one rounding of the exact product, as a bf16 dequantisation)."""
    bi = s // 2
    sel = bi | (bi << 4) | ((4 + bi) << 8) | ((4 + bi) << 12)
    shift = "shr.b32 t, t, 4;" if s % 2 else ""
    tail = ("fma.rn.bf16x2 t, t, one, bias; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, t, $3, z; }"
            if scale is not None else "fma.rn.bf16x2 $0, t, one, bias; }")
    asm = ("{ .reg .b32 t, one, bias, z; "
           f"prmt.b32 t, $1, $2, {sel:#06x}; {shift} "
           "lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; "
           "mov.b32 one, 0x3F803F80; mov.b32 bias, 0xC308C308; " + tail)
    args = [words] if scale is None else [words, scale]
    [out] = pltriton.elementwise_inline_asm(
        asm, args=args, constraints="=r,r,r" + (",r" if scale is not None else ""), pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.bfloat16)])
    return out


def _plane(words, s: int, mode: str, dtype, scale=None):
    """Nibble plane s of int32 words [R, W] as dtype values q = nibble - 8 (times scale [R] if given)."""
    if mode == "asm":
        if scale is None:
            return _asm_plane(words, s).astype(dtype)
        sc = jnp.broadcast_to(scale.astype(jnp.bfloat16)[:, None], words.shape)
        return _asm_plane(words, s, sc).astype(dtype)
    nib = jax.lax.shift_right_logical(words, jnp.int32(4 * s)) & 0xF if s else words & 0xF
    if mode == "magic":
        q = jax.lax.bitcast_convert_type(nib | 0x4B000000, jnp.float32) - jnp.float32(8388616.0)
    elif mode == "int":
        q = (nib - 8).astype(jnp.float32)
    else:
        raise ValueError(f"unknown dequant mode {mode!r}")
    if scale is not None:
        q = q * scale.astype(jnp.float32)[:, None]
    return q.astype(dtype)


def _join8(planes):
    """8 planes [R, W] -> [R, 8W] with column w*8 + s holding planes[s][:, w] (three levels of joins)."""
    r, w = planes[0].shape

    def join(a, b):  # [R, n] x2 -> [R, 2n], column 2c + i from (a, b)[i][:, c]
        return jnp.stack([a, b], axis=-1).reshape(r, 2 * a.shape[1])

    l1 = {(j, k): join(planes[2 * j + k], planes[4 + 2 * j + k]) for j in (0, 1) for k in (0, 1)}
    l2 = {k: join(l1[(0, k)], l1[(1, k)]) for k in (0, 1)}
    return join(l2[0], l2[1])


def _stream_rows(w_ref, s_ref, a_ref, e, row0, col0, nrows: int, in_dim: int, bw: int, group: int,
                 t: int, mode: str, dtype, acc_rows: tuple[int, ...], probe: str, split: int = 1, part=0,
                 design: str = "planes"):
    """acc[j] [nrows, T] f32 = W_e[row0 + acc_rows[j] + (0..nrows)] @ A[:, col0:col0+T] over in_dim (or over
    its part ``part`` of ``split`` equal parts of whole blocks: split-K).

    w_ref int32 [E, O, I/8] planar, s_ref [E, I/G, O] group-major, a_ref [I, P] transposed activations
    (rows in ``join_perm`` order for design "join", natural order for "planes").
    probe (benchmark only, wrong results): "dq_once" dequantises one plane per block and reuses it for all
    8; "no_dot" replaces the dot by a row sum of the operand.
    """
    nblk = in_dim // (PACK * bw) // split

    def body(b, accs):
        b = b + part * nblk
        accs = list(accs)
        words = [w_ref[e, pl.ds(row0 + r, nrows), pl.ds(b * bw, bw)] for r in acc_rows]  # [R, W] int32
        if design == "join":
            a = a_ref[pl.ds(b * PACK * bw, PACK * bw), pl.ds(col0, t)].astype(dtype)  # [8W, T]
            for j, r in enumerate(acc_rows):
                planes = []
                for s in range(PACK):
                    sc = s_ref[e, (b * PACK * bw + s * bw) // group, pl.ds(row0 + r, nrows)]  # [R]
                    if probe == "dq_once" and s:
                        planes.append(planes[0])
                    else:
                        planes.append(_plane(words[j], s, mode, dtype, sc))
                op = _join8(planes)  # [R, 8W]
                if probe == "no_dot":
                    accs[j] = accs[j] + jnp.sum(op.astype(jnp.float32), axis=1, keepdims=True)
                else:
                    accs[j] = accs[j] + jnp.dot(op, a, preferred_element_type=jnp.float32)
            return tuple(accs)
        q0 = [None] * len(acc_rows)
        for s in range(PACK):  # design "planes": one K=W dot per plane, f32 post-scaling
            a = a_ref[pl.ds(b * PACK * bw + s * bw, bw), pl.ds(col0, t)].astype(dtype)  # [W, T], shared
            g = (b * PACK * bw + s * bw) // group
            for j, r in enumerate(acc_rows):
                if probe == "dq_once":
                    q0[j] = _plane(words[j], 0, mode, dtype) if q0[j] is None else q0[j]
                    q = q0[j]
                else:
                    q = _plane(words[j], s, mode, dtype)
                pdot = jnp.dot(q, a, preferred_element_type=jnp.float32)  # [R, T]
                sc = s_ref[e, g, pl.ds(row0 + r, nrows)].astype(jnp.float32)  # [R]
                accs[j] = accs[j] + pdot * sc[:, None]
        return tuple(accs)

    init = tuple(jnp.zeros((nrows, t), jnp.float32) for _ in acc_rows)
    return jax.lax.fori_loop(0, nblk, body, init)


def _gate_up_kernel(te_ref, x_ref, w_ref, s_ref, h_ref, *, f, d, bn, t, bw, group, mode, dtype, probe, split,
                    design):
    i, j = pl.program_id(0), pl.program_id(1)
    part = pl.program_id(2) if split > 1 else 0
    e = te_ref[i]

    @pl.when(e >= 0)
    def _():
        g, u = _stream_rows(w_ref, s_ref, x_ref, e, j * bn, i * t, bn, d, bw, group, t, mode, dtype,
                            (0, f), probe, split, part, design)
        if split == 1:  # fused SiLU*up epilogue; h^T [F, P]
            h = g / (1.0 + jnp.exp(-g)) * u
            h_ref[pl.ds(j * bn, bn), pl.ds(i * t, t)] = h.astype(h_ref.dtype)
        else:  # split-K partial sums [S, 2, F, P] f32, epilogue in XLA
            h_ref[part, 0, pl.ds(j * bn, bn), pl.ds(i * t, t)] = g
            h_ref[part, 1, pl.ds(j * bn, bn), pl.ds(i * t, t)] = u


def _down_kernel(te_ref, rw_ref, h_ref, w_ref, s_ref, y_ref, *, f, bn, t, bw, group, mode, dtype, probe, split,
                 design):
    i, j = pl.program_id(0), pl.program_id(1)
    part = pl.program_id(2) if split > 1 else 0
    e = te_ref[i]

    @pl.when(e >= 0)
    def _():
        (acc,) = _stream_rows(w_ref, s_ref, h_ref, e, j * bn, i * t, bn, f, bw, group, t, mode, dtype,
                              (0,), probe, split, part, design)
        rw = rw_ref[pl.ds(i * t, t)]
        y_ref[part, pl.ds(j * bn, bn), pl.ds(i * t, t)] = acc * rw[None, :]


def _default_split(programs: int, nblk: int, target: int = 528) -> int:
    """Smallest split-K factor (a divisor of the block count) giving >= target programs (4 per SM)."""
    for sp in range(1, nblk + 1):
        if nblk % sp == 0 and programs * sp >= target:
            return sp
    return nblk


def int4_moe(x, expert_ids, expert_weights, weights: Int4ExpertWeights, *, interpret: bool = False,
             tile: int | None = None, block_n1: int | None = None, block_n2: int | None = None, num_warps: int = 4,
             num_stages: int = 3, split1: int | None = None, split2: int | None = None,
             dequant: str | None = None, design: str = "planes", probe: str = "",
             expert_offset: int | jax.Array = 0, out_dtype=None):
    """Routed experts with the Pallas kernels. Same contract as ``int4_moe_ref``.

    x [M, D] (bf16; f32 allowed in interpret mode), expert_ids int32 [M, K] (global ids), expert_weights
    f32 [M, K], weights: Int4ExpertWeights of experts expert_offset .. expert_offset + E - 1 -> y [M, D]
    in ``out_dtype`` (default x.dtype).

    Tuning: tile (T, tokens per tile; default from M), block_n1 (gate/up rows per program, each of gate
    and up), block_n2 (down rows per program; both default to the largest power of two <= 64 dividing F,
    resp. D), num_warps, num_stages, split1/split2 (split-K factors of
    the two GEMMs, dividing their 256-column block counts; default: smallest giving >= 528 programs;
    partial sums are added in XLA), dequant ("asm" on GPU, "magic" in interpret mode by default), probe
    (benchmark only, wrong results: "dq_once" dequantises one nibble plane per block, "no_dot" replaces
    the dots by row sums, "glue" runs only the XLA routing/gather/combine), design ("planes": eight K=32
    dots per 256-column block with f32 post-scaling, the default; "join": one K=256 dot per block on the
    joined, pre-scaled planes, slower on the H200).
    """
    m, d, k = check_moe_inputs(x, expert_ids, expert_weights, weights.d_model)
    e_n, f, grp = weights.num_experts, weights.d_ff, weights.group_size
    t, bn1, bn2, s1, s2 = _kernel_tiling(m, k, weights, tile, block_n1, block_n2, split1, split2, design, dequant,
                                         probe)
    mode = dequant or ("magic" if interpret else "asm")
    if interpret and mode == "asm":
        raise ValueError("dequant='asm' needs a GPU (inline PTX); use 'magic' or 'int' in interpret mode")
    if m == 0:
        return jnp.zeros((0, d), out_dtype or x.dtype)
    dt = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    row_token, row_weight, tile_expert, _, _ = route_narrow(expert_ids - expert_offset, expert_weights, e_n, t)
    nt = tile_expert.shape[0]
    p = nt * t
    bw13, bw2 = weights.w13_block_words, weights.w2_block_words
    x_pad = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])
    if design == "join":  # activations in the joined column order (one gather)
        x_t = x_pad[row_token[:, None], jnp.asarray(join_perm(d, bw13))[None, :]].T  # [D, P]
    else:
        x_t = x_pad[row_token].T
    params = None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    common = dict(t=t, group=grp, mode=mode, dtype=dt, probe=probe, design=design)
    if probe == "glue":  # benchmark only: the XLA routing/gather/combine around the kernels, no kernels
        h_t = (x_t[:f] * 0).astype(x.dtype) if d >= f else jnp.zeros((f, p), x.dtype)
        y_t = (x_t * tile_expert.sum()).astype(jnp.float32)[None]
        return _combine(y_t.sum(0).T, row_token, m, out_dtype or x.dtype)

    h_shape = (f, p) if s1 == 1 else (s1, 2, f, p)
    h_t = pl.pallas_call(
        functools.partial(_gate_up_kernel, f=f, d=d, bn=bn1, bw=bw13, split=s1, **common),
        out_shape=jax.ShapeDtypeStruct(h_shape, x.dtype if s1 == 1 else jnp.float32),
        grid=(nt, f // bn1, s1), interpret=interpret, compiler_params=params,
        name="int4_moe_gate_up",
    )(tile_expert, x_t, weights.w13, weights.w13_scale)
    if s1 > 1:
        gu = h_t.sum(0)
        h_t = (gu[0] * jax.nn.sigmoid(gu[0]) * gu[1]).astype(x.dtype)
    if design == "planes":  # h comes out in the stored (joined) row order: back to natural for "planes"
        h_t = h_t[jnp.asarray(np.argsort(join_perm(f, bw2)))]

    y_t = pl.pallas_call(
        functools.partial(_down_kernel, f=f, bn=bn2, bw=bw2, split=s2, **common),
        out_shape=jax.ShapeDtypeStruct((s2, d, p), jnp.float32),
        grid=(nt, d // bn2, s2), interpret=interpret, compiler_params=params,
        name="int4_moe_down",
    )(tile_expert, row_weight, h_t, weights.w2, weights.w2_scale)
    return _combine(y_t.sum(0).T, row_token, m, out_dtype or x.dtype)


def routed_experts(x, expert_ids, expert_weights, weights: Int4ExpertWeights, *,
                   expert_offset: int | jax.Array = 0, out_dtype=None, interpret: bool = False, **tuning):
    """Dispatcher: the Pallas kernel when lowered for CUDA, the XLA twin on any other platform.

    Same contract as ``int4_moe_ref``. The choice is made per lowering platform
    (``lax.platform_dependent``), not from environment or global state, so one jitted program runs on a
    CPU host and on the H200. Activations other than bf16, and weights the kernel cannot tile
    (``kernel_tiling_error``), run the twin on every platform. ``interpret=True`` forces the kernel
    through the Pallas interpreter on every platform (tests); ``tuning`` goes to ``int4_moe`` and to the
    twin, which checks it as the kernel does on every platform.
    """
    kw = dict(out_dtype=out_dtype)
    offset = jnp.asarray(expert_offset, jnp.int32)
    if interpret:
        return int4_moe(x, expert_ids, expert_weights, weights, interpret=True, expert_offset=offset, **kw, **tuning)
    if x.dtype != jnp.bfloat16 or kernel_tiling_error(weights) is not None:
        return int4_moe_ref(x, expert_ids, expert_weights, weights, expert_offset=offset, **kw, **tuning)
    return jax.lax.platform_dependent(
        x, expert_ids, expert_weights, weights, offset,
        cuda=lambda *a: int4_moe(*a[:4], expert_offset=a[4], **kw, **tuning),
        default=lambda *a: int4_moe_ref(*a[:4], expert_offset=a[4], **kw, **tuning))
