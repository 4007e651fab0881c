"""Minimal, memory-mapped safetensors reading (bf16 included via ml_dtypes), with clear errors.

We read the format directly (8-byte little-endian header length, JSON header, raw little-endian
data) so that tensors are memory-mapped one at a time — host memory stays near one tensor — and a
truncated or malformed file fails with a message naming the file and tensor.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterator

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, or does not match the model."""


class SafetensorsFile:
    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                raise CheckpointError(f"{path}: truncated safetensors file (header of {header_len} bytes)")
            try:
                header = json.loads(f.read(header_len))
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{path}: malformed safetensors header: {e}") from None
        header.pop("__metadata__", None)
        _check_layout(path, header)
        self.header = header
        self.data_start = 8 + header_len
        self.size = size

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only memory-mapped numpy array."""
        if name not in self.header:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        info = self.header[name]
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dtype = np.dtype(DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != expected:
            raise CheckpointError(f"{self.path}: tensor {name!r} has {end - begin} bytes, shape {shape} needs "
                                  f"{expected}")
        if self.data_start + end > self.size:
            raise CheckpointError(f"{self.path}: truncated file: tensor {name!r} ends at byte "
                                  f"{self.data_start + end} but the file has {self.size}")
        if expected == 0:
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + begin, shape=shape)


def _check_layout(path: str, header: dict) -> None:
    """The tensors' byte ranges, as the safetensors format requires: each [begin, end) with 0 <= begin <= end,
    laid end to end from 0 without gaps or overlaps (so no two tensors alias, none reads the header)."""
    spans = []
    for name, info in header.items():
        try:
            begin, end = (int(v) for v in info["data_offsets"])
            info["dtype"], tuple(info["shape"])
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}: {info}") from None
        if not 0 <= begin <= end:
            raise CheckpointError(f"{path}: tensor {name!r} has invalid data_offsets [{begin}, {end}]")
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise CheckpointError(f"{path}: tensor {name!r} starts at data byte {begin}, expected {at} (the "
                                  "tensors' data_offsets overlap or leave a gap)")
        at = end


def checkpoint_files(directory: str) -> list[str]:
    """The shard files of an HF checkpoint directory (index order if an index exists)."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: not a directory")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = list(dict.fromkeys(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: malformed index (a JSON object with a 'weight_map' of tensor "
                                  f"name to shard file expected): {e!r}") from None
        missing = [n for n in files if not os.path.exists(os.path.join(directory, n))]
        if missing:
            raise CheckpointError(f"{directory}: index names missing shard files {missing}")
        return [os.path.join(directory, n) for n in files]
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not found:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    return [os.path.join(directory, n) for n in found]


def iter_tensors(directory: str) -> Iterator[tuple[str, SafetensorsFile]]:
    """Yields (tensor name, file) over all shards, one shard at a time."""
    for path in checkpoint_files(directory):
        file = SafetensorsFile(path)
        for name in file.keys():
            yield name, file


def save_file(tensors: dict[str, np.ndarray], path: str) -> None:
    """Writes a safetensors file (used by tests and the converter)."""
    rev = {np.dtype(v): k for k, v in DTYPES.items()}
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        blob = arr.tobytes()
        header[name] = {"dtype": rev[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def checked_array(tensor_name: str, leaf, abstract_leaf) -> np.ndarray:
    """Shape/dtype check of one host array against the parameter it fills (anything with ``shape`` and
    ``dtype``): int32 only from int32, a float parameter only from a float tensor; returns a C-contiguous
    copy in the parameter's dtype (the memory map is not kept). CheckpointError naming the tensor otherwise."""
    if tuple(leaf.shape) != tuple(abstract_leaf.shape):
        raise CheckpointError(f"{tensor_name}: shape {tuple(leaf.shape)} != expected {tuple(abstract_leaf.shape)}")
    target = np.dtype(abstract_leaf.dtype)
    if target == np.int32 and leaf.dtype != np.int32:
        raise CheckpointError(f"{tensor_name}: dtype {leaf.dtype} != int32")
    if target != np.int32 and not np.issubdtype(leaf.dtype, np.floating) and leaf.dtype != ml_dtypes.bfloat16:
        raise CheckpointError(f"{tensor_name}: dtype {leaf.dtype} is not a float type")
    with np.errstate(over="ignore"):  # float16's overflow, counted and refused below
        out = np.ascontiguousarray(leaf, dtype=target)
    if target == np.float16 and leaf.dtype != np.float16:  # the one float target narrower in range than its source
        overflow = int(np.count_nonzero(np.isinf(out) & ~np.isinf(leaf)))
        if overflow:
            raise CheckpointError(f"{tensor_name}: {overflow} values overflow float16 (|x| > 65504); load it in "
                                  "bfloat16 or float32")
    return out
