"""Target-model invariants: torch parity, absorbed == naive MLA, cached decode == full forward,
tree block == sequential paths, sharded == unsharded."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_reference import hf_logits_and_hidden, tiny_hf_model
from ddtree_jax.cache import init_cache
from ddtree_jax.decode import decode_step, pad_prompts, prefill
from ddtree_jax.hf_loader import load_hf_model
from ddtree_jax.sharding import param_shardings
from ddtree_jax.layers import rms_norm
from ddtree_jax.config import tiny_config
from ddtree_jax.model import KimiModel, Runtime, causal_mask
from ddtree_jax.sharding import DEFAULT_RULES, make_mesh


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _load_pair(tmp_path_factory, **overrides):
    hf = tiny_hf_model(seed=1, **overrides)
    path = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(path)
    return hf, load_hf_model(str(path), dtype="float32")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _load_pair(tmp_path_factory)


@pytest.fixture(scope="module", params=[dict(), dict(n_group=2, topk_group=1)], ids=["k2", "grouped"])
def any_pair(request, tmp_path_factory):
    return _load_pair(tmp_path_factory, **request.param)


@jax.jit(static_argnames=("graphdef", "runtime", "taps"))
def _full_forward(graphdef, state, tokens, runtime, taps):
    model = nnx.merge(graphdef, state)
    b, t = tokens.shape
    cache = init_cache(model.cfg, b, t)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    return model(tokens, positions, cache, causal_mask(b, t), tap_layers=taps, runtime=runtime)


def full_forward(model, tokens, runtime=Runtime(), taps=()):
    """Plain causal forward of whole sequences [B, T] from an empty cache (jitted)."""
    graphdef, state = nnx.split(model)
    return _full_forward(graphdef, state, jnp.asarray(tokens), runtime, tuple(taps))


def test_forward_matmul_precision_is_explicit():
    """The forward pins f32 matmul precision (GPUs would otherwise use TF32 and greedy DDTree could
    differ from AR); ``matmul_precision=None`` leaves the caller's setting."""
    model = KimiModel(tiny_config(), nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((1, 3), jnp.int32)

    def dots(runtime):
        text = str(jax.make_jaxpr(lambda s: _full_forward.__wrapped__(graphdef, s, tokens, runtime, ()))(state))
        return text.count("dot_general"), text.count("Precision.HIGHEST")

    with jax.default_matmul_precision("default"):  # conftest sets "highest" for the whole suite
        total, highest = dots(Runtime())
        total_free, highest_free = dots(Runtime(matmul_precision=None))
    assert total > 10 and highest == 2 * total  # every dot: (lhs, rhs) both HIGHEST
    assert total_free == total and highest_free < highest
    bf16 = KimiModel(tiny_config(dtype="bfloat16"), nnx.Rngs(0))  # bf16 models are left alone
    graphdef, state = nnx.split(bf16)
    with jax.default_matmul_precision("default"):
        assert dots(Runtime()) == dots(Runtime(matmul_precision=None))


def test_config_read_from_file(any_pair):
    hf, model = any_pair
    cfg = model.cfg
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 64.0 and cfg.rope.beta_fast == 32.0
    assert cfg.n_group == hf.config.n_group and cfg.eos_token_ids == (1,)
    assert abs(cfg.softmax_scale - hf.model.layers[0].self_attn.scaling) < 1e-7


@pytest.mark.parametrize("attention", ["absorbed", "naive"])
def test_logits_and_hidden_states_match_torch(any_pair, attention):
    hf, model = any_pair
    tokens = np.random.default_rng(0).integers(0, hf.config.vocab_size, (2, 11))
    ref_logits, ref_hidden = hf_logits_and_hidden(hf, tokens)
    n = model.cfg.num_layers
    out = full_forward(model, tokens, Runtime(attention=attention), taps=tuple(range(n + 1)))
    assert rel_err(out.logits, ref_logits) <= 1e-4
    for i in range(n - 1):  # HF hidden_states[i+1] is layer i's output; the last one is final-normed
        assert rel_err(out.taps[i], ref_hidden[i + 1]) <= 1e-4, f"layer {i}"
    last = rms_norm(out.taps[n - 1], model.norm.weight.value, model.cfg.rms_norm_eps)
    assert rel_err(last, ref_hidden[n]) <= 1e-4
    assert rel_err(out.taps[n], ref_hidden[n]) <= 1e-4  # tap index n: after the final norm, as HF's


def test_a_block_of_the_wrong_shape_or_dtype_is_refused_by_name():
    """tokens, positions, tree_mask and cache must agree (B, T) and have integer / bool dtypes: a float position
    would rotate by a fraction of a step and a float mask would read any nonzero as visible, silently."""
    cfg = tiny_config()
    model = KimiModel(cfg, nnx.Rngs(0))
    b, t = 2, 3
    tokens, positions = jnp.ones((b, t), jnp.int32), jnp.broadcast_to(jnp.arange(t), (b, t))
    cache, mask = init_cache(cfg, b, 16), causal_mask(b, t)
    cases = [((tokens[0], positions, cache, mask), r"tokens must be \[B, T\], got shape \(3,\)"),
             ((tokens.astype(jnp.float32), positions, cache, mask), "tokens must be integers, got dtype float32"),
             ((tokens, positions[:, :2], cache, mask), r"positions must have shape \(2, 3\), got \(2, 2\)"),
             ((tokens, positions + 0.5, cache, mask), "positions must be integers, got dtype float32"),
             ((tokens, positions, cache, mask[:1]), r"tree_mask must be \[B, T, T\]=\(2, 3, 3\) bool"),
             ((tokens, positions, cache, mask.astype(jnp.float32)), "tree_mask must be .* float32"),
             ((tokens, positions, init_cache(cfg, 3, 16), mask),
              r"cache must hold kv \[NL, B, S, C\]=\(3, 2, 16, 40\)")]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            model(*args)
        with pytest.raises(ValueError, match=match):
            jax.jit(lambda *a: model(*a))(*args)
    assert model(tokens, positions, cache, mask).logits.shape == (b, t, cfg.vocab_size)


def test_taps_come_in_the_order_asked():
    """tap_layers (1, 0): taps[0] is layer 1's output, taps[1] layer 0's (a drafter's target_layer_ids order)."""
    cfg = tiny_config(num_layers=2, first_k_dense_replace=2)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: KimiModel(cfg, nnx.Rngs(0))))
    rng = np.random.default_rng(5)
    state = jax.tree.map(lambda a: jnp.asarray(0.1 * rng.standard_normal(a.shape), a.dtype), abstract)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 4)))

    @jax.jit
    def both_orders(state):
        model = nnx.merge(graphdef, state)
        run = functools.partial(model, tokens, jnp.arange(4)[None], init_cache(cfg, 1, 4), causal_mask(1, 4))
        return run(tap_layers=(1, 0)).taps, run(tap_layers=(0, 1)).taps

    swapped, in_order = both_orders(state)
    assert np.abs(np.asarray(in_order[0] - in_order[1])).max() > 1e-3
    np.testing.assert_array_equal(np.asarray(swapped), np.asarray(in_order)[::-1])


