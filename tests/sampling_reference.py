"""A plain float64 reference for truncated sampling (``ddtree_jax.sampling``), shared by the sampling, tree and
engine tests."""

import numpy as np


def truncated_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """What sampling draws from, one row [W], in float64: softmax over the tokens kept after the temperature by
    top-k (the top_k largest, ties with the last one kept), then top-p (the fewest likeliest tokens whose mass
    reaches top_p, ties with the last one kept), then min-p (the tokens at least min_p times as likely as the
    likeliest)."""
    z = np.asarray(logits, np.float64) / temperature
    keep = np.ones(z.shape, bool)
    if top_k:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    if top_p < 1:
        p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        p /= p.sum()
        ranked = np.sort(p)[::-1]
        mass_before = np.concatenate([[0.0], np.cumsum(ranked)[:-1]])
        keep &= p >= ranked[max(int((mass_before < top_p).sum()), 1) - 1]
    if min_p > 0:
        keep &= np.exp(z - z.max()) >= min_p
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    return p / p.sum()
