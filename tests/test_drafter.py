"""DFlash drafter: parity with a plain PyTorch reference (transformers' Qwen3 components + KV injection),
multi-round context appends == whole context at once, bidirectional block, positions, cache overflow,
config and checkpoint errors."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash_reference import HF_CONFIG, N_TAPS, YARN, export, random_reference, ref_tensors
from ddtree_jax.config import ConfigError, tiny_config, yarn_mscale
from ddtree_jax.drafter import (DFlashDrafter, DrafterConfig, build_target_layer_ids, check_drafter_target,
                                draft_cache_axes, draft_logits, init_draft_cache, k26_drafter_config,
                                load_hf_drafter, tiny_drafter_config)
from ddtree_jax.model import KimiModel
from ddtree_jax.rope import rope_cos_sin, rope_inv_freq
from ddtree_jax.safetensors_io import CheckpointError
from ddtree_jax.sharding import DEFAULT_RULES, make_mesh, named_sharding

BLOCK, MASK = HF_CONFIG["block_size"], HF_CONFIG["dflash_config"]["mask_token_id"]


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    ref = random_reference()
    return ref, export(ref_tensors(ref, prefix="model."), tmp_path_factory.mktemp("drafter"))


@pytest.fixture(scope="module")
def setup(exported):
    ref, path = exported
    drafter = load_hf_drafter(path, dtype="float32")
    return ref, drafter, random_target()


def random_target(seed=3):
    """A tiny KimiModel with random weights, filled from numpy (eager NNX init is slow on CPU)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: KimiModel(tiny_config(), nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda s: jnp.asarray((0.1 * rng.standard_normal(s.shape)).astype(s.dtype)), abstract)
    return nnx.merge(graphdef, state)


# ----- jitted entry points --------------------------------------------------------------------------

@jax.jit(static_argnames=("graphdef",))
def _append(graphdef, state, cache, taps, positions, counts):
    return nnx.merge(graphdef, state).append_context(cache, taps, positions, counts)


@jax.jit(static_argnames=("graphdef",))
def _forward(graphdef, state, cache, embeds, positions):
    return nnx.merge(graphdef, state)(cache, embeds, positions)


@jax.jit(static_argnames=("dgraph", "tgraph"))
def _draft_logits(dgraph, dstate, tgraph, tstate, cache, bonus, start):
    return draft_logits(nnx.merge(dgraph, dstate), nnx.merge(tgraph, tstate), cache, bonus, start)


def append(drafter, cache, taps, positions, counts):
    g, s = nnx.split(drafter)
    return _append(g, s, cache, jnp.asarray(taps, jnp.float32), jnp.asarray(positions, jnp.int32),
                   jnp.asarray(counts, jnp.int32))


def forward(drafter, cache, embeds, positions):
    g, s = nnx.split(drafter)
    return np.asarray(_forward(g, s, cache, jnp.asarray(embeds, jnp.float32), jnp.asarray(positions, jnp.int32)))


def logits(drafter, target, cache, bonus, start):
    (dg, ds), (tg, ts) = nnx.split(drafter), nnx.split(target)
    return np.asarray(_draft_logits(dg, ds, tg, ts, cache, jnp.asarray(bonus, jnp.int32),
                                    jnp.asarray(start, jnp.int32)))


def torch_logits(ref, target, taps, positions, bonus):
    """taps [n, B, Tc, D], positions [B, Tc+Tb], bonus [B] -> logits [B, Tb-1, W] via the target's tables."""
    embed = np.asarray(target.embed.value)
    head = torch.from_numpy(np.array(target.lm_head.value))
    tokens = np.concatenate([np.asarray(bonus)[:, None], np.full((len(bonus), BLOCK - 1), MASK)], axis=1)
    with torch.no_grad():
        hidden = ref(torch.from_numpy(np.concatenate(list(taps), axis=-1)).float(),
                     torch.from_numpy(embed[tokens]), torch.from_numpy(np.asarray(positions, np.int64)))
    return (hidden[:, 1:] @ head).numpy()


