"""In-kernel building blocks of the two Mosaic GPU attention kernels, ``mla_attention_mgpu.split_attention``
(64-row tiles) and ``mla_attention_narrow.split_attention_narrow`` (the keys as wgmma's M).

* the producer's ring of key blocks (:func:`stream_key_blocks`) and the kinds of key block it serves;
* masking: a partial block's value rows zeroed (:func:`zero_rows_from`), a tree block's scores masked by the
  mask words (:func:`mask_tree_scores`);
* the "swapped" consumer steps with the keys as wgmma's M (:func:`swapped_scores`, :func:`swapped_softmax`,
  :func:`store_swapped_output`): the narrow kernel's whole loop and the 64-row kernel's tail rows;
* Mosaic GPU's on-device profiler: the regions the kernels name (``PROFILE_REGIONS``), which of them are
  recorded (:func:`region_scope`) and the buffer's size check (:func:`profiler_params`).

Dimension letters: BK keys per block, C latent+rope width, L value width, V query rows of a program.
Functions documented "inside a kernel" are traced inside a ``plgpu.kernel`` body only.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mla_kernel_inputs import WORD
from pallas_kernels.tree_attention import _LN2

try:  # Mosaic GPU Pallas (in the JAX versions this repo supports; guarded for clarity); both kernels import it here
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

__all__ = ["plgpu", "stream_key_blocks", "zero_rows_from", "mask_tree_scores", "swapped_scores", "swapped_softmax",
           "store_swapped_output", "async_proxy_fence", "profiler_params", "region_scope", "PROFILE_REGIONS",
           "PROFILE_REGION_BYTES", "WHOLE", "PARTIAL", "TREE", "MASKED", "WORD", "SMEM_LIMIT"]

SMEM_LIMIT = 227 * 1024  # the H200's shared memory a program may take
MASKED = -1e30           # masked score (log2 units): finite (``mla_attention_mgpu``'s module docstring)
WHOLE, PARTIAL, TREE = range(3)  # the kinds of key block: a whole cache block, the partial one, a tree block
PROFILE_REGION_BYTES = 16  # Mosaic GPU's profiler: per region and warpgroup, two events of two 32-bit words
PROFILE_REGIONS = ("q_wait", "k_wait", "scores", "softmax", "handoff", "p_wait", "pv", "tail_scores", "tail_softmax",
                   "epilogue", "normalize", "store_smem", "store_gmem", "slot_wait",
                   "peer_wait", "peer_lse", "peer_copy", "merge")  # every region a kernel names


def profiler_params(profile_dir, profile_regions: int, smem: int, warpgroups: int, name: str,
                    profile_names=None) -> dict:
    """The CompilerParams entries of Mosaic GPU's on-device profiler (none without ``profile_dir``), or a
    ValueError: ``profile_dir`` and ``profile_regions`` go together, and the profiler's buffer
    (PROFILE_REGION_BYTES per region and warpgroup, after the kernel's ``smem`` bytes rounded to 8) must fit
    in shared memory. ``profile_names`` (with ``profile_dir`` only) must name regions of PROFILE_REGIONS."""
    if (profile_dir is None) != (profile_regions <= 0):
        raise ValueError(f"{name}: profile_dir={profile_dir!r} and profile_regions={profile_regions} go together")
    if profile_names is not None:
        if profile_dir is None:
            raise ValueError(f"{name}: profile_names={profile_names!r} needs profile_dir")
        if isinstance(profile_names, str) or not set(profile_names) <= set(PROFILE_REGIONS):
            raise ValueError(f"{name}: profile_names={profile_names!r} must be a collection of {PROFILE_REGIONS}")
    if profile_dir is None:
        return {}
    start, per_region = -(-smem // 8) * 8, PROFILE_REGION_BYTES * warpgroups
    if start + per_region * profile_regions > SMEM_LIMIT:
        raise ValueError(f"{name}: profiling {profile_regions} regions a warpgroup needs "
                         f"{start + per_region * profile_regions} bytes of shared memory (limit {SMEM_LIMIT}); "
                         f"beside this kernel's {smem} at most {max(0, (SMEM_LIMIT - start) // per_region)} fit")
    return dict(profile_space=int(profile_regions), profile_dir=str(profile_dir))


def region_scope(profile_names=None):
    """name -> the context of one region for Mosaic GPU's profiler: ``jax.named_scope(name)``, or no region when
    ``profile_names`` (a diagnostic: fewer regions fit the few spare bytes of shared memory) leaves the name out."""
    def scope(name: str):
        return jax.named_scope(name) if profile_names is None or name in profile_names else contextlib.nullcontext()
    return scope


def stream_key_blocks(kv_ref, tkv_ref, b, lo, nb, n_cache, n_all, k_smem, k_bars, consumed_bars, stages: int,
                      block_k: int, on_tree_block=None, first_block_alone: bool = False, region=jax.named_scope):
    """A producer warpgroup's ring of key blocks, inside a Mosaic GPU kernel: step j in [0, n_cache) copies
    cache block lo + j of stream b, step j in [n_cache, n_all) tree block t = lo + j - nb (``nb`` = the cache
    blocks read), each into slot j % stages (``k_smem``, arriving on ``k_bars``) once the consumers have freed
    it (``consumed_bars``); ``on_tree_block(t, slot)`` issues a tree block's further copies (its mask words).
    A cache block may reach past the cache's S rows: the TMA unit fills those rows with zeros.

    ``first_block_alone``: the second block's copy waits until the first has landed, so that when every program
    starts at once the first blocks are not served interleaved with the second ones (``split_attention``).
    ``region``: the context of the profiler's region ``slot_wait`` (``region_scope``)."""
    @pl.loop(0, n_all)
    def _(j):
        slot = lax.rem(j, stages)
        if first_block_alone:
            @pl.when(j == 1)
            def _():
                plgpu.barrier_wait(k_bars.at[0])

        @pl.when(j >= stages)
        def _():
            with region("slot_wait"):  # a region for Mosaic GPU's profiler, where it is on
                plgpu.barrier_wait(consumed_bars.at[slot])

        @pl.when(j < n_cache)
        def _():
            plgpu.copy_gmem_to_smem(kv_ref.at[b, pl.ds((lo + j) * block_k, block_k)], k_smem.at[slot],
                                    k_bars.at[slot])

        @pl.when(j >= n_cache)
        def _():
            t = lo + j - nb
            plgpu.copy_gmem_to_smem(tkv_ref.at[b, pl.ds(t * block_k, block_k)], k_smem.at[slot], k_bars.at[slot])
            if on_tree_block is not None:
                on_tree_block(t, slot)


def zero_rows_from(block_ref, first_row, rows: int):
    """Inside a kernel's consumer warpgroup: rows [first_row, rows) of a [rows, 64 k] swizzled bf16 block in
    shared memory set to zero (64 columns at a time), then fenced for the tensor cores' reads."""
    row = plgpu.broadcasted_iota(jnp.int32, (rows, 64), 0, layout=plgpu.Layout.WGMMA)
    for c in range(block_ref.shape[1] // 64):
        chunk = block_ref.at[:, pl.ds(c * 64, 64)]
        chunk[...] = jnp.where(row < first_row, chunk[...], jnp.zeros((), block_ref.dtype))
    plgpu.commit_smem()


def mask_tree_scores(s, key, row_word, row_dim: int):
    """Inside a kernel: one tree block's scores ``s`` with every key its query row may not see set to MASKED.
    ``key``: each score's key index in the block; ``row_word(w)``: word w of each row's mask bits (key k is
    bit k % 32 of word k // 32), a vector along axis ``row_dim`` of s."""
    word = None
    for w in range(s.shape[1 - row_dim] // WORD):  # the word holding each key's bit, per query row
        ww = lax.broadcast_in_dim(row_word(w), s.shape, [row_dim])
        word = ww if word is None else jnp.where(key >= w * WORD, ww, word)
    seen = lax.shift_right_logical(word, key & (WORD - 1)) & 1
    return jnp.where(seen != 0, s, MASKED)


def swapped_scores(k_block, q_smem, kind, rem, scale_log2, row_words=None, after_qk=None):
    """Inside a consumer warpgroup, the keys as wgmma's M: sᵀ [BK, V] = k·qᵀ in log2 units for the V query rows
    ``q_smem`` [V, C] over the key block ``k_block`` [BK, C] (both in shared memory), masked for a PARTIAL block
    (keys from ``rem`` on) or a TREE block (``row_words()`` loads its mask words, one [V] vector per word, before
    the product, so that the loads overlap it). ``after_qk`` runs once the product is read."""
    BK, V = k_block.shape[0], q_smem.shape[0]
    words = row_words() if kind == TREE else None

    def qk(s_ref):
        plgpu.wgmma(s_ref, k_block, plgpu.transpose_ref(q_smem, (1, 0)))
        return s_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((BK, V), jnp.float32)) * scale_log2
    if after_qk is not None:
        after_qk()
    key = plgpu.broadcasted_iota(jnp.int32, (BK, V), 0, layout=plgpu.Layout.WGMMA)
    if kind == WHOLE:
        return s
    if kind == PARTIAL:
        return jnp.where(key < rem, s, MASKED)
    return mask_tree_scores(s, key, words.__getitem__, row_dim=1)


def swapped_softmax(s, m, l, p_smem):
    """Inside a consumer warpgroup: the online-softmax update for sᵀ [BK, V] (log2 units), reducing over the keys
    (its rows, across the warpgroup's warps). m [V] the running max, l [BK, V] the running denominators (summed
    over the keys only after the last block). Writes pᵀ (bf16) into ``p_smem`` [V, BK] and returns (m, alpha, l)."""
    m_new = jnp.maximum(m, s.max(axis=0))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [1]))
    l = l * lax.broadcast_in_dim(alpha, l.shape, [1]) + p
    p_smem.transpose((1, 0))[...] = plgpu.layout_cast(p.astype(jnp.bfloat16), plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    return m_new, alpha, l


def store_swapped_output(acc, m, l, o_smem, lse_smem, region=jax.named_scope):
    """Inside a consumer warpgroup: oᵀ [L, V] (the keys as wgmma's M) normalised by the denominators l [BK, V]
    into ``o_smem`` [V, L] (bf16) and the LSE (natural log) into ``lse_smem`` [V]; a row that saw only masked
    keys is empty (0 and -inf). ``region``: the context of the profiler's regions (``region_scope``)."""
    with region("normalize"):
        l = jnp.where(m < 0.5 * MASKED, 0.0, l.sum(axis=0))
        empty = l == 0.0
        inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
        o = acc * lax.broadcast_in_dim(inv, acc.shape, [1])
    with region("store_smem"):
        o_smem.transpose((1, 0))[...] = plgpu.layout_cast(o.astype(jnp.bfloat16), plgpu.Layout.WGMMA_TRANSPOSED)
        lse_smem[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * _LN2)
        plgpu.commit_smem()


def async_proxy_fence():
    """Inside a kernel: ``fence.proxy.async.global`` in every thread, which orders a thread's global-memory
    accesses through the TMA unit (the async proxy) with its ordinary ones. A program that hands data it wrote
    with TMA copies to another program through a semaphore runs it between its copies' completion and the signal;
    the receiver, between its wait and the TMA copies that read the data."""
    @plgpu.inline_mgpu()
    def fence(ctx):
        del ctx
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.proxy.async.global;", "", has_side_effects=True)

    fence()