def test_a_forward_lowers_one_body_per_layer_structure():
    """Each decoder layer is called through the jitted ``apply_layer``: the lowered forward holds one function per
    layer structure (dense, MoE) whatever the layer count, so lowering does not grow with the layers (issue #7)."""
    def lowered_functions(num_layers):
        cfg = tiny_config(num_layers=num_layers, first_k_dense_replace=1)
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: KimiModel(cfg, nnx.Rngs(0))))
        ints = jax.ShapeDtypeStruct((1, 3), jnp.int32)
        cache = jax.eval_shape(lambda: init_cache(cfg, 1, 8))
        mask = jax.ShapeDtypeStruct((1, 3, 3), jnp.bool_)
        text = jax.jit(lambda st, *a: nnx.merge(graphdef, st)(*a).logits).lower(abstract, ints, ints, cache,
                                                                              mask).as_text()
        return sorted(re.findall(r"func\.func (?:private|public) @(\w+)", text))

    assert lowered_functions(2) == lowered_functions(6)
    assert sum(name.startswith("apply_layer") for name in lowered_functions(6)) == 2  # dense, MoE


def test_model_without_q_lora_matches_torch(tmp_path_factory):
    """q_lora_rank None (DeepSeek-V2-Lite style, q projected straight from the hidden state)."""
    hf, model = _load_pair(tmp_path_factory, q_lora_rank=None, num_hidden_layers=1)  # one dense layer
    assert model.layers[0].attn.q_a is None
    tokens = np.random.default_rng(6).integers(0, hf.config.vocab_size, (1, 6))
    assert rel_err(full_forward(model, tokens).logits, hf_logits_and_hidden(hf, tokens)[0]) <= 1e-4


