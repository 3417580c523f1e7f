"""Megatron's SentencePiece types (SentencePieceTokenizer, GPTSentencePieceTokenizer,
Llama2Tokenizer) and TikTokenizer, on real files made here: SentencePiece models trained with
the `sentencepiece` library (BPE and unigram) and a TikTokenizer JSON vocabulary of the 256
bytes and merges learned from the same text. braid.vocab's sizes and end-of-document ids,
tools/preprocess_data.py's .bin/.idx and pretrain_gpt.py's vocabulary are checked against
megatron-core's own tokenizers (megatron.core.tokenizers, built by its build_tokenizer from
Megatron's argument names) and its IndexedDatasetBuilder."""

import argparse
import base64
import collections
import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import sentencepiece as spm

from braid import vocab
from braid.arguments import ArgumentError, parse_args
from braid.vocab import VocabError

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    from megatron.core.datasets import indexed_dataset as mcore
    from megatron.core.tokenizers.text.libraries import tiktoken_tokenizer
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "Braid", "trains",
         "MegaTron", "camelCase", "Grüße", "aus", "Köln", "日本語", "🙂", "2024", "3.14", "—",
         "don't", "x+y=z", "(tabs\tand", "newlines)"]


def sentences(n, seed):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 14)))) for _ in range(n)]


CORPUS = sentences(400, 0)
# Special tokens inside the text: megatron-core's TikTokenizer encodes them as themselves, the
# legacy SentencePiece mode cuts out those it was given; " Ω" encodes as a lone word-boundary
# piece "▁" and "Ω", the piece legacy mode drops after a special token but not after the last.
TEXTS = [*sentences(60, 1), "", "fox<x> jumps<y><x>  the end<x>", "<y>", "a</s>b<SPECIAL_9>c",
         "<x> Ωmega<y> (tabs<x> Ω", "line one\nline two\r\n\ttabbed   spaced",
         "emoji 🙂🙂 and 日本語 and Grüße"]


def megatron(tokenizer_type, model, *, legacy=False, special=None, pattern=None,
             vocab_size=None, num_special=None):
    """megatron-core's tokenizer for Megatron's arguments (its defaults where None)."""
    args = argparse.Namespace(
        tokenizer_type=tokenizer_type, tokenizer_model=str(model), tokenizer_metadata=None,
        tokenizer_sentencepiece_legacy=legacy, tokenizer_special_tokens=special,
        tiktoken_pattern=pattern, vocab_size=vocab_size,
        tiktoken_num_special_tokens=1000 if num_special is None else num_special)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_tokenizer(args)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """SentencePiece models: BPE, unigram, and a BPE without an eos piece (eos_id -1)."""
    folder = tmp_path_factory.mktemp("spm")
    for name, kind, extra in (("bpe", "bpe", {}), ("unigram", "unigram", {}),
                              ("no_eos", "bpe", {"eos_id": -1})):
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(CORPUS), model_prefix=str(folder / name), vocab_size=150,
            model_type=kind, hard_vocab_limit=False, minloglevel=2, **extra)
    return folder


def tiktoken_file(path, texts, merges):
    """Megatron's TikTokenizer vocabulary: the 256 bytes, then `merges` byte pairs learned from
    `texts` (most frequent first), as [{rank, token_bytes (base64), token_str}]."""
    words = collections.Counter(w.encode() for t in texts for w in re.findall(r" ?\S+", t))
    pieces = {w: [bytes([b]) for b in w] for w in words}
    tokens = [bytes([i]) for i in range(256)]
    for _ in range(merges):
        pairs = collections.Counter()
        for w, n in words.items():
            for pair in zip(pieces[w], pieces[w][1:]):
                pairs[pair] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if a + b not in tokens:
            tokens.append(a + b)
        for w, seq in pieces.items():
            i = 0
            while i < len(seq) - 1:
                if seq[i] == a and seq[i + 1] == b:
                    seq[i:i + 2] = [a + b]
                i += 1
    path.write_text(json.dumps([
        {"rank": i, "token_bytes": base64.b64encode(t).decode(),
         "token_str": t.decode("utf-8", errors="replace")} for i, t in enumerate(tokens)]))
    return path, len(tokens)


@pytest.fixture(scope="module")
def tiktoken_json(tmp_path_factory):
    return tiktoken_file(tmp_path_factory.mktemp("tiktoken") / "vocab.json", CORPUS, 120)


# ---- the vocabulary and the end-of-document token -----------------------------------------


