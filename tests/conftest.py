"""Test setup: 8 fake CPU devices (for sharding tests) and float32 matmuls on CPU.

Only this file and experiments/ read the environment; library code never does.
"""

import gc
import importlib.metadata
import importlib.util
import os


def cuda_plugin_installed() -> bool:
    """Whether JAX will find a CUDA backend here (its plugin is installed), read without importing JAX."""
    names = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
    for name in names:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:
            continue
    return False


# Fast compiles for the CPU suite: XLA's LLVM backend at -O0 without its expensive passes. The tests' configs are
# tiny, so their time is compiling, not running (the slowest engine test: 95 s -> 55 s on a 2-core EPYC). Results move
# by float32 rounding only (the shipped pair's sampled run_decode: the same tokens, log-probabilities within 1.5e-5),
# well inside every test's tolerance. Both flags would also reach a GPU's PTX, so they are left out where a CUDA backend
# is installed.
CPU_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def fusion_emitter_flags(jaxlib_version: str) -> tuple[str, ...]:
    """XLA:CPU's older elemental emitters in place of its MLIR fusion emitters: 25-30 % less time for compile-bound
    tests and for the shipped pair's execution-bound one at -O0 (session 66: test_stop_strings.py 70 -> 51 s; the
    trained pair 52 -> 40 s). XLA aborts the process on a flag it does not know, and this one goes once the old
    emitters are deleted, so it is set only for the jaxlib releases it was checked on (0.10.x)."""
    major_minor = tuple(int(part) for part in jaxlib_version.split(".")[:2])
    return ("--xla_cpu_use_fusion_emitters=false",) if major_minor == (0, 10) else ()


CPU_COMPILE_FLAGS += fusion_emitter_flags(importlib.metadata.version("jaxlib"))

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
if not cuda_plugin_installed():
    for flag in CPU_COMPILE_FLAGS:
        if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
            os.environ["XLA_FLAGS"] += " " + flag

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def user_environment(root: str, compile_flags: bool) -> dict:
    """This process's environment for a child process that runs as a user's would: one host device (without the
    8 fake ones set above), ``root`` first on PYTHONPATH, and the suite's -O0 ``CPU_COMPILE_FLAGS`` kept only where
    ``compile_flags``."""
    dropped = ("--xla_force_host_platform_device_count",) + (
        () if compile_flags else tuple(f.split("=")[0] for f in CPU_COMPILE_FLAGS))
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(dropped))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


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


def mapped_regions() -> int | None:
    """Memory regions this process maps (Linux: lines of /proc/self/maps); None where that cannot be read."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def map_limit() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return None


MAP_LIMIT = map_limit()


@pytest.fixture(autouse=True)
def bound_compiled_programs():
    """Drops JAX's compile caches before a test once this process maps over half of Linux's vm.max_map_count.

    Every program XLA:CPU compiles keeps memory regions mapped while it is cached. A worker that has compiled a few
    hundred engines (test_engine.py alone maps ~45 000 regions at 60 %) reaches the limit (65 530 by default), and
    the next compile's mmap fails inside LLVM: session 59's CI died there twice, by segfault and by abort, in
    different tests. Dropping the caches frees the regions; later tests recompile what they need."""
    count = mapped_regions() if MAP_LIMIT else None
    if count is not None and count > MAP_LIMIT // 2:
        jax.clear_caches()
        gc.collect()
    yield


def pytest_sessionfinish(session, exitstatus):
    """Keeps a worker's exit inside pytest-xdist's grace period.

    A worker ends holding ~2 million objects (JAX's compile caches, torch, transformers), and each full garbage
    collection of them took ~2 s on the 2-core CI machine. Teardown triggered several in a row; 5 s after the
    controller asked a worker to stop, execnet sent it SIGINT, which surfaced as a KeyboardInterrupt "ignored" in
    JAX's GC callback (sessions 52-54; their execnet traces say "sending ourselves a SIGINT"). Collecting at exit
    frees nothing that exit does not, so what is alive now is frozen out of every later collection."""
    gc.freeze()