@pytest.mark.parametrize("overrides", [dict(n_shared_experts=0), dict(num_hidden_layers=2, first_k_dense_replace=3),
                                       dict(hidden_act="swish")], ids=["no-shared-experts", "all-dense", "swish"])
def test_configs_transformers_takes_load_and_match_torch(tmp_path_factory, overrides):
    """Before, each was refused: no shared experts (transformers saves them as empty tensors), a
    first_k_dense_replace past the last layer (every layer dense, as in a cut-down DeepSeek-V3) and "swish" (SiLU
    in transformers' ACT2FN)."""
    hf, model = _load_pair(tmp_path_factory, **overrides)
    assert model.cfg.first_k_dense_replace <= model.cfg.num_layers
    tokens = np.random.default_rng(7).integers(0, hf.config.vocab_size, (2, 7))
    assert rel_err(full_forward(model, tokens).logits, hf_logits_and_hidden(hf, tokens)[0]) <= 1e-4


def test_absorbed_equals_naive(pair):
    _, model = pair
    tokens = np.random.default_rng(1).integers(0, model.cfg.vocab_size, (3, 9))
    a = full_forward(model, tokens, Runtime(attention="absorbed")).logits
    b = full_forward(model, tokens, Runtime(attention="naive")).logits
    assert rel_err(a, b) <= 1e-5


def test_both_attentions_ignore_what_lies_past_the_prefix(pair):
    """Cache rows at or past a stream's length may hold anything (NaN included): naive attention gave NaN logits
    there (probability 0 times a NaN value), absorbed attention none."""
    import dataclasses

    _, model = pair
    cache = init_cache(model.cfg, 2, 8)
    cache = dataclasses.replace(cache, kv=cache.kv.at[:, 0, 3:].set(jnp.nan).at[:, 1, 0:].set(jnp.nan),
                                lengths=jnp.array([3, 0], jnp.int32))
    tokens, positions = jnp.array([[3, 4], [5, 6]]), jnp.array([[3, 4], [0, 1]])
    logits = {att: np.asarray(model(tokens, positions, cache, causal_mask(2, 2),
                                    runtime=Runtime(attention=att)).logits) for att in ("absorbed", "naive")}
    assert np.isfinite(logits["absorbed"]).all() and np.isfinite(logits["naive"]).all()
    assert rel_err(logits["naive"], logits["absorbed"]) <= 1e-5


def test_cached_decode_equals_full_forward(pair):
    """Ragged prompts prefilled together, then token-by-token decode: every logit row equals the
    full-sequence forward of that stream."""
    _, model = pair
    cfg = model.cfg
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (14, 12, 15)]
    prompt_lens = [5, 3, 8]
    graphdef, state = nnx.split(model)
    cache = init_cache(cfg, 3, 32)
    tokens, lengths = pad_prompts([s[:n] for s, n in zip(seqs, prompt_lens)], vocab_size=cfg.vocab_size,
                                  capacity=32)
    last, cache, overflow, _ = prefill(graphdef, state, cache, jnp.asarray(tokens), jnp.asarray(lengths))
    assert not overflow.any()
    got = [[np.asarray(last[b])] for b in range(3)]
    for step in range(6):
        nxt = jnp.asarray([s[n + step] for s, n in zip(seqs, prompt_lens)], jnp.int32)
        logits, cache, overflow = decode_step(graphdef, state, cache, nxt)
        for b in range(3):
            got[b].append(np.asarray(logits[b]))
    width = max(len(s) for s in seqs)
    padded = np.asarray([s + [0] * (width - len(s)) for s in seqs])  # causal: padding after is invisible
    full = np.asarray(full_forward(model, padded).logits)
    for b, (s, n) in enumerate(zip(seqs, prompt_lens)):
        assert rel_err(np.stack(got[b]), full[b, n - 1: n + 6]) <= 1e-4, f"stream {b}"


