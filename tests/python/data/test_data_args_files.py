"""Megatron-LM's --data-args-path and --per-split-data-args-path: the blends read from files
train exactly as the same blends on the command line; malformed files are refused by name."""

import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "engine"))
from pretrain_job import jsonl, losses, run, validation, write_documents  # noqa: E402

from braid.arguments import ArgumentError, parse_args  # noqa: E402

COMMON = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "32",
          "--num-attention-heads", "2", "--vocab-size", "500", "--seq-length", "32",
          "--micro-batch-size", "4", "--train-iters", "6", "--log-interval", "3",
          "--eval-interval", "3", "--eval-iters", "2"]


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    out = {}
    for name, high, seed in (("a", 500, 0), ("b", 100, 1), ("c", 300, 2)):
        out[name] = str(root / f"{name}_text_document")
        write_documents(out[name], 150, high, seed)
    return out


def trained(tmp_path, name, flags):
    path = str(tmp_path / f"{name}.jsonl")
    r = run(1, [*COMMON, *flags, "--metrics-jsonl", path])
    assert r.returncode == 0, r.stdout + r.stderr
    return jsonl(path)


def test_files_train_as_the_command_line(prefixes, tmp_path):
    a, b, c = prefixes["a"], prefixes["b"], prefixes["c"]
    (tmp_path / "blend.txt").write_text(f"0.3 {a}\n0.7\n   {b}\n")
    from_file = trained(tmp_path, "file", ["--data-args-path", str(tmp_path / "blend.txt")])
    given = trained(tmp_path, "given", ["--data-path", "0.3", a, "0.7", b])
    assert losses(from_file) == losses(given) and validation(from_file) == validation(given)
    other = trained(tmp_path, "other", ["--data-path", "0.7", a, "0.3", b])
    assert losses(other) != losses(given)  # the weights matter: the file's were read

    # Megatron's per-split JSON: a list, one string of words, or null
    (tmp_path / "splits.json").write_text(json.dumps(
        {"train": [a], "valid": f"1 {b}", "test": None}))
    from_json = trained(tmp_path, "json", ["--per-split-data-args-path",
                                           str(tmp_path / "splits.json")])
    given = trained(tmp_path, "split_given", ["--train-data-path", a, "--valid-data-path", "1", b])
    assert losses(from_json) == losses(given) and validation(from_json) == validation(given)
    (tmp_path / "splits_c.json").write_text(json.dumps(
        {"train": [a], "valid": [c], "test": None}))
    other = trained(tmp_path, "json_c", ["--per-split-data-args-path",
                                         str(tmp_path / "splits_c.json")])
    assert validation(other) != validation(given)


@pytest.mark.parametrize("content,flags,message", [
    (None, ["--data-args-path", "{missing}"], "--data-args-path {missing}: cannot read it"),
    ("", ["--data-args-path", "{file}"], "--data-args-path {file}: the file is empty"),
    ("x", ["--data-args-path", "{file}", "--data-path", "{a}"],
     "give --data-path or --data-args-path, not both"),
    ('{"train": ["x"]}', ["--per-split-data-args-path", "{file}"],
     "should be a JSON object with the keys \"train\", \"valid\" and \"test\""),
    ("[1, 2", ["--per-split-data-args-path", "{file}"], "{file}: not JSON"),
    ('{"train": {"p": 1}, "valid": null, "test": null}', ["--per-split-data-args-path", "{file}"],
     "\"train\" should be a list of words, one string of them, or null"),
    ('{"train": "x", "valid": null, "test": null}',
     ["--per-split-data-args-path", "{file}", "--valid-data-path", "{a}"],
     "give --per-split-data-args-path or --valid-data-path, not both"),
    ("0.5 {a} 0.5 nowhere", ["--data-args-path", "{file}"], "nowhere"),
])
def test_bad_files_are_refused(prefixes, tmp_path, content, flags, message):
    names = {"{file}": str(tmp_path / "args"), "{missing}": str(tmp_path / "missing"),
             "{a}": prefixes["a"]}

    def fill(text):
        for name, value in names.items():
            text = text.replace(name, value)
        return text
    if content is not None:
        (tmp_path / "args").write_text(fill(content))
    with pytest.raises(ArgumentError) as e:
        parse_args([*COMMON, *map(fill, flags)], 1)
    assert fill(message) in str(e.value), str(e.value)


def test_planning_elsewhere_does_not_read_them(tmp_path):
    # tools/plan.py (check_files=False) takes a command line whose files live on the cluster.
    a = parse_args([*COMMON, "--data-args-path", str(tmp_path / "on_the_cluster.txt")], 1,
                   check_files=False)
    assert a.data_path == [str(tmp_path / "on_the_cluster.txt")] and not a.addition_data
