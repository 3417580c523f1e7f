"""tools/preprocess_data.py, run as a subprocess on real files; its output is read back with
braid's IndexedDataset and with megatron-core's."""

import gzip
import json
import os
import pty
import subprocess
import sys
import warnings

import numpy as np
import pytest

from braid.data import IndexedDataset

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    from megatron.core.datasets import indexed_dataset as mcore

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")
TEXTS = [
    "Hello, world.",
    "Grüße aus Köln — 日本語 too",
    "",
    "a second line\nwith a newline and a tab\t.",
    "emoji 🙂 and escapes \" \\",
]


def run(*args, check_rc=0, **kwargs):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    if "stderr" not in kwargs:
        kwargs.update(capture_output=True, text=True)
    proc = subprocess.run([sys.executable, TOOL, *map(str, args)], env=env, timeout=120, **kwargs)
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stderr
    return proc


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def documents(prefix):
    """Each document's tokens, read with braid and checked against megatron-core."""
    ours = IndexedDataset(str(prefix))
    theirs = mcore.IndexedDataset(str(prefix))
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    docs = []
    bounds = ours.document_indices
    for d in range(ours.num_documents):
        seqs = [ours[i] for i in range(bounds[d], bounds[d + 1])]
        for i in range(bounds[d], bounds[d + 1]):
            np.testing.assert_array_equal(ours[i], theirs[i])
        docs.append([int(t) for s in seqs for t in s])
    return docs


def byte_tokens(text, eod=True):
    ids = list(text.encode("utf-8"))
    return ids + [256] if eod and ids else ids


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A small byte-level BPE tokenizer.json, trained here (no download), with an EOS token and
    a post-processor that puts <s> in front (a special token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<pad>", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    folder = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_byte_level_jsonl_several_files_in_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": t, "id": k} for k, t in enumerate(TEXTS)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "b file"}])
    c = write_jsonl(tmp_path / "c.jsonl", [{"text": "c file"}])
    out = tmp_path / "out"
    proc = run("--input", b, str(tmp_path / "[ac].jsonl"), "--output-prefix", out,
               "--tokenizer-type", "ByteLevel", "--append-eod", "--workers", 1)
    assert "MB/s" in proc.stderr and "skipped 0 record(s)" in proc.stderr
    expected = ["b file"] + TEXTS + ["c file"]  # the files as given, the glob sorted
    assert documents(str(out) + "_text_document") == [byte_tokens(t) for t in expected]
    ds = IndexedDataset(str(out) + "_text_document")
    assert ds.token_type == "u16"  # 257 tokens: Megatron's rule
    # The empty text is an empty document (no sequences), as Megatron writes it.
    assert ds.num_sequences == len(expected) - 1 and ds.num_documents == len(expected)
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path))
    assert a.exists()


def test_workers_do_not_change_the_output(tmp_path):
    rng = np.random.default_rng(0)
    words = ["alpha", "βeta", "γ", "delta", "日本", "x"]
    records = [{"text": " ".join(rng.choice(words, size=int(rng.integers(0, 60))))}
               for _ in range(800)]
    records[100] = {"oops": 1}  # bad records land in different chunks and workers
    records[555] = {"text": None}
    src = write_jsonl(tmp_path / "in.jsonl", records)
    outputs = []
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        proc = run("--input", src, "--output-prefix", out, "--tokenizer-type", "ByteLevel",
                   "--append-eod", "--workers", workers, "--chunk-bytes", 2000, check_rc=3)
        assert f"{src}:101: skipped: no field 'text'" in proc.stderr
        assert f"{src}:556: skipped: field 'text' is NoneType, not a string" in proc.stderr
        prefix = str(out) + "_text_document"
        outputs.append([open(prefix + ext, "rb").read() for ext in (".bin", ".idx")])
    assert outputs[0] == outputs[1]
    good = [r["text"] for k, r in enumerate(records) if k not in (100, 555)]
    assert documents(str(tmp_path / "w3") + "_text_document") == [byte_tokens(t) for t in good]


