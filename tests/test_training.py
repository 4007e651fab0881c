"""Training pieces on CPU: pinned corpus, tokenizers, one step of each trainer, the DFlash training mask
and its equivalence with the drafter's inference forward."""

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ddtree_jax.checkpoint import restore_drafter, save_drafter
from ddtree_jax.cache import init_cache
from ddtree_jax.config import tiny_config
from ddtree_jax.drafter import DFlashDrafter, init_draft_cache, tiny_drafter_config
from ddtree_jax.model import KimiModel, causal_mask
from ddtree_jax.moe import routed_experts_xla
from ddtree_jax.tokenizer import ByteTokenizer, HFTokenizer, TiktokenTokenizer, load_tokenizer
from experiments import data as data_lib
from experiments import train_drafter as td
from experiments import train_target as tt


# ------------------------------------------------------------------------------------------- data
def _fake_stdlib(root):
    files = {"os.py": "import sys\n", "json/__init__.py": "x = 1\n", "json/decoder.py": "def f():\n    pass\n",
             "test/test_os.py": "assert 1\n", "site-packages/pkg.py": "y = 2\n",
             "_sysconfigdata_x.py": "build = {}\n", "README.txt": "not python\n"}
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def test_manifest_pins_files_and_catches_a_changed_file(tmp_path):
    root = str(tmp_path / "lib")
    _fake_stdlib(root)
    manifest = data_lib.build_manifest(root)
    assert [f["path"] for f in manifest["files"]] == ["json/__init__.py", "json/decoder.py", "os.py",
                                                      "test/test_os.py"]
    assert data_lib.verify(manifest, root) == manifest["files"]
    with open(os.path.join(root, "json", "decoder.py"), "a") as f:
        f.write("# edited\n")
    with pytest.raises(data_lib.DataMismatch, match="json/decoder.py"):
        data_lib.verify(manifest, root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        files = data_lib.verify(manifest, root, allow_mismatch=True)
    assert caught and "allow-mismatch" in str(caught[0].message)
    assert data_lib.data_hash(files) != data_lib.data_hash(manifest["files"])
    os.remove(os.path.join(root, "os.py"))
    with pytest.raises(data_lib.DataMismatch, match="1 missing"):
        data_lib.verify(manifest, root)


def test_heldout_split_is_by_file_and_deterministic():
    manifest = data_lib.load_manifest()
    held = [f["path"] for f in manifest["files"] if f["heldout"]]
    assert held and len(held) < len(manifest["files"]) // 5
    assert all(data_lib.is_heldout(p) for p in held)
    rows = data_lib.pack([np.arange(5), np.arange(7)], seq_len=3, eos_id=0)
    assert rows.shape == (3, 4) and rows[1, 1] == 0  # EOS after the first doc


def test_token_streams_travel_and_refuse_another_tokenizer(tmp_path, monkeypatch):
    texts = {"train": [("a.py", "def f():\n    return 1\n"), ("b.py", "x = [1, 2]\n")],
             "heldout": [("c.py", "import os\n")]}
    monkeypatch.setattr(data_lib, "load_texts",
                        lambda split, allow_mismatch=False: (texts[split], {"data_hash": "h", "num_files": 1}))
    tok = data_lib.train_tokenizer([t for _, t in texts["train"]] * 5, vocab_size=280)
    tok_path = str(tmp_path / "tokenizer.json")
    tok.save(tok_path)
    out = str(tmp_path / "sub" / "tokens.npz")
    info = data_lib.export_tokens(tok, out, tokenizer_path=tok_path)
    train, held, back = data_lib.load_tokens(out, tokenizer_path=tok_path)
    eos = tok.token_to_id(data_lib.EOS_TOKEN)
    expect = [i for _, t in texts["train"] for i in tok.encode(t).ids + [eos]]
    assert train.tolist() == expect and held[-1] == eos and back == info
    assert data_lib.pack(train, 3).shape == (len(expect) // 4, 4)
    with pytest.raises(ValueError, match="holds no row"):
        data_lib.pack(held, 1000)
    other = data_lib.train_tokenizer(["completely different text"] * 5, vocab_size=270)
    other.save(str(tmp_path / "other.json"))
    with pytest.raises(data_lib.DataMismatch, match="re-export"):
        data_lib.load_tokens(out, tokenizer_path=str(tmp_path / "other.json"))


def test_timed_training_fixes_its_length_during_warmup():
    import time

    saves = []

    def run_step(step, lr):
        time.sleep(0.005)
        return {"loss": 1.0}

    curve, done, total, _ = tt.training_loop(
        run_step, start=0, total_steps=None, minutes=0.004, lr=1e-3, warmup=16, max_minutes=None,
        save_every=1000, save=lambda step, total, c: saves.append((step, total)), desc="t")
    assert done == total == len(curve) and 16 <= total < 100 and saves == [(total, total)]
    # every step (warmup ones included) ran at the learning rate of the final schedule
    schedule = tt.lr_schedule(total, 1e-3, 16)
    np.testing.assert_allclose([c["lr"] for c in curve], [float(schedule(i)) for i in range(total)], rtol=1e-6)
    _, done, total, _ = tt.training_loop(
        run_step, start=0, total_steps=None, minutes=10, lr=1e-3, warmup=16, max_minutes=None, save_every=1000,
        save=lambda *a: None, desc="t", max_steps=18)  # e.g. an epoch cap
    assert done == total == 18
    with pytest.raises(ValueError, match="warmup"):
        tt.training_loop(run_step, start=0, total_steps=None, minutes=1, lr=1e-3, warmup=5, max_minutes=None,
                         save_every=10, save=lambda *a: None, desc="t")
    with pytest.raises(FloatingPointError):
        tt.training_loop(lambda s, lr: {"loss": float("nan")}, start=0, total_steps=3, minutes=None, lr=1e-3,
                         warmup=1, max_minutes=None, save_every=10, save=lambda *a: None, desc="t")


def test_shipped_manifest_matches_this_python():
    manifest = data_lib.load_manifest()
    if manifest["python_version"] != data_lib.python_version():
        pytest.skip(f"manifest pinned on Python {manifest['python_version']}")
    data_lib.verify(manifest)


def test_shipped_prompts_are_the_pinned_cut():
    """experiments/heldout_prompts.json holds the first prompts ``run_decode`` cuts by default (the shipped
    tokenizer, seed 0, 64-128 tokens) from the pinned held-out files: the same paths, lines and texts as a cut on
    this machine where its stdlib is the manifest's."""
    with open(data_lib.PROMPTS_PATH, encoding="utf-8") as f:
        shipped = json.load(f)
    manifest = data_lib.load_manifest()
    assert (shipped["python_version"], shipped["manifest_total_sha256"]) == (manifest["python_version"],
                                                                             manifest["total_sha256"])
    cut = dict(data_lib.SHIPPED_PROMPT_CUT)
    count = cut.pop("count")
    assert len(shipped["prompts"]) == count and {k: shipped[k] for k in cut} == cut
    tokenizer_dir = data_lib.SHIPPED_TOKENIZER_DIR
    assert shipped["tokenizer"] == data_lib.tokenizer_file_fingerprint(tokenizer_dir)
    for model in ("target", "drafter"):  # the shipped pair reads the same tokenizer
        assert data_lib.tokenizer_file_fingerprint(os.path.join(data_lib.ROOT, "checkpoints", model)) == \
            shipped["tokenizer"]
    tokenizer = load_tokenizer(tokenizer_dir, 4096)
    for q in shipped["prompts"]:
        assert cut["min_tokens"] <= len(tokenizer.encode(q["text"])) <= cut["max_tokens"] and q["text"].endswith("\n")
    if manifest["python_version"] != data_lib.python_version():
        pytest.skip(f"the cut itself needs the pinned stdlib (Python {manifest['python_version']})")
    again = data_lib.cut_heldout_prompts(tokenizer, count, **cut)
    assert [(q["path"], q["line"], q["text"]) for q in again] == \
        [(q["path"], q["line"], q["text"]) for q in shipped["prompts"]]


def test_no_shipped_prompt_is_training_text():
    """Held-out files can share text with training ones (test_sunau.py's fixture is in test_wave.py): the cut skips
    a prompt found verbatim in a training file."""
    manifest = data_lib.load_manifest()
    if manifest["python_version"] != data_lib.python_version():
        pytest.skip(f"the training texts are the pinned stdlib's (Python {manifest['python_version']})")
    train, _ = data_lib.load_texts("train")
    with open(data_lib.PROMPTS_PATH, encoding="utf-8") as f:
        shipped = json.load(f)
    for q in shipped["prompts"]:
        assert not any(q["text"] in text for _, text in train), q["path"]


def test_prompts_found_in_the_excluded_texts_are_skipped():
    texts = [(f"f{i}.py", "".join(f"line {i} {j}\n" for j in range(40))) for i in range(4)]
    tokenizer = ByteTokenizer(256)
    kept = data_lib.eval_prompts(tokenizer, texts, n=6, min_tokens=20, max_tokens=60, seed=1)
    path = kept[0]["path"]
    skipped = data_lib.eval_prompts(tokenizer, texts, n=6, min_tokens=20, max_tokens=60, seed=1,
                                    exclude=["prefix\n" + dict(texts)[path]])
    assert len(skipped) == 6 and all(q["path"] != path for q in skipped)


def test_shipped_prompts_answer_only_for_their_cut(tmp_path):
    """``shipped_prompts`` gives the first n texts for the file's tokenizer, seed and token range with n within its
    count, None for any other request (the caller cuts those from the stdlib), and refuses n < 1 or another file."""
    with open(data_lib.PROMPTS_PATH, encoding="utf-8") as f:
        shipped = json.load(f)
    texts = [q["text"] for q in shipped["prompts"]]
    fp = shipped["tokenizer"]
    cut = dict(seed=0, min_tokens=64, max_tokens=128)
    assert data_lib.shipped_prompts(fp, 8, **cut) == texts[:8]
    assert data_lib.shipped_prompts(fp, len(texts), **cut) == texts
    assert data_lib.shipped_prompts(fp, len(texts) + 1, **cut) is None
    assert data_lib.shipped_prompts(None, 8, **cut) is None  # the byte tokenizer
    assert data_lib.shipped_prompts("tokenizer.json:sha256:" + "0" * 64, 8, **cut) is None
    for other in (dict(cut, seed=1), dict(cut, min_tokens=32), dict(cut, max_tokens=96)):
        assert data_lib.shipped_prompts(fp, 8, **other) is None
    with pytest.raises(ValueError, match="n must be >= 1"):
        data_lib.shipped_prompts(fp, 0, **cut)
    bad = tmp_path / "prompts.json"
    bad.write_text(json.dumps({"format": "something/1", "prompts": []}))
    with pytest.raises(ValueError, match="not a ddtree-jax-heldout-prompts/1 file"):
        data_lib.shipped_prompts(fp, 1, path=str(bad), **cut)
    assert data_lib.tokenizer_file_fingerprint(str(tmp_path)) is None


# ------------------------------------------------------------------------------------------- tokenizers
def test_bpe_round_trip_and_prompts(tmp_path):
    texts = ["def add(a, b):\n    return a + b\n", "class Foo:\n    pass\n", "import os\nprint('héllo')\n"] * 20
    tok = data_lib.train_tokenizer(texts, vocab_size=300)
    assert tok.token_to_id(data_lib.EOS_TOKEN) == 0 and tok.token_to_id(data_lib.MASK_TOKEN) == 1
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path), 300)
    assert isinstance(loaded, HFTokenizer)
    for text in texts[:3] + ["  unseen\tté✓ 12345\n"]:
        assert loaded.decode(loaded.encode(text)) == text
    prompts = data_lib.eval_prompts(tok, [("a.py", "\n".join(texts))], n=3, min_tokens=8, max_tokens=40)
    assert len(prompts) == 3 and all(8 <= len(p["ids"]) <= 40 and p["text"].endswith("\n") for p in prompts)


