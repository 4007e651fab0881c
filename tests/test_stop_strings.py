"""Stop strings (``stop_strings``): the automata tables against a plain search of the joined bytes; tokenizers'
``token_bytes`` against their own decode; the engine's output cut where its text first holds a stop string."""

import os
import types

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import stop_strings as st
from ddtree_jax.engine import Engine, EngineConfig
from ddtree_jax.tokenizer import ByteTokenizer, load_tokenizer
from tests.test_engine import NEW, PROMPTS, VOCAB, build_models, generate_all

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def random_token_bytes(rng, w, alphabet=b"ab\n", longest=3):
    """w tokens of 0..longest bytes over a small alphabet (so stop strings span tokens and recur)."""
    return [bytes(rng.choice(list(alphabet), int(rng.integers(0, longest + 1))).tolist()) for _ in range(w)]


def ends_in_token(token_bytes, tokens, strings) -> list[bool]:
    """Plain reference: for each token, whether an occurrence of any string in the join of all the tokens' bytes
    ends inside that token's bytes."""
    text = b"".join(token_bytes[t] for t in tokens)
    ends = set()
    for s in strings:
        pattern = s.encode("utf-8")
        at = text.find(pattern)
        while at >= 0:
            ends.add(at + len(pattern))
            at = text.find(pattern, at + 1)
    out, start = [], 0
    for t in tokens:
        stop = start + len(token_bytes[t])
        out.append(any(start < e <= stop for e in ends))
        start = stop
    return out


@pytest.mark.parametrize("strings", [("ab",), ("a\na", "bb"), ("aaaa", "b", "\nab\n"), ("abab",)])
def test_advance_finds_every_end_a_plain_search_finds(strings):
    """Random streams of tokens fed in random-sized steps (as rounds emit them): each token's ``completes`` equals
    the plain search's, overlapping and repeated occurrences and ones spanning steps included; tokens past a
    step's count change no state."""
    rng = np.random.default_rng(len("".join(strings)))
    w, b, steps, width = 40, 6, 8, 4
    token_bytes = random_token_bytes(rng, w)
    tables = st.build_stop_tables(strings, token_bytes)
    streams = rng.integers(0, w, (b, steps * width))
    states = st.start_states(tables, b)
    got = [[] for _ in range(b)]
    fed = [0] * b
    for _ in range(steps):
        counts = rng.integers(0, width + 1, b)
        chunk = np.stack([np.pad(streams[i, fed[i]:fed[i] + counts[i]], (0, width - counts[i]),
                                 constant_values=-1) for i in range(b)])  # PAD past the count
        ends, states = st.advance(tables, states, jnp.asarray(chunk, jnp.int32), jnp.asarray(counts, jnp.int32))
        for i in range(b):
            got[i].extend(np.asarray(ends[i, :counts[i]]).tolist())
            fed[i] += counts[i]
    total = 0
    for i in range(b):
        want = ends_in_token(token_bytes, streams[i, :fed[i]].tolist(), strings)
        assert got[i] == want, i
        total += sum(want)
    assert total >= 3


def test_kmp_automaton_states_are_the_longest_matched_prefix():
    pattern = b"abab"
    dfa = st.kmp_automaton(pattern)
    rng = np.random.default_rng(1)
    text = bytes(rng.choice(list(b"ab"), 200).tolist())
    state = 0
    for i, byte in enumerate(text):
        state = dfa[state, byte]
        seen = text[:i + 1]
        assert state == max(k for k in range(len(pattern) + 1) if seen.endswith(pattern[:k]))


@pytest.mark.parametrize("bad,message", [("\n", "must be a sequence of strings"), ([""], r"stop_strings\[0\] must be a "
                                                                                          "non-empty string"),
                                         (["a", 3], r"stop_strings\[1\] must be a non-empty string"),
                                         (["a", "b\udcff"], r"stop_strings\[1\] cannot be encoded as UTF-8"),
                                         (["\ufffdx"], r"stop_strings\[0\] holds U\+FFFD")])
def test_bad_stop_strings_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        st.check_stop_strings(bad)
    with pytest.raises(ValueError, match=message):
        EngineConfig(stop_strings=bad)


def test_token_bytes_join_to_the_decoded_text():
    """The shipped byte-level BPE (tokenizer.json) and the byte tokenizer: the bytes of a text's tokens join to
    its decoded text, multi-byte characters split across tokens and a special token (skipped) included."""
    shipped = load_tokenizer(os.path.join(ROOT, "checkpoints", "target"), 4096)
    text = "def f(x):\n    return x * 2  # héllo wörld 日本\n\n<|endoftext|>ok"
    for tokenizer, vocab in ((shipped, 4096), (ByteTokenizer(300), 300)):
        token_bytes = tokenizer.token_bytes(vocab)
        ids = tokenizer.encode(text)
        assert b"".join(token_bytes[i] for i in ids) == tokenizer.decode(ids).encode("utf-8")
    assert shipped.token_bytes(4096)[0] == b""  # <|endoftext|>: decode skips it


