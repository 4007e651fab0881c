"""experiments/probe_clusters.py on the CPU: the launch config it hands the CUDA driver has the layout of cuda.h's
CUlaunchConfig and CUlaunchAttribute (sizes and offsets on a 64-bit host), the cluster dimension lands in the
attribute's value, bad sizes are refused, and without a driver the script says it needs a GPU."""

import ctypes

import pytest

from experiments.probe_clusters import (LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, LaunchAttribute, LaunchConfig,
                                        cluster_config, main)


def test_driver_structs_match_cuda_h():
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert LaunchConfig.hStream.offset == 32 and LaunchConfig.attrs.offset == 40
    assert LaunchConfig.numAttrs.offset == 48 and ctypes.sizeof(LaunchConfig) == 56


def test_cluster_config():
    config, attr = cluster_config(8, 16, 384, 231_504)
    assert (config.gridDimX, config.gridDimY, config.blockDimX, config.sharedMemBytes) == (128, 1, 384, 231_504)
    assert config.numAttrs == 1 and config.attrs.contents.id == LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert list(config.attrs.contents.value[:3]) == [8, 1, 1] and attr.value[0] == 8
    for bad in (dict(cluster=0), dict(grid_clusters=0), dict(smem=-1)):
        with pytest.raises(ValueError):
            cluster_config(**{**dict(cluster=2, grid_clusters=4, threads=384, smem=0), **bad})


def test_without_a_driver_it_needs_a_gpu():
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(SystemExit, match="needs a GPU"):
            main([])
    else:
        pytest.skip("a CUDA driver is present: main() would run the probe")