def test_tiktoken_format_tokenizer(tmp_path):
    import base64

    merges = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor"]
    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({m: 256 + j for j, m in enumerate(merges)})
    with open(tmp_path / "tiktoken.model", "w") as f:
        for token, rank in ranks.items():
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"added_tokens_decoder": {str(len(ranks)): {"content": "[BOS]", "special": True}}}, f)
    tok = load_tokenizer(str(tmp_path), 1000)
    assert isinstance(tok, TiktokenTokenizer)
    ids = tok.encode("hello world")
    # "hello" -> one token; " world" -> " wor" (lowest-rank merges first) + "l" + "d"
    assert ids == [ranks[b"hello"], ranks[b" wor"], ord("l"), ord("d")]
    for text in ["hello world", "héllo 世界 12345\n\n  x", ""]:
        assert tok.decode(tok.encode(text)) == text
    # special-token texts are their ids unless asked otherwise, as K2's tokenization_kimi.py encodes
    assert tok.encode("[BOS]hello") == [len(ranks), ranks[b"hello"]]
    assert tok.encode("[BOS]hello", allow_special=False) == [*b"[BOS]", ranks[b"hello"]]
    assert tok.decode([len(ranks)]) == "[BOS]" and tok.vocab_size == len(ranks) + 256
    # the unnamed reserved slots are named by their ids, as K2 names them
    reserved = len(ranks) + 8
    assert tok.decode([reserved]) == f"<|reserved_token_{reserved}|>"
    assert tok.encode(f"<|reserved_token_{reserved}|>") == [reserved]