def test_a_tokenizer_json_asking_for_truncation_or_padding_still_encodes_the_whole_prompt(tmp_path):
    from tokenizers import Tokenizer

    path = os.path.join(ROOT, "checkpoints", "target", "tokenizer.json")
    text = "def f(x):\n    return x * 2  # a prompt longer than eight tokens"
    want = load_tokenizer(os.path.dirname(path), 4096).encode(text)
    for name, setting in (("truncating", lambda t: t.enable_truncation(max_length=8)),
                          ("padding", lambda t: t.enable_padding(length=len(want) + 16, pad_id=0))):
        tokenizer = Tokenizer.from_file(path)
        setting(tokenizer)
        (tmp_path / name).mkdir()
        tokenizer.save(str(tmp_path / name / "tokenizer.json"))
        assert load_tokenizer(str(tmp_path / name), 4096).encode(text) == want, name
    assert len(want) > 8


class FakeTokenizer:
    """Just what the engine reads: each id's bytes."""

    def __init__(self, token_bytes):
        self._bytes = token_bytes

    def token_bytes(self, vocab_size):
        assert vocab_size == len(self._bytes)
        return self._bytes


@pytest.fixture(scope="module")
def models():
    return build_models()


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_engine_stops_where_the_text_first_holds_a_stop_string(models, mode):
    """Over a made-up vocabulary of 0-3 bytes a token, with strings cut from AR's output text: every mode's output
    is AR's cut after the token whose bytes complete the first occurrence (status stop_string), across tokens and
    rounds; with min_new_tokens, an occurrence within the first tokens does not stop the stream."""
    target, drafter = models
    rng = np.random.default_rng(11)
    token_bytes = random_token_bytes(rng, VOCAB, alphabet=b"abc\n", longest=3)
    tokenizer = FakeTokenizer(token_bytes)
    prompts = PROMPTS[:8]
    ar = generate_all(target, None, EngineConfig(mode="ar", max_new_tokens=NEW, capacity=64), prompts, 8)
    texts = [b"".join(token_bytes[t] for t in tokens) for tokens in ar]
    strings = tuple(sorted({texts[i][3:6].decode() for i in (0, 2, 5) if len(texts[i]) >= 6}))
    for min_new in (0, 3):
        ecfg = EngineConfig(mode=mode, budget=16, max_new_tokens=NEW, capacity=64, stop_strings=strings,
                            min_new_tokens=min_new)
        res = Engine(target, drafter if mode != "ar" else None, ecfg, tokenizer=tokenizer).generate(prompts)
        want = []
        for tokens in ar:
            ends = ends_in_token(token_bytes, tokens, strings)
            first = next((k for k, end in enumerate(ends) if end and k >= min_new), None)
            want.append((tokens, "max_new_tokens") if first is None else (tokens[:first + 1], "stop_string"))
        assert list(zip(res["tokens"], res["status"])) == want, (min_new, strings)
        assert sum(status == "stop_string" for _, status in want) >= 3
    with pytest.raises(ValueError, match=r"stop_strings \['ab'\] are matched in the decoded text: give "
                                         r"Engine\(..., tokenizer=...\)"):
        Engine(target, drafter, EngineConfig(capacity=64, stop_strings=("ab",)))
    short = types.SimpleNamespace(token_bytes=lambda w: token_bytes[:-1])
    with pytest.raises(ValueError, match=f"token_bytes gave {VOCAB - 1} tokens' bytes for the target's vocabulary "
                                         f"of {VOCAB}"):
        Engine(target, drafter, EngineConfig(capacity=64, stop_strings=("ab",)), tokenizer=short)


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_each_stream_stops_on_its_own_strings(models, mode):
    """``generate(..., stop_strings=[one sequence per stream])``: each stream's output is AR's cut where its text
    first holds one of its own strings (none: never; another stream's string does not stop it); one sequence stops
    every stream; None keeps the config's; a batch of other strings at the same rounded sizes compiles nothing."""
    from experiments import bench_util

    target, drafter = models
    rng = np.random.default_rng(12)
    token_bytes = random_token_bytes(rng, VOCAB, alphabet=b"abc\n", longest=3)
    prompts = PROMPTS[:6]
    ar = generate_all(target, None, EngineConfig(mode="ar", max_new_tokens=NEW, capacity=64), prompts, 6)
    texts = [b"".join(token_bytes[t] for t in tokens) for tokens in ar]
    own = [texts[b][2:5].decode() for b in range(6)]  # stream 2's text is empty: it never stops
    per_stream = [(own[0],), (), (own[0], own[1]), (own[1],), (own[4],), ("zzz", own[5])]
    ecfg = EngineConfig(mode=mode, budget=16, max_new_tokens=NEW, capacity=64, stop_strings=(own[5],))
    engine = Engine(target, drafter if mode != "ar" else None, ecfg, tokenizer=FakeTokenizer(token_bytes))

    def cut(tokens, strings):
        ends = ends_in_token(token_bytes, tokens, strings) if strings else [False] * len(tokens)
        first = next((k for k, end in enumerate(ends) if end), None)
        return (tokens, "max_new_tokens") if first is None else (tokens[:first + 1], "stop_string")

    res = engine.generate(prompts, stop_strings=per_stream)
    want = [cut(tokens, strings) for tokens, strings in zip(ar, per_stream)]
    assert list(zip(res["tokens"], res["status"])) == want
    assert [status for _, status in want].count("stop_string") >= 3 and want[1][1] == "max_new_tokens"
    res = engine.generate(prompts, stop_strings=(own[3],))
    assert list(zip(res["tokens"], res["status"])) == [cut(tokens, (own[3],)) for tokens in ar]
    res = engine.generate(prompts)  # the config's string
    assert list(zip(res["tokens"], res["status"])) == [cut(tokens, (own[5],)) for tokens in ar]
    mixed = [None, (own[1],), None, (own[3],), None, ()]  # None: the config's string, as other per-stream settings
    res = engine.generate(prompts, stop_strings=mixed)
    assert list(zip(res["tokens"], res["status"])) == [cut(tokens, (own[5],) if strings is None else strings)
                                                       for tokens, strings in zip(ar, mixed)]
    res = engine.generate(prompts, stop_strings=[None] * 6)  # every stream the config's (refused before)
    assert list(zip(res["tokens"], res["status"])) == [cut(tokens, (own[5],)) for tokens in ar]
    other = [(own[1],), (own[0],), (), (own[3], "ab"), (own[4],), ("c",)]  # 6 strings, 5 above: S 8, Q 4 both
    with bench_util.counting_compiles() as compiles:
        res = engine.generate(prompts, stop_strings=other)
    assert compiles == []
    assert list(zip(res["tokens"], res["status"])) == [cut(tokens, strings) for tokens, strings in zip(ar, other)]