# ----- parity ---------------------------------------------------------------------------------------

def test_one_round_matches_torch(setup):
    ref, drafter, target = setup
    rng = np.random.default_rng(0)
    b, tc = 2, 6
    taps = rng.standard_normal((N_TAPS, b, tc, 64)).astype(np.float32)
    base = np.array([0, 37])
    ctx_pos = base[:, None] + np.arange(tc)
    start = base + tc
    bonus = np.array([5, 77])
    cache, overflow = append(drafter, init_draft_cache(drafter.cfg, b, 16), taps, ctx_pos, [tc, tc])
    assert not np.asarray(overflow).any() and np.asarray(cache.lengths).tolist() == [tc, tc]
    got = logits(drafter, target, cache, bonus, start)
    want = torch_logits(ref, target, taps, base[:, None] + np.arange(tc + BLOCK), bonus)
    assert got.shape == (b, BLOCK - 1, 256) and got.dtype == np.float32
    assert rel_err(got, want) <= 1e-4


def test_multi_round_appends_equal_whole_context(setup):
    """Two ragged appends with padding rows (junk) per stream == torch over the whole context at once."""
    ref, drafter, target = setup
    rng = np.random.default_rng(1)
    lengths, offsets, bonus = [7, 5], [0, 11], np.array([3, 200])
    full = [rng.standard_normal((N_TAPS, n, 64)).astype(np.float32) for n in lengths]
    cache = init_draft_cache(drafter.cfg, 2, 12)
    done = [0, 0]
    for tc, counts in ((4, [4, 2]), (5, [3, 3])):
        taps = 100 * rng.standard_normal((N_TAPS, 2, tc, 64)).astype(np.float32)  # junk in padding rows
        pos = rng.integers(500, 900, (2, tc))
        for s in range(2):
            rows = slice(done[s], done[s] + counts[s])
            taps[:, s, : counts[s]] = full[s][:, rows]
            pos[s, : counts[s]] = offsets[s] + np.arange(done[s], done[s] + counts[s])
            done[s] += counts[s]
        cache, overflow = append(drafter, cache, taps, pos, counts)
        assert not np.asarray(overflow).any()
    assert np.asarray(cache.lengths).tolist() == lengths
    start = np.asarray(offsets) + np.asarray(lengths)
    got = logits(drafter, target, cache, bonus, start)
    for s in range(2):
        want = torch_logits(ref, target, full[s][:, None], (offsets[s] + np.arange(lengths[s] + BLOCK))[None],
                            bonus[s:s + 1])
        assert rel_err(got[s], want[0]) <= 1e-4, f"stream {s}"


def test_block_is_bidirectional_and_positions_matter(setup):
    _, drafter, _ = setup
    rng = np.random.default_rng(2)
    taps = rng.standard_normal((N_TAPS, 1, 5, 64)).astype(np.float32)
    cache, _ = append(drafter, init_draft_cache(drafter.cfg, 1, 8), taps, np.arange(5)[None], [5])
    embeds = rng.standard_normal((1, BLOCK, 64)).astype(np.float32)
    pos = (5 + np.arange(BLOCK))[None]
    base = forward(drafter, cache, embeds, pos)
    changed = embeds.copy()
    changed[:, -1] = rng.standard_normal(64)
    out = forward(drafter, cache, changed, pos)
    assert (np.abs(out - base)[0, :-1].max(axis=-1) > 1e-3).all(), "earlier slots must see the last block token"
    assert np.abs(forward(drafter, cache, embeds, pos + 3) - base).max() > 1e-3, "block positions must matter"
    moved, _ = append(drafter, init_draft_cache(drafter.cfg, 1, 8), taps, np.arange(5)[None] + 2, [5])
    assert np.abs(forward(drafter, moved, embeds, pos) - base).max() > 1e-3, "context positions must matter"
    # rows past lengths are invisible
    junk = cache.k.at[:, :, 5:].set(1e3), cache.v.at[:, :, 5:].set(-1e3)
    dirty = type(cache)(k=junk[0], v=junk[1], lengths=cache.lengths)
    np.testing.assert_allclose(forward(drafter, dirty, embeds, pos), base, rtol=1e-6, atol=1e-6)


