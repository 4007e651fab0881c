"""Continuous batching: N requests decoded in B < N slots, each slot taking the next request as soon as its stream
stops, so that the batch stays full while requests wait.

The N requests are checked once (``Engine.check_requests``), and what the programs compile (the sampling switches,
the logit processing, the stop strings' tables) is read from all N: every admission's prefill and every dispatch
runs the programs that one batch of all N would run, and a request's tokens are the ones ``Engine.generate`` gives
it among all N (its key is its own: ``stream_keys``). An admission prefills the waiting requests in a batch of their
own (its size rounded up to a power of two, so that few sizes compile, at most the free slots) and writes its
streams into the free slots of the decode state (``admit``); while requests wait, a dispatch ends at the round in
which a stream stops (``Engine.dispatch``'s floor).

Shapes: B slots (streams of the decode state), n streams of an admission, N requests.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.checks import is_integer
from ddtree_jax.decode import bucket_length
from ddtree_jax.model import Runtime
from ddtree_jax.scores import per_stream_slices, scores_lists
from ddtree_jax.stopping import MAX_TOKENS, RUNNING, STATUS_NAMES

if TYPE_CHECKING:
    from ddtree_jax.engine import DecodeState, Engine, Requests


@dataclasses.dataclass(frozen=True)
class Finished:
    """One request's result, as ``Engine.serve`` reports it when its stream stops: ``index`` is its place among the
    requests; ``rounds`` the rounds its stream ran and ``tau_hist`` their histogram of tokens emitted per round;
    ``logprobs`` / ``top_logprobs`` as ``summary.summarize``'s (None unless the config keeps them)."""

    index: int
    tokens: list[int]
    status: str
    rounds: int
    tau_hist: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list] | None = None


def check_slots(slots, data_shards: int) -> int:
    """``slots`` as an int >= 1 that ``data_shards`` (``stream_shards``) divides; ValueError otherwise."""
    if not is_integer(slots) or slots < 1:
        raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
    check_split(f"slots={slots}", slots, data_shards)
    return int(slots)


def check_split(what: str, streams: int, data_shards: int, hint: str = "") -> None:
    """ValueError unless ``data_shards`` (``stream_shards``) divides ``streams``, naming them as ``what``."""
    if streams % data_shards:
        raise ValueError(f"{what} must be a multiple of the {data_shards} ways the mesh splits the streams: each "
                         f"device holds an equal part of them{hint}")


def stream_shards(runtime: Runtime) -> int:
    """How many ways the runtime's mesh splits the streams (its logical "batch" axis); 1 without a mesh."""
    if runtime.mesh is None:
        return 1
    axis = runtime.rules.mesh_axis("batch")
    return 1 if axis is None else int(runtime.mesh.shape[axis])


