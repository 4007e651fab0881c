"""Logit processing (``processors``) against transformers' processors and plain walks up each tree node's parents."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from ddtree_jax import processors as pr
from ddtree_jax.stopping import check_id_sequences
from ddtree_jax.stream_settings import (NUMBERS, OFF, StreamSettings, stream_allowed_ids, stream_eos_ids,
                                       stream_sequences,
                                       stream_logit_bias, stream_stop_ids)
from test_tree import random_tree

W = 24


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_is_transformers(penalty):
    """``apply_repetition_penalty`` over a context's tokens (repeated ids included) equals transformers'
    ``RepetitionPenaltyLogitsProcessor`` on the same ids, on logits of both signs."""
    rng = np.random.default_rng(int(penalty * 10))
    logits = rng.standard_normal((6, 40)).astype(np.float32) * 3
    context = rng.integers(0, 40, (6, 12))
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.from_numpy(context), torch.from_numpy(logits)).numpy()
    seen = np.zeros((6, 40), bool)
    np.put_along_axis(seen, context, True, axis=1)
    got = np.asarray(pr.apply_repetition_penalty(jnp.asarray(logits), jnp.asarray(seen), penalty))
    np.testing.assert_array_max_ulp(got, want, maxulp=1)  # XLA may divide by the constant as a product
    assert (got != logits).sum() == seen.sum()  # every seen token moved, no other


def path_below_root(tokens, parents, node):
    """The tokens of node's ancestors below the root and its own, root side first (a plain walk up the parents)."""
    path = []
    while node > 0:
        path.append(int(tokens[node]))
        node = int(parents[node])
    return path[::-1]


def test_node_counts_add_each_nodes_path_below_the_root():
    """``node_counts`` against a plain walk up each node's parents: the stream's output counts plus one per token of
    the node and of its ancestors below the root; the root (already the output's last token) and a padding node's
    id add nothing."""
    rng = np.random.default_rng(3)
    b, t = 3, 12
    tree = random_tree(rng, b, t, W, max_depth=4)
    tokens, parents, depths = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.depths))
    leaf = [n for n in range(1, t) if n not in parents[0]][0]
    tokens = tokens.copy()
    tokens[0, leaf] = -1  # a padding node: its id must not wrap to the vocabulary's last token
    out_counts = rng.integers(0, 3, (b, W)).astype(np.int32)
    got = np.asarray(pr.node_counts(jnp.asarray(out_counts), jnp.asarray(tokens), tree.visibility,
                                    jnp.asarray(depths)))
    for s in range(b):
        for node in range(t):
            want = out_counts[s].copy()
            for token in path_below_root(tokens[s], parents[s], node):
                if token >= 0:
                    want[token] += 1
            assert got[s, node].tolist() == want.tolist(), (s, node)


# name: (the token sets, the numbers: one for every stream or a list of one per stream)
PROCESSINGS = {
    "allowed": (dict(allowed_token_ids=(0, 3, 4, 9, 17, W - 1)), {}),
    "bias": (dict(logit_bias=((2, 3.5), (5, -100.0), (W - 1, 1.25))), {}),
    "min_new_tokens": (dict(eos_ids=(1, 7)), dict(min_new_tokens=6)),
    "repetition": ({}, dict(repetition_penalty=1.7)),
    "frequency": ({}, dict(frequency_penalty=0.6)),
    "presence": ({}, dict(presence_penalty=-0.4)),
    "all": (dict(allowed_token_ids=tuple(range(1, W, 2)) + (2,), bad_words=((3,), (5, 9), (9, 1, 11)),
                 logit_bias=((2, 3.5), (7, 2.0)), eos_ids=(1, 7)),
            dict(min_new_tokens=6, repetition_penalty=0.8, frequency_penalty=0.3, presence_penalty=0.5)),
    "per stream": (dict(eos_ids=(1, 7)), dict(min_new_tokens=[6, 0, 3, 9], repetition_penalty=[0.8, 1.0, 1.4, 0.8],
                                              frequency_penalty=[0.3, 0.0, -0.2, 0.3],
                                              presence_penalty=[0.5, 0.5, 0.0, -1.0])),
    # each stream its own logit bias (stream 1 None: the config's; stream 2 none), the config's compiled out (no id
    # 0 in a bias: the reference, transformers' SequenceBiasLogitsProcessor, refuses it in the GPU image's version)
    "bias per stream": (dict(logit_bias=((2, 1.0), (9, -3.0)), eos_ids=(1, 7)),
                        dict(logit_bias=[{2: 3.5, 5: -100.0}, None, {}, {W - 1: 1.25, 13: -2.0, 7: 0.5}],
                             min_new_tokens=[0, 4, 0, 2])),
    # each stream its own stop token ids, held back with the EOS ids by its own min_new_tokens (stream 2: none;
    # stream 3's reach its first place only: min_new_tokens 1)
    "stop ids per stream": (dict(eos_ids=(1,)), dict(stop_token_ids=[[4, 9], [W - 1, 1, 7], None, [0, 11, 12]],
                                                     min_new_tokens=[6, 0, 5, 1])),
    # each stream its own EOS ids (stream 0 None: the config's; stream 1 none), the config's compiled out
    "eos per stream": (dict(eos_ids=(1, 7)), dict(eos_ids=[None, [], [4], [9, 1]], min_new_tokens=[9, 9, 12, 3])),
    # each stream its own allowed ids (stream 1 None: the config's; stream 2 all), the config's compiled out
    "allowed per stream": (dict(allowed_token_ids=(0, 3, 4, 9, 17, W - 1), eos_ids=(1, 7)),
                           dict(allowed_token_ids=[[2, 5, 8], None, [], [W - 1, 1, 7, 3]],
                                min_new_tokens=[0, 0, 0, 2])),
}


