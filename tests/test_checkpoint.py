"""Our Orbax checkpoints: bit-exact roundtrip (float and INT4), atomic saves, sharded restore on 8 fake
devices, streaming conversion of a multi-shard HF checkpoint, and the memory planner against real bytes."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax import checkpoint as ckpt
from ddtree_jax.cache import init_cache
from ddtree_jax.checkpoint import (INDEX_FILE, checkpoint_config, read_index, restore_model, save_model)
from ddtree_jax.config import QuantConfig, tiny_config
from ddtree_jax.hf_loader import abstract_model, load_hf_model
from ddtree_jax.memory_plan import parse_mesh, plan_memory, state_bytes
from ddtree_jax.moe import route
from ddtree_jax.model import causal_mask
from ddtree_jax.quant import QuantArray
from ddtree_jax.safetensors_io import CheckpointError
from ddtree_jax.sharding import DEFAULT_RULES, make_mesh, param_shardings
from experiments.convert_checkpoint import main as convert_main
from experiments.convert_checkpoint import random_hf_checkpoint

TINY_HF_DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                    num_hidden_layers=3, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                    first_k_dense_replace=1)


def random_model(cfg, seed=0):
    """A KimiModel with random values in every leaf (int32 words: all 32 bits random), built from the
    abstract state in numpy (no XLA init)."""
    graphdef, abstract = abstract_model(cfg)
    rng = np.random.default_rng(seed)

    def fill(leaf):
        if leaf.dtype == jnp.int32:
            return jnp.asarray(rng.integers(-2**31, 2**31, leaf.shape, dtype=np.int64).astype(np.int32))
        return jnp.asarray(rng.standard_normal(leaf.shape, np.float32), leaf.dtype)

    return nnx.merge(graphdef, jax.tree.map(fill, abstract))


def assert_same_state(a, b):
    fa, fb = dict(nnx.state(a).flat_state()), dict(nnx.state(b).flat_state())
    assert fa.keys() == fb.keys()
    for key in fa:
        va, vb = fa[key].value, fb[key].value
        assert isinstance(va, QuantArray) == isinstance(vb, QuantArray), key
        for x, y in zip(jax.tree.leaves(va), jax.tree.leaves(vb)):
            assert x.dtype == y.dtype and x.shape == y.shape, key
            np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8), err_msg=str(key))


@pytest.mark.parametrize("quant", [None, QuantConfig()], ids=["float", "int4"])
def test_roundtrip_bit_exact(tmp_path, quant):
    cfg = tiny_config(dtype="bfloat16", quant=quant)
    model = random_model(cfg)
    save_model(model, str(tmp_path / "ck"), {"step": 7, "note": "x"})
    restored = restore_model(str(tmp_path / "ck"))
    assert_same_state(model, restored)
    assert restored.cfg == cfg and checkpoint_config(str(tmp_path / "ck")) == cfg
    assert read_index(str(tmp_path / "ck"))["metadata"] == {"step": 7, "note": "x"}
    if quant:
        assert isinstance(restored.layers[1].mlp.w13.value, QuantArray)


def test_bfloat16_storage_of_a_float32_model(tmp_path):
    from ddtree_jax.checkpoint import restore_drafter, save_drafter
    from ddtree_jax.drafter import DFlashDrafter, tiny_drafter_config

    cfg = tiny_config(quant=QuantConfig())  # float32 model, INT4 experts
    model = random_model(cfg)
    save_model(model, str(tmp_path / "ck"), {"note": "x"}, storage_dtype="bfloat16")
    restored = restore_model(str(tmp_path / "ck"))
    assert restored.cfg == cfg and read_index(str(tmp_path / "ck"))["metadata"]["storage_dtype"] == "bfloat16"
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype) if x.dtype == jnp.float32 else x,
                           nnx.state(model))
    for (key, a), (_, b), (_, exact) in zip(sorted(rounded.flat_state()), sorted(nnx.state(restored).flat_state()),
                                            sorted(nnx.state(model).flat_state())):
        if key[-1] in ("router", "router_bias"):  # the routing parameters are stored as they are
            a = exact
        for x, y in zip(jax.tree.leaves(a.get_value()), jax.tree.leaves(b.get_value())):
            assert x.dtype == y.dtype, key  # float32 again, INT4 words and scales untouched
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(key))
    assert not np.array_equal(np.asarray(model.embed.get_value()), np.asarray(restored.embed.get_value()))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((512, cfg.hidden_size)), jnp.float32)
    mlp, back = model.layers[1].mlp, restored.layers[1].mlp
    bias = mlp.router_bias.get_value()  # random normal: far from bfloat16's grid
    assert not np.array_equal(np.asarray(bias.astype(jnp.bfloat16).astype(jnp.float32)), np.asarray(bias))
    np.testing.assert_array_equal(np.asarray(route(x, mlp.router.get_value(), bias, cfg)[0]),
                                  np.asarray(route(x, back.router.get_value(), back.router_bias.get_value(), cfg)[0]))
    drafter = DFlashDrafter(tiny_drafter_config(cfg), nnx.Rngs(3))
    save_drafter(drafter, str(tmp_path / "d"), storage_dtype="bfloat16")
    back = restore_drafter(str(tmp_path / "d"))
    for a, b in zip(jax.tree.leaves(nnx.state(drafter)), jax.tree.leaves(nnx.state(back))):
        assert b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32)), np.asarray(b))


def test_interrupted_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    cfg = tiny_config(quant=QuantConfig())
    path = str(tmp_path / "ck")
    first, second = random_model(cfg, seed=1), random_model(cfg, seed=2)
    save_model(first, path, {"step": 1})
    calls = []
    real_save_part = ckpt._save_part

    def failing(writer, name, params):
        calls.append(name)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        real_save_part(writer, name, params)

    monkeypatch.setattr(ckpt, "_save_part", failing)
    with pytest.raises(OSError, match="simulated"):
        save_model(second, path, {"step": 2})
    monkeypatch.setattr(ckpt, "_save_part", real_save_part)
    assert read_index(path)["metadata"] == {"step": 1}
    assert_same_state(first, restore_model(path))
    # a save killed without cleanup leaves an orphan data dir: still the old checkpoint, removed by the next save
    orphan = os.path.join(path, "data-" + "0" * 32)
    os.makedirs(os.path.join(orphan, "layer_000"))
    assert_same_state(first, restore_model(path))
    save_model(second, path, {"step": 2})
    assert sorted(os.listdir(path)) == sorted([INDEX_FILE, read_index(path)["data"]])
    assert_same_state(second, restore_model(path))


def test_restore_sharded_on_8_devices_and_planner(tmp_path, host_devices):
    cfg = tiny_config(num_heads=8, quant=QuantConfig())  # heads/experts/vocab/ffn split 8 ways
    model = random_model(cfg, seed=3)
    save_model(model, str(tmp_path / "ck"))
    mesh = make_mesh(data=1, model=8, devices=host_devices)
    restored = restore_model(str(tmp_path / "ck"), mesh=mesh, rules=DEFAULT_RULES)
    assert_same_state(model, restored)
    state = nnx.state(restored)
    expected = param_shardings(state, mesh, DEFAULT_RULES)
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(expected)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    w13 = restored.layers[1].mlp.w13.value
    assert w13.packed.addressable_shards[0].data.shape[0] == cfg.n_routed_experts // 8
    # planner from abstract shapes == real bytes: whole model, and what device 0 holds on the 1x8 mesh
    plan = plan_memory(cfg, parse_mesh("1x8"))
    assert plan.weight_bytes("total") == state_bytes(state)
    device0 = host_devices[0]
    on_device0 = sum(s.data.nbytes for leaf in jax.tree.leaves(state) for s in leaf.addressable_shards
                     if s.device == device0)
    assert plan.weight_bytes("per_device") == on_device0
    assert plan.weights["experts_int4"]["total"] == 2 * (cfg.num_layers - 1) * cfg.n_routed_experts * (
        3 * cfg.moe_intermediate_size * cfg.hidden_size // 8) * 4 // 2
    assert plan.cache_per_token["total"] == cfg.num_layers * cfg.latent_dim * 4  # float32 tiny config


def test_restore_config_checks(tmp_path):
    cfg = tiny_config()
    save_model(random_model(cfg), str(tmp_path / "ck"))
    with pytest.raises(CheckpointError, match=r"hidden_size \(128 != stored 64\)"):
        restore_model(str(tmp_path / "ck"), cfg.replace(hidden_size=128))
    with pytest.raises(CheckpointError, match=r"routed_scaling_factor .*rms_norm_eps"):  # same shapes, other math
        restore_model(str(tmp_path / "ck"), cfg.replace(routed_scaling_factor=9.0, rms_norm_eps=0.5))
    as_bf16 = restore_model(str(tmp_path / "ck"), cfg.replace(dtype="bfloat16"))  # float params cast on restore
    assert as_bf16.embed.value.dtype == jnp.bfloat16
    with pytest.raises(CheckpointError, match="not a ddtree-jax checkpoint"):
        restore_model(str(tmp_path))


def test_a_malformed_commit_record_is_refused_by_name(tmp_path):
    """A commit record edited or damaged by hand: refused with its path, never a truncated model, another
    checkpoint's data or a bare KeyError / JSONDecodeError / TypeError."""
    import json

    path = str(tmp_path / "ck")
    save_model(random_model(tiny_config()), path)
    record = os.path.join(path, INDEX_FILE)
    good = open(record).read()

    def edited(change):
        raw = json.loads(good)
        change(raw)
        with open(record, "w") as f:
            json.dump(raw, f)

    def fewer_layers(raw):
        raw["model_config"]["num_layers"] -= 1
    cases = [
        (fewer_layers, r"holds 1[0-9] parameters its config does not declare, e.g. \['layers\.2\."),
        (lambda raw: raw.update(data="../other/" + raw["data"]), r"names data dir '\.\./other/data-"),
        (lambda raw: raw.pop("parts"), r"field 'parts' must be a JSON dict, got None"),
        (lambda raw: raw.pop("data"), "field 'data' must be a JSON str, got None"),
        (lambda raw: raw["parts"].update(embed="embed"), r"part 'embed' must list parameter names"),
        (lambda raw: raw["model_config"]["rope"].update(foo=1), r"stored RoPE config has unknown fields \['foo'\]"),
        (lambda raw: raw["model_config"].pop("rope"), "stored RoPE config must be a JSON object, got None"),
    ]
    for change, match in cases:
        edited(change)
        with pytest.raises(CheckpointError, match=match):
            restore_model(path)
    with open(record, "w") as f:
        f.write(good[:-20])
    with pytest.raises(CheckpointError, match=f"{INDEX_FILE}: not JSON"):
        restore_model(path)
    with open(record, "w") as f:
        f.write(good)
    assert_same_state(restore_model(path), random_model(tiny_config()))