def test_invisible_cache_rows_may_hold_nan(setup):
    """Rows past a stream's length never reach the output, not even as 0 * NaN."""
    _, drafter, _ = setup
    rng = np.random.default_rng(7)
    cache, _ = append(drafter, init_draft_cache(drafter.cfg, 1, 8), rng.standard_normal((N_TAPS, 1, 5, 64)),
                      np.arange(5)[None], [5])
    embeds, pos = rng.standard_normal((1, BLOCK, 64)), (5 + np.arange(BLOCK))[None]
    dirty = type(cache)(k=cache.k.at[:, :, 5:].set(jnp.nan), v=cache.v.at[:, :, 5:].set(jnp.nan),
                        lengths=cache.lengths)
    np.testing.assert_array_equal(forward(drafter, dirty, embeds, pos), forward(drafter, cache, embeds, pos))


def test_append_fills_to_capacity_and_flags_counts_past_the_block(setup):
    _, drafter, _ = setup
    rng = np.random.default_rng(8)
    taps = rng.standard_normal((N_TAPS, 2, 3, 64))
    cache = init_draft_cache(drafter.cfg, 2, 6)
    cache, overflow = append(drafter, cache, taps, np.tile(np.arange(3), (2, 1)), [3, 1])
    full, overflow = append(drafter, cache, taps, np.tile(np.arange(3, 6), (2, 1)), [3, 4])
    assert np.asarray(overflow).tolist() == [False, True]  # 3 + 3 == capacity fits; 4 rows of a 3-row block do not
    assert np.asarray(full.lengths).tolist() == [6, 1]


def test_cache_overflow_is_flagged_not_clamped(setup):
    _, drafter, _ = setup
    rng = np.random.default_rng(3)
    cache = init_draft_cache(drafter.cfg, 2, 8)
    cache, overflow = append(drafter, cache, rng.standard_normal((N_TAPS, 2, 6, 64)), np.tile(np.arange(6), (2, 1)),
                             [6, 2])
    assert not np.asarray(overflow).any()
    before = jax.tree.map(np.asarray, cache)
    taps = rng.standard_normal((N_TAPS, 2, 3, 64))
    after, overflow = append(drafter, cache, taps, np.tile(np.arange(6, 9), (2, 1)), [3, 1])
    assert np.asarray(overflow).tolist() == [True, False]
    assert np.asarray(after.lengths).tolist() == [6, 3]
    np.testing.assert_array_equal(np.asarray(after.k)[:, 0], before.k[:, 0])
    np.testing.assert_array_equal(np.asarray(after.v)[:, 0], before.v[:, 0])
    assert np.abs(np.asarray(after.k)[:, 1, 2]).max() > 0 and np.abs(np.asarray(after.k)[:, 1, 3:]).max() == 0
    _, overflow = append(drafter, cache, taps, np.zeros((2, 3)), [4, -1])  # counts outside [0, Tc]
    assert np.asarray(overflow).tolist() == [True, True]


# ----- config, rope amplitude, loading errors ----------------------------------------------------------