def test_split_long_runs_cuts_runs_past_the_limit():
    from ddtree_jax.tokenizer import split_long_runs

    assert split_long_runs("", 3) == [""] and split_long_runs("abc de", 3) == ["abc de"]
    assert split_long_runs("abcd  efgh", 3) == ["abc", "d  efg", "h"]
    assert split_long_runs("a     b", 2) == ["a  ", "  ", " b"]
    text = "x y" * 5 + "z" * 10 + "\n" * 7
    for limit in (1, 2, 3, 7):
        parts = split_long_runs(text, limit)
        assert "".join(parts) == text and all(parts)


def test_tiktoken_encodes_in_kimis_parts():
    """K2's tokenizer cuts a run of more than 25,000 like characters, and a text at every 400,000 characters,
    and no piece crosses a cut: the pieces at a cut are tokenized apart."""
    from ddtree_jax.tokenizer import KIMI_MAX_ENCODE_CHARS, KIMI_MAX_RUN_CHARS

    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({b"ab": 256, b" ab": 257})
    tok = TiktokenTokenizer(ranks)
    run = "x" * (KIMI_MAX_RUN_CHARS - 1) + "ab"  # its 'b' is the run's 25,001st character
    assert tok.encode(run) == [ord("x")] * (KIMI_MAX_RUN_CHARS - 1) + [ord("a"), ord("b")]
    assert tok.encode(run[1:]) == [ord("x")] * (KIMI_MAX_RUN_CHARS - 2) + [256]
    text = "ab " * (KIMI_MAX_ENCODE_CHARS // 3 + 1)  # the cut at 400,000 falls between an 'a' and its 'b'
    assert text[KIMI_MAX_ENCODE_CHARS - 1:KIMI_MAX_ENCODE_CHARS + 1] == "ab"
    ids = tok.encode(text)
    assert ids == tok.encode(text[:KIMI_MAX_ENCODE_CHARS]) + tok.encode(text[KIMI_MAX_ENCODE_CHARS:])
    assert ids.count(257) == len(text) // 3 - 2 and tok.decode(ids) == text


# ------------------------------------------------------------------------------------------- target
def _tiny_target(**kw):
    cfg = tiny_config(vocab_size=64, num_layers=2, **kw)
    return KimiModel(cfg, nnx.Rngs(0))


def test_dense_routed_path_matches_xla_and_is_differentiable():
    key = jax.random.PRNGKey(0)
    m, d, e, f, k = 12, 16, 4, 8, 2
    x = jax.random.normal(key, (m, d))
    ids = jax.random.randint(jax.random.PRNGKey(1), (m, k), 0, e)
    ids = ids.at[:, 1].set((ids[:, 0] + 1) % e)  # distinct experts per token
    w = jax.random.uniform(jax.random.PRNGKey(2), (m, k))
    w13 = jax.random.normal(jax.random.PRNGKey(3), (e, 2 * f, d)) * 0.1
    w2 = jax.random.normal(jax.random.PRNGKey(4), (e, d, f)) * 0.1
    np.testing.assert_allclose(jax.jit(tt.routed_experts_dense)(x, ids, w, w13, w2),
                               jax.jit(routed_experts_xla)(x, ids, w, w13, w2), rtol=1e-5, atol=1e-5)
    g = jax.jit(jax.grad(lambda w: tt.routed_experts_dense(x, ids, w, w13, w2).sum()))(w)
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0


def test_target_training_step_decreases_loss(tmp_path):
    model = _tiny_target()
    graphdef, params = nnx.split(model)
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)
    step = tt.make_train_step(graphdef, tx)
    rows = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 17)), jnp.int32)
    params2, opt_state2, loss0 = step(params, opt_state, rows, 1.0)  # donates params and opt_state
    params = jax.tree.map(jnp.zeros_like, params2)  # a structure-alike for the restore below
    opt_state = jax.tree.map(jnp.zeros_like, opt_state2)
    _, _, loss1 = step(jax.tree.map(jnp.copy, params2), jax.tree.map(jnp.copy, opt_state2), rows, 1.0)
    assert float(loss1) < float(loss0)
    # router bias: no gradient update, but the balancing rule moves it
    bias = [v for k, v in params2.flat_state() if k[-1] == "router_bias"]
    assert all(np.all(np.asarray(b.value) == 0) for b in bias)
    params3, loads = tt.make_bias_update(graphdef, 0.1)(params2, rows)
    assert loads.shape == (1, 8) and np.isclose(float(loads.sum()), 1.0)
    bias3 = [np.asarray(v.value) for k, v in params3.flat_state() if k[-1] == "router_bias"]
    assert len(bias3) == loads.shape[0]
    for j, moved in enumerate(bias3):  # from zero: exactly rate * sign(mean load - load), per expert
        np.testing.assert_array_equal(moved, 0.1 * np.sign(np.asarray(loads[j]).mean() - np.asarray(loads[j])))
        assert np.any(moved != 0)
    # the training forward equals the inference forward (absorbed attention, XLA experts)
    b, t = 2, 16

    @jax.jit
    def both(state, tokens):
        m = nnx.merge(graphdef, state)
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        ref = m(tokens, pos, init_cache(m.cfg, b, 1), causal_mask(b, t)).logits
        return tt.lm_forward(m, tokens).logits, ref

    train_logits, ref = both(params3, rows[:, :-1])
    np.testing.assert_allclose(train_logits, ref, rtol=2e-4, atol=2e-4)
    # resumable state round trip; a resume with other arguments is refused
    tt.save_train_state(str(tmp_path / "state"), (params3, opt_state2), 7, {"resume_key": {"lr": 1}})
    (p, o), s = tt.restore_train_state(str(tmp_path / "state"), (params, opt_state), {"lr": 1})
    assert s == 7
    for a, c in zip(jax.tree.leaves((p, o)), jax.tree.leaves((params3, opt_state2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    with pytest.raises(ValueError, match="fresh --state-dir"):
        tt.restore_train_state(str(tmp_path / "state"), (params, opt_state), {"lr": 2})
    # INT4 export: experts become QuantArrays within the quantization error, the rest is unchanged
    trained = nnx.merge(graphdef, params3)
    q = tt.quantize_experts(trained)
    assert q.cfg.quant is not None
    w13, qw13 = trained.layers[1].mlp.w13.value, q.layers[1].mlp.w13.value
    err = np.abs(np.asarray(qw13.dequantize()) - np.asarray(w13)).max()
    assert 0 < err <= np.abs(np.asarray(w13)).max() / 7 * 0.51 + 1e-6
    np.testing.assert_array_equal(np.asarray(q.embed.value), np.asarray(trained.embed.value))


# ------------------------------------------------------------------------------------------- drafter
def test_training_mask_matches_the_spec():
    # S = 6 context rows, two blocks of 3 at anchors 2 and 4
    mask = np.asarray(td.training_mask(jnp.asarray([[2, 4]]), 6, 3))[0]
    ctx = [[1, 1, 0, 0, 0, 0]] * 3 + [[1, 1, 1, 1, 0, 0]] * 3
    own = [[1, 1, 1, 0, 0, 0]] * 3 + [[0, 0, 0, 1, 1, 1]] * 3
    np.testing.assert_array_equal(mask, np.concatenate([np.asarray(ctx), np.asarray(own)], 1).astype(bool))


def _tiny_pair():
    target = _tiny_target()
    dcfg = tiny_drafter_config(target.cfg, block_size=4)
    return target, DFlashDrafter(dcfg, nnx.Rngs(1))


def test_training_forward_equals_inference_forward():
    target, drafter = _tiny_pair()
    cfg = drafter.cfg
    s, anchors = 12, jnp.asarray([[3, 7]])
    seqs = jnp.asarray(np.random.default_rng(0).integers(2, 63, (1, s)), jnp.int32)
    t_def, t_state = nnx.split(target)
    d_def, d_state = nnx.split(drafter)
    bs = cfg.block_size

    @jax.jit
    def run(t_state, d_state, cache):
        target, drafter = nnx.merge(t_def, t_state), nnx.merge(d_def, d_state)
        taps = tt.lm_forward(target, seqs, tap_layers=cfg.target_layer_ids).taps
        tokens, _ = td.block_inputs(seqs, anchors, bs, cfg.mask_token_id)
        hidden = td.drafter_train_hidden(drafter, taps, target.embed_tokens(tokens), anchors)
        refs = []
        for n in range(anchors.shape[1]):  # inference: a cache holding context rows < anchor, one block
            a = anchors[0, n]
            c, _ = drafter.append_context(cache, taps, jnp.arange(s)[None], a[None])
            blk = tokens[:, n * bs:(n + 1) * bs]
            refs.append(drafter(c, target.embed_tokens(blk), a + jnp.arange(bs)[None]))
        return hidden, jnp.concatenate(refs, axis=1)

    hidden, ref = run(t_state, d_state, init_draft_cache(cfg, 1, 16))
    np.testing.assert_allclose(hidden, ref, rtol=2e-4, atol=2e-4)


def test_drafter_training_step_decreases_loss(tmp_path):
    target, drafter = _tiny_pair()
    cfg = drafter.cfg
    seqs = jnp.asarray(np.random.default_rng(0).integers(2, 63, (2, 16)), jnp.int32)
    taps = tt.lm_forward(target, seqs, tap_layers=cfg.target_layer_ids).taps
    anchors = jnp.asarray(td.sample_anchors(np.random.default_rng(0), 2, 3, 4, 16 - cfg.block_size))
    d_def, params = nnx.split(drafter)
    t_def, t_state = nnx.split(target)
    tx = optax.adam(1e-2)
    weights = jnp.asarray(td.decay_weights(cfg.block_size, 4.0))
    assert weights[0] == 0 and np.isclose(weights[2], np.exp(-1 / 4.0))
    step = td.make_train_step(d_def, t_def, tx, weights)
    frozen = [np.asarray(x) for x in jax.tree.leaves(t_state)]
    p1, o1, loss0, _ = step(params, tx.init(params), t_state, taps, seqs, anchors, 1.0)
    _, _, loss1, acc = step(jax.tree.map(jnp.copy, p1), jax.tree.map(jnp.copy, o1), t_state, taps, seqs, anchors, 1.0)
    assert float(loss1) < float(loss0) and acc.shape == (cfg.block_size,)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(frozen, jax.tree.leaves(t_state)))
    trained = nnx.merge(d_def, p1)
    save_drafter(trained, str(tmp_path / "d"))
    back = restore_drafter(str(tmp_path / "d"))
    assert back.cfg == cfg
    for a, b in zip(jax.tree.leaves(nnx.state(back)), jax.tree.leaves(nnx.state(trained))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_eval_probe_spans_the_heldout_rows_past_the_final_eval():
    held = np.arange(300)[:, None] * np.ones((1, 5), dtype=np.int64)  # row i holds i
    probe = tt.probe_rows(held, eval_rows=100, count=32)[:, 0]
    assert len(set(probe.tolist())) == 32 and probe.min() == 100 and probe.max() == 299  # disjoint, first to last
    assert np.all(np.diff(probe) >= 6)  # evenly spread, not the last 32 rows
    assert len(tt.probe_rows(held, eval_rows=268, count=32)) == 32
    with pytest.raises(ValueError, match="only 31 of the 300 held-out rows are left"):
        tt.probe_rows(held, eval_rows=269, count=32)


def _scan_bpe(ranks, piece):
    """The plain BPE: scan every adjacent pair, join the lowest-ranked (leftmost of equals), repeat."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while True:
        joined = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
        if not joined:
            return [ranks[p] for p in parts]
        _, i = min(joined)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def test_tiktoken_merge_matches_the_plain_scan():
    rng = np.random.default_rng(0)
    for _ in range(150):
        alphabet = b"abc"[:rng.integers(1, 4)]
        ranks = {bytes([i]): i for i in range(256)}
        for _ in range(rng.integers(0, 40)):
            ranks.setdefault(bytes(rng.choice(list(alphabet), rng.integers(2, 7))), len(ranks))
        tok = TiktokenTokenizer(ranks)
        for _ in range(10):
            piece = bytes(rng.choice(list(alphabet), rng.integers(1, 40)))
            assert tok._merge(piece) == _scan_bpe(ranks, piece), (sorted(ranks.items())[256:], piece)


def test_bfloat16_models_train_through_a_float32_master_copy():
    """A bfloat16 model's params would drop Adam steps below half an ulp (RMSNorm weights near 1.0 stayed exactly
    1.0 at lr 1e-3); the trainers keep float32 masters and run the model on them cast back."""
    _, params = nnx.split(_tiny_target(dtype="bfloat16"))
    graphdef = nnx.graphdef(_tiny_target(dtype="bfloat16"))
    master, dtypes = tt.float32_master(params)
    assert {x.dtype for x in jax.tree.leaves(params)} >= {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(master)} == {jnp.dtype(jnp.float32)}
    tx = tt.make_optimizer()
    step = tt.make_train_step(graphdef, tx, dtypes=dtypes)
    rows = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 17)), jnp.int32)
    start = [np.asarray(x) for x in jax.tree.leaves(master)]
    opt_state = tx.init(master)
    for _ in range(3):
        master, opt_state, loss = step(master, opt_state, rows, jnp.float32(1e-3))
    assert np.isfinite(float(loss))
    norms = [(k, np.asarray(v.value)) for k, v in master.flat_state() if "norm" in "/".join(map(str, k))]
    assert norms
    before = dict(zip([k for k, _ in master.flat_state()], start))
    for k, value in norms:
        assert np.all(value != before[k]), k
    cast = tt.as_dtypes(master, dtypes)
    assert [x.dtype for x in jax.tree.leaves(cast)] == [x.dtype for x in jax.tree.leaves(params)]


def test_no_warmup_starts_at_the_full_rate():
    assert float(tt.lr_schedule(300, 3e-3, 0)(0)) == pytest.approx(3e-3)
    assert float(tt.lr_schedule(300, 3e-3, 0)(300)) == pytest.approx(3e-4)
    assert float(tt.lr_schedule(300, 3e-3, 10)(0)) == 0.0
    assert float(tt.lr_schedule(300, 3e-3, 10)(10)) == pytest.approx(3e-3)


def test_a_drafter_steps_batch_depends_on_its_step_alone():
    """A resumed drafter run draws what an uninterrupted one draws at each step (it used to reseed at the resume)."""
    draws = [td.step_batch(0, step, 50, 4, 3, 8, 40) for step in range(6)]
    again = [td.step_batch(0, step, 50, 4, 3, 8, 40) for step in (3, 4, 5)]
    for (idx, anchors), (idx2, anchors2) in zip(draws[3:], again):
        np.testing.assert_array_equal(idx, idx2)
        np.testing.assert_array_equal(anchors, anchors2)
    assert len({tuple(idx) for idx, _ in draws}) == 6  # fresh batches every step
    for idx, anchors in draws:
        assert len(set(idx)) == 4 and anchors.shape == (4, 3) and anchors.min() >= 8 and anchors.max() <= 40
        assert np.all(np.diff(anchors, axis=1) > 0)
