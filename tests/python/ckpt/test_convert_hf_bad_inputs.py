"""tools/convert_hf.py on bad files (beside test_convert_hf.py's bad inputs, which fills its
file): an export never writes over an HF model, and an unreadable metadata.json, shard or
model.safetensors.index.json is one error line naming the file and what was expected."""

import os

import pytest

from test_convert_hf import assert_fails, imported, run_tool


def test_export_refuses_a_directory_holding_an_hf_model(tmp_path):
    hf_dir, ckpt = imported(tmp_path, "llama-mqa-tied")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "model.safetensors.index.json").write_text("{}")
    for out, held in [(hf_dir, "config.json, model.safetensors"),
                      (tmp_path / "o", "model.safetensors.index.json")]:
        before = {n: (out / n).read_bytes() for n in os.listdir(out)}
        assert_fails(run_tool("export", "--load", ckpt, "--hf-dir", out),
                     f"{out} already holds a Hugging Face model ({held}); export into a new "
                     "directory")
        assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before


@pytest.mark.parametrize("file,content,words", [
    ("metadata.json", "", "metadata.json: not valid JSON (Expecting value"),
    ("metadata.json", '{"format', "metadata.json: not valid JSON (Unterminated string"),
    ("metadata.json", "[]", "expected braid's checkpoint metadata, a JSON object, holds an array"),
    ("metadata.json", "null", "expected braid's checkpoint metadata, a JSON object, holds null"),
    ("metadata.json", None, "metadata.json is a directory, expected a file"),
    ("mp_rank_00_000.safetensors", None, "is a directory, expected a .safetensors file"),
    ("model.safetensors.index.json", '{"weight_map": {"a', "not valid JSON (Unterminated"),
    ("model.safetensors.index.json", '{"weight_map": []}', "weight_map should be a non-empty "
     "object of tensor name -> .safetensors file name"),
])
def test_unreadable_metadata_shard_and_index(tmp_path, file, content, words):
    hf_dir, ckpt = imported(tmp_path, "llama-mqa-tied")
    index = file.startswith("model")  # the HF directory's, else the checkpoint's
    path = (hf_dir if index else ckpt / "iter_0000000") / file
    if index:  # sharded: its one file the index's shard
        os.rename(hf_dir / "model.safetensors", hf_dir / "model-00001.safetensors")
    else:
        os.remove(path)
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    args = ["import", "--hf-dir", hf_dir, "--save", tmp_path / "o"] if index else \
        ["export", "--load", ckpt, "--hf-dir", tmp_path / "o"]
    assert_fails(run_tool(*args), str(path), words)
    assert not (tmp_path / "o").exists()