@jax.jit(static_argnames=("graphdef",))
def _logits(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    return model(tokens, positions, init_cache(model.cfg, b, t), causal_mask(b, t)).logits


def logits(model, tokens):
    graphdef, state = nnx.split(model)
    return np.asarray(_logits(graphdef, state, jnp.asarray(tokens)))


def test_convert_warns_of_a_missing_tokenizer(tmp_path, capsys):
    """Converting a directory without a tokenizer works (memory sweeps convert random checkpoints) but says that
    run_decode.py will refuse the result until one is copied there."""
    hf_dir, out = str(tmp_path / "hf"), str(tmp_path / "out")
    random_hf_checkpoint(hf_dir, dims=dict(TINY_HF_DIMS, num_hidden_layers=1), shards=1)
    convert_main(["--hf", hf_dir, "--out", out, "--dtype", "float32", "--no-progress"])
    assert f"warning: {hf_dir} has no tokenizer (tokenizer.json or tiktoken.model)" in capsys.readouterr().err


def test_convert_multi_shard_checkpoint(tmp_path):
    hf_dir, out = str(tmp_path / "hf"), str(tmp_path / "out")
    files = random_hf_checkpoint(hf_dir, dims=TINY_HF_DIMS, shards=4)
    assert len(files) == 4 and os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json"))
    with open(os.path.join(hf_dir, "tiktoken.model"), "w") as f:  # the tokenizer travels with the weights
        f.write("dG9rZW4= 0\n")
    report = convert_main(["--hf", hf_dir, "--out", out, "--dtype", "float32", "--no-progress"])
    with open(os.path.join(out, "tiktoken.model")) as f:
        assert f.read() == "dG9rZW4= 0\n"
    assert report["shards"] == 4 and report["parts"] == 3 + 3  # 3 layers + embed, norm, lm_head
    direct = load_hf_model(hf_dir, dtype="float32")
    converted = restore_model(out)
    assert converted.cfg == direct.cfg and converted.cfg.weight_prefix == "language_model."
    assert_same_state(direct, converted)
    tokens = np.random.default_rng(0).integers(0, direct.cfg.vocab_size, (2, 7))
    a, b = logits(direct, tokens), logits(converted, tokens)
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)
    # the planner's total for this config is the loaded model's real size
    assert plan_memory(direct.cfg, parse_mesh("1x1")).weight_bytes("total") == state_bytes(nnx.state(direct))