def test_hugging_face_tokenizer_two_keys_and_workers(tmp_path, tokenizer_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eod = tok.token_to_id("<|endoftext|>")
    records = [{"text": t, "title": t[:5], "n": k} for k, t in enumerate(TEXTS * 30)]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    for workers, special in ((1, False), (2, False), (2, True)):
        out = tmp_path / f"hf{workers}{'s' if special else ''}"
        run("--input", src, "--output-prefix", out, "--json-keys", "text", "title",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            tokenizer_dir / "tokenizer.json", "--append-eod", "--workers", workers,
            "--chunk-bytes", 500, *(["--tokenizer-hf-include-special-tokens"] if special else []))
        for key in ("text", "title"):
            expected = []
            for r in records:
                ids = tok.encode(r[key], add_special_tokens=special).ids
                expected.append(ids + [eod] if ids else ids)
            assert documents(f"{out}_{key}_document") == expected
    assert open(tmp_path / "hf1_text_document.bin", "rb").read() == open(
        tmp_path / "hf2_text_document.bin", "rb").read()


def test_eod_token_from_tokenizer_config_and_lists_of_sentences(tmp_path, tokenizer_dir):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": ["Hello", "", "world"]}])
    run("--input", src, "--output-prefix", tmp_path / "out", "--tokenizer-type",
        "HuggingFaceTokenizer", "--tokenizer-model", folder, "--append-eod")
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # One sequence per non-empty sentence; the end-of-document token joins the last one.
    assert ds.num_sequences == 2 and ds.num_documents == 1
    assert list(ds[0]) == tok.encode("Hello", add_special_tokens=False).ids
    assert list(ds[1]) == tok.encode("world", add_special_tokens=False).ids + [
        tok.token_to_id("<pad>")]


def test_gpt2_bpe_vocab_and_merges_encode_as_gpt2s_tokenizer(tmp_path):
    # Megatron's standard preprocessing command (--tokenizer-type GPT2BPETokenizer --vocab-file
    # --merge-file), checked against transformers' GPT2Tokenizer - GPT-2's own Python encoder,
    # not the tokenizers library braid encodes with - on files trained here (no download).
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Tokenizer

    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator(TEXTS * 20, vocab_size=320, special_tokens=["<|endoftext|>"])
    trained.save_model(str(tmp_path))
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    gpt2 = GPT2Tokenizer(str(vocab), str(merges))
    texts = [*TEXTS, "  it's they're we'll    spaced\n\n  out", "Hello world! 123 4567"]
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    r = run("--input", src, "--output-prefix", tmp_path / "out", "--tokenizer-type",
            "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod",
            "--workers", 2, "--partitions", 2, "--keep-newlines")
    eod = json.loads(vocab.read_text())["<|endoftext|>"]
    assert documents(tmp_path / "out_text_document") == \
        [gpt2.encode(t) + [eod] if t else [] for t in texts]
    assert f"tokenizer GPT2BPETokenizer ({len(json.loads(vocab.read_text()))} tokens" in r.stderr
    # Each file's flag belongs to its type; a missing one is named.
    for args, said in ((["--tokenizer-model", vocab], "--tokenizer-model is not read by "
                        "--tokenizer-type GPT2BPETokenizer"),
                       (["--vocab-file", vocab], "GPT2BPETokenizer needs --vocab-file vocab.json "
                        "and --merge-file merges.txt")):
        bad = run("--input", src, "--output-prefix", tmp_path / "bad", "--tokenizer-type",
                  "GPT2BPETokenizer", *args, check_rc=None)
        assert bad.returncode != 0 and said in bad.stderr, bad.stderr
    bad = run("--input", src, "--output-prefix", tmp_path / "bad", "--tokenizer-type",
              "ByteLevel", "--merge-file", merges, check_rc=2)
    assert "--merge-file is not read by --tokenizer-type ByteLevel" in bad.stderr


def test_plain_text_and_gzip(tmp_path):
    (tmp_path / "book.txt").write_text("first line\n\nsecond line\r\n", encoding="utf-8")
    with gzip.open(tmp_path / "more.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": "zipped"}) + "\n")
    run("--input", tmp_path / "book.txt", tmp_path / "more.jsonl.gz", "--output-prefix",
        tmp_path / "out", "--tokenizer-type", "ByteLevel")
    assert documents(str(tmp_path / "out_text_document")) == [
        byte_tokens(t, eod=False) for t in ("first line", "second line", "zipped")]


def test_bad_input_is_reported_and_valid_records_are_kept(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf" + b'{"text": "one"}\n'  # a byte order mark is not an error
        b'{"text": "two"\n'  # 2: invalid JSON
        b'\n'  # 3: blank, ignored
        b'{"txt": "x"}\n'  # 4: missing field
        b'{"text": "caf\xe9"}\n'  # 5: Latin-1, not UTF-8
        b'["text"]\n'  # 6: not an object
        b'{"text": "\\ud800"}\n'  # 7: valid JSON, but no UTF-8 for a lone surrogate
        b'{"text": "three"}'  # last line without a newline
    )
    (tmp_path / "empty.jsonl").write_bytes(b"")
    args = ["--input", path, tmp_path / "empty.jsonl", "--output-prefix", tmp_path / "out",
            "--tokenizer-type", "ByteLevel"]
    proc = run(*args, check_rc=3)
    for line, reason in [(2, "invalid JSON"), (4, "no field 'text' (fields: txt)"),
                         (5, "invalid UTF-8 at byte 13"), (6, "expected a JSON object, got list"),
                         (7, "the text holds an unpaired surrogate at character 0")]:
        assert f"{path}:{line}: skipped: {reason}" in proc.stderr
    assert f"{tmp_path / 'empty.jsonl'}: empty file" in proc.stderr
    assert "skipped 5 record(s), 1 empty file(s)" in proc.stderr
    assert documents(str(tmp_path / "out_text_document")) == [
        byte_tokens(t, eod=False) for t in ("one", "three")]
    # --allow-skipped: the same output, exit 0; --max-reported limits the lines.
    proc = run(*args, "--allow-skipped", "--max-reported", 2)
    assert proc.stderr.count(": skipped: ") == 2 and "only counting" in proc.stderr


