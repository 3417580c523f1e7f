"""braid's safetensors reader/writer against the Python `safetensors` library, both ways.

braid's side is tests/cpp/ckpt/safetensors_tool (write | dump | copy), found through the
BRAID_SAFETENSORS_TOOL environment variable or else as the newest build*/tests/cpp/ckpt/
safetensors_tool in the repository.
"""

import glob
import json
import os
import struct
import subprocess

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as np_load_file
from safetensors.numpy import save_file as np_save_file
from safetensors.torch import load_file as torch_load_file
from safetensors.torch import save_file as torch_save_file

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def _tool():
    path = os.environ.get("BRAID_SAFETENSORS_TOOL")
    if path:
        return path
    found = glob.glob(os.path.join(ROOT, "build*", "tests", "cpp", "ckpt", "safetensors_tool"))
    if not found:
        pytest.fail("safetensors_tool not built: build the target safetensors_tool, or set "
                    "BRAID_SAFETENSORS_TOOL")
    return max(found, key=os.path.getmtime)


def run_tool(*args):
    result = subprocess.run([_tool(), *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def dump(path):
    return json.loads(run_tool("dump", str(path)))


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, f.read(n)


def ramp(shape, scale, offset):
    n = int(np.prod(shape, dtype=np.int64))
    return (np.arange(n, dtype=np.float64) * scale + offset).reshape(shape)


NOTE = 'quotes " backslash \\ newline \n unicode \u00e9'


def test_python_reads_what_braid_wrote(tmp_path):
    path = tmp_path / "braid.safetensors"
    run_tool("write", str(path))
    expected = {
        "f32": ramp((3, 4), 0.5, -3).astype(np.float32),
        "f16": ramp((7,), 0.125, -3).astype(np.float16),
        "i32": ramp((2, 2), 100000, -3).astype(np.int32),
        "i64": (np.arange(5, dtype=np.int64) * 10**12 - 3),
        "u8": ramp((9,), 7, 0).astype(np.uint8),
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.array(-1.5, np.float32),
        "raw_i8": np.arange(-3, 3, dtype=np.int8).reshape(2, 3),
    }
    loaded = torch_load_file(str(path))  # torch: numpy has no bf16
    assert sorted(loaded) == sorted(list(expected) + ["bf16"])
    for name, want in expected.items():
        got = loaded[name].numpy()
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    bf16 = torch.from_numpy(ramp((2, 3, 1), 0.25, -3)).to(torch.bfloat16)
    assert loaded["bf16"].dtype == torch.bfloat16
    assert torch.equal(loaded["bf16"], bf16)

    from safetensors import safe_open
    with safe_open(str(path), framework="np") as f:
        assert f.metadata() == {"format": "pt", "step": "42", "note": NOTE}
    n, _ = header(path)
    assert (8 + n) % 8 == 0


def python_sample():
    rng = np.random.default_rng(0)
    return {
        "f64": rng.standard_normal((2, 3)),
        "f32": rng.standard_normal((4, 5)).astype(np.float32),
        "f16": rng.standard_normal((3,)).astype(np.float16),
        "i64": rng.integers(-2**62, 2**62, (3, 2), dtype=np.int64),
        "i32": rng.integers(-2**31, 2**31 - 1, (7,), dtype=np.int32),
        "i16": rng.integers(-2**15, 2**15 - 1, (2, 2), dtype=np.int16),
        "u8": rng.integers(0, 255, (11,), dtype=np.uint8),
        "i8": rng.integers(-128, 127, (5,), dtype=np.int8),
        "bool": rng.integers(0, 2, (6,)).astype(bool),
        "empty": np.zeros((2, 0), np.float32),
        "scalar": np.array(3.25, np.float32),
        "six_dims": np.arange(12, dtype=np.float32).reshape(1, 2, 1, 3, 2, 1),
    }


NP_TO_ST = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
            "int16": "I16", "uint8": "U8", "int8": "I8", "bool": "BOOL"}


def test_braid_reads_what_python_wrote(tmp_path):
    arrays = python_sample()
    path = tmp_path / "np.safetensors"
    np_save_file(arrays, str(path), metadata={"format": "np", "k": NOTE})
    out = dump(path)
    assert out["metadata"] == {"format": "np", "k": NOTE}
    assert sorted(out["tensors"]) == sorted(arrays)
    for name, a in arrays.items():
        t = out["tensors"][name]
        assert t["dtype"] == NP_TO_ST[str(a.dtype)], name
        assert t["shape"] == list(a.shape), name
        assert bytes.fromhex(t["hex"]) == np.ascontiguousarray(a).tobytes(), name

    # torch: bf16 (which numpy lacks) and f16.
    tensors = {"w": torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).bfloat16(),
               "h": torch.randn(5, generator=torch.Generator().manual_seed(2)).half()}
    path = tmp_path / "torch.safetensors"
    torch_save_file(tensors, str(path))
    out = dump(path)
    assert out["metadata"] == {}
    for name, t in tensors.items():
        assert out["tensors"][name]["shape"] == list(t.shape)
        assert out["tensors"][name]["dtype"] == ("BF16" if t.dtype == torch.bfloat16 else "F16")
        assert bytes.fromhex(out["tensors"][name]["hex"]) == t.view(torch.int16).numpy().tobytes()


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_braid_writes_the_same_bytes_as_python(tmp_path, metadata):
    # The library writes "__metadata__" in hash-map order, so byte identity is defined for at
    # most one key; braid sorts the keys.
    arrays = python_sample()
    arrays["bf16_as_u16"] = np.arange(4, dtype=np.uint16)
    src = tmp_path / "src.safetensors"
    np_save_file(arrays, str(src), metadata=metadata)
    copy = tmp_path / "copy.safetensors"
    run_tool("copy", str(src), str(copy))
    assert copy.read_bytes() == src.read_bytes()
    tensors = {"w": torch.ones(2, 2, dtype=torch.bfloat16), "b": torch.zeros(3),
               "e4m3": torch.full((3,), 0.5).to(torch.float8_e4m3fn),
               "e5m2": torch.full((2, 1), -2.0).to(torch.float8_e5m2),
               "u32": torch.tensor([1, 2, 3]).to(torch.uint32),
               "u64": torch.tensor([4, 5]).to(torch.uint64)}
    torch_save_file(tensors, str(src), metadata=metadata)
    run_tool("copy", str(src), str(copy))
    assert copy.read_bytes() == src.read_bytes()


def test_braid_rejects_what_python_rejects(tmp_path):
    path = tmp_path / "hole.safetensors"
    h = b'{"t":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}'
    path.write_bytes(struct.pack("<Q", len(h)) + h + bytes(12))
    with pytest.raises(Exception):
        np_load_file(str(path))
    result = subprocess.run([_tool(), "dump", str(path)], capture_output=True, text=True)
    assert result.returncode == 1
    assert str(path) in result.stderr and "'t'" in result.stderr and "hole" in result.stderr
