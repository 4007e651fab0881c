"""Convert an HF checkpoint directory (K2.6 INT4 or float) into a ddtree-jax Orbax checkpoint.

    python experiments/convert_checkpoint.py --hf DIR --out DIR [--dtype bfloat16] [--result NAME]
    python experiments/convert_checkpoint.py --make-random DIR [--shards 8]   # a K2.6-layout test input
    python experiments/convert_checkpoint.py --sweep WORKDIR [--result convert_rss]

--sweep writes random K2.6-layout checkpoints of 4/8/16/32 layers (32 experts: ~33 MB per layer, one layer or
so per shard) and of 4 layers with 64/128 experts (bigger layers), converts each in a fresh process and, for
contrast, loads each whole into host memory with ``load_hf_model`` in a fresh process, recording peak RSS of both
against the largest shard and the total.

Streams shard by shard, one memory-mapped tensor at a time; each decoder layer is written as soon as all
of its tensors have arrived (``ddtree_jax.checkpoint.convert_hf_checkpoint``), so host memory stays near
the largest in-flight layer, not the whole model. Prints peak RSS (VmHWM; resource.getrusage) next to the
largest shard and the total checkpoint size; ``--result NAME`` also records them with
``experiments/bench_util.write_result``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from ddtree_jax.checkpoint import convert_hf_checkpoint  # noqa: E402
from ddtree_jax.hf_loader import hf_model_config  # noqa: E402
from ddtree_jax.safetensors_io import SafetensorsFile, checkpoint_files, save_file  # noqa: E402

MIB = 2**20

# A small K2.6-shaped model (~280 MB, experts INT4) for the memory measurement.
DEMO_DIMS = dict(vocab_size=16384, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
                 num_hidden_layers=8, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128,
                 qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32, n_shared_experts=1,
                 num_experts_per_tok=4, first_k_dense_replace=1)


def random_hf_checkpoint(path: str, dims: dict | None = None, shards: int = 8, seed: int = 0) -> list[str]:
    """Writes a K2.6-layout HF directory of random tensors, built in numpy one layer at a time.

    ``kimi_k25`` wrapper config (text model under ``text_config`` with a compressed-tensors pack-quantized
    INT4 ``quantization_config``), tensors prefixed ``language_model.``, routed experts as
    weight_packed / weight_scale (bf16) / weight_shape, everything else bf16 (router bias f32), a vision
    tensor, split into ``shards`` files of about equal size in layer order plus
    ``model.safetensors.index.json``. Returns the shard paths.
    """
    d = dict(DEMO_DIMS, **(dims or {}))
    rng = np.random.default_rng(seed)
    hid, heads, nope, rope, v = (d[k] for k in ("hidden_size", "num_attention_heads", "qk_nope_head_dim",
                                                "qk_rope_head_dim", "v_head_dim"))
    bf16 = ml_dtypes.bfloat16

    def normal(*shape, std=0.02):
        return (std * rng.standard_normal(shape, np.float32)).astype(bf16)

    def layer_tensors(i):
        p = f"language_model.model.layers.{i}."
        t = {p + "input_layernorm.weight": np.ones(hid, bf16),
             p + "post_attention_layernorm.weight": np.ones(hid, bf16),
             p + "self_attn.q_a_proj.weight": normal(d["q_lora_rank"], hid),
             p + "self_attn.q_a_layernorm.weight": np.ones(d["q_lora_rank"], bf16),
             p + "self_attn.q_b_proj.weight": normal(heads * (nope + rope), d["q_lora_rank"]),
             p + "self_attn.kv_a_proj_with_mqa.weight": normal(d["kv_lora_rank"] + rope, hid),
             p + "self_attn.kv_a_layernorm.weight": np.ones(d["kv_lora_rank"], bf16),
             p + "self_attn.kv_b_proj.weight": normal(heads * (nope + v), d["kv_lora_rank"]),
             p + "self_attn.o_proj.weight": normal(hid, heads * v)}
        if i < d["first_k_dense_replace"]:
            f = d["intermediate_size"]
            t.update({p + "mlp.gate_proj.weight": normal(f, hid), p + "mlp.up_proj.weight": normal(f, hid),
                      p + "mlp.down_proj.weight": normal(hid, f)})
            return t
        f, fs = d["moe_intermediate_size"], d["moe_intermediate_size"] * d["n_shared_experts"]
        t.update({p + "mlp.gate.weight": normal(d["n_routed_experts"], hid),
                  p + "mlp.gate.e_score_correction_bias":
                      (0.1 * rng.standard_normal(d["n_routed_experts"])).astype(np.float32),
                  p + "mlp.shared_experts.gate_proj.weight": normal(fs, hid),
                  p + "mlp.shared_experts.up_proj.weight": normal(fs, hid),
                  p + "mlp.shared_experts.down_proj.weight": normal(hid, fs)})
        for e in range(d["n_routed_experts"]):
            for proj, (out_dim, in_dim) in (("gate_proj", (f, hid)), ("up_proj", (f, hid)), ("down_proj", (hid, f))):
                q = f"{p}mlp.experts.{e}.{proj}."
                t[q + "weight_packed"] = rng.integers(-2**31, 2**31, (out_dim, in_dim // 8),
                                                      dtype=np.int64).astype(np.int32)
                t[q + "weight_scale"] = (0.002 * (1 + rng.random((out_dim, in_dim // 32), np.float32))).astype(bf16)
                t[q + "weight_shape"] = np.array([out_dim, in_dim], np.int64)
        return t

    def globals_first():
        return {"language_model.model.embed_tokens.weight": normal(d["vocab_size"], hid),
                "vision_tower.patch_embed.proj.weight": normal(64, 3, 14, 14)}

    def globals_last():
        return {"language_model.model.norm.weight": np.ones(hid, bf16),
                "language_model.lm_head.weight": normal(d["vocab_size"], hid)}

    groups = [globals_first] + [lambda i=i: layer_tensors(i) for i in range(d["num_hidden_layers"])] + [globals_last]
    # size of every group without materialising all of them at once
    sizes = []
    for make in groups:
        tensors = make()
        sizes.append(sum(a.nbytes for a in tensors.values()))
        del tensors
    rng = np.random.default_rng(seed)  # regenerate identically while writing
    target = sum(sizes) / shards
    os.makedirs(path, exist_ok=True)
    weight_map, files, chunk, chunk_bytes = {}, [], {}, 0

    def flush():
        nonlocal chunk, chunk_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(chunk, os.path.join(path, name))
        weight_map.update({k: name for k in chunk})
        files.append(os.path.join(path, name))
        chunk, chunk_bytes = {}, 0

    for make, size in zip(groups, sizes):
        if chunk and chunk_bytes + size / 2 > target and len(files) < shards - 1:
            flush()
        chunk.update(make())
        chunk_bytes += size
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, f)
    text = {"model_type": "kimi_k2", **d, "num_key_value_heads": heads, "n_group": 1, "topk_group": 1,
            "routed_scaling_factor": 2.827, "norm_topk_prob": True, "rms_norm_eps": 1e-5, "topk_method": "noaux_tc",
            "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 4096, "eos_token_id": 1,
            "rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings":
                                                    4096, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                                    "mscale_all_dim": 1.0},
            "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                    "quantization_status": "compressed", "config_groups": {"group_0": {
                                        "targets": ["Linear"], "input_activations": None, "output_activations": None,
                                        "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                    "strategy": "group", "group_size": 32, "dynamic": False}}},
                                    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*lm_head.*",
                                               r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "re:vision_tower.*"]}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
                   "text_config": text}, f, indent=1)
    return files


def peak_rss_bytes() -> int:
    """Peak resident set size of this process image so far, in bytes.

    Linux: VmHWM of /proc/self/status. resource.getrusage's ru_maxrss is the same high-water mark
    except that it survives exec, so a child started from a large parent would report the parent's
    peak; ru_maxrss (KiB on Linux) is the fallback elsewhere and is recorded alongside.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return getrusage_peak_bytes()