def random_tree(rng, t):
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
    depth = [0] * t
    for i in range(1, t):
        depth[i] = depth[parents[i]] + 1
    vis = np.zeros((t, t), bool)
    for i in range(t):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    return parents, np.array(depth), vis


def test_tree_block_equals_sequential_paths(pair):
    """Each tree node's logits equal the last logits of its root-to-node path run as a plain sequence."""
    _, model = pair
    cfg = model.cfg
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, cfg.vocab_size, 6).tolist()
    t = 9
    parents, depth, vis = random_tree(rng, t)
    node_tokens = rng.integers(0, cfg.vocab_size, t)
    graphdef, state = nnx.split(model)
    cache = init_cache(cfg, 1, 32)
    tokens, lengths = pad_prompts([prefix], vocab_size=cfg.vocab_size, capacity=32)
    _, cache, _, _ = prefill(graphdef, state, cache, jnp.asarray(tokens), jnp.asarray(lengths))
    positions = jnp.asarray(len(prefix) + depth)[None]
    block = jax.jit(lambda st, c, tok, pos, v: nnx.merge(graphdef, st)(tok, pos, c, v).logits)
    logits = np.asarray(block(state, cache, jnp.asarray(node_tokens)[None], positions, jnp.asarray(vis)[None]))[0]
    paths = []
    for i in range(t):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(prefix + [int(node_tokens[j]) for j in reversed(path)])
    width = max(len(p) for p in paths)
    ref = np.asarray(full_forward(model, np.asarray([p + [0] * (width - len(p)) for p in paths])).logits)
    for i, p in enumerate(paths):
        assert rel_err(logits[i], ref[i, len(p) - 1]) <= 1e-4, f"node {i}"


def test_sharded_equals_unsharded(pair, host_devices):
    """8 fake CPU devices: data=2 x model=4 (experts expert-parallel, heads/ffn/vocab tensor-parallel)."""
    _, model = pair
    mesh = make_mesh(data=2, model=4, devices=host_devices)
    graphdef, state = nnx.split(model)
    sharded_state = jax.device_put(state, param_shardings(state, mesh, DEFAULT_RULES))
    experts = sharded_state["layers"][1]["mlp"]["w13"].value
    assert experts.addressable_shards[0].data.shape[0] == model.cfg.n_routed_experts // 4
    tokens = np.random.default_rng(4).integers(0, model.cfg.vocab_size, (4, 7))
    runtime = Runtime(mesh=mesh, rules=DEFAULT_RULES)

    @jax.jit
    def run(state, tokens):
        m = nnx.merge(graphdef, state)
        b, t = tokens.shape
        cache = init_cache(m.cfg, b, t)
        return m(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), cache, causal_mask(b, t), runtime=runtime).logits

    sharded = run(sharded_state, jnp.asarray(tokens))
    plain = full_forward(model, tokens).logits
    assert rel_err(sharded, plain) <= 1e-5
    # the router is replicated, so routing needs no collective: the model axis sees only sums (attention
    # output, expert shares, the LM head's gather), never the all-to-alls of a top-k across devices
    hlo = run.lower(sharded_state, jnp.asarray(tokens)).compile().as_text()
    assert not re.search(r"\b(all-to-all|collective-permute)(-start)?\(", hlo)
    assert sharded_state["layers"][1]["mlp"]["router"].value.sharding.is_fully_replicated


def test_runtime_checks_its_attention_and_a_mesh_brings_its_rules(host_devices):
    """A mesh without rules takes DEFAULT_RULES, which every placement on a mesh falls back to, so the latent
    attention and the experts run per device as the weights were placed (without rules they left shard_map out)."""
    mesh = make_mesh(data=2, model=4, devices=host_devices)
    assert Runtime(mesh=mesh).rules is DEFAULT_RULES and Runtime(mesh=mesh) == Runtime(mesh=mesh, rules=DEFAULT_RULES)
    assert Runtime().rules is None
    with pytest.raises(ValueError, match="attention must be 'absorbed' or 'naive', got 'flash'"):
        Runtime(attention="flash")


