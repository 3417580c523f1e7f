"""braid.vocab: the vocabulary size of Megatron's tokenizer arguments, read from real tokenizer
files (a BPE tokenizer trained here with the `tokenizers` library, GPT-2-style vocab.json and
merges.txt written from it) and checked against the library's own count."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "python"))

from braid.vocab import VocabError, read  # noqa: E402

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A byte-level BPE trained on a few sentences, with two added special tokens."""
    tmp = tmp_path_factory.mktemp("tok")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog"] * 50 + ["braid trains models"] * 50
    tok.train_from_iterator(text, trainer)
    tok.add_special_tokens(["<|pad|>", "<|im_start|>"])
    (tmp / "hf").mkdir()
    tok.save(str(tmp / "hf" / "tokenizer.json"))
    # GPT-2's files: vocab.json (token -> id) and merges.txt, from the same model.
    model = json.loads(tok.to_str())["model"]
    with open(tmp / "vocab.json", "w", encoding="utf-8") as f:
        json.dump(model["vocab"], f)
    with open(tmp / "merges.txt", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for merge in model["merges"]:
            f.write((merge if isinstance(merge, str) else " ".join(merge)) + "\n")
    return tmp, tok, len(model["vocab"])


def test_hugging_face_counts_added_tokens_like_the_library(trained):
    tmp, tok, base = trained
    want = tok.get_vocab_size(with_added_tokens=True)
    assert want == base + 2
    assert read("HuggingFaceTokenizer", tokenizer_model=str(tmp / "hf")).size == want
    assert read("HuggingFaceTokenizer",
                tokenizer_model=str(tmp / "hf" / "tokenizer.json")).size == want


def test_gpt2_bpe_is_the_vocab_files_entries(trained):
    tmp, _, base = trained
    assert read("GPT2BPETokenizer", vocab_file=str(tmp / "vocab.json"),
                merge_file=str(tmp / "merges.txt")).size == base


def test_end_of_document_tokens(trained, tmp_path):
    tmp, tok, _ = trained
    eos = tok.token_to_id("<|endoftext|>")
    assert read("GPT2BPETokenizer", vocab_file=str(tmp / "vocab.json"),
                merge_file=str(tmp / "merges.txt")).eod == eos
    assert read("HuggingFaceTokenizer", tokenizer_model=str(tmp / "hf")).eod == eos  # a candidate
    # A tokenizer_config.json's eos_token wins over the candidates.
    (tmp_path / "tokenizer.json").write_text((tmp / "hf" / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_start|>"}))
    assert read("HuggingFaceTokenizer", tokenizer_model=str(tmp_path)).eod == \
        tok.token_to_id("<|im_start|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    vocab = read("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert vocab.eod is None and "<nope>" in vocab.eod_looked_for, vocab.eod_looked_for
    assert read("NullTokenizer", vocab_size_arg=300).eod == 300
    assert read("ByteLevel").eod == 256


def test_null_and_byte_level():
    assert read("NullTokenizer", vocab_size_arg=300).size == 301  # Megatron's EOD is 300
    assert read("ByteLevel").size == 257


@pytest.mark.parametrize("kwargs, message", [
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="VOCAB"),
     "--tokenizer-type GPT2BPETokenizer needs --merge-file"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/nonexistent/v.json", merge_file="MERGES"),
     "--merge-file MERGES: no such file"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/nonexistent/v.json",
          merge_file="MERGES_EXIST"), "--vocab-file /nonexistent/v.json: no such file"),
    (dict(tokenizer_type="HuggingFaceTokenizer"), "needs --tokenizer-model"),
    (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="NOT_JSON"),
     "not a readable JSON file"),
    (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/nonexistent"),
     "--tokenizer-model /nonexistent: no such file"),
    (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="TOKENIZER",
          vocab_file="VOCAB"), "--vocab-file is not read by --tokenizer-type HuggingFaceTokenizer"),
    (dict(tokenizer_type="NullTokenizer"), "NullTokenizer needs --vocab-size"),
    (dict(tokenizer_type="BertWordPieceCase"),
     "give --tokenizer-type NullTokenizer --vocab-size N"),
    (dict(tokenizer_type="Whatever"), "--tokenizer-type Whatever: unknown"),
])
def test_bad_arguments_name_what_is_wrong(kwargs, message, trained, tmp_path):
    tmp, _, _ = trained
    (tmp_path / "bad.json").write_text("{not json")
    real = {"VOCAB": str(tmp / "vocab.json"), "MERGES_EXIST": str(tmp / "merges.txt"),
            "NOT_JSON": str(tmp_path / "bad.json"), "TOKENIZER": str(tmp / "hf")}
    kwargs = {k: real.get(v, v) for k, v in kwargs.items()}
    with pytest.raises(VocabError) as e:
        read(kwargs.pop("tokenizer_type"), **kwargs)
    assert message in str(e.value)