def getrusage_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_FULL_LOAD = """
import sys, jax
from experiments.convert_checkpoint import peak_rss_bytes
from ddtree_jax.hf_loader import load_hf_model
base = peak_rss_bytes()
model = load_hf_model(sys.argv[1], dtype="bfloat16")
jax.block_until_ready(jax.tree.leaves(model))
print("RSS", base, peak_rss_bytes())
"""


SWEEP = ((4, 32), (8, 32), (16, 32), (32, 32), (4, 64), (4, 128))  # (layers, routed experts)


def sweep(workdir: str, points=SWEEP) -> dict:
    """Peak RSS of streaming conversion vs. a whole-model load, over model sizes (more layers: bigger
    model, same layer size; more experts: bigger layers), each in a fresh process."""
    rows = []
    here = os.path.abspath(__file__)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(here)))
    for layers, experts in points:
        hf, out = os.path.join(workdir, f"hf_{layers}_{experts}"), os.path.join(workdir, f"out_{layers}_{experts}")
        shutil.rmtree(hf, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        files = random_hf_checkpoint(hf, dims={"num_hidden_layers": layers, "n_routed_experts": experts},
                                     shards=layers + 2)
        proc = subprocess.run([sys.executable, here, "--hf", hf, "--out", out, "--no-progress", "--json-line"],
                              capture_output=True, text=True, env=env, check=True)
        conv = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
        proc = subprocess.run([sys.executable, "-c", _FULL_LOAD, hf], capture_output=True, text=True, env=env,
                              check=True)
        base, peak = (int(x) for x in proc.stdout.split("RSS")[-1].split())
        rows.append({"layers": layers, "experts": experts, "shards": len(files),
                     "hf_total_mib": conv["hf_total_bytes"] / MIB,
                     "largest_shard_mib": conv["largest_shard_bytes"] / MIB,
                     "convert_peak_rss_mib": conv["peak_rss_bytes"] / MIB,
                     "convert_baseline_rss_mib": conv["peak_rss_before_bytes"] / MIB,
                     "convert_over_baseline_mib": conv["peak_rss_over_baseline_bytes"] / MIB,
                     "convert_peak_buffered_mib": conv["peak_buffered_bytes"] / MIB,
                     "convert_seconds": conv["seconds"],
                     "full_load_peak_rss_mib": peak / MIB, "full_load_over_baseline_mib": (peak - base) / MIB})
        shutil.rmtree(hf, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        print(rows[-1], flush=True)
    return {"rows": rows, "note": "peak RSS = VmHWM (= getrusage ru_maxrss, minus what ru_maxrss inherits across "
            "exec); baseline = peak RSS after imports, before conversion/load; each conversion and each full "
            "load in a fresh process; random K2.6-layout INT4 checkpoints (experts INT4, rest bf16)"}


# the flags each mode reads (besides the one naming the mode); every other flag given is refused
MODE_FLAGS = {"--make-random": ("--shards", "--layers"), "--sweep": ("--result",),
              "convert": ("--hf", "--out", "--dtype", "--result", "--no-progress", "--json-line")}


def check_args(args) -> None:
    """Refuses a flag that the chosen mode (--make-random, --sweep or a conversion) would ignore, fills in the
    defaults of the flags it reads; ValueError naming the flag otherwise."""
    given = {"--hf": args.hf, "--out": args.out, "--make-random": args.make_random, "--shards": args.shards,
             "--layers": args.layers, "--dtype": args.dtype, "--result": args.result, "--sweep": args.sweep,
             "--no-progress": args.no_progress or None, "--json-line": args.json_line or None}
    modes = [flag for flag in ("--make-random", "--sweep") if given[flag] is not None]
    if len(modes) > 1:
        raise ValueError("--make-random and --sweep are separate modes: give one")
    mode = modes[0] if modes else "convert"
    ignored = [flag for flag, value in given.items()
               if value is not None and flag not in modes and flag not in MODE_FLAGS[mode]]
    if ignored:
        what = "a conversion" if mode == "convert" else mode
        raise ValueError(f"{', '.join(ignored)} {'does' if len(ignored) == 1 else 'do'} nothing with {what} "
                         f"(it reads only {', '.join(MODE_FLAGS[mode])})")
    if mode == "convert" and not (args.hf and args.out):
        raise ValueError("--hf and --out are required")
    for flag, value in (("--shards", args.shards), ("--layers", args.layers)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if mode == "--make-random":
        args.shards = 8 if args.shards is None else args.shards
        args.layers = DEMO_DIMS["num_hidden_layers"] if args.layers is None else args.layers
    if mode == "convert":
        args.dtype = args.dtype or "bfloat16"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", help="HF checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("--out", help="output checkpoint directory")
    parser.add_argument("--make-random", metavar="DIR", help="write a random K2.6-layout HF checkpoint and exit")
    parser.add_argument("--shards", type=int, default=None, help="shards for --make-random (default 8)")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"layers for --make-random (default {DEMO_DIMS['num_hidden_layers']})")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float16"),
                        help="dtype of the non-expert weights when converting (default bfloat16; INT4 experts stay "
                             "INT4)")
    parser.add_argument("--result", help="write experiments/results/<RESULT>.json with the measurement")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--sweep", metavar="WORKDIR", help="measure peak RSS over several model sizes")
    parser.add_argument("--json-line", action="store_true", help="print the report as one JSON line")
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        parser.error(str(e))
    if args.make_random:
        files = random_hf_checkpoint(args.make_random, dims={"num_hidden_layers": args.layers},
                                     shards=args.shards)
        print(f"wrote {len(files)} shards, {sum(map(os.path.getsize, files)) / MIB:.1f} MiB, to {args.make_random}")
        return {"files": files}
    if args.sweep:
        from experiments.bench_util import print_table, write_result
        result = sweep(args.sweep)
        print_table(result["rows"], list(result["rows"][0]))
        if args.result:
            print("wrote", write_result(args.result, result))
        return result
    try:  # the directory given read as a checkpoint (its config and shard list) before the conversion starts
        files = checkpoint_files(args.hf)
        hf_model_config(args.hf, dtype=args.dtype)
    except ValueError as e:  # ConfigError, CheckpointError
        parser.error(f"--hf {args.hf}: {e}")
    from ddtree_jax.tokenizer import TOKENIZER_FILES, tokenizer_file
    if tokenizer_file(args.hf) is None:
        print(f"convert_checkpoint.py: warning: {args.hf} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); "
              f"run_decode.py refuses {args.out} until one is copied there", file=sys.stderr)
    shard_sizes = {os.path.basename(f): os.path.getsize(f) for f in files}
    total_tensors = sum(len(SafetensorsFile(f).keys()) for f in files)
    rss_before = peak_rss_bytes()
    bar = tqdm(total=total_tensors, unit="tensor", desc="convert", disable=args.no_progress)
    t0 = time.perf_counter()
    # every tensor of the directory ticks the bar (skipped vision tensors are not reported: catch up at the end)
    stats = convert_hf_checkpoint(args.hf, args.out, dtype=args.dtype, progress=lambda name: bar.update(1),
                                  metadata={"converted_by": "experiments/convert_checkpoint.py"})
    bar.update(bar.total - bar.n)
    bar.close()
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    largest = max(shard_sizes.values())
    hf_total = sum(shard_sizes.values())
    report = {
        "hf_dir": os.path.abspath(args.hf), "out_dir": os.path.abspath(args.out), "dtype": args.dtype,
        "shards": len(files), "hf_total_bytes": hf_total, "largest_shard_bytes": largest,
        "param_bytes_written": stats["param_bytes"], "peak_buffered_bytes": stats["peak_buffered_bytes"],
        "parts": stats["parts"], "peak_rss_before_bytes": rss_before, "peak_rss_bytes": peak,
        "peak_rss_over_baseline_bytes": peak - rss_before, "getrusage_maxrss_bytes": getrusage_peak_bytes(),
        "seconds": seconds,
    }
    print(f"converted {len(files)} shards ({hf_total / MIB:.1f} MiB, largest {largest / MIB:.1f} MiB) into "
          f"{stats['parts']} parts in {seconds:.1f} s")
    print(f"peak RSS {peak / MIB:.1f} MiB (baseline before conversion {rss_before / MIB:.1f} MiB, "
          f"+{(peak - rss_before) / MIB:.1f} MiB); most bytes buffered at once {stats['peak_buffered_bytes'] / MIB:.1f}"
          " MiB")
    if args.json_line:
        print(json.dumps(report))
    if args.result:
        from experiments.bench_util import write_result
        print("wrote", write_result(args.result, report))
    return report


if __name__ == "__main__":
    main()
