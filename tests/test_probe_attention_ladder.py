"""experiments/probe_attention_ladder.py on the CPU: every rung lowers to one Mosaic GPU kernel for CUDA within
the H200's shared memory, in the op's grid (splits_for at T = 1, H = 64), beside the real kernel on the same
blocks; bad arguments are refused; without a GPU the script says it needs one."""

import jax
import jax.numpy as jnp
import pytest

from experiments.probe_attention_ladder import (LAYOUTS, RUNGS, fixed_and_per_block, ladder_kernel, main, mosaic_us,
                                               point_bytes, real_kernel)
from pallas_kernels.mla_attention_plan import splits_for


def lowered(fn, B, S):
    return jax.jit(fn).trace(jax.ShapeDtypeStruct((B, 64, 576), jnp.bfloat16),
                             jax.ShapeDtypeStruct((B, S, 576), jnp.bfloat16)).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("rung", RUNGS)
def test_rungs_lower_for_cuda_in_the_ops_grid(rung):
    B, S = 16, 8192
    low = lowered(ladder_kernel(B, S, rung), B, S)
    assert low.as_text().count("mosaic_gpu") >= 1
    assert low.out_info.shape == (splits_for(B, 1, 64, S, 64), B, 64, 512)


@pytest.mark.parametrize("layout,rung", [("slot2", "copy"), ("slot3", "scores"), ("slot3", "pv")])
def test_layouts_without_the_query_tile_lower(layout, rung):
    """The query tile's memory as a third key slot (slot3) fits the H200's shared memory beside p and the stats."""
    B, S = 4, 4096
    assert LAYOUTS[layout][1]
    low = lowered(ladder_kernel(B, S, rung, layout), B, S)
    assert low.as_text().count("mosaic_gpu") >= 1
    assert low.out_info.shape == (splits_for(B, 1, 64, S, 64), B, 64, 512)


def test_real_kernel_on_the_same_blocks_lowers():
    low = lowered(real_kernel(2, 1024), 2, 1024)
    assert "mosaic_gpu" in low.as_text() and low.out_info.shape == (splits_for(2, 1, 64, 1024, 64), 2, 64, 512)


def test_bad_arguments():
    with pytest.raises(ValueError, match="not one of"):
        ladder_kernel(1, 1024, "merge")
    with pytest.raises(ValueError, match="not one of"):
        ladder_kernel(1, 1024, "copy", "tile3")
    with pytest.raises(ValueError, match="has no query tile"):
        ladder_kernel(1, 1024, "query", "slot3")
    for B, S in ((0, 1024), (1, 100), (1, 0)):
        with pytest.raises(ValueError, match="positive multiple of 64"):
            ladder_kernel(B, S, "copy")
    with pytest.raises(SystemExit):
        main(["--points", "1,100"])
    with pytest.raises(SystemExit):
        main(["--rungs", "copy,merge"])
    for layouts in ("slot4", ","):
        with pytest.raises(SystemExit):
            main(["--layouts", layouts])
    assert point_bytes(16, 8192) == 2 * 16 * (8192 * 576 + 64 * 576 + 576 + 64 * 512)  # keys, q, tree key, out
    if jax.default_backend() != "gpu":
        with pytest.raises(SystemExit, match="needs a Hopper GPU"):
            main(["--points", "1,1024"])


def test_mosaic_us_is_the_median_launch():
    """The rung's time is the median of the Mosaic GPU kernel's launches (as the docstring says), not their mean:
    one slow launch of four does not move it; the chain's tie kernels are left out."""
    result = {"launches_us": {"mosaic_gpu_kernel": [10.0, 11.0, 12.0, 40.0], "tie_fusion": [1.0] * 4},
              "kernels": [["mosaic_gpu_kernel", 1.0, 18.25e-6], ["tie_fusion", 1.0, 1e-6]]}
    assert mosaic_us(result) == 11.5
    with pytest.raises(RuntimeError, match="one Mosaic GPU kernel"):
        mosaic_us({"launches_us": {"tie_fusion": [1.0]}, "kernels": []})


def test_fixed_and_per_block_recovers_a_line_per_grid():
    """Rows of one grid size (B * splits programs) on an exact line are fitted back to its intercept and slope; a
    group with one block count (or one point) has no line; layouts, rungs and grid sizes are never mixed. Session
    53's two copy-rung points (128 programs of 16 and 8 blocks) give its quoted 2.01 µs a block and 6.4 µs fixed."""
    def row(B, S, splits, us, rung="copy", layout="tile2"):
        return dict(B=B, S=S, splits=splits, kernel_us=us, rung=rung, layout=layout)

    line = [row(16, S, 8, 6.4 + 2.01 * (S // 64 // 8)) for S in (2048, 4096, 8192, 16384)]
    line += [row(1, S, 128, 6.4 + 2.01 * (S // 64 // 128)) for S in (32768, 131072)]
    others = [row(16, 8192, 8, 99.0, rung="pv"), row(4, 8192, 33, 10.0), row(4, 65536, 33, 70.0, layout="slot2")]
    [fit] = fixed_and_per_block(line + others)
    assert (fit["layout"], fit["rung"], fit["programs"], fit["blocks"]) == ("tile2", "copy", 128, [4, 8, 16, 32])
    assert abs(fit["us_per_block"] - 2.01) < 1e-9 and abs(fit["fixed_us"] - 6.4) < 1e-9
    assert fit["max_residual_us"] < 1e-9
    # the busiest program sets the blocks: 33 splits of 128 blocks -> 4; of 1024 -> 32 (31 or 32 each)
    [fit] = fixed_and_per_block([row(4, 8192, 33, 10.0), row(4, 65536, 33, 70.0)])
    assert fit["blocks"] == [4, 32] and abs(fit["us_per_block"] - 60.0 / 28) < 1e-9
    [fit] = fixed_and_per_block([row(16, 8192, 8, 38.58), row(1, 65536, 128, 22.50)])
    assert round(fit["us_per_block"], 2) == 2.01 and round(fit["fixed_us"], 1) == 6.4