@pytest.mark.parametrize("b,h", [(4, 6), (3, 8)])
def test_latent_attention_leaves_an_axis_that_does_not_divide_replicated(b, h, host_devices):
    """data=2 x model=4: a batch or head count the mesh axis does not divide is left replicated (the other
    axis still split where it divides), with the unsharded result; never handed to shard_map unevenly."""
    from pallas_kernels.tree_attention import tree_attention_ref
    from ddtree_jax.model import latent_attention
    from tests.test_tree_attention_kernel import as_jax, make_case
    runtime = Runtime(mesh=make_mesh(data=2, model=4, devices=host_devices), rules=DEFAULT_RULES)
    args = as_jax(make_case(0, b, 4, h, 16, 8, 24, [0, 5, 24, 11][:b], "tree"))
    kw = dict(scale=0.2, kv_lora_rank=16)
    got = jax.jit(lambda *a: latent_attention(tree_attention_ref, runtime, *a, **kw))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(tree_attention_ref(*args, **kw)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec,x_shape,w_shape,axis", [
    ("btd,dhk->bthk", (1, 1, 16), (16, 2, 8), (0, 0)),     # q_b
    ("bthv,hvd->btd", (1, 1, 2, 8), (2, 8, 16), (0, 0)),   # the output projection
    ("...d,df->...f", (1, 16), (16, 24), (0, 0)),          # the shared expert on flat tokens
    ("btd,dw->btw", (1, 1, 16), (16, 24), (0, 0)),
    ("td,dhk->hkt", (1, 16), (16, 2, 8), (0, 2)),           # the token axis moves: sliced where the result has it
    ("md,ed->me", (1, 16), (24, 16), (0, 0)),               # the router's bf16 dot (bench_layer's padded variant)
    ("...d,df->...f", (1, 3, 16), (16, 24), None),         # three tokens: not padded
    ("bthn,lhn->bthl", (1, 1, 2, 8), (4, 2, 8), None),     # heads shared with w (absorbed MLA): not padded
    ("bths,bshv->bthv", (1, 1, 2, 4), (1, 4, 2, 8), None),
])
def test_one_token_dot_padding(spec, x_shape, w_shape, axis):
    """On CUDA one token's product runs padded to 2 rows (XLA's one-row kernel is slower); the padded
    product is the plain one, and only one-token products by a weight are padded."""
    from ddtree_jax.layers import _one_token_axis, _padded_dot, _plain_dot, dot
    assert _one_token_axis(spec, x_shape) == axis
    rng = np.random.default_rng(len(spec))
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)
    want = _plain_dot(x, w, spec, x.dtype)
    np.testing.assert_allclose(np.asarray(dot(x, w, spec)), np.asarray(want), rtol=1e-6, atol=1e-6)
    if axis is not None:
        got = _padded_dot(x, w, spec, axis, x.dtype)
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_every_logical_axis_is_used():
    """A declared logical axis that no parameter or cache carries is dead: rules for it would do nothing."""
    from ddtree_jax.cache import CACHE_AXES
    from ddtree_jax.config import QuantConfig
    from ddtree_jax.drafter import DRAFT_CACHE_AXES, DFlashDrafter, tiny_drafter_config
    from ddtree_jax.hf_loader import ShapeOnlyRngs, abstract_model
    from ddtree_jax.sharding import LOGICAL_AXES

    used = set(CACHE_AXES) | set(DRAFT_CACHE_AXES)
    for quant in (None, QuantConfig()):
        cfg = tiny_config(quant=quant)
        drafter = nnx.eval_shape(lambda: DFlashDrafter(tiny_drafter_config(cfg), ShapeOnlyRngs()))
        for state in (abstract_model(cfg)[1], nnx.state(drafter)):
            for _, variable in state.flat_state():
                used.update(axis for axis in variable.get_metadata()["logical_axes"] if axis is not None)
    assert set(LOGICAL_AXES) == used