def test_convert_refuses_an_out_dir_with_tokenizer_files_the_source_lacks(tmp_path):
    from ddtree_jax.checkpoint import convert_hf_checkpoint, copy_tokenizer_files

    hf_dir, out = str(tmp_path / "hf"), str(tmp_path / "out")
    random_hf_checkpoint(hf_dir, dims=TINY_HF_DIMS, shards=1)
    with open(os.path.join(hf_dir, "tiktoken.model"), "w") as f:
        f.write("dG9rZW4= 0\n")
    os.makedirs(out)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:  # an older model's tokenizer
        f.write("{}")
    with pytest.raises(CheckpointError, match=r"tokenizer files \['tokenizer\.json'\] that .*hf lacks"):
        copy_tokenizer_files(hf_dir, out)
    with pytest.raises(CheckpointError, match=r"tokenizer files \['tokenizer\.json'\]"):
        convert_hf_checkpoint(hf_dir, out, dtype="float32")
    assert sorted(os.listdir(out)) == ["tokenizer.json"]  # refused before writing anything; the user's file kept
    os.remove(os.path.join(out, "tokenizer.json"))
    for _ in range(2):  # re-converting the same source into the same directory still works
        assert convert_hf_checkpoint(hf_dir, out, dtype="float32")["tokenizer_files"] == ["tiktoken.model"]
    before = sorted(os.listdir(hf_dir))
    for same in (hf_dir, os.path.join(hf_dir, ".")):  # before, it committed there, then failed copying the tokenizer
        with pytest.raises(CheckpointError, match="is the HF checkpoint's own directory"):
            convert_hf_checkpoint(hf_dir, same, dtype="float32")
    assert sorted(os.listdir(hf_dir)) == before


