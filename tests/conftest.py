"""Test setup: 8 fake CPU devices (for sharding tests) and float32 matmuls on CPU.

Only this file and experiments/ read the environment; library code never does.
"""

import gc
import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


@pytest.fixture
def host_devices():
    """The 8 fake CPU devices set above, for sharding tests; beside a GPU too, where ``jax.devices()`` is the
    GPU alone."""
    devices = jax.devices("cpu")
    assert len(devices) == 8, "tests/conftest.py sets 8 host devices"
    return devices


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    if os.environ.get("DDTREE_REQUIRE_GPU") == "1":  # experiments/gpu_suite.py sets it for its processes
        raise pytest.UsageError("DDTREE_REQUIRE_GPU=1 but JAX sees no GPU (its backend may have failed to start, e.g. "
                                "out of memory): the GPU tests would be skipped, not run")
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """Keeps a worker's exit inside pytest-xdist's grace period.

    A worker ends holding ~2 million objects (JAX's compile caches, torch, transformers), and each full garbage
    collection of them took ~2 s on the 2-core CI machine. Teardown triggered several in a row; 5 s after the
    controller asked a worker to stop, execnet sent it SIGINT, which surfaced as a KeyboardInterrupt "ignored" in
    JAX's GC callback (sessions 52-54; their execnet traces say "sending ourselves a SIGINT"). Collecting at exit
    frees nothing that exit does not, so what is alive now is frozen out of every later collection."""
    gc.freeze()