@pytest.mark.parametrize("name", ["bpe", "unigram"])
@pytest.mark.parametrize("kind", vocab.SENTENCEPIECE)
def test_sentencepiece_size_and_eod_are_megatron_cores(models, name, kind):
    path = models / f"{name}.model"
    ours = vocab.read(kind, tokenizer_model=str(path))
    theirs = megatron(kind, path)
    assert (ours.size, ours.eod) == (theirs.vocab_size, theirs.eod)
    processor = spm.SentencePieceProcessor(model_file=str(path))
    assert ours.size == processor.get_piece_size() and ours.eod == processor.eos_id() == 2


def test_sentencepiece_legacy_special_tokens(models):
    # Tokens the model lacks get the next ids (its own "<unk>" name too: megatron-core's rule),
    # one it has keeps its id, a repeat changes nothing; legacy mode has no end of document.
    path = models / "bpe.model"
    processor = spm.SentencePieceProcessor(model_file=str(path))
    known = processor.id_to_piece(40)
    special = ["<x>", known, "<unk>", "<x>", "<y>"]
    ours = vocab.sentencepiece_model("Llama2Tokenizer", str(path), True, special)
    theirs = megatron("Llama2Tokenizer", path, legacy=True, special=special)
    base = processor.get_piece_size()
    assert ours.special == {"<x>": base, known: 40, "<unk>": base + 1, "<y>": base + 2}
    assert ours.size == theirs.vocab_size == base + 3
    with pytest.raises(AttributeError):
        theirs.eod  # noqa: B018 (megatron-core names none)
    assert ours.eod is None
    assert vocab.read("SentencePieceTokenizer", tokenizer_model=str(path),
                      sentencepiece_legacy=True).size == base


@pytest.mark.parametrize("size, count, special", [
    (None, None, None),  # 1000 special tokens, the whole file (--vocab-size given below)
    (200, 16, None),  # the file cut to its first 184 tokens
    (None, 12, ["<|bos|>", "<unk>", "<s>", "<mask>", "<pad>", "<cls>", "<sep>", "</s>"]),
])
def test_tiktoken_size_and_eod_are_megatron_cores(tiktoken_json, size, count, special):
    path, entries = tiktoken_json
    size = size or entries + (count or 1000)
    ours = vocab.tiktoken_vocabulary(str(path), size, count, special)
    theirs = megatron("TikTokenizer", path, vocab_size=size, num_special=count, special=special)
    assert (ours.size, ours.eod) == (theirs.vocab_size, theirs.eod) == (
        size, 7 if special else 2)
    assert ours.ranks == theirs._tokenizer.token2id  # the offset ranks, byte for byte
    assert ours.special == {t: i for i, t in enumerate(theirs._tokenizer.special_tokens)}
    assert vocab.read("TikTokenizer", tokenizer_model=str(path), vocab_size_arg=size,
                      tiktoken_num_special_tokens=count, special_tokens=special).size == size


def test_tiktoken_patterns_are_megatron_cores():
    assert vocab.TIKTOKEN_PATTERNS == {"v1": tiktoken_tokenizer._PATTERN_TIKTOKEN_V1,
                                       "v2": tiktoken_tokenizer._PATTERN_TIKTOKEN_V2}
    assert vocab.TIKTOKEN_SPECIAL_TOKENS == tuple(tiktoken_tokenizer.SPECIAL_TOKENS)
    assert vocab.TIKTOKEN_VOCAB_SIZE == tiktoken_tokenizer.DEFAULT_TIKTOKEN_MAX_VOCAB


# ---- tools/preprocess_data.py: Megatron's .bin/.idx, byte for byte -------------------------


def preprocess(tmp_path, name, *args, check_rc=0, texts=TEXTS):
    src = tmp_path / "in.jsonl"
    if not src.exists():
        with open(src, "w", encoding="utf-8") as f:
            for k, text in enumerate(texts):
                # A list of strings is a document of several sequences, as in Megatron.
                f.write(json.dumps({"text": [text, text[:7]] if k % 9 == 4 else text}) + "\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    proc = subprocess.run([sys.executable, TOOL, "--input", str(src), "--output-prefix",
                           str(tmp_path / name), *map(str, args)], env=env, timeout=120,
                          capture_output=True, text=True)
    assert proc.returncode == check_rc, proc.stderr
    return proc, src


