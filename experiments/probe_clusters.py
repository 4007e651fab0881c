"""How many thread-block clusters of each size a Hopper GPU holds at once, at the attention kernels' shared memory.

    PYTHONPATH=. python experiments/probe_clusters.py --out DIR

The question behind it (issue #6): three designs ran the attention kernels' programs as clusters (RESULTS.md,
sessions 19, 41 and 44: a merge through shared memory, the query tile multicast, a pair merge) and none paid. The
log read two of them as "the clusters do not all fit at once", which was never checked. A cluster's programs
must sit on SMs of one GPC, so how many fit depends on how many SMs each GPC has, which no device attribute
reports. The CUDA driver does know:
``cuOccupancyMaxActiveClusters`` gives the number of clusters of a given size that can be resident at once for
a kernel's block size and shared memory. This asks it for an empty kernel (PTX for sm_90a) with the 64-row
attention kernel's block (three warpgroups, 384 threads) at its shared memory (one program per SM), at half of
the SM's shared memory (two per SM) and with none. The query is plain ctypes over ``libcuda``, no compiler. Needs
an NVIDIA GPU with compute capability 9.0.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import bench_util  # noqa: E402

PTX = b"""
.version 8.0
.target sm_90a
.address_size 64
.visible .entry probe_cluster_kernel() { ret; }
"""
KERNEL_NAME = b"probe_cluster_kernel"
CLUSTER_SIZES = (1, 2, 4, 8, 16)
ATTENTION_SMEM = 231_504   # mla_attention_mgpu.smem_bytes at K2.6 width, 64-key blocks, 2 stages
ATTENTION_THREADS = 384    # producer and two consumers
# CUDA driver enums (cuda.h)
FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
DEVICE_MULTIPROCESSOR_COUNT = 16
DEVICE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
DEVICE_COMPUTE_CAPABILITY_MAJOR = 75


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union (here the cluster's x, y, z)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint32 * 16)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def cluster_config(cluster: int, grid_clusters: int, threads: int, smem: int):
    """The launch config (and the attribute it points to, which must outlive it) of ``grid_clusters`` clusters of
    ``cluster`` programs along x."""
    if cluster < 1 or grid_clusters < 1 or threads < 1 or smem < 0:
        raise ValueError(f"cluster={cluster}, grid_clusters={grid_clusters}, threads={threads}, smem={smem}")
    attr = LaunchAttribute(id=LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
    attr.value[0], attr.value[1], attr.value[2] = cluster, 1, 1
    config = LaunchConfig(gridDimX=cluster * grid_clusters, gridDimY=1, gridDimZ=1, blockDimX=threads, blockDimY=1,
                          blockDimZ=1, sharedMemBytes=smem, hStream=None, attrs=ctypes.pointer(attr), numAttrs=1)
    return config, attr


class Driver:
    """The few CUDA driver calls the probe makes, each checked."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise SystemExit(f"probe_clusters needs a GPU and its driver (libcuda.so.1): {e}") from None
        self.call("cuInit", 0)
        self.device = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(self.device), 0)
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), self.device)
        self.call("cuCtxSetCurrent", ctx)

    def call(self, name: str, *args):
        status = getattr(self.lib, name)(*args)
        if status != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(status, ctypes.byref(msg))
            raise RuntimeError(f"{name} failed: {status} ({(msg.value or b'?').decode()})")

    def attribute(self, attr: int) -> int:
        out = ctypes.c_int()
        self.call("cuDeviceGetAttribute", ctypes.byref(out), attr, self.device)
        return out.value

    def empty_kernel(self):
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self.call("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(PTX))
        self.call("cuModuleGetFunction", ctypes.byref(fn), module, KERNEL_NAME)
        self.call("cuFuncSetAttribute", fn, FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        return fn

    def max_active_clusters(self, fn, cluster: int, threads: int, smem: int, grid_clusters: int) -> int:
        self.call("cuFuncSetAttribute", fn, FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        config, _attr = cluster_config(cluster, grid_clusters, threads, smem)
        out = ctypes.c_int()
        self.call("cuOccupancyMaxActiveClusters", ctypes.byref(out), fn, ctypes.byref(config))
        return out.value


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=ATTENTION_THREADS)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None, help="folder for probe_clusters.json (default: none written)")
    args = ap.parse_args(argv)
    drv = Driver()
    sms = drv.attribute(DEVICE_MULTIPROCESSOR_COUNT)
    if drv.attribute(DEVICE_COMPUTE_CAPABILITY_MAJOR) != 9:
        raise SystemExit("probe_clusters: the empty kernel is PTX for sm_90a (Hopper)")
    smem_limit = drv.attribute(DEVICE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    fn = drv.empty_kernel()
    rows = []
    for smem in (min(ATTENTION_SMEM, smem_limit), smem_limit // 2, 0):
        for cluster in CLUSTER_SIZES:
            try:
                n = drv.max_active_clusters(fn, cluster, args.threads, smem, grid_clusters=sms)
                error = None
            except RuntimeError as e:  # e.g. a cluster size the device refuses
                n, error = None, str(e)
            rows.append(dict(smem=smem, cluster=cluster, max_active_clusters=n,
                             resident_programs=None if n is None else n * cluster, error=error))
    print(f"{sms} SMs, {args.threads} threads a program, opt-in shared memory {smem_limit} bytes")
    bench_util.print_table(rows, ["smem", "cluster", "max_active_clusters", "resident_programs", "error"])
    if args.out:
        bench_util.write_result("probe_clusters", dict(code_commit=args.commit, sms=sms, threads=args.threads,
                                                       smem_limit=smem_limit, rows=rows), args.out)
    return rows


if __name__ == "__main__":
    main()