def test_fatal_errors_leave_no_output(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "x"}])
    proc = run("--input", tmp_path / "missing*.jsonl", "--output-prefix", tmp_path / "o",
               "--tokenizer-type", "ByteLevel", check_rc=1)
    assert "no file matches" in proc.stderr
    proc = run("--input", src, "--output-prefix", tmp_path / "no" / "dir" / "o",
               "--tokenizer-type", "ByteLevel", check_rc=1)
    assert "no folder" in proc.stderr
    proc = run("--input", src, "--output-prefix", tmp_path / "o", "--tokenizer-type",
               "HuggingFaceTokenizer", check_rc=1)
    assert "needs --tokenizer-model" in proc.stderr
    proc = run("--input", src, "--output-prefix", tmp_path / "o", "--tokenizer-type",
               "ByteLevel", "--split-sentences", check_rc=2)
    assert "not supported" in proc.stderr
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    proc = run("--input", src, tmp_path / "bad.jsonl.gz", "--output-prefix", tmp_path / "o",
               "--tokenizer-type", "ByteLevel", "--workers", 2, check_rc=1)
    assert "bad.jsonl.gz: cannot read: Not a gzipped file" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl.gz", "in.jsonl"]


def test_no_valid_record_keeps_an_earlier_output(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "kept"}])
    prefix = tmp_path / "out"
    run("--input", src, "--output-prefix", prefix, "--tokenizer-type", "ByteLevel")
    before = {n: (tmp_path / n).read_bytes() for n in ("out_text_document.bin",
                                                         "out_text_document.idx")}
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": \n["text"]\n')
    for inputs, skipped in [(["empty.jsonl"], "skipped 0 record(s), 1 empty file(s)"),
                            (["bad.jsonl"], "skipped 2 record(s), 0 empty file(s)"),
                            (["in.jsonl", "--json-keys", "text", "body"], "skipped 1 record(s)")]:
        proc = run("--input", *[tmp_path / inputs[0], *inputs[1:]], "--output-prefix", prefix,
                   "--tokenizer-type", "ByteLevel", check_rc=1)
        assert f"preprocess_data: error: no valid record in the input ({skipped}" in proc.stderr
        assert f"wrote nothing to {prefix}_text_document.bin/.idx" in proc.stderr
        assert {n: (tmp_path / n).read_bytes() for n in before} == before
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "empty.jsonl", "in.jsonl", *before]
    assert documents(str(prefix) + "_text_document") == [byte_tokens("kept", eod=False)]
    proc = run("--input", src, "--output-prefix", "", "--tokenizer-type", "ByteLevel",
               check_rc=2, cwd=tmp_path)
    assert "--output-prefix '': give a path ending in a file name prefix" in proc.stderr


def test_a_corrupt_tokenizer_json_is_one_error_line(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "x"}])
    (tmp_path / "bad_tok.json").write_text('{"model": ')
    proc = run("--input", src, "--output-prefix", tmp_path / "o", "--tokenizer-type",
               "HuggingFaceTokenizer", "--tokenizer-model", tmp_path / "bad_tok.json", check_rc=1)
    assert proc.stderr.strip() == (f"preprocess_data: error: --tokenizer-model "
                                   f"{tmp_path / 'bad_tok.json'}: not a readable JSON file "
                                   "(Expecting value: line 1 column 11 (char 10))")
    assert sorted(os.listdir(tmp_path)) == ["bad_tok.json", "in.jsonl"]

def test_progress_bar_on_a_terminal(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "x" * 100}] * 50)
    master, slave = pty.openpty()
    try:
        run("--input", src, "--output-prefix", tmp_path / "o", "--tokenizer-type", "ByteLevel",
            stderr=slave, stdout=subprocess.DEVNULL)
        os.close(slave)
        slave = None
        out = b""
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # the terminal closes with the process
                break
            if not data:
                break
            out += data
    finally:
        if slave is not None:
            os.close(slave)
        os.close(master)
    assert b"\r[##############################] 100.0%" in out and b"MB/s" in out