def megatrons_files(tokenizer, src, prefix, append_eod):
    """What Megatron-LM's tools/preprocess_data.py writes for `src`: megatron-core's tokenizer
    and IndexedDatasetBuilder, its encode step done here."""
    builder = mcore.IndexedDatasetBuilder(
        prefix + ".bin", dtype=mcore.DType.optimal_dtype(tokenizer.vocab_size))
    for line in open(src, encoding="utf-8"):
        text = json.loads(line)["text"]
        ids, lengths = [], []
        for sentence in text if isinstance(text, list) else [text]:
            sentence_ids = tokenizer.tokenize(sentence)
            if sentence_ids:
                ids += sentence_ids
                lengths.append(len(sentence_ids))
        if ids and append_eod:
            ids.append(tokenizer.eod)
            lengths[-1] += 1
        builder.add_document(ids, lengths)
    builder.finalize(prefix + ".idx")


def assert_same_files(ours, theirs):
    for ext in (".bin", ".idx"):
        with open(ours + ext, "rb") as a, open(theirs + ext, "rb") as b:
            assert a.read() == b.read(), ext


@pytest.mark.parametrize("name, kind, workers", [
    ("bpe", "Llama2Tokenizer", 1), ("unigram", "SentencePieceTokenizer", 2),
    ("bpe", "GPTSentencePieceTokenizer", 2)])
def test_preprocess_sentencepiece_writes_megatrons_files(tmp_path, models, name, kind, workers):
    path = models / f"{name}.model"
    _, src = preprocess(tmp_path, "ours", "--tokenizer-type", kind, "--tokenizer-model", path,
                        "--append-eod", "--workers", workers, "--chunk-bytes", 300)
    megatrons_files(megatron(kind, path), src, str(tmp_path / "theirs"), True)
    assert_same_files(str(tmp_path / "ours_text_document"), str(tmp_path / "theirs"))
    # No BOS (megatron-core's Llama2Tokenizer; its --legacy-tokenizer class put one first).
    ds = mcore.IndexedDataset(str(tmp_path / "ours_text_document"))
    assert ds[0][0] != spm.SentencePieceProcessor(model_file=str(path)).bos_id()


def test_preprocess_null_tokenizer_writes_megatrons_files(tmp_path):
    # Megatron's NullTokenizer: the text is its ids; a record with an id outside [0, N) or a
    # word that is not an integer is skipped and named (Megatron would stop or write it).
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
    rng = np.random.default_rng(4)
    # Three-digit ids: the documents that are lists of sequences (preprocess) cut after 7
    # characters, which then ends on a whole id.
    texts = [" ".join(map(str, rng.integers(100, 300, int(rng.integers(1, 30)))))
             for _ in range(200)]
    _, src = preprocess(tmp_path, "ours", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                        300, "--append-eod", "--workers", 2, "--chunk-bytes", 500, texts=texts)

    class Megatron(NullTokenizer):  # megatron-core 0.16's names for Megatron-LM's encode step
        tokenize, eod = NullTokenizer.text_to_ids, property(lambda self: self._eod_id)
    megatrons_files(Megatron(300), src, str(tmp_path / "theirs"), True)
    assert_same_files(str(tmp_path / "ours_text_document"), str(tmp_path / "theirs"))
    bad = tmp_path / "bad"
    bad.mkdir()
    proc, _ = preprocess(bad, "ours", "--tokenizer-type", "NullTokenizer", "--vocab-size", 300,
                         check_rc=3, texts=["1 2 3", "4 300", "5 x", "6"])
    assert "token 300 is outside the vocabulary [0, 300) of --vocab-size 300" in proc.stderr
    assert "NullTokenizer reads token ids as integers separated by single spaces, got '5 x'" \
        in proc.stderr
    proc, _ = preprocess(bad, "none", "--tokenizer-type", "NullTokenizer", check_rc=1)
    assert "NullTokenizer needs --vocab-size N" in proc.stderr