def stream_numbers(b, numbers):
    """Each stream's numbers (a dict per stream, every setting's off value where not given)."""
    return [{name: (value[s] if isinstance(value, list) else value) for name, value in {**OFF, **numbers}.items()}
            for s in range(b)]


def processing_and_settings(b, name, **changes):
    """PROCESSINGS[name] for b streams, its token sets changed by ``changes``: (LogitProcessing, settings [B] on
    the device, each stream's numbers)."""
    sets, numbers = PROCESSINGS[name]
    per_stream = stream_numbers(b, numbers)
    own_bias = None
    if "logit_bias" in numbers:  # each stream's pairs, None the config's
        own_bias = stream_logit_bias(numbers["logit_bias"], b, W, sets["logit_bias"], pr.check_logit_bias)
        for stream in per_stream:
            stream["logit_bias"] = pr.check_logit_bias(sets["logit_bias"] if stream["logit_bias"] is None
                                                       else stream["logit_bias"])
    stop_ids = stream_stop_ids(numbers.get("stop_token_ids"), b, W)
    eos_ids = stream_eos_ids(numbers.get("eos_ids"), b, W, sets.get("eos_ids", ()))
    for stream in per_stream if eos_ids is not None else ():
        if stream["eos_ids"] is None:
            stream["eos_ids"] = sets["eos_ids"]
    own_allowed = None
    if "allowed_token_ids" in numbers:  # each stream's ids, None the config's
        own_allowed = stream_allowed_ids(numbers["allowed_token_ids"], b, W, sets["allowed_token_ids"])
        for stream in per_stream:
            if stream["allowed_token_ids"] is None:
                stream["allowed_token_ids"] = sets["allowed_token_ids"]
    host = StreamSettings(**{n: np.asarray([stream[n] for stream in per_stream],
                                           np.int32 if n in ("top_k", "min_new_tokens") else np.float32)
                             for n in NUMBERS}, logit_bias=own_bias, stop_ids=stop_ids, allowed=own_allowed,
                          eos_ids=eos_ids)
    processing = pr.processing_for(host, **{**sets, **changes})
    return processing, jax.tree.map(jnp.asarray, host), per_stream