def _drafter_dirs(path):
    return sorted(entry for entry in os.listdir(path) if entry.startswith("params"))


def test_interrupted_drafter_save_keeps_previous_drafter(tmp_path, monkeypatch):
    from ddtree_jax.checkpoint import DRAFTER_INDEX_FILE, restore_drafter, save_drafter
    from ddtree_jax.drafter import DFlashDrafter, tiny_drafter_config

    dcfg = tiny_drafter_config(tiny_config())
    first, second = DFlashDrafter(dcfg, nnx.Rngs(1)), DFlashDrafter(dcfg, nnx.Rngs(2))
    path = str(tmp_path / "d")
    save_drafter(first, path, {"step": 1})

    def fails_before_the_commit(*args):  # the params are written, the commit record is not
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt, "_write_json_atomic", fails_before_the_commit)
    with pytest.raises(OSError, match="simulated"):
        save_drafter(second, path, {"step": 2})
    monkeypatch.undo()
    for a, b in zip(jax.tree.leaves(nnx.state(first)), jax.tree.leaves(nnx.state(restore_drafter(path)))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(_drafter_dirs(path)) == 1
    os.makedirs(os.path.join(path, "params-" + "0" * 32))  # a save killed without cleanup leaves an orphan
    save_drafter(second, path, {"step": 2})
    assert len(_drafter_dirs(path)) == 1  # older params dirs are gone after the commit
    assert sorted(os.listdir(path)) == sorted([DRAFTER_INDEX_FILE] + _drafter_dirs(path))
    for a, b in zip(jax.tree.leaves(nnx.state(second)), jax.tree.leaves(nnx.state(restore_drafter(path)))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_drafter_in_the_layout_before_atomic_saves_still_restores(tmp_path):
    import json

    from ddtree_jax.checkpoint import DRAFTER_INDEX_FILE, restore_drafter, save_drafter
    from ddtree_jax.drafter import DFlashDrafter, tiny_drafter_config

    dcfg = tiny_drafter_config(tiny_config())
    old, new = DFlashDrafter(dcfg, nnx.Rngs(1)), DFlashDrafter(dcfg, nnx.Rngs(2))
    path = str(tmp_path / "d")
    save_drafter(old, path)
    index_file = os.path.join(path, DRAFTER_INDEX_FILE)
    with open(index_file) as f:
        index = json.load(f)
    os.rename(os.path.join(path, index.pop("params")), os.path.join(path, "params"))  # the old layout
    with open(index_file, "w") as f:
        json.dump(index, f)
    for a, b in zip(jax.tree.leaves(nnx.state(old)), jax.tree.leaves(nnx.state(restore_drafter(path)))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    save_drafter(new, path)  # saving over it replaces the old params/ as well
    assert _drafter_dirs(path) != ["params"] and len(_drafter_dirs(path)) == 1
    for a, b in zip(jax.tree.leaves(nnx.state(new)), jax.tree.leaves(nnx.state(restore_drafter(path)))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    index["params"] = "../elsewhere"
    with open(index_file, "w") as f:
        json.dump(index, f)
    with pytest.raises(CheckpointError, match="names params dir '../elsewhere'"):
        restore_drafter(path)


@pytest.mark.parametrize("streams_split", [True, False], ids=["batch-over-data", "no-batch-rule"])
def test_planned_cache_bytes_follow_the_rules(host_devices, streams_split):
    from ddtree_jax.cache import CACHE_AXES
    from ddtree_jax.memory_plan import held_bytes_per_device
    from ddtree_jax.sharding import ShardingRules, named_sharding

    cfg = tiny_config()
    rules = DEFAULT_RULES if streams_split else ShardingRules(
        rules=tuple(rule for rule in DEFAULT_RULES.rules if rule[0] != "batch"))
    mesh = make_mesh(data=2, model=4, devices=host_devices)
    cache = init_cache(cfg, batch=8, capacity=100)
    placed = jax.device_put(cache.kv, named_sharding(mesh, rules, CACHE_AXES))
    plan = plan_memory(cfg, parse_mesh("2x4"), rules)
    assert plan.cache_bytes(100, 8) == max(held_bytes_per_device(placed).values())
    assert plan.cache_bytes(100, 8, "total") == cache.kv.nbytes