@pytest.mark.parametrize("name", ["bpe", "unigram"])
def test_preprocess_sentencepiece_legacy_special_tokens(tmp_path, models, name):
    path = models / f"{name}.model"
    special = ["<x>", "<y>", "jump", "fox", "jumps", "<x>"]  # "jump" first: "jumps" never wins
    _, src = preprocess(tmp_path, "ours", "--tokenizer-type", "Llama2Tokenizer",
                        "--tokenizer-model", path, "--tokenizer-sentencepiece-legacy",
                        "--tokenizer-special-tokens", *special, "--workers", 2)
    tokenizer = megatron("Llama2Tokenizer", path, legacy=True, special=special)
    megatrons_files(tokenizer, src, str(tmp_path / "theirs"), False)
    assert_same_files(str(tmp_path / "ours_text_document"), str(tmp_path / "theirs"))
    ds = mcore.IndexedDataset(str(tmp_path / "ours_text_document"))
    x = tokenizer._tokenizer.special_token_to_id["<x>"]
    assert x >= spm.SentencePieceProcessor(model_file=str(path)).get_piece_size()
    assert x in ds[ds.document_indices[TEXTS.index("fox<x> jumps<y><x>  the end<x>")]]
    # Without legacy mode the same text is encoded as text.
    proc, _ = preprocess(tmp_path, "plain", "--tokenizer-type", "Llama2Tokenizer",
                         "--tokenizer-model", path, "--append-eod")
    megatrons_files(megatron("Llama2Tokenizer", path), src, str(tmp_path / "plain_m"), True)
    assert_same_files(str(tmp_path / "plain_text_document"), str(tmp_path / "plain_m"))


@pytest.mark.parametrize("pattern, count, special", [
    (None, None, None), ("v1", 16, None), ("v2", 12, ["<|bos|>", "<unk>", "<s>", "<mask>",
                                                      "<pad>", "<cls>", "<sep>", "</s>"])])
def test_preprocess_tiktoken_writes_megatrons_files(tmp_path, tiktoken_json, pattern, count,
                                                    special):
    path, entries = tiktoken_json
    size = entries + (count or 1000) - 5  # the file's last 5 tokens cut
    flags = [*(["--tiktoken-pattern", pattern] if pattern else []),
             *(["--tiktoken-num-special-tokens", count] if count else []),
             *(["--tiktoken-special-tokens", *special] if special else [])]
    # tiktoken encodes a lone surrogate as U+FFFD (for the SentencePiece types braid skips the
    # record, megatron-core fails).
    _, src = preprocess(tmp_path, "ours", "--tokenizer-type", "TikTokenizer", "--tokenizer-model",
                        path, "--vocab-size", size, *flags, "--append-eod", "--workers", 2,
                        "--chunk-bytes", 300, texts=[*TEXTS, "lone \ud800 surrogate"])
    tokenizer = megatron("TikTokenizer", path, pattern=pattern, vocab_size=size,
                         num_special=count, special=special)
    megatrons_files(tokenizer, src, str(tmp_path / "theirs"), True)
    assert_same_files(str(tmp_path / "ours_text_document"), str(tmp_path / "theirs"))
    ds = mcore.IndexedDataset(str(tmp_path / "ours_text_document"))
    eod = 7 if special else 2
    assert ds[0][-1] == eod and min(ds[0][:-1]) >= (count or 1000)  # the file's tokens, shifted
    doc = list(ds[ds.document_indices[TEXTS.index("a</s>b<SPECIAL_9>c")]])
    assert eod in doc[:-1] and 9 in doc  # special tokens in the text are recognised


# ---- refusals ------------------------------------------------------------------------------


