"""Megatron-LM's `torch_dist` checkpoints (megatron-core's dist_checkpointing over PyTorch's
distributed checkpoint format, DCP) as global tensors: reading one iteration's folder and
writing one (tools/convert_megatron.py's).

An iteration folder holds
  metadata.json    {"sharded_backend": "torch_dist", ...}: dist_checkpointing's marker
  .metadata        DCP's index (a pickle): per key its global shape, dtype and chunks, and
                   where each chunk's bytes are
  __R_T.distcp     the chunks: each a torch.save of one tensor, or the bytes of an object
  common.pt        a torch.save of what is not sharded: args, iteration, checkpoint_version, ...

Reading never runs code from the files: the two pickles are read by an unpickler that builds
only plain containers, argparse.Namespace and torch's DCP metadata classes, and stands an inert
`Opaque` in for any other class (an enum, a path, a config object); the chunks are read with
torch.load(weights_only=True). Tensors come back as safetensors_numpy.Tensor (their bits kept,
bf16 included). torch is needed for both directions.
"""

import argparse
import codecs
import collections
import copyreg
import functools
import io
import json
import os
import pickle
import warnings
import zipfile

import numpy as np

from safetensors_numpy import Tensor

try:
    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                      WriteItemType)
except ImportError:  # said when a command needs it (require_torch)
    torch = None

BACKEND_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                  "common_backend": "torch", "common_backend_version": 1}
CONFIG_FILE = "metadata.json"  # dist_checkpointing's name (braid's own metadata has it too)
COMMON_FILE = "common.pt"
INDEX_FILE = ".metadata"
TORCH_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# mcore_data's record of a tensor megatron-core before 0.14 saved flattened (_read_flattened)
REFORMULATED = "nd_reformulated_orig_global_shape"


class FormatError(Exception):
    """A torch_dist folder this module cannot read: the file and what is wrong."""


def require_torch():
    if torch is None:
        raise FormatError("convert_megatron.py needs PyTorch to read and write torch_dist "
                          "checkpoints (PyTorch's distributed checkpoint format): pip install "
                          "torch")


# ---- pickles without code --------------------------------------------------------------------

class Opaque:
    """An object of a class the reader does not build: its pickled name, the arguments it was
    built from and its state. Nothing of the class runs."""

    pickled_name = "?"
    args, state = (), None  # where copyreg's reconstructor built it without __new__'s arguments

    def __new__(cls, *args):
        obj = object.__new__(cls)
        obj.args = args
        return obj

    def __setstate__(self, state):
        self.state = state
        if isinstance(state, dict):  # a dataclass's or plain object's fields, as attributes
            self.__dict__.update({k: v for k, v in state.items() if k not in ("args", "state")})

    def __repr__(self):
        return f"{self.pickled_name}{self.args!r}"


def _opaque_class(module, name):
    return type(name, (Opaque,), {"pickled_name": f"{module}.{name}"})


@functools.lru_cache(maxsize=None)
def _safe_globals():
    """What the unpickler builds as it is; anything else becomes an Opaque."""
    safe = {("collections", "OrderedDict"): collections.OrderedDict,
            ("argparse", "Namespace"): argparse.Namespace,
            ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
            ("builtins", "slice"): slice, ("builtins", "bytearray"): bytearray,
            ("_codecs", "encode"): codecs.encode,  # how protocol 2 stores bytes (b"": bytes())
            ("builtins", "bytes"): bytes, ("__builtin__", "bytes"): bytes,
            ("copyreg", "_reconstructor"): copyreg._reconstructor}
    if torch is not None:
        safe[("torch", "Size")] = torch.Size
        for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                     "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                     "_MEM_FORMAT_ENCODING"):
            safe[("torch.distributed.checkpoint.metadata", name)] = getattr(dcp_metadata, name)
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        safe[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    return safe


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        safe = _safe_globals()
        if (module, name) in safe:
            return safe[(module, name)]
        if module == "torch" and torch is not None:
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value  # torch.float32, torch.strided: plain values
        return _opaque_class(module, name)

    def persistent_load(self, pid):  # a tensor's storage in a torch.save: not read
        return Opaque("storage", *pid[1:2])


def load_pickle(data: bytes):
    return _Unpickler(io.BytesIO(data)).load()


def load_torch_save(path):
    """The object a torch.save wrote to `path`, its tensors left out (Opaque storages)."""
    try:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith("data.pkl")]
            if len(names) != 1:
                raise FormatError(f"{path}: not a torch.save file (no data.pkl)")
            return load_pickle(z.read(names[0]))
    except (zipfile.BadZipFile, OSError, pickle.UnpicklingError, EOFError, ValueError,
            TypeError, AttributeError) as e:
        raise FormatError(f"{path}: not a readable torch.save file ({e})")