def reference_row(row, processing, numbers, prompt, output):
    """One place's processed logits: the tokens not allowed at -inf, then transformers' processors over the
    context (prompt + output so far), then the frequency and presence penalties over the output's counts in numpy;
    ``numbers``: the stream's (penalties and min_new_tokens, and its logit bias, stop token ids and allowed token
    ids where it has its own)."""
    ids = torch.tensor([list(prompt) + list(output)])
    allowed = numbers.get("allowed_token_ids", processing.allowed_token_ids)  # the stream's own, where it has them
    if allowed:
        row = np.where(np.isin(np.arange(row.shape[-1]), allowed), row, -np.inf)
    scores = torch.from_numpy(np.asarray(row, np.float32)[None].copy())
    bad_words = numbers.get("bad_words", processing.bad_words)  # the stream's own, where it has them
    if bad_words:
        scores = NoBadWordsLogitsProcessor([list(word) for word in bad_words])(ids, scores)
    bias = numbers.get("logit_bias", processing.logit_bias)  # the stream's own pairs, where it has them
    if bias:
        scores = SequenceBiasLogitsProcessor([[[i], a] for i, a in bias])(ids, scores)
    # the stream's EOS ids (its own, where it has them) and its stop ids
    held = list(numbers.get("eos_ids", processing.eos_ids)) + list(numbers.get("stop_token_ids") or ())
    if numbers["min_new_tokens"] and held:
        scores = MinNewTokensLengthLogitsProcessor(len(prompt), numbers["min_new_tokens"], held)(ids, scores)
    if numbers["repetition_penalty"] != 1:
        scores = RepetitionPenaltyLogitsProcessor(numbers["repetition_penalty"])(ids, scores)
    scores = scores.numpy()[0]
    counts = np.bincount(np.asarray(output, np.int64), minlength=row.shape[-1]).astype(np.float32)
    return (scores - np.float32(numbers["frequency_penalty"]) * counts
            - np.where(counts > 0, np.float32(numbers["presence_penalty"]), np.float32(0)))


def random_history(rng, b, roots, processing):
    """Per stream a prompt and an output ending in its tree's root; their TokenHistory (or None) and num_out."""
    prompts = [rng.integers(0, W, int(rng.integers(1, 9))).tolist() for _ in range(b)]
    outputs = [rng.integers(0, W, int(rng.integers(0, 6))).tolist() + [int(root)] for root in roots]
    width = max(map(len, prompts))
    padded = np.array([p + [0] * (width - len(p)) for p in prompts], np.int32)
    history = pr.start_history(processing, jnp.asarray(padded), jnp.asarray([len(p) for p in prompts]), W)
    out_width = max(map(len, outputs))
    padded_out = np.array([o + [0] * (out_width - len(o)) for o in outputs], np.int32)
    num_out = jnp.asarray([len(o) for o in outputs], jnp.int32)
    history = pr.extend_history(history, jnp.asarray(padded_out), num_out)
    return prompts, outputs, history, num_out


@pytest.mark.parametrize("name", list(PROCESSINGS))
def test_process_logits_at_each_tree_node_is_transformers_over_that_nodes_context(name):
    """Every tree node's processed row equals the reference's over that node's own context: the prompt, the
    output (its last token the root) and the node's path below the root, whose length sets min_new_tokens' count.
    Each processing changes some rows; min_new_tokens releases the EOS ids deeper in the tree. "per stream": each
    stream its own penalties and min_new_tokens, some of them off."""
    rng = np.random.default_rng(len(name))
    b, t = 4, 14
    processing, settings, numbers = processing_and_settings(b, name)
    tree = random_tree(rng, b, t, W, max_depth=5)
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    prompts, outputs, history, num_out = random_history(rng, b, tokens[:, 0], processing)
    logits = rng.standard_normal((b, t, W)).astype(np.float32) * 3
    got = np.asarray(pr.process_logits(jnp.asarray(logits), processing, settings, history, num_out, tree))
    for s in range(b):
        for node in range(t):
            # the place after the node: its context ends in its path below the root, the node's own token last
            context = outputs[s] + path_below_root(tokens[s], parents[s], node)
            want = reference_row(logits[s, node], processing, numbers[s], prompts[s], context)
            np.testing.assert_allclose(got[s, node], want, rtol=1e-6, atol=1e-6, err_msg=f"stream {s}, node {node}")
    assert (got != logits).any()
    if name == "min_new_tokens":
        blocked = np.isneginf(got[:, :, 1])
        assert blocked.any() and not blocked.all()
    if name == "allowed per stream":  # stream 2 allows every token, stream 0 three
        assert not np.isneginf(got[2]).any() and (np.isfinite(got[0]).sum(-1) == 3).all()
    if name == "eos per stream":  # stream 1 holds back no EOS; stream 2 its own 4, not the config's 1
        assert not np.isneginf(got[1]).any() and np.isneginf(got[2, :, 4]).any()
        assert not np.isneginf(got[2, :, 1]).any() and np.isneginf(got[0, :, 1]).any()
    if name == "stop ids per stream":  # a stream's own stop ids are held back in its rows alone
        assert np.isneginf(got[0, :, 4]).any() and not np.isneginf(got[1:3, :, 4]).any()


