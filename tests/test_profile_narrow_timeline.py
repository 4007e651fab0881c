"""``experiments/profile_narrow_timeline.py``'s reading of a Mosaic GPU profiler trace (a synthetic one: the
profiler itself runs inside a kernel on a Hopper GPU), and the kernel's profiling arguments."""

import jax.numpy as jnp
import pytest

from experiments.profile_narrow_timeline import program_timelines, summarize
from pallas_kernels.mla_attention_narrow import split_attention_narrow

CONSUMER = [("q_wait", 0, 200), ("k_wait", 200, 2000), ("scores", 2000, 2400), ("softmax", 2400, 2600),
            ("pv", 2600, 3000), ("k_wait", 3000, 3200), ("scores", 3200, 3600), ("softmax", 3600, 3800),
            ("pv", 3800, 4200), ("k_wait", 4200, 4300), ("scores", 4300, 4700), ("softmax", 4700, 4900),
            ("pv", 4900, 5300), ("epilogue", 5300, 6300),  # the epilogue's parts nest inside it
            ("normalize", 5300, 5400), ("store_smem", 5400, 5800), ("store_gmem", 5800, 6300)]
PRODUCER = [("slot_wait", 100, 300), ("slot_wait", 2500, 2900)]


def trace_of(starts_ns):
    """Events as the profiler dumps them: ts = (globaltimer ns at the start + cycles since the first event) / 1e3,
    tid = 1 + warpgroup + 2 * program."""
    events = []
    for program, start in enumerate(starts_ns):
        for wg, regions in ((0, CONSUMER), (1, PRODUCER)):
            first = regions[0][1]
            for name, b, e in regions:
                for ph, cyc in (("B", b), ("E", e)):
                    cyc += 0.5 if ph == "B" and name in ("normalize", "store_smem", "store_gmem") else 0
                    events.append({"name": name, "ph": ph, "ts": (start + cyc - first) / 1e3, "pid": 1 + 7 * program,
                                   "tid": 1 + wg + 2 * program})
    return {"traceEvents": sorted(events, key=lambda ev: ev["ts"])}


def test_program_timelines_at_2_ghz():
    progs = program_timelines(trace_of([1000, 1500]), clock_ghz=2.0)
    assert [p["program"] for p in progs] == [0, 1] and [p["sm"] for p in progs] == [0, 7]
    p = progs[0]
    assert p["blocks"] == 3
    assert p["fill_us"] == pytest.approx(1.0)          # 2000 cycles to the end of the first k_wait
    assert p["block_us"] == pytest.approx(0.6)         # the iterations after the first: 1200 cycles
    assert p["k_wait_us"] == pytest.approx(0.075)      # median of 200 and 100 cycles (blocks 2 and 3)
    assert p["scores_us"] == pytest.approx(0.2) and p["pv_us"] == pytest.approx(0.2)
    assert p["epilogue_us"] == pytest.approx(0.5) and p["busy_us"] == pytest.approx(3.15)
    assert p["slot_wait_us"] == pytest.approx(0.3)
    assert (p["normalize_us"], p["store_smem_us"], p["store_gmem_us"]) == pytest.approx((0.05, 0.2, 0.25), abs=1e-3)
    assert progs[1]["start_us"] == pytest.approx(0.5) and progs[1]["end_us"] == pytest.approx(3.65)
    row = summarize(progs)
    assert row["programs"] == 2 and row["max_end_us"] == pytest.approx(3.65) and row["max_blocks"] == 3


def test_profiling_arguments_go_together():
    z = jnp.zeros
    args = (z((1, 8, 576), jnp.bfloat16), z((1, 256, 576), jnp.bfloat16), z((1,), jnp.int32),
            z((1, 64, 576), jnp.bfloat16), z((1, 2, 8), jnp.int32))
    for kw in ({"profile_dir": "/tmp/x"}, {"profile_regions": 16}):
        with pytest.raises(ValueError, match="go together"):
            split_attention_narrow(*args, scale=0.1, kv_lora_rank=512, valid_rows=8, **kw)