# ---- reading ---------------------------------------------------------------------------------

def is_torch_dist(folder):
    try:
        with open(os.path.join(folder, CONFIG_FILE)) as f:
            return json.load(f).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False


def read_common(folder):
    """common.pt: a dict (args, iteration, checkpoint_version, content_metadata, ...)."""
    path = os.path.join(folder, COMMON_FILE)
    if not os.path.isfile(path):
        raise FormatError(f"{folder}: no {COMMON_FILE}")
    common = load_torch_save(path)
    if not isinstance(common, dict):
        raise FormatError(f"{path}: holds a {type(common).__name__}, not a dict")
    return common


def read_index(folder):
    """DCP's .metadata: Metadata(state_dict_metadata, storage_data, ...)."""
    require_torch()
    path = os.path.join(folder, INDEX_FILE)
    if not os.path.isfile(path):
        raise FormatError(f"{folder}: no {INDEX_FILE} (PyTorch's distributed checkpoint index)")
    with open(path, "rb") as f:
        data = f.read()
    try:
        index = load_pickle(data)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise FormatError(f"{path}: not a readable DCP index ({e})")
    # DCP's Metadata (or megatron-core 0.15's MCoreMetadata, an Opaque with its fields)
    if not hasattr(index, "state_dict_metadata") or not hasattr(index, "storage_data"):
        raise FormatError(f"{path}: holds a {type(index).__name__}, not DCP's Metadata")
    return index


def _read_item(folder, info, what):
    if getattr(info, "transform_descriptors", None):
        raise FormatError(f"{folder}: {what} is stored through {info.transform_descriptors} "
                          "(compressed?); this tool reads plain torch_dist files")
    path = os.path.join(folder, info.relative_path)
    try:
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
    except OSError as e:
        raise FormatError(f"{folder}: {what}: {e}")
    if len(data) != info.length:
        raise FormatError(f"{path}: {what} runs past the end of the file (truncated?)")
    return data


def to_tensor(t, what):
    """A torch tensor as a Tensor (its bits)."""
    if not isinstance(t, torch.Tensor):
        raise FormatError(f"{what} is a {type(t).__name__}, not a tensor")
    name = str(t.dtype).replace("torch.", "")
    if name not in TORCH_DTYPES:
        raise FormatError(f"{what} has dtype {name} (braid's parameters are float32, bfloat16 or "
                          "float16)")
    if name == "bfloat16":
        return Tensor("BF16", t.contiguous().view(torch.int16).numpy().view(np.uint16))
    return Tensor(TORCH_DTYPES[name], t.contiguous().numpy())


def read_torch_dist(folder, wanted_tensor=lambda key: True):
    """(name -> Tensor of every tensor key `wanted_tensor` takes, assembled from its chunks;
    name -> bytes of every object key (a torch.save each); the names of the tensors left out)."""
    index = read_index(folder)
    where, pieces = {}, {}
    for mi, info in (index.storage_data or {}).items():
        offset = tuple(mi.offset) if mi.offset is not None else None
        where[(mi.fqn, offset)] = info
        pieces.setdefault(mi.fqn, []).append((offset, info))
    mcore = getattr(index, "mcore_data", None)
    tensors, objects, left_out = {}, {}, []
    for key, entry in index.state_dict_metadata.items():
        if isinstance(entry, dcp_metadata.BytesStorageMetadata):
            if (key, None) not in where:
                raise FormatError(f"{folder}/{INDEX_FILE}: no storage for object {key}")
            objects[key] = _read_item(folder, where[(key, None)], key)
            continue
        if not wanted_tensor(key):
            left_out.append(key)
            continue
        shape = (mcore.get(key) or {}).get(REFORMULATED) if isinstance(mcore, dict) else None
        if shape is not None:
            tensors[key] = _read_flattened(folder, key, entry, pieces.get(key, []), shape)
        else:
            tensors[key] = _read_tensor(folder, key, entry, where)
    return tensors, objects, left_out


