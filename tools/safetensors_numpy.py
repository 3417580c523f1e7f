"""safetensors files as raw bytes with numpy alone (tools/convert_hf.py's): a tensor keeps its
stored dtype and bits (bf16 included), files are written atomically."""

import json
import os
import struct

import numpy as np

# Storage dtype per safetensors dtype; bf16 is kept as its 16 bits (numpy has no bfloat16).
STORAGE = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4",
           "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}


class SafetensorsError(Exception):
    """A file that is not the safetensors it should be: the path and what is wrong."""


class Tensor:
    """A tensor's safetensors dtype and its bytes as a numpy array of the storage dtype."""

    def __init__(self, dtype, array):
        self.dtype, self.array = dtype, array

    @property
    def shape(self):
        return list(self.array.shape)

    def like(self, array):
        return Tensor(self.dtype, np.ascontiguousarray(array))


def bf16_bits(values):
    """float32 values as bfloat16 bits (uint16), rounded to nearest even."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def read_safetensors(path):
    """name -> Tensor (memory-mapped), and the file's __metadata__."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise SafetensorsError(f"{path}: not a readable safetensors file ({e})")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    start = 8 + n
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info["dtype"]
        if dtype not in STORAGE:
            raise SafetensorsError(f"{path}: {name} has dtype {dtype}, which this tool does not "
                                   "read")
        begin, end = info["data_offsets"]
        if start + end > data.size:
            raise SafetensorsError(f"{path}: {name} runs past the end of the file (truncated?)")
        raw = data[start + begin:start + end]
        tensors[name] = Tensor(dtype, raw.view(STORAGE[dtype]).reshape(info["shape"]))
    return tensors, header.get("__metadata__", {})


def write_safetensors(path, tensors, metadata=None):
    """Writes name -> Tensor; wider dtypes first, so every tensor is aligned to its element."""
    order = sorted(tensors, key=lambda k: (-np.dtype(STORAGE[tensors[k].dtype]).itemsize, k))
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name in order:
        t = tensors[name]
        nbytes = t.array.nbytes
        header[name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)

    def write(f):
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in order:
            f.write(np.ascontiguousarray(tensors[name].array).tobytes())
    write_atomically(path, write)


def write_atomically(path, write, mode="wb"):
    """write(f) into path.tmp, fsynced, then renamed over path: a reader never sees half a file."""
    tmp = path + ".tmp"
    with open(tmp, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text(path, text):
    write_atomically(path, lambda f: f.write(text), "w")