def kimi_hf_dict():
    """The published Kimi-K2.5-DFlash config.json fields (notes §1.1) plus MLP width and block size."""
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 7168,
            "intermediate_size": 18432, "vocab_size": 163840, "head_dim": 128, "num_attention_heads": 64,
            "num_key_value_heads": 8, "num_hidden_layers": 6, "num_target_layers": 61, "block_size": 8,
            "max_position_embeddings": 262144, "rope_theta": 50000.0,
            "dflash_config": {"target_layer_ids": [1, 12, 24, 35, 47, 58], "mask_token_id": 163838},
            "rope_scaling": {"rope_type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}}


def test_kimi_config_and_preset():
    cfg = DrafterConfig.from_hf_dict(kimi_hf_dict())
    assert cfg == k26_drafter_config()
    assert hash(cfg) == hash(k26_drafter_config())
    raw = kimi_hf_dict()
    del raw["dflash_config"]["target_layer_ids"]
    assert DrafterConfig.from_hf_dict(raw).target_layer_ids == (1, 12, 24, 35, 47, 58)
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    legacy = DrafterConfig.from_hf_dict(kimi_hf_dict(), legacy_yarn_amplitude=True)
    assert legacy == k26_drafter_config(legacy_yarn_amplitude=True)
    assert abs(legacy.rope.attention_factor - (1 + 0.1 * np.log(64))) < 1e-9
    explicit = kimi_hf_dict()
    explicit["rope_scaling"]["attention_factor"] = 1.25
    assert DrafterConfig.from_hf_dict(explicit, legacy_yarn_amplitude=True).rope.attention_factor == 1.25
    tiny = tiny_drafter_config(tiny_config())
    assert tiny.hidden_size == 64 and tiny.target_layer_ids == (0, 2) and tiny.mask_token_id == 255
    assert DrafterConfig.from_hf_dict(HF_CONFIG, dtype="float32") == tiny_drafter_config(tiny_config()).replace(
        rope=DrafterConfig.from_hf_dict(HF_CONFIG).rope, last_tap_after_norm=True)


@pytest.mark.parametrize("legacy", [False, True])
def test_yarn_amplitude_matches_transformers(legacy):
    """cos/sin (amplitude included) of the K2.6 drafter's YaRN == Qwen3RotaryEmbedding; the legacy option
    equals transformers with an explicit attention_factor 1 + 0.1 ln 64 (notes §1.5)."""
    raw = kimi_hf_dict()
    rope = dict(raw["rope_scaling"], rope_theta=50000.0)
    if legacy:
        rope["attention_factor"] = yarn_mscale(64.0)
    hf = Qwen3RotaryEmbedding(Qwen3Config(hidden_size=7168, num_attention_heads=64, head_dim=128,
                                          max_position_embeddings=262144, rope_parameters=rope))
    assert abs(hf.attention_scaling - (yarn_mscale(64.0) if legacy else 1.0)) < 1e-6
    cfg = k26_drafter_config(legacy_yarn_amplitude=legacy)
    # torch's float32 power is not correctly rounded: its table is <= 1 ulp off ours on a few frequencies; at
    # position p that is an angle error of about p * 1e-8 rad, so the table comparison below stays at moderate positions
    inv_freq, amplitude = rope_inv_freq(cfg.rope, cfg.head_dim)
    np.testing.assert_array_max_ulp(inv_freq, hf.inv_freq.numpy(), maxulp=1)
    assert abs(amplitude - hf.attention_scaling) < 1e-7
    pos = np.array([[0, 1, 7, 300, 1000]])
    cos_hf, sin_hf = hf(torch.zeros(1, dtype=torch.float32), torch.from_numpy(pos))
    cos, sin = rope_cos_sin(jnp.asarray(pos), cfg.rope, cfg.head_dim)
    # Each side rounds the angle p * f to float32 (and transformers 5.24 rounds it differently from 5.0: 3e-5
    # apart at p = 1000), so the tables agree to a few float32 ulps of the angle, and ours is within one
    # rounding of the product of the exact cos and sin.
    angle = pos[..., None] * np.asarray(inv_freq, np.float64)
    ulps = amplitude * np.finfo(np.float32).eps * np.maximum(angle, 1.0)
    for ours, theirs, exact in ((cos, cos_hf, np.cos(angle)), (sin, sin_hf, np.sin(angle))):
        ours = np.asarray(ours, np.float64)
        assert np.all(np.abs(ours - theirs.numpy()[..., :64]) <= 8 * ulps + 2e-6)
        assert np.all(np.abs(ours - amplitude * exact) <= 2 * ulps + 2e-6)


@pytest.mark.parametrize("change, message", [
    ({"num_key_value_heads": 3}, "not divisible by num_kv_heads"),
    ({"dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 256}}, "mask_token_id=256 outside"),
    ({"dflash_config": {"target_layer_ids": [0, 2]}}, "lacks dflash_config.mask_token_id"),
    ({"dflash_config": {"mask_token_id": 3}, "num_target_layers": None}, "neither dflash_config.target_layer_ids"),
    ({"dflash_config": {"target_layer_ids": [0, 3], "mask_token_id": 3}}, "outside \\[0, num_target_layers=3\\)"),
    ({"block_size": 1}, "block_size=1 must be >= 2"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding-window"),
    ({"architectures": ["DFlash2DraftModel"]}, "unsupported drafter architectures"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "unsupported drafter rope type"),
    ({"intermediate_size": None}, "lacks required field 'intermediate_size'"),
    ({"rope_scaling": {k: v for k, v in YARN.items() if k != "factor"}}, "lacks required field 'factor'"),
])
def test_bad_config_raises(change, message):
    raw = {**copy.deepcopy(HF_CONFIG), **change}
    with pytest.raises(ConfigError, match=message):
        DrafterConfig.from_hf_dict(raw)


@pytest.mark.parametrize("change, message", [
    ({"head_dim": 15}, "head_dim=15 must be even"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps=0.0 must be > 0"),
    ({"dflash_config": {"target_layer_ids": [-1, 2], "mask_token_id": 3}}, "has negative entries"),
    ({"is_causal": True}, "causal drafter attention"),
    ({"dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 3, "causal": True}}, "causal drafter attention"),
    ({"input_embedding_scale": 2.0}, "input_embedding_scale=2.0 is not supported"),
    ({"output_multiplier": 0.5}, "output_multiplier=0.5 is not supported"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"rope_scaling": {**YARN, "truncate": False}}, "truncate: false"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"rope_scaling": {**YARN, "factor": 0.0}}, r"yarn rope factor=0.0 must be > 0"),
    ({"rope_scaling": {**YARN, "factor": -2.0}}, r"yarn rope factor=-2.0 must be > 0"),
    ({"rope_scaling": {**YARN, "beta_fast": -5}}, r"yarn rope beta_fast=-5.0 must be > 0"),
    ({"rope_scaling": {**YARN, "original_max_position_embeddings": 0}}, r"yarn rope original_max_position=0 must be"),
    ({"rope_theta": 0}, r"rope theta=0.0 must be > 0"),
], ids=["odd-head-dim", "zero-eps", "negative-tap", "is-causal", "causal", "embedding-scale", "output-multiplier",
        "softcapping", "no-truncate", "gelu", "attention-bias", "yarn-factor-0", "yarn-factor-negative",
        "yarn-beta-negative", "yarn-original-0", "theta-0"])
def test_unsupported_drafter_settings_raise(change, message):
    raw = {**copy.deepcopy(HF_CONFIG), **change}
    with pytest.raises(ConfigError, match=message):
        DrafterConfig.from_hf_dict(raw)


def test_config_defaults_and_precedence_follow_the_reference():
    """Absent head_dim / rms_norm_eps take Qwen3Config's defaults; dflash_config wins over top-level fields;
    build_target_layer_ids gives L // 2 for a single draft layer."""
    raw = copy.deepcopy(HF_CONFIG)
    del raw["head_dim"], raw["rms_norm_eps"]
    raw.update(block_size=4, mask_token_id=3, dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 255,
                                                              "block_size": 8})
    cfg = DrafterConfig.from_hf_dict(raw)
    assert (cfg.head_dim, cfg.rms_norm_eps) == (Qwen3Config().head_dim, Qwen3Config().rms_norm_eps)
    assert (cfg.block_size, cfg.mask_token_id) == (8, 255)
    assert build_target_layer_ids(36, 1) == (18,) and build_target_layer_ids(61, 1) == (30,)


def test_an_hf_drafter_reads_the_target_last_layer_after_the_final_norm(tmp_path):
    """The reference reads transformers' hidden_states[layer_id + 1], whose last entry is after the target's final
    norm: an HF drafter maps a tap of the last layer to the model's final-norm tap (index num_layers); drafters saved
    here keep the convention they were trained with (a record without the field: before the norm)."""
    from ddtree_jax.checkpoint import drafter_config_from_dict, drafter_config_to_dict, restore_drafter, save_drafter
    from ddtree_jax.drafter import target_taps

    raw = copy.deepcopy(HF_CONFIG)
    raw["dflash_config"] = dict(raw.get("dflash_config") or {}, target_layer_ids=[0, 2])
    cfg = DrafterConfig.from_hf_dict(raw)
    assert cfg.last_tap_after_norm and target_taps(cfg, 3) == (0, 3) and target_taps(cfg, 4) == (0, 2)
    assert target_taps(cfg.replace(last_tap_after_norm=False), 3) == (0, 2)
    old_record = {k: v for k, v in drafter_config_to_dict(cfg).items() if k != "last_tap_after_norm"}
    assert not drafter_config_from_dict(old_record).last_tap_after_norm
    drafter = DFlashDrafter(tiny_drafter_config(tiny_config(), last_tap_after_norm=True), nnx.Rngs(0))
    save_drafter(drafter, str(tmp_path / "d"))
    assert restore_drafter(str(tmp_path / "d")).cfg.last_tap_after_norm


@pytest.mark.parametrize("rope_fields", [
    {"rope_theta": 50000.0, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 8.0,
                                                 "original_max_position_embeddings": 32}},
    {"rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}},
    {"rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
], ids=["theta-in-rope-parameters", "legacy-type-key", "default"])
def test_rope_fields_read_as_transformers_reads_them(rope_fields):
    raw = {k: v for k, v in HF_CONFIG.items() if k not in ("rope_theta", "rope_scaling")} | rope_fields
    cfg = DrafterConfig.from_hf_dict(raw)
    hf = Qwen3RotaryEmbedding(Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=16,
                                          max_position_embeddings=2048, **rope_fields))
    inv_freq, amplitude = rope_inv_freq(cfg.rope, cfg.head_dim)
    np.testing.assert_array_max_ulp(inv_freq, hf.inv_freq.numpy(), maxulp=1)  # torch's power: test_rope
    assert amplitude == pytest.approx(hf.attention_scaling, abs=1e-7)


def test_drafter_target_mismatch_raises():
    with pytest.raises(ConfigError, match="vocab_size 300 != target vocab_size 256"):
        check_drafter_target(tiny_drafter_config(tiny_config(), vocab_size=300, mask_token_id=1), tiny_config())
    with pytest.raises(ConfigError, match="outside the target's 3 layers"):
        check_drafter_target(tiny_drafter_config(tiny_config(), target_layer_ids=(0, 5), num_target_layers=None),
                             tiny_config())
    # taps that fit, but a drafter built on a deeper target's features
    with pytest.raises(ConfigError, match="num_target_layers=23 != target num_layers 3"):
        check_drafter_target(tiny_drafter_config(tiny_config()).replace(num_target_layers=23), tiny_config())
    check_drafter_target(tiny_drafter_config(tiny_config()).replace(num_target_layers=None), tiny_config())


def test_drafter_target_boundaries_raise():
    with pytest.raises(ConfigError, match="outside the target's 3 layers"):  # the first layer past the end
        check_drafter_target(tiny_drafter_config(tiny_config(), target_layer_ids=(0, 3), num_target_layers=None),
                             tiny_config())
    with pytest.raises(ConfigError, match="drafter hidden_size 32 != target hidden_size 64"):
        check_drafter_target(tiny_drafter_config(tiny_config(), hidden_size=32), tiny_config())


def test_draft_logits_check_the_target_and_loader_skips_rotary_buffers(setup, tmp_path):
    ref, drafter, _ = setup
    deeper = nnx.eval_shape(lambda: KimiModel(tiny_config(num_layers=4), nnx.Rngs(0)))
    with pytest.raises(ConfigError, match="num_target_layers=3 != target num_layers 4"):
        draft_logits(drafter, deeper, init_draft_cache(drafter.cfg, 1, 8), jnp.zeros(1, jnp.int32),
                     jnp.zeros(1, jnp.int32))
    tensors = {**ref_tensors(ref, prefix="model."), "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8)}
    assert isinstance(load_hf_drafter(export(tensors, tmp_path / "rotary"), dtype="float32"), DFlashDrafter)


def test_draft_inputs_of_the_wrong_shape_raise(setup):
    _, drafter, _ = setup
    with pytest.raises(ValueError, match="batch >= 1 and capacity >= 1"):
        init_draft_cache(drafter.cfg, 2, 0)
    with pytest.raises(ValueError, match="batch >= 1 and capacity >= 1"):
        init_draft_cache(drafter.cfg, 0, 4)
    with pytest.raises(ValueError, match=r"taps of shape \(3, 1, 5, 64\): expected \[2, B, Tc, 64\]"):
        drafter.context_features(jnp.zeros((3, 1, 5, 64)))
    with pytest.raises(ValueError, match=r"taps of shape \(2, 1, 5, 32\)"):
        drafter.context_features(jnp.zeros((2, 1, 5, 32)))


def test_draft_block_arguments_are_checked_by_name(setup):
    """Each argument of a draft step that does not fit the cache's streams, or would be truncated to an int (a
    float position rotates by a fraction of a step), is named in a ValueError, eagerly and at trace time."""
    _, drafter, target = setup
    cache = init_draft_cache(drafter.cfg, 1, 8)
    taps, pos, counts = jnp.zeros((N_TAPS, 1, 5, 64)), jnp.arange(5)[None], jnp.array([5])
    embeds, block_pos = jnp.zeros((1, BLOCK, 64)), jnp.arange(BLOCK)[None]
    bonus, start = jnp.array([3]), jnp.array([0])
    calls = [
        (lambda: drafter.append_context(cache, jnp.zeros((N_TAPS, 2, 5, 64)), pos, counts),
         r"taps must be \[n, B, Tc, D\] with B = 1 \(the draft cache's streams\), got \(2, 2, 5, 64\)"),
        (lambda: drafter.append_context(cache, taps, pos + 0.5, counts), "positions must be integers"),
        (lambda: drafter.append_context(cache, taps, pos[:, :4], counts), r"positions must have shape \(1, 5\)"),
        (lambda: drafter.append_context(cache, taps, pos, counts * 1.0), "counts must be integers"),
        (lambda: drafter(cache, jnp.zeros((1, BLOCK, 32)), block_pos),
         r"block_embeds must be \[B, Tb, D\] = \[1, Tb, 64\], got \(1, 4, 32\)"),
        (lambda: drafter(cache, jnp.zeros((2, BLOCK, 64)), block_pos), "block_embeds must be"),
        (lambda: drafter(cache, embeds, block_pos * 1.0), "block_positions must be integers"),
        (lambda: draft_logits(drafter, target, cache, bonus * 1.0, start), "bonus_tokens must be integers"),
        (lambda: draft_logits(drafter, target, cache, bonus, jnp.array([0, 1])), r"start must have shape \(1,\)"),
    ]
    for call, match in calls:
        with pytest.raises(ValueError, match=match):
            call()
        with pytest.raises(ValueError, match=match):
            jax.jit(call)()


def test_loader_errors_name_the_tensor(setup, tmp_path):
    ref = setup[0]
    good = ref_tensors(ref)
    assert isinstance(load_hf_drafter(export(good, tmp_path / "plain"), dtype="float32"), DFlashDrafter)
    missing = dict(good)
    del missing["layers.1.self_attn.k_norm.weight"]
    with pytest.raises(CheckpointError, match="missing tensors \\['layers.1.self_attn.k_norm.weight'\\]"):
        load_hf_drafter(export(missing, tmp_path / "missing"), dtype="float32")
    extra = {**good, "layers.2.mlp.up_proj.weight": good["layers.1.mlp.up_proj.weight"]}
    with pytest.raises(CheckpointError, match="unexpected tensor 'layers.2.mlp.up_proj.weight'"):
        load_hf_drafter(export(extra, tmp_path / "extra"), dtype="float32")
    wrong = {**good, "fc.weight": good["fc.weight"][:, :64]}
    with pytest.raises(CheckpointError, match="fc.weight: shape \\(64, 64\\) != expected \\(64, 128\\)"):
        load_hf_drafter(export(wrong, tmp_path / "wrong"), dtype="float32")
    twice = {**good, "model.norm.weight": good["norm.weight"]}
    with pytest.raises(CheckpointError, match="duplicates"):
        load_hf_drafter(export(twice, tmp_path / "twice"), dtype="float32")
    ints = {**good, "norm.weight": np.ones_like(good["norm.weight"], np.int32)}  # never cast into a float param
    with pytest.raises(CheckpointError, match="norm.weight: dtype int32 is not a float type"):
        load_hf_drafter(export(ints, tmp_path / "ints"), dtype="float32")


def test_bfloat16_drafter_runs(setup):
    """bf16 weights and cache: one round stays close to the f32 drafter (smoke test of the dtype path)."""
    _, drafter, target = setup
    g, s = nnx.split(drafter)
    cfg16 = drafter.cfg.replace(dtype="bfloat16")
    s16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), s)
    d16 = nnx.merge(nnx.split(nnx.eval_shape(lambda: DFlashDrafter(cfg16, nnx.Rngs(0))))[0], s16)
    rng = np.random.default_rng(4)
    taps = rng.standard_normal((N_TAPS, 1, 5, 64)).astype(np.float32)
    c32, _ = append(drafter, init_draft_cache(drafter.cfg, 1, 8), taps, np.arange(5)[None], [5])
    c16, _ = append(d16, init_draft_cache(cfg16, 1, 8), taps, np.arange(5)[None], [5])
    assert c16.k.dtype == jnp.bfloat16
    a = logits(drafter, target, c32, [9], [5])
    b = logits(d16, target, c16, [9], [5])
    assert b.dtype == np.float32 and rel_err(b, a) <= 0.05


def test_sharded_equals_unsharded(exported, setup, host_devices):
    """Weights loaded onto a 2x2 (data, model) mesh and a cache laid out by its logical axes give the same
    hidden states as the single-device drafter."""
    _, path = exported
    _, drafter, _ = setup
    mesh = make_mesh(data=2, model=2, devices=host_devices)
    sharded = load_hf_drafter(path, dtype="float32", mesh=mesh)
    assert sharded.layers[0].attn.k.value.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    cache = jax.tree.map(lambda x, axes: jax.device_put(x, named_sharding(mesh, DEFAULT_RULES, axes)),
                         init_draft_cache(drafter.cfg, 2, 16), draft_cache_axes(),
                         is_leaf=lambda x: isinstance(x, tuple))
    rng = np.random.default_rng(5)
    taps = rng.standard_normal((N_TAPS, 2, 6, 64)).astype(np.float32)
    pos = np.tile(np.arange(6), (2, 1))
    embeds = rng.standard_normal((2, BLOCK, 64)).astype(np.float32)
    c1, _ = append(sharded, cache, taps, pos, [6, 4])
    c2, _ = append(drafter, init_draft_cache(drafter.cfg, 2, 16), taps, pos, [6, 4])
    block_pos = np.array([6, 4])[:, None] + np.arange(BLOCK)
    assert rel_err(forward(sharded, c1, embeds, block_pos), forward(drafter, c2, embeds, block_pos)) <= 1e-5
