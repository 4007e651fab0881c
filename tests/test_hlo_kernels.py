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
    assert "layers.py rms_norm" in by_function and "1.00       1  some_cublas_gemm" in by_function
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
