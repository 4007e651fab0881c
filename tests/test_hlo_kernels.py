"""hlo_kernels: a trace's kernel names joined to the optimized HLO of the same compile and read back to the
repository's source lines."""

import json

import jax
import jax.numpy as jnp
import pytest

from ddtree_jax.layers import rms_norm
from experiments import hlo_kernels


def compiled_hlo():
    fn = jax.jit(lambda x, w: jnp.tanh(rms_norm(x, w, 1e-6)) @ x.T)
    return fn.lower(jnp.ones((4, 64), jnp.float32), jnp.ones((64,), jnp.float32)).compile().as_text()


def test_fusions_read_back_to_the_library_lines_they_came_from():
    hlo = hlo_kernels.parse_hlo(compiled_hlo())
    entry = [r for recs in hlo["computations"].values() for r in recs if r["op"] == "fusion"]
    assert entry, "the CPU compile fused nothing"
    described = [hlo_kernels.describe(hlo, hlo_kernels.kernel_key(r["name"])) for r in entry]
    assert any(line.startswith("layers.py:") and "rms_norm" in line for d in described for line in d["lines"])
    assert all(d["op"] == "fusion" and sum(d["ops"].values()) > 0 for d in described)
    missing = hlo_kernels.describe(hlo, "body_mosaic_gpu_kernel")  # a Pallas kernel's own name
    assert missing["op"] is None and not missing["lines"]


def test_the_command_prints_each_kernel_with_its_source(tmp_path, capsys):
    text = compiled_hlo()
    (tmp_path / "hlo.txt").write_text(text)
    hlo = hlo_kernels.parse_hlo(text)
    fusions = [r["name"] for recs in hlo["computations"].values() for r in recs if r["op"] == "fusion"]
    kernels = [[hlo_kernels.kernel_key(n), 1.0, 2.5] for n in fusions] + [["some_cublas_gemm", 1.0, 1.0]]
    (tmp_path / "r.json").write_text(json.dumps({"rows": [{"M": 1, "part": "layer", "us": 9.0, "kernels": kernels}]}))
    hlo_kernels.main([str(tmp_path / "r.json"), str(tmp_path / "hlo.txt"), "--row", "part=layer,M=1", "--by-function"])
    out = capsys.readouterr().out
    by_function = out.split("function (a kernel's")[1]
    assert "layers.py rms_norm" in by_function and "1.00        1  some_cublas_gemm" in by_function
    assert "layers.py:" in out and "some_cublas_gemm  [not in the HLO]" in out
    assert f"{2.5 * len(fusions) + 1.0:7.2f} µs over the {len(kernels)} kernels listed" in out


def test_the_command_asks_for_exactly_one_traced_row(tmp_path, capsys):
    rows = [{"M": 1, "part": "layer", "us": 1.0, "kernels": []}, {"M": 1, "part": "moe", "us": 1.0}]
    (tmp_path / "r.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "hlo.txt").write_text("HloModule m\n")
    for row, says in (("M=1", "has 2 rows with {'M': 1}"), ("part=moe,M=1", "1 rows with {'part': 'moe', 'M': 1}, "
                                                                            "without kernels"), ("M", "is not KEY")):
        with pytest.raises(SystemExit):
            hlo_kernels.main([str(tmp_path / "r.json"), str(tmp_path / "hlo.txt"), "--row", row])
        assert says in capsys.readouterr().err


HAND_WRITTEN = """HloModule m

FileNames
1 "/repo/ddtree_jax/layers.py"

FunctionNames
1 "rms_norm"
2 "_plain_dot"

FileLocations
1 {file_name_id=1 function_name_id=1 line=37 end_line=37 column=1 end_column=2}
2 {file_name_id=1 function_name_id=2 line=75 end_line=75 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}

%fused_dot (p0: bf16[2,64], p1: bf16[64,32]) -> f32[2,32] {
  %p0 = bf16[2,64]{1,0} parameter(0)
  %m1 = bf16[2,64]{1,0} multiply(%p0, %p0), metadata={op_name="mul" stack_frame_id=1}
  %m2 = bf16[2,64]{1,0} multiply(%m1, %p0), metadata={op_name="mul" stack_frame_id=1}
  %p1 = bf16[64,32]{1,0} parameter(1)
  ROOT %d = f32[2,32]{1,0} dot(%m2, %p1), lhs_contracting_dims={1}, metadata={op_name="dot" stack_frame_id=2}
}

ENTRY %main (a: bf16[2,64], b: bf16[64,32]) -> f32[2,32] {
  %a = bf16[2,64]{1,0} parameter(0)
  %b = bf16[64,32]{1,0} parameter(1)
  ROOT %gemm_fusion_dot.7 = f32[2,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot
}
"""


def test_a_fusion_is_anchored_at_its_dot_not_its_most_frequent_line():
    """A GEMM fusion with the norm's scaling as its prologue is the dot's kernel (two multiplies from rms_norm, one
    dot): read back by the trace's name, with '.' as '_'."""
    d = hlo_kernels.describe(hlo_kernels.parse_hlo(HAND_WRITTEN), "gemm_fusion_dot_7")
    assert d["op"] == "fusion" and d["shape"].startswith("f32[2,32]")
    assert d["ops"] == {"multiply": 2, "dot": 1}
    assert d["lines"].most_common(1)[0][0] == "layers.py:37 (rms_norm)"
    assert d["anchor"] == "layers.py:75 (_plain_dot)"