@pytest.mark.parametrize("per_stream", [False, True])
def test_bad_words_ban_where_each_nodes_context_ends_with_the_rest(per_stream):
    """Bad words planted from the contexts themselves (inside the tree, spanning the root into the output, reaching
    the prompt, and one-token ones): every node's row equals transformers' ``NoBadWordsLogitsProcessor`` over that
    node's context, and each planted word banned its last token somewhere. ``per_stream``: each stream its own words
    (stream 0 the first and the one-token one, stream 1 the second, stream 2 None: the config's, all three; stream
    3 none), the config's compiled out."""
    rng = np.random.default_rng(21)
    b, t = 4, 14
    tree = random_tree(rng, b, t, W, max_depth=5)
    tokens, parents, depths = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.depths))
    prompts = [rng.integers(0, W, 4).tolist() for _ in range(b)]
    outputs = [[int(x) for x in rng.integers(0, W, 2)] + [int(tokens[s, 0])] for s in range(b)]
    deep = int(np.argmax(depths[0]))  # a path inside the tree
    below = path_below_root(tokens[0], parents[0], deep)
    first = [n for n in range(1, t) if depths[1, n] == 1][0]  # spanning the root into the output and the prompt
    words = ((below[-2], below[-1], 20), (prompts[1][-1], outputs[1][0], outputs[1][1], outputs[1][2],
                                          int(tokens[1, first]), 21), (22,))
    processing = pr.LogitProcessing(bad_words=words)
    settings, numbers = processing_and_settings(b, "allowed")[1:]  # every number off
    if per_stream:
        own = [[words[0], words[2]], [words[1]], None, []]
        settings = dataclasses.replace(settings, bad_words=jax.tree.map(
            jnp.asarray, stream_sequences(own, b, W, words, check_id_sequences, "bad_words")))
        processing = pr.processing_for(jax.tree.map(np.asarray, settings), bad_words=words)
        assert processing.bad_words == () and processing.window == 7  # L = 8 > the longest word's 6
        for stream, word_set in zip(numbers, own):
            stream["bad_words"] = words if word_set is None else word_set
    width = max(map(len, prompts))
    history = pr.start_history(processing, jnp.asarray([p + [0] * (width - len(p)) for p in prompts]),
                               jnp.asarray([len(p) for p in prompts]), W)
    num_out = jnp.full((b,), 3, jnp.int32)
    history = pr.extend_history(history, jnp.asarray(outputs, jnp.int32), num_out)
    logits = rng.standard_normal((b, t, W)).astype(np.float32)
    got = np.asarray(pr.process_logits(jnp.asarray(logits), processing, settings, history, num_out, tree))
    for s in range(b):
        for node in range(t):
            want = reference_row(logits[s, node], processing, numbers[s], prompts[s],
                                 outputs[s] + path_below_root(tokens[s], parents[s], node))
            np.testing.assert_array_equal(got[s, node], want, err_msg=f"stream {s}, node {node}")
    assert np.isneginf(got[0, deep, 20]) and np.isneginf(got[1, first, 21])
    assert np.isfinite(got[:, :, 20]).sum() > 0 and np.isfinite(got[:, :, 21]).sum() > 0
    one_token_banned = [True, False, True, False] if per_stream else [True] * b
    assert [bool(np.isneginf(got[s, :, 22]).all()) for s in range(b)] == one_token_banned
    assert not np.isneginf(got[:, :, 22]).any(1)[~np.asarray(one_token_banned)].any()


def test_process_logits_without_a_tree_is_the_place_after_the_history():
    """T = 1 and no tree: the row after the prompt and output, as the prefill and plain decoding process it; a bad
    word planted from stream 0's last two context tokens bans its last token there."""
    rng = np.random.default_rng(5)
    window_of_two, settings, numbers = processing_and_settings(3, "all", bad_words=((3,), (0, 0, 0)))  # K = 2
    prompts, outputs, history, num_out = random_history(rng, 3, rng.integers(0, W, 3), window_of_two)
    context = prompts[0] + outputs[0]
    processing = dataclasses.replace(window_of_two, bad_words=((3,), (context[-2], context[-1], 13)))
    logits = rng.standard_normal((3, 1, W)).astype(np.float32) * 3
    got = np.asarray(pr.process_logits(jnp.asarray(logits), processing, settings, history, num_out))
    for s in range(3):
        want = reference_row(logits[s, 0], processing, numbers[s], prompts[s], outputs[s])
        np.testing.assert_allclose(got[s, 0], want, rtol=1e-6, atol=1e-6)
    assert np.isneginf(got[0, 0, 13])
    with pytest.raises(ValueError, match="without a tree there is one place to process, got 2"):
        pr.process_logits(jnp.zeros((3, 2, W)), processing, settings, history, num_out)