def test_vocabulary_refusals_name_what_is_wrong(models, tiktoken_json, tmp_path, monkeypatch):
    spm_path, (tik_path, entries) = str(models / "bpe.model"), tiktoken_json

    def refused(message, kind, **kwargs):
        with pytest.raises(VocabError) as e:
            vocab.read(kind, **kwargs)
        assert message in str(e.value), str(e.value)

    refused("--tokenizer-type Llama2Tokenizer needs --tokenizer-model", "Llama2Tokenizer")
    refused("--tokenizer-model /nonexistent.model: no such file", "Llama2Tokenizer",
            tokenizer_model="/nonexistent.model")
    refused("not a SentencePiece model", "SentencePieceTokenizer", tokenizer_model=str(tik_path))
    refused("--vocab-file is not read by --tokenizer-type Llama2Tokenizer", "Llama2Tokenizer",
            tokenizer_model=spm_path, vocab_file=spm_path)
    refused("needs --tokenizer-sentencepiece-legacy", "Llama2Tokenizer",
            tokenizer_model=spm_path, special_tokens=["<x>"])
    refused("TikTokenizer reads a .json vocabulary", "TikTokenizer", tokenizer_model=spm_path,
            vocab_size_arg=2000)
    (tmp_path / "model.json").write_bytes(open(spm_path, "rb").read())
    refused("not a readable JSON file", "TikTokenizer",
            tokenizer_model=str(tmp_path / "model.json"))
    refused(f"has {entries} tokens; --vocab-size 131072 less 1000 special tokens needs 130072 "
            f"(give --vocab-size {entries + 1000}", "TikTokenizer", tokenizer_model=str(tik_path))
    refused("must hold megatron-core's <unk> <s> </s> <mask> <pad> <cls> <sep> (missing: <mask>",
            "TikTokenizer", tokenizer_model=str(tik_path), vocab_size_arg=2000,
            special_tokens=["<unk>", "<s>", "</s>"])
    refused("needs 7 special tokens <= --tiktoken-num-special-tokens 5 < --vocab-size 2000",
            "TikTokenizer", tokenizer_model=str(tik_path), vocab_size_arg=2000,
            tiktoken_num_special_tokens=5)
    refused("<SPECIAL_8> twice", "TikTokenizer", tokenizer_model=str(tik_path),
            vocab_size_arg=2000, tiktoken_num_special_tokens=9,
            special_tokens=[*vocab.TIKTOKEN_SPECIAL_TOKENS, "<SPECIAL_8>"])
    good = json.loads(tik_path.read_text())
    for mutate, message in [
            (lambda v: v.__setitem__(300, {**v[300], "rank": 7}),
             "entry 300: rank 7, expected 300"),
            (lambda v: v[3].pop("token_str"), "entry 3: expected an object of rank"),
            (lambda v: v.__setitem__(5, {**v[5], "token_bytes": "QQ=="}),
             "entry 5: the first 256 tokens must be the bytes 0..255"),
            (lambda v: v.__setitem__(260, {**v[260], "token_bytes": v[259]["token_bytes"]}),
             "entry 260: the bytes of entry 259 again"),
            (lambda v: v.__setitem__(261, {**v[261], "token_bytes": "A"}), "is not base64")]:
        bad = json.loads(json.dumps(good))
        mutate(bad)
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        refused(message, "TikTokenizer", tokenizer_model=str(tmp_path / "bad.json"),
                vocab_size_arg=entries + 1000)
    # A model without an eos piece (megatron-core's eod would be -1): no end of document.
    no_eos = vocab.read("Llama2Tokenizer", tokenizer_model=str(models / "no_eos.model"))
    assert no_eos.eod is None and "eos_id -1" in no_eos.eod_looked_for
    # The libraries are imported for these types only, and their absence says what to install.
    spec = importlib.util.spec_from_file_location("preprocess_data", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    refused("needs the sentencepiece library: pip install sentencepiece", "Llama2Tokenizer",
            tokenizer_model=spm_path)
    assert vocab.read("TikTokenizer", tokenizer_model=str(tik_path),
                      vocab_size_arg=entries + 1000).eod == 2  # the JSON file alone
    with pytest.raises(VocabError, match="needs the tiktoken library: pip install tiktoken"):
        tool.TikTokenizer(vocab.tiktoken_vocabulary(str(tik_path), entries + 1000),
                          vocab.TIKTOKEN_PATTERNS["v2"])
    assert vocab.read("NullTokenizer", vocab_size_arg=10).size == 11


MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
         "--device", "cpu", "--mock-data", "--seq-length", "16"]


@pytest.mark.parametrize("flags, message", [
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "9", "--tiktoken-num-special-tokens",
      "8"], "--tiktoken-num-special-tokens needs --tokenizer-type TikTokenizer"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "M",
      "--tiktoken-special-tokens", "<s>"], "--tiktoken-special-tokens needs --tokenizer-type "
     "TikTokenizer"),
    (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "T",
      "--tokenizer-sentencepiece-legacy"],
     "--tokenizer-sentencepiece-legacy needs --tokenizer-type SentencePieceTokenizer, "
     "GPTSentencePieceTokenizer or Llama2Tokenizer (got TikTokenizer)"),
    (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "M",
      "--tokenizer-special-tokens", "<x>"], "needs --tokenizer-sentencepiece-legacy"),
    (["--tokenizer-special-tokens", "<x>"], "--tokenizer-special-tokens needs --tokenizer-type "
     "TikTokenizer, or a SentencePiece type with --tokenizer-sentencepiece-legacy"),
    (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "T", "--tokenizer-special-tokens",
      "<s>", "--tiktoken-special-tokens", "<s>"], "not both"),
    (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "M",
      "--tokenizer-sentencepiece-legacy", "--eod-mask-loss"], "--eod-mask-loss: --tokenizer-type "
     "Llama2Tokenizer has no end-of-document token (looked for the eos piece, which "
     "megatron-core's SentencePiece wrapper does not name"),
    (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "M", "--vocab-size", "64"],
     "--vocab-size 64 disagrees with --tokenizer-type Llama2Tokenizer, whose vocabulary has"),
    (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "T"], "needs 130072"),
    (["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "/nonexistent.model"],
     "--tokenizer-model /nonexistent.model: no such file"),
])
def test_pretrain_gpt_refuses_with_the_flag(flags, message, models, tiktoken_json):
    real = {"M": str(models / "bpe.model"), "T": str(tiktoken_json[0])}
    with pytest.raises(ArgumentError) as e:
        parse_args([*MODEL, *[real.get(f, f) for f in flags]], 1)
    assert message in str(e.value), str(e.value)


