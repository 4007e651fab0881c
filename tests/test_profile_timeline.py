"""``experiments/profile_timeline.py``'s reading of a Mosaic GPU profiler trace (a synthetic one: the
profiler itself runs inside a kernel on a Hopper GPU), and the kernel's profiling arguments."""

import jax.numpy as jnp
import pytest

import jax

from experiments.profile_timeline import program_timelines, regions_needed, summarize
from pallas_kernels.mgpu_attention_parts import profiler_params, region_scope
from pallas_kernels.mla_attention_mgpu import smem_bytes, split_attention
from pallas_kernels.mla_attention_narrow import split_attention_narrow

CONSUMER = [("q_wait", 0, 200), ("k_wait", 200, 2000), ("scores", 2000, 2400), ("softmax", 2400, 2600),
            ("pv", 2600, 3000), ("k_wait", 3000, 3200), ("scores", 3200, 3600), ("softmax", 3600, 3800),
            ("pv", 3800, 4200), ("k_wait", 4200, 4300), ("scores", 4300, 4700), ("softmax", 4700, 4900),
            ("pv", 4900, 5300), ("epilogue", 5300, 6300),  # the epilogue's parts nest inside it
            ("normalize", 5300, 5400), ("store_smem", 5400, 5800), ("store_gmem", 5800, 6300)]
PRODUCER = [("slot_wait", 100, 300), ("slot_wait", 2500, 2900)]


# the 64-row kernel with a tail: consumer 0, consumer 1 (two blocks each), the producer
WIDE = [
    [("k_wait", 0, 1000), ("scores", 1000, 1400), ("softmax", 1400, 1500), ("handoff", 1500, 1700), ("pv", 1700, 2000),
     ("k_wait", 2000, 2100), ("scores", 2100, 2500), ("softmax", 2500, 2600), ("handoff", 2600, 3000),
     ("pv", 3000, 3300), ("epilogue", 3300, 3500)],
    [("k_wait", 0, 1000), ("tail_scores", 1000, 1200), ("tail_softmax", 1200, 1600), ("p_wait", 1600, 1700),
     ("pv", 1700, 2000), ("k_wait", 2000, 2050), ("tail_scores", 2050, 2250), ("tail_softmax", 2250, 2850),
     ("p_wait", 2850, 3000), ("pv", 3000, 3400), ("epilogue", 3400, 4000)],
    PRODUCER]


def trace_of(starts_ns, wgs=(CONSUMER, PRODUCER)):
    """Events as the profiler dumps them: ts = (globaltimer ns at the start + cycles since the first event) / 1e3,
    tid = 1 + warpgroup + len(wgs) * program."""
    events = []
    for program, start in enumerate(starts_ns):
        for wg, regions in enumerate(wgs):
            first = regions[0][1]
            for name, b, e in regions:
                for ph, cyc in (("B", b), ("E", e)):
                    cyc += 0.5 if ph == "B" and name in ("normalize", "store_smem", "store_gmem") else 0
                    events.append({"name": name, "ph": ph, "ts": (start + cyc - first) / 1e3, "pid": 1 + 7 * program,
                                   "tid": 1 + wg + len(wgs) * program})
    return {"traceEvents": sorted(events, key=lambda ev: ev["ts"])}


def test_program_timelines_at_2_ghz():
    progs = program_timelines(trace_of([1000, 1500]), clock_ghz=2.0)
    assert [p["program"] for p in progs] == [0, 1] and [p["sm"] for p in progs] == [0, 7]
    p = progs[0]
    assert p["blocks"] == 3
    assert p["fill_us"] == pytest.approx(1.0)          # 2000 cycles to the end of the first k_wait
    assert p["block_us"] == pytest.approx(0.6)         # the iterations after the first: 1200 cycles
    assert p["iterations_us"] == pytest.approx([1.4, 0.6]) and p["loop_us"] == pytest.approx(1.65)
    assert p["k_wait_us"] == pytest.approx(0.075)      # median of 200 and 100 cycles (blocks 2 and 3)
    assert p["scores_us"] == pytest.approx(0.2) and p["pv_us"] == pytest.approx(0.2)
    assert p["epilogue_us"] == pytest.approx(0.5) and p["busy_us"] == pytest.approx(3.15)
    assert p["slot_wait_us"] == pytest.approx(0.3) and p["q_wait_us"] == pytest.approx(0.1)  # once a program
    assert (p["normalize_us"], p["store_smem_us"], p["store_gmem_us"]) == pytest.approx((0.05, 0.2, 0.25), abs=1e-3)
    assert progs[1]["start_us"] == pytest.approx(0.5) and progs[1]["end_us"] == pytest.approx(3.65)
    row = summarize(progs)
    assert row["programs"] == 2 and row["max_end_us"] == pytest.approx(3.65) and row["max_blocks"] == 3