def test_bad_per_stream_stop_strings_refused(models):
    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(capacity=64, max_new_tokens=NEW),
                    tokenizer=FakeTokenizer([b"a"] * VOCAB))
    with pytest.raises(ValueError, match=r"stop_strings must be one sequence of strings or one per stream \(3\), "
                                         "got 2 sequences"):
        engine.prefill(PROMPTS[:3], stop_strings=[("a",), ("b",)])
    with pytest.raises(ValueError, match=r"stream 1's stop_strings\[0\] must be a non-empty string"):
        engine.prefill(PROMPTS[:2], stop_strings=[("a",), ("",)])
    with pytest.raises(ValueError, match="stop_strings must be a sequence of strings"):
        engine.prefill(PROMPTS[:2], stop_strings="a")
    with pytest.raises(ValueError, match="stream 0's min_new_tokens=2 holds back EOS ids, stop token ids and stop "
                                         "sequences"):
        engine.prefill(PROMPTS[:2], stop_strings=[(), ("a",)], min_new_tokens=2)
    engine.prefill(PROMPTS[:2], stop_strings=[("b",), ("a",)], min_new_tokens=2)
    bare = Engine(target, drafter, EngineConfig(capacity=64, max_new_tokens=NEW))
    with pytest.raises(ValueError, match=r"stop_strings \['ab'\] are matched in the decoded text: give "
                                         r"Engine\(..., tokenizer=...\)"):
        bare.prefill(PROMPTS[:2], stop_strings=("ab",))
    assert bare.generate(PROMPTS[:2], stop_strings=())["status"] == ["max_new_tokens"] * 2


def test_the_tabler_keeps_a_bounded_number_of_strings():
    tabler = st.StopStringTabler([bytes([i]) for i in range(256)])
    first = tabler.string_tables("s0")
    for i in range(1, 3 * st.STRINGS_KEPT):
        tabler.string_tables(f"s{i}")
        tabler.string_tables("s0")  # used again and again: kept
    assert len(tabler._kept) == st.STRINGS_KEPT and tabler.string_tables("s0") is first
    assert "s1" not in tabler._kept


def test_a_tablers_batch_tables_are_each_strings_own_padded():
    """``StopStringTabler.tables(round_up=True)``: each string's rows are its own tables' (``build_stop_tables``
    of it alone), padding strings and states never complete; the last STACKS_KEPT batches' stacks are kept, and a
    kept batch gives the same tables again."""
    rng = np.random.default_rng(4)
    token_bytes = random_token_bytes(rng, 50)
    tabler = st.StopStringTabler(token_bytes)
    strings = ("ab", "a\nb\na", "b")
    tables = tabler.tables(strings, round_up=True)
    assert tables.next_state.shape == (4, 8, 50)
    for s, text in enumerate(strings):
        alone = st.build_stop_tables((text,), token_bytes)
        q = len(text) + 1
        np.testing.assert_array_equal(tables.next_state[s, :q], alone.next_state[0])
        np.testing.assert_array_equal(tables.completes[s, :q], alone.completes[0])
        assert not np.asarray(tables.completes[s, q:]).any()
    assert not np.asarray(tables.completes[3]).any()
    for extra in ("c", "d", "e", "f"):
        tabler.tables(strings + (extra,), round_up=True)
    assert len(tabler._stacked) == st.STACKS_KEPT
    again = tabler.tables(strings, round_up=True)
    np.testing.assert_array_equal(again.next_state, tables.next_state)
    np.testing.assert_array_equal(again.completes, tables.completes)
