"""experiments/probe_gmem_sync.py on the CPU: each variant lowers to one Mosaic GPU kernel for CUDA, only the
counter variants carry Pallas's zeroing of their global counters, and bad shapes are refused."""

import jax
import jax.numpy as jnp
import pytest

from experiments.probe_gmem_sync import ROW, VARIANTS, main, probe_kernel


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_lower_for_cuda(variant):
    fn = probe_kernel(16, 8, variant)
    text = jax.jit(fn).trace(jax.ShapeDtypeStruct((16, ROW), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1
    zeroed = "tensor<2xi32>" in text  # the two groups' counters, an aliased input Pallas fills with zeros
    assert zeroed == (variant != "plain")


def test_bad_arguments():
    with pytest.raises(ValueError, match="must divide"):
        probe_kernel(16, 5, "plain")
    with pytest.raises(ValueError, match="not one of"):
        probe_kernel(16, 8, "spin")
    if jax.default_backend() != "gpu":  # on a GPU main([]) runs the probe itself
        with pytest.raises(SystemExit, match="needs a GPU"):
            main([])
