"""What a decode reports: each stream's tokens, status and log-probabilities, and the run's metrics (tau, its
histogram, rounds, tokens per second), from a finished decode state (``summarize``) or from per-request results
(``summary``, which continuous batching fills from its ``serving.Finished``).

Shapes: B streams, D+2 bins of tokens emitted per round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ddtree_jax.scores import per_stream_slices, scores_lists
from ddtree_jax.stopping import STATUS_NAMES

if TYPE_CHECKING:
    from ddtree_jax.engine import DecodeState


def summarize(state: DecodeState, prefill_s: float, decode_s: float) -> dict:
    """Per-stream tokens and status, and metrics (``summary``) of a state whose streams have stopped."""
    num = np.asarray(state.num_out)
    first = np.zeros_like(num)
    scores = (None, None) if state.out_scores is None else scores_lists(state.out_scores, first, num)
    return summary(per_stream_slices(state.out_tokens, first, num),
                   [STATUS_NAMES[int(s)] for s in np.asarray(state.status)], np.asarray(state.rounds),
                   np.asarray(state.tau_hist), prefill_s, decode_s, *scores)


def summary(tokens: list[list[int]], status: list[str], rounds: np.ndarray, tau_hist: np.ndarray, prefill_s: float,
            decode_s: float, logprobs=None, top_logprobs=None, batch_rounds: int | None = None) -> dict:
    """Per-stream tokens and status, and metrics: new_tokens counts every generated token (the prefill's
    first token per stream included); tau and tokens_per_s count only the tokens of the rounds (decode_s),
    not the one the prefill samples per stream (its time is in prefill_s). rounds [B], tau_hist [B, D+2];
    batch_rounds: the rounds the batch ran (None: the most any stream ran, as in a batch whose streams start
    together). With
    ``EngineConfig(logprobs=True)``, logprobs holds each token's log-probability (``logprobs_mode``: under the
    target, or under what it was taken from), and with ``top_logprobs=n`` top_logprobs its n likeliest
    [token, log-probability] pairs (``scores.scores_lists``); else None. round_tokens: the tokens of the rounds."""
    num = np.array([len(t) for t in tokens], np.int64)
    emitted_in_rounds = np.maximum(num - 1, 0)  # the first token comes from prefill (none: stopped there, no_token)
    return {
        "tokens": tokens,
        "logprobs": logprobs, "top_logprobs": top_logprobs,
        "status": status,
        "rounds": rounds.tolist(),
        "batch_rounds": int(rounds.max(initial=0)) if batch_rounds is None else batch_rounds,
        "tau_mean": float(emitted_in_rounds.sum() / max(rounds.sum(), 1)),
        "tau_per_stream": (emitted_in_rounds / np.maximum(rounds, 1)).tolist(),
        "tau_hist": tau_hist.sum(0).tolist(),
        "new_tokens": int(num.sum()),
        "round_tokens": int(emitted_in_rounds.sum()),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "tokens_per_s": float(emitted_in_rounds.sum() / decode_s) if decode_s > 0 else float("nan"),
    }