def test_default_processing_changes_nothing_and_keeps_no_history():
    logits = jnp.ones((2, 3, W), jnp.bfloat16)
    processing = pr.LogitProcessing()
    assert pr.process_logits(logits, processing, None, None, jnp.zeros((2,), jnp.int32)) is logits
    assert pr.start_history(processing, jnp.zeros((2, 4), jnp.int32), jnp.ones((2,), jnp.int32), W) is None
    # min_new_tokens without EOS ids leaves the logits alone (it holds back stop sequences only)
    assert not pr.LogitProcessing(min_new_tokens=True).changes_logits


@pytest.mark.parametrize("bias,want", [({3: 1.0, 1: -2}, ((1, -2.0), (3, 1.0))), ([(4, 0.5)], ((4, 0.5),)),
                                       ((), ()), ({}, ())])
def test_logit_bias_normalised(bias, want):
    assert pr.check_logit_bias(bias) == want


@pytest.mark.parametrize("bias,message", [
    ([(1, 1.0), (1, 2.0)], "gives token 1 twice"), ({-1: 1.0}, "ids must be integers >= 0"),
    ({True: 1.0}, "ids must be integers >= 0"), ({1.0: 1.0}, "ids must be integers >= 0"),
    ({1: float("inf")}, r"logit_bias\[1\] must be a number in"), ({1: "2"}, r"logit_bias\[1\] must be a number in"),
    ({1: 100.5}, r"logit_bias\[1\] must be a number in \[-100, 100\]"), ({1: -1e39}, r"logit_bias\[1\] must be"),
    ([1, 2], r"\(token id, amount\) pairs"), ([(1, 2, 3)], "pairs"), (1.0, "must be a mapping"),
    ({W: 1.0}, rf"token id {W} is outside the vocabulary \[0, {W}\)")])
def test_bad_logit_bias_refused(bias, message):
    with pytest.raises(ValueError, match=message):
        pr.check_logit_bias(bias, W)


@pytest.mark.parametrize("bad", [0.0, -1.2, float("nan"), float("inf"), True, "1.2", 1e-46, 1e39,
                                 1e-38,  # positive logits of seen tokens became +inf, and the lowest id won the tie
                                 2.0**-20 * 0.999, 2.0**20 * 1.001])
def test_bad_repetition_penalty_refused(bad):
    with pytest.raises(ValueError, match=r"repetition_penalty must be a number in \[2\^-20, 2\^20\]"):
        pr.check_repetition_penalty(bad)
    assert pr.check_repetition_penalty(2.0**-20) == 2.0**-20 and pr.check_repetition_penalty(2.0**20) == 2.0**20


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), True, "0.5", None, 2.01, -2.5, 1e39])
def test_bad_additive_penalty_refused(bad):
    with pytest.raises(ValueError, match=r"frequency_penalty must be a number in \[-2, 2\] \(0: off\)"):
        pr.check_additive_penalty("frequency_penalty", bad)


@pytest.mark.parametrize("allowed,message", [
    ("13", "must be a sequence of token ids"), ([1, -2], "must be token ids >= 0, got -2"),
    ([1, 2.0], "must be token ids >= 0, got 2.0"), ([3, W, W + 2], rf"\[{W}, {W + 2}\] are outside the vocabulary")])
def test_bad_allowed_token_ids_refused(allowed, message):
    with pytest.raises(ValueError, match=f"allowed_token_ids {message}"):
        pr.check_allowed_token_ids(allowed, W)
    assert pr.check_allowed_token_ids({5, 2, 5}) == (2, 5)


@pytest.mark.parametrize("bad,message", [(-1, ">= 0"), (2.0, "an integer"), (True, "an integer")])
def test_bad_min_new_tokens_refused(bad, message):
    with pytest.raises(ValueError, match=f"min_new_tokens must be {message}"):
        pr.check_min_new_tokens(bad)