def admission_size(waiting: int, free: int, data_shards: int) -> int:
    """The streams of an admission's prefill for ``min(waiting, free)`` requests: that count rounded up to a power
    of two and to a multiple of ``data_shards``, at most ``free`` rounded up to that multiple."""
    size = 1 << (min(waiting, free) - 1).bit_length()
    size = -(-size // data_shards) * data_shards
    return min(size, -(-free // data_shards) * data_shards)


@dataclasses.dataclass(frozen=True)
class ServeUpdate:
    """What ``serve_updates`` reports after each admission and each dispatch: ``new_tokens`` maps each request that
    emitted tokens since the last update (its index among the requests) to those tokens; ``finished`` holds the
    requests whose streams stopped since (their tokens whole, the last ones also in ``new_tokens``)."""

    new_tokens: dict[int, list[int]]
    finished: list[Finished]


def serve(engine: Engine, requests: Requests, slots: int, timing: dict | None = None) -> Iterator[Finished]:
    """Decodes ``requests`` in ``slots`` streams, yielding each request's ``Finished`` as its stream stops (in the
    order they stop). ``slots`` is checked here, the decoding starts at the first ``next``. ``timing``, where
    given, gains the seconds spent in admissions ("prefill_s") and in dispatches ("decode_s"), and the rounds the
    batch ran ("batch_rounds")."""
    return (done for update in serve_updates(engine, requests, slots, timing) for done in update.finished)


def serve_updates(engine: Engine, requests: Requests, slots: int, timing: dict | None = None) -> Iterator[ServeUpdate]:
    """``serve``'s decoding, reported as it goes: a ServeUpdate after each admission and each dispatch that emitted
    a token or stopped a stream. Joined over the updates, each request's ``new_tokens`` are its ``Finished.tokens``."""
    data_shards = stream_shards(engine.runtime)
    slots = check_slots(slots, data_shards)
    timing = {} if timing is None else timing
    timing.update(prefill_s=0.0, decode_s=0.0, batch_rounds=0)
    return _serve(engine, requests, slots, data_shards, timing)


def _serve(engine: Engine, requests: Requests, slots: int, data_shards: int, timing: dict) -> Iterator[ServeUpdate]:
    n = len(requests)
    holder = np.full(slots, -1)  # the request in each slot (-1: none)
    sent = np.zeros(slots, np.int64)  # the tokens of each slot's request reported so far
    waiting = 0  # the next request to admit
    state = None
    while True:
        free = np.flatnonzero(holder < 0)
        if waiting < n and free.size:
            t0 = time.perf_counter()
            count = min(n - waiting, free.size)
            size = slots if state is None else admission_size(n - waiting, free.size, data_shards)
            index = np.arange(waiting, waiting + count)
            rows = requests.rows(np.concatenate([index, np.full(size - count, index[-1])]))  # repeats fill it up
            fresh = engine.prefill_requests(rows)
            if state is None:  # the first admission fills every slot: the unused ones stop at once
                state = idle_after(fresh, count)
            else:
                state = admit(state, fresh, jnp.asarray(np.concatenate([free[:count], np.full(size - count, slots)])))
            holder[free[:count]] = index
            sent[free[:count]] = 0
            waiting += count
            jax.block_until_ready(state.status)
            timing["prefill_s"] += time.perf_counter() - t0
        status, num = np.asarray(state.status), np.asarray(state.num_out)
        held = np.flatnonzero(holder >= 0)
        stopped = held[status[held] != RUNNING]
        grew = held[num[held] > sent[held]]
        if grew.size or stopped.size:  # (a stream can stop without a token: a full cache)
            new = per_stream_slices(np.asarray(state.out_tokens)[grew], sent[grew], num[grew])
            sent[grew] = num[grew]
            yield ServeUpdate(dict(zip(holder[grew].tolist(), new)), list(_finished(state, holder, stopped, status)))
        holder[stopped] = -1
        if stopped.size:
            continue  # their slots take the next requests before the next dispatch
        running = int((status == RUNNING).sum())
        if running == 0:
            return
        t0 = time.perf_counter()
        before = np.asarray(state.rounds)
        state = engine.dispatch(state, running if waiting < n else 0)
        # the dispatch's rounds: every one of them ran the streams that ran through it (no slot changes inside)
        timing["batch_rounds"] += int((np.asarray(state.rounds) - before).max())
        timing["decode_s"] += time.perf_counter() - t0


def _finished(state: DecodeState, holder: np.ndarray, slots: np.ndarray, status: np.ndarray) -> Iterator[Finished]:
    """The Finished of the requests in ``slots`` (their streams have stopped), read to the host."""
    if not slots.size:
        return
    num = np.asarray(state.num_out)[slots]
    first = np.zeros_like(num)
    tokens = per_stream_slices(np.asarray(state.out_tokens)[slots], first, num)
    scores = (None, None)
    if state.out_scores is not None:
        scores = scores_lists(jax.tree.map(lambda x: np.asarray(x)[slots], state.out_scores), first, num)
    rounds, hist = np.asarray(state.rounds)[slots], np.asarray(state.tau_hist)[slots]
    for i, slot in enumerate(slots.tolist()):
        yield Finished(index=int(holder[slot]), tokens=tokens[i], status=STATUS_NAMES[int(status[slot])],
                       rounds=int(rounds[i]), tau_hist=hist[i].tolist(),
                       logprobs=None if scores[0] is None else scores[0][i],
                       top_logprobs=None if scores[1] is None else scores[1][i])


def idle_after(state: DecodeState, count: int) -> DecodeState:
    """The state with its streams from ``count`` on stopped (status MAX_TOKENS; they hold no request)."""
    if count == state.status.shape[0]:
        return state
    unused = jnp.arange(state.status.shape[0]) >= count
    return dataclasses.replace(state, status=jnp.where(unused, jnp.int32(MAX_TOKENS), state.status))


@functools.partial(jax.jit, donate_argnames=("state",))
def admit(state: DecodeState, fresh: DecodeState, slots: jax.Array) -> DecodeState:
    """``state`` [B streams] with stream ``slots[i]`` replaced by ``fresh``'s stream i (a prefill's state of n
    streams, the same programs' and stop tables'), for each i whose ``slots[i]`` [n] int32 is < B; the others are
    dropped. Every per-stream leaf is written along its stream axis: the caches' and ``ctx_taps``' second (their
    first is the layer), the others' first; the stop tables are the batch's and stay."""

    def put(into, rows, axis):
        index = (slice(None),) * axis + (slots,)
        return into.at[index].set(rows, mode="drop")

    def put_cache(into, rows):  # LatentCache / DraftCache: [NL, B, ...] tensors, [B] lengths
        return jax.tree.map(lambda a, b: put(a, b, 0 if a.ndim == 1 else 1), into, rows)

    if (fresh.switches, fresh.processing) != (state.switches, state.processing):
        raise ValueError("an admission's streams must run the programs of the state they join: prefill them from "
                         "the same Requests (``Requests.rows``)")
    merged = {}
    for field in dataclasses.fields(state):
        name = field.name
        if field.metadata.get("static") or name == "stop_tables":
            continue
        into, rows = getattr(state, name), getattr(fresh, name)
        if name in ("cache", "draft_cache"):
            merged[name] = None if into is None else put_cache(into, rows)
        else:
            axis = 1 if name == "ctx_taps" else 0
            merged[name] = jax.tree.map(lambda a, b, axis=axis: put(a, b, axis), into, rows)
    return dataclasses.replace(state, **merged)


def warm_up(engine: Engine, requests: Requests, slots: int) -> None:
    """Compiles every program that ``serve(engine, requests, slots)`` can run, without decoding: the prefill of
    each admission size (``admission_size``) at each prompt width among the requests (``decode.pad_prompts``'
    buckets), ``admit`` of each size, and the round loop at ``slots`` streams (entered with every stream stopped,
    so it runs no round)."""
    shards = stream_shards(engine.runtime)
    slots = check_slots(slots, shards)
    n = len(requests)
    sizes = {slots} | {admission_size(w, f, shards) for w in range(1, n + 1) for f in range(1, slots + 1)}
    by_width = {min(bucket_length(len(p)), engine.ecfg.capacity): i for i, p in enumerate(requests.prompts)}
    state = None
    for size in sorted(sizes, reverse=True):
        for i in by_width.values():
            fresh = engine.prefill_requests(requests.rows(np.full(size, i)))
            if state is None:
                state = idle_after(fresh, 0)
            else:
                state = admit(state, fresh, jnp.full((size,), slots, jnp.int32))  # every row dropped
    jax.block_until_ready(engine.dispatch(state, 1).status)