def test_program_timelines_of_three_warpgroups():
    """Consumer 1's regions come prefixed; the program ends with its later consumer."""
    (p,) = program_timelines(trace_of([1000], WIDE), clock_ghz=1.0, warpgroups=3)
    assert p["blocks"] == 2 and p["fill_us"] == pytest.approx(1.0)
    assert p["handoff_us"] == pytest.approx(0.4) and p["scores_us"] == pytest.approx(0.4)  # the second block's
    assert p["c1_tail_softmax_us"] == pytest.approx(0.6) and p["c1_p_wait_us"] == pytest.approx(0.15)
    assert p["c1_k_wait_us"] == pytest.approx(0.05) and p["c1_pv_us"] == pytest.approx(0.4)
    assert p["epilogue_us"] == pytest.approx(0.2) and p["c1_epilogue_us"] == pytest.approx(0.6)
    assert p["busy_us"] == pytest.approx(4.0) and p["slot_wait_us"] == pytest.approx(0.6)
    assert "c1_blocks" not in p and "c2_slot_wait_us" not in p
    row = summarize([p])
    assert row["c1_pv_us"] == pytest.approx(0.4) and row["max_end_us"] == pytest.approx(4.0)


def test_profiling_arguments_go_together():
    z = jnp.zeros
    args = (z((1, 8, 576), jnp.bfloat16), z((1, 256, 576), jnp.bfloat16), z((1,), jnp.int32),
            z((1, 64, 576), jnp.bfloat16), z((1, 2, 8), jnp.int32))
    for kw in ({"profile_dir": "/tmp/x"}, {"profile_regions": 16}):
        with pytest.raises(ValueError, match="go together"):
            split_attention_narrow(*args, scale=0.1, kv_lora_rank=512, valid_rows=8, **kw)
    wide = (z((1, 64, 576), jnp.bfloat16),) + args[1:4] + (z((1, 2, 64), jnp.int32),)
    for kw in ({"profile_dir": "/tmp/x"}, {"profile_regions": 16}):
        with pytest.raises(ValueError, match="go together"):
            split_attention(*wide, scale=0.1, kv_lora_rank=512, **kw)


def test_profiler_buffer_must_fit_in_shared_memory():
    """The profiler's buffer (16 bytes a region and warpgroup) goes after the kernel's shared memory: the 64-row
    kernel at 64 rows leaves room for 19 regions, and asking for more is a clear error, not Mosaic GPU's."""
    assert profiler_params(None, 0, 1000, 3, "k") == {}
    assert profiler_params("/d", 19, smem_bytes(576, 64, 2), 3, "k") == {"profile_space": 19, "profile_dir": "/d"}
    with pytest.raises(ValueError, match="at most 19 fit"):
        profiler_params("/d", 20, smem_bytes(576, 64, 2), 3, "k")
    z = jnp.zeros
    wide = (z((1, 64, 576), jnp.bfloat16), z((1, 256, 576), jnp.bfloat16), z((1,), jnp.int32),
            z((1, 64, 576), jnp.bfloat16), z((1, 2, 64), jnp.int32))
    with pytest.raises(ValueError, match="split_attention: profiling 100 regions"):
        split_attention(*wide, scale=0.1, kv_lora_rank=512, profile_dir="/tmp/x", profile_regions=100)


def test_profile_names_choose_the_regions():
    """``profile_names`` keeps a kernel's named scopes (the profiler's regions) for the names it holds only, and
    ``regions_needed`` counts what a warpgroup then records: at T*H = 64, a 64K prefix's 10 blocks a program fit
    the 19 regions with one region a block, not with all of them."""
    def scopes(names):
        def f(x):
            region = region_scope(names)
            with region("k_wait"):
                x = x + 1
            with region("scores"):
                return x * 2
        return [str(e.source_info.name_stack) for e in jax.make_jaxpr(f)(1.0).eqns]

    assert scopes(None) == ["k_wait", "scores"]
    assert scopes({"scores"}) == ["", "scores"]
    assert regions_needed(None, 10) == 2 + 9 + 5 * 10      # header, Init, the once-a-program regions (5, and the
    # in-kernel merge's 4), 5 a block
    assert regions_needed(("k_wait", "slot_wait"), 10) == 12  # header, Init and one a block (either warpgroup)
    assert regions_needed(("scores", "p_wait", "q_wait"), 10) == 13  # consumer 0 and 1 each one a block
    assert regions_needed(("softmax", "handoff"), 3) == 8
    assert regions_needed(("q_wait", "epilogue", "store_smem", "store_gmem"), 10) == 6  # once a program only


def test_profile_names_are_checked():
    smem = smem_bytes(576, 64, 2)
    params = profiler_params("/d", 11, smem, 3, "k", ("k_wait", "slot_wait"))
    assert params == {"profile_space": 11, "profile_dir": "/d"}
    with pytest.raises(ValueError, match="must be a collection of"):
        profiler_params("/d", 11, smem, 3, "k", ("k_wait", "kwait"))
    with pytest.raises(ValueError, match="must be a collection of"):
        profiler_params("/d", 11, smem, 3, "k", "k_wait")
    with pytest.raises(ValueError, match="needs profile_dir"):
        profiler_params(None, 0, smem, 3, "k", ("k_wait",))
    z = jnp.zeros
    args = (z((1, 8, 576), jnp.bfloat16), z((1, 256, 576), jnp.bfloat16), z((1,), jnp.int32),
            z((1, 64, 576), jnp.bfloat16), z((1, 2, 8), jnp.int32))
    with pytest.raises(ValueError, match="split_attention_narrow: profile_names"):
        split_attention_narrow(*args, scale=0.1, kv_lora_rank=512, valid_rows=8, profile_names=("k_wait",))