def test_pretrain_gpt_notes_a_tiktoken_pattern_without_tiktokenizer(models):
    # Megatron's own Llama 3 launch script passes --tiktoken-pattern v2 with NullTokenizer:
    # accepted, and the log says it changes nothing.
    from braid.tokenizer_args import notes
    for flags, kind in ((["--vocab-size", "300"], "none"),
                        (["--tokenizer-type", "NullTokenizer", "--vocab-size", "300"],
                         "NullTokenizer"),
                        (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
                          str(models / "bpe.model")], "Llama2Tokenizer")):
        a = parse_args([*MODEL, *flags, "--tiktoken-pattern", "v2"], 1)
        assert notes(a) == ["braid: --tiktoken-pattern v2 has no effect: it is TikTokenizer's, "
                            f"and the tokenizer is {kind}"]
    assert notes(parse_args([*MODEL, "--vocab-size", "300"], 1)) == []


def test_preprocess_refuses_with_the_flag(tmp_path, models, tiktoken_json):
    model = models / "bpe.model"
    for flags, rc, message in [
            (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", model,
              "--tiktoken-pattern", "v1"], 2, "--tiktoken-pattern needs --tokenizer-type "
             "TikTokenizer (got Llama2Tokenizer)"),
            (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", model, "--vocab-size",
              "9"], 2, "--vocab-size is not read by --tokenizer-type Llama2Tokenizer"),
            (["--tokenizer-type", "ByteLevel", "--tokenizer-model", model], 2,
             "--tokenizer-model is not read by --tokenizer-type ByteLevel"),
            (["--tokenizer-type", "Llama2Tokenizer"], 1, "Llama2Tokenizer needs --tokenizer-model"),
            (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", tiktoken_json[0]], 1,
             "not a SentencePiece model"),
            (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", model,
              "--tokenizer-sentencepiece-legacy", "--append-eod"], 1,
             "--append-eod: the tokenizer has no end-of-document token"),
            (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", tiktoken_json[0]], 1,
             "needs 130072")]:
        proc, _ = preprocess(tmp_path, "o", *flags, check_rc=rc)
        assert message in proc.stderr, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


# ---- pretrain_gpt.py ----------------------------------------------------------------------


def test_pretrain_gpt_sizes_its_vocabulary_from_them(tmp_path, models, tiktoken_json):
    # Megatron's Mixtral script's flags (--tokenizer-type Llama2Tokenizer --tokenizer-model),
    # with --eod-mask-loss naming the eos piece; TikTokenizer with Llama 3's --tiktoken-pattern
    # v2; and data tokenized by preprocess_data.py with the same flags.
    path, entries = tiktoken_json
    spm_flags = ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
                 str(models / "unigram.model")]
    preprocess(tmp_path, "data", *spm_flags, "--append-eod")
    size = spm.SentencePieceProcessor(model_file=str(models / "unigram.model")).get_piece_size()
    for flags, vocab_size in [
            ([*spm_flags, "--eod-mask-loss"], size),
            (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(path),
              "--tiktoken-pattern", "v2", "--vocab-size", str(entries + 1000)], entries + 1000),
            ([*spm_flags, "--eod-mask-loss", "--data-path",
              str(tmp_path / "data_text_document"), "--split", "100,0,0"], size)]:
        model = [f for f in MODEL if f != "--mock-data"] if "--data-path" in flags else MODEL
        proc = subprocess.run(
            [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *model, *flags,
             "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
             "--eval-iters", "0"], cwd=ROOT, capture_output=True, text=True, timeout=180,
            env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python")))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert re.search(rf"^  vocab_size \.+ {vocab_size}$", proc.stdout, re.M), proc.stdout
        assert "iteration        2/       2" in proc.stdout