def tensor_chunks(folder):
    """{tensor key: [(offsets, sizes)] of each chunk it was saved in} (a layer's, an expert's, a
    TP rank's shard: what one rank's parameter holds)."""
    return {key: [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks]
            for key, entry in read_index(folder).state_dict_metadata.items()
            if not isinstance(entry, dcp_metadata.BytesStorageMetadata)}


def _read_tensor(folder, key, entry, where):
    shape = tuple(entry.size)
    whole, covered = None, 0
    for chunk in entry.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        info = where.get((key, offsets))
        if info is None:
            raise FormatError(f"{folder}/{INDEX_FILE}: no storage for {key} at {list(offsets)}")
        part = _load_piece(folder, key, offsets, info)
        if tuple(part.array.shape) != sizes:
            raise FormatError(f"{folder}: {key} at {list(offsets)} holds "
                              f"{list(part.array.shape)}, the index says {list(sizes)}")
        if whole is None:
            whole = Tensor(part.dtype, np.empty(shape, dtype=part.array.dtype))
        if part.dtype != whole.dtype or any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise FormatError(f"{folder}: the chunks of {key} differ in dtype or leave its "
                              f"shape {list(shape)}")
        whole.array[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = part.array
        covered += int(np.prod(sizes))
    if whole is None or covered != int(np.prod(shape)):
        raise FormatError(f"{folder}: the chunks of {key} do not cover its shape {list(shape)}")
    return whole


def _load_piece(folder, key, offsets, info):
    """One stored chunk of `key` (at `offsets`) as a Tensor."""
    data = _read_item(folder, info, f"{key} at {list(offsets)}")
    try:
        t = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # torch.load raises many kinds
        raise FormatError(f"{folder}: {key} at {list(offsets)} is not a readable tensor "
                          f"({type(e).__name__}: {e})")
    if not isinstance(t, torch.Tensor):
        raise FormatError(f"{folder}: {key} at {list(offsets)} holds a {type(t).__name__}")
    return to_tensor(t, f"{folder}: {key}")


def _read_flattened(folder, key, entry, pieces, shape):
    """A tensor megatron-core before 0.14 saved in flattened pieces (the distributed
    optimizer's fully_sharded_model_space state: each data-parallel rank's range of each
    rank's parameter): DCP holds it as [chunks along each axis..., elements of a chunk], the
    last axis cut into the ranks' ranges, and .metadata's mcore_data its global `shape`. Back
    to `shape`, each chunk's elements in place."""
    shape, saved = tuple(int(n) for n in shape), tuple(entry.size)
    grid, numel = saved[:-1], saved[-1] if saved else 0
    if len(saved) != len(shape) + 1 or any(n <= 0 or s % n for s, n in zip(shape, grid)) or \
            int(np.prod([s // n for s, n in zip(shape, grid)])) != numel:
        raise FormatError(f"{folder}: {key} is saved flattened as {list(saved)}, which does not "
                          f"cut its shape {list(shape)} into chunks")
    local = tuple(s // n for s, n in zip(shape, grid))
    flat, seen = None, np.zeros(saved, dtype=bool)
    for offsets, info in pieces:
        if offsets is None or len(offsets) != len(saved):
            raise FormatError(f"{folder}: {key} has a piece at {offsets}, not a chunk's range")
        part = _load_piece(folder, key, offsets, info)
        start, n = offsets[-1], part.array.size
        box = (*offsets[:-1], slice(start, start + n))
        if part.array.shape != (1,) * len(grid) + (n,) or start + n > numel or \
                any(o >= g for o, g in zip(offsets, grid)) or seen[box].any():
            raise FormatError(f"{folder}: {key}'s piece at {list(offsets)} "
                              f"{list(part.array.shape)} leaves or overlaps {list(saved)}")
        if flat is None:
            flat = Tensor(part.dtype, np.empty(saved, dtype=part.array.dtype))
        elif part.dtype != flat.dtype:
            raise FormatError(f"{folder}: the pieces of {key} differ in dtype")
        flat.array[box] = part.array.reshape(-1)
        seen[box] = True
    if flat is None or not seen.all():
        raise FormatError(f"{folder}: the pieces of {key} do not cover its {int(np.prod(shape))} "
                          "elements")
    whole = np.empty(shape, dtype=flat.array.dtype)
    for chunk in np.ndindex(*grid):
        whole[tuple(slice(c * n, (c + 1) * n) for c, n in zip(chunk, local))] = \
            flat.array[chunk].reshape(local)
    return Tensor(flat.dtype, whole)


def load_object(data, what):
    """The value of an object a torch_dist save stored (megatron-core stores a list of one),
    read with torch.load(weights_only=True); FormatError where that cannot read it."""
    try:
        value = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # torch.load raises many kinds
        raise FormatError(f"{what}: an object torch.load(weights_only=True) does not read "
                          f"({type(e).__name__})")
    return value[0] if isinstance(value, list) and len(value) == 1 else value


# ---- writing ---------------------------------------------------------------------------------

def _torch_tensor(t):
    if t.dtype == "BF16":
        return torch.from_numpy(np.ascontiguousarray(t.array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(t.array))


class _LayerChunkPlanner(DefaultSavePlanner if torch is not None else object):
    """Writes each tensor whose first axis is layers (megatron-core's stacked decoder.layers.*)
    as one chunk per layer, as megatron-core saves them, so that a loading rank reads its
    layers' bytes rather than the whole stack; objects as the torch.save of their value."""

    def __init__(self, stacked):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.stacked = stacked

    def create_local_plan(self):
        items = []
        for key, value in self.state_dict.items():
            if not isinstance(value, torch.Tensor):
                items.append(WriteItem(index=dcp_metadata.MetadataIndex(key),
                                       type=WriteItemType.BYTE_IO))
                continue
            size, props = value.size(), dcp_metadata.TensorProperties.create_from_tensor(value)
            rows = range(size[0]) if key in self.stacked else [None]
            for row in rows:
                offsets = torch.Size([row or 0] + [0] * (len(size) - 1)) if size else size
                sizes = torch.Size([1, *size[1:]]) if row is not None else size
                chunk = dcp_metadata.ChunkStorageMetadata(offsets=offsets, sizes=sizes)
                items.append(WriteItem(index=dcp_metadata.MetadataIndex(key, offsets),
                                       type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=chunk, properties=props,
                                                                   size=size)))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item):
        value = self.state_dict[write_item.index.fqn]
        if write_item.type == WriteItemType.BYTE_IO:
            data = io.BytesIO()
            torch.save([value], data)  # megatron-core's ShardedObject: a list of one
            data.seek(0)
            return data
        chunk = write_item.tensor_data.chunk
        index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
        return value[index].contiguous()


def write_torch_dist(folder, tensors, objects, common, stacked):
    """Writes the iteration folder `folder` (which must not exist): `tensors` (key -> Tensor),
    `objects` (key -> a value torch.load(weights_only=True) reads back; key as megatron-core's
    ShardedObject.unique_key), `common` (common.pt's dict), the tensors named in `stacked` one
    chunk per layer. Written into a temporary folder renamed into place at the end."""
    require_torch()
    tmp = folder + ".tmp"
    if os.path.exists(tmp):
        raise FormatError(f"{tmp} exists (left by an export that stopped?); remove it")
    os.makedirs(tmp)
    state = {key: _torch_tensor(t) for key, t in tensors.items()}
    state.update(objects)
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": no_dist says so
        warnings.simplefilter("ignore", UserWarning)
        dcp_save(state, storage_writer=FileSystemWriter(tmp, thread_count=1),
                 planner=_LayerChunkPlanner(set(stacked)), no_dist=True)
    torch.save(common, os.path.join(tmp, COMMON_FILE))
    with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
        json.dump(BACKEND_CONFIG, f)
    os.replace(tmp, folder)
