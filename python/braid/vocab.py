"""The vocabulary size (and end-of-document token) Megatron's tokenizer arguments imply.

braid trains on data tokenized beforehand (tools/preprocess_data.py), so at training time a
tokenizer only sizes the model's vocabulary - as in Megatron, whose padded vocabulary starts
from the tokenizer's size - and names the end-of-document token (--eod-mask-loss). This reads
both from the tokenizer's own files, with Megatron's argument names, so a Megatron launch
script's tokenizer flags work unchanged:

  GPT2BPETokenizer      --vocab-file vocab.json --merge-file merges.txt: the vocab.json entries
  HuggingFaceTokenizer  --tokenizer-model DIR or tokenizer.json: its vocabulary with the added
                        tokens (the `tokenizers` library's get_vocab_size(with_added_tokens=True))
  SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer
                        --tokenizer-model x.model: its pieces (the `sentencepiece` library), plus
                        --tokenizer-special-tokens it lacks in --tokenizer-sentencepiece-legacy
                        mode; the end of document is its eos piece
  TikTokenizer          --tokenizer-model x.json (Megatron's list of {rank, token_bytes,
                        token_str}): --vocab-size (default 2^17) ids, the first
                        --tiktoken-num-special-tokens (default 1000) special; the end of document
                        is the special token </s>
  ByteLevel             braid's own (tools/preprocess_data.py): 256 bytes and an end-of-document
  NullTokenizer         --vocab-size N: tokens 0..N-1 and Megatron's end-of-document token N

The SentencePiece and TikToken rules are megatron-core's tokenizers (megatron.core.tokenizers,
which Megatron-LM's training and preprocessing use unless --legacy-tokenizer); the functions
that read those files also serve tools/preprocess_data.py, which encodes with them.
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import importlib
import json
import os

BYTE_LEVEL_VOCAB_SIZE = 257
BYTE_LEVEL_EOD = 256
# A tokenizer.json's end-of-document token when its tokenizer_config.json names no eos_token:
# the first of these it has (tools/preprocess_data.py appends the same one).
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")

# Megatron's three names of one megatron-core class: the same vocabulary, end of document and
# encoding (Megatron's --legacy-tokenizer classes differed: Llama2Tokenizer put BOS first).
SENTENCEPIECE = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
READ = ("GPT2BPETokenizer", "HuggingFaceTokenizer", *SENTENCEPIECE, "TikTokenizer", "ByteLevel",
        "NullTokenizer")
# Megatron's other types (BERT's word pieces, multimodal ones): not for GPT pretraining here.
OTHER = ("BertWordPieceLowerCase", "BertWordPieceCase", "MultimodalTokenizer",
         "NullMultimodalTokenizer", "SFTTokenizer")

# megatron-core's TikTokenizer: --vocab-size ids (this without it), of which the first
# --tiktoken-num-special-tokens are special: --tokenizer-special-tokens (default these; any list
# must hold them), then fillers <SPECIAL_i> up to that number. The JSON file's tokens follow.
TIKTOKEN_VOCAB_SIZE = 2 ** 17
TIKTOKEN_NUM_SPECIAL_TOKENS = 1000
TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
TIKTOKEN_EOD = "</s>"
# --tiktoken-pattern: how text is split before byte-pair merging. v1: a letter run with at most
# one leading non-letter, single digits, punctuation runs, line breaks, other whitespace. v2
# (the default): the same, but letter runs split where lower case turns to upper case.
_LEAD = r"[^\r\n\p{L}\p{N}]?"
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
TIKTOKEN_PATTERNS = {
    "v1": "|".join([_LEAD + r"+\p{L}+", r"\p{N}", r" ?[^\s\p{L}\p{N}]++[\r\n]*", r"\s*[\r\n]",
                    r"\s+(?!\S)", r"\s+"]),
    "v2": "|".join([_LEAD + _UPPER + "*" + _LOWER + "+", _LEAD + _UPPER + "+" + _LOWER + "*",
                    r"\p{N}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)",
                    r"\s+"]),
}


class VocabError(ValueError):
    """A tokenizer argument braid cannot size the vocabulary from; the message says why."""


def _load_json(path: str, flag: str):
    if not os.path.isfile(path):
        raise VocabError(f"{flag} {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise VocabError(f"{flag} {path}: not a readable JSON file ({e})") from None


def eos_from_config(folder: str) -> str | None:
    """The eos_token a tokenizer_config.json in `folder` names, if any."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def _hugging_face(model: str) -> tuple[int, dict[str, int], str]:
    """(vocabulary size, token -> id, path) of a tokenizer.json."""
    path = os.path.join(model, "tokenizer.json") if os.path.isdir(model) else model
    doc = _load_json(path, "--tokenizer-model")
    vocab = doc.get("model", {}).get("vocab") if isinstance(doc, dict) else None
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        ids = dict(vocab)
    elif isinstance(vocab, list):  # Unigram: [token, score] in id order
        ids = {entry[0]: i for i, entry in enumerate(vocab)}
    else:
        raise VocabError(f"--tokenizer-model {path}: no model.vocab (not a tokenizer.json of the "
                         "Hugging Face tokenizers library)")
    for t in doc.get("added_tokens", []):
        if isinstance(t, dict) and "id" in t and "content" in t:
            ids[t["content"]] = t["id"]
    return len(set(ids.values())), ids, path


def library(name: str, tokenizer_type: str):
    """The module `name` (a PyPI package of that name), imported only for the tokenizer types
    that need it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        pass
    raise VocabError(f"--tokenizer-type {tokenizer_type} needs the {name} library: pip install "
                     f"{name} (requirements-test.txt pins the tested version)")


@dataclasses.dataclass(frozen=True)
class SentencePieceModel:
    processor: object         # the sentencepiece.SentencePieceProcessor of the .model file
    special: dict[str, int]   # legacy mode's --tokenizer-special-tokens -> id, first given first
    size: int
    eod: int | None
    eod_looked_for: str


def sentencepiece_model(tokenizer_type: str, path: str, legacy: bool = False,
                        special_tokens: list[str] | None = None) -> SentencePieceModel:
    """A SentencePiece .model as megatron-core's SentencePieceTokenizer reads it: its pieces,
    and in legacy mode each special token it lacks (even its own unknown-piece name) as the next
    id. The end of document is the model's eos piece; legacy mode has none (megatron-core's
    wrapper then names eos only from special tokens given by name, which Megatron's command line
    cannot do), nor has a model trained without one (eos_id -1)."""
    if special_tokens and not legacy:
        raise VocabError(f"--tokenizer-special-tokens with --tokenizer-type {tokenizer_type} "
                         "needs --tokenizer-sentencepiece-legacy (megatron-core's SentencePiece "
                         "wrapper takes special tokens only in its legacy mode)")
    if any(not token for token in special_tokens or ()):
        raise VocabError("--tokenizer-special-tokens: an empty token")
    sentencepiece = library("sentencepiece", tokenizer_type)
    if not os.path.isfile(path):
        raise VocabError(f"--tokenizer-model {path}: no such file")
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(path)
    except (OSError, RuntimeError) as e:
        raise VocabError(f"--tokenizer-model {path}: not a SentencePiece model ({e}); "
                         f"--tokenizer-type {tokenizer_type} reads a .model file") from None
    size, special = processor.get_piece_size(), {}
    for token in special_tokens or ():
        piece = processor.piece_to_id(token)
        if piece != processor.unk_id():
            special[token] = piece
        elif token not in special:
            special[token] = size
            size += 1
    eos = processor.eos_id()
    if legacy:
        return SentencePieceModel(processor, special, size, None,
                                  "the eos piece, which megatron-core's SentencePiece wrapper "
                                  "does not name in --tokenizer-sentencepiece-legacy mode")
    return SentencePieceModel(processor, special, size, eos if eos >= 0 else None,
                              f"the eos piece of {path}: it has none, eos_id -1")


@dataclasses.dataclass(frozen=True)
class TikTokenVocabulary:
    ranks: dict[bytes, int]   # the JSON file's tokens -> ids (rank + special tokens)
    special: dict[str, int]   # the special tokens -> ids 0, 1, ...
    size: int
    eod: int


def tiktoken_vocabulary(path: str, vocab_size: int | None = None,
                        num_special_tokens: int | None = None,
                        special_tokens: list[str] | None = None) -> TikTokenVocabulary:
    """Megatron's TikTokenizer vocabulary as megatron-core's TikTokenTokenizer builds it:
    `vocab_size` ids (default 2^17), the first `num_special_tokens` (default 1000) the special
    tokens and their fillers, then the JSON file's first vocab_size - num_special_tokens
    tokens, each at its rank plus num_special_tokens. The end of document is </s>."""
    size = TIKTOKEN_VOCAB_SIZE if vocab_size is None else vocab_size
    count = TIKTOKEN_NUM_SPECIAL_TOKENS if num_special_tokens is None else num_special_tokens
    named = list(TIKTOKEN_SPECIAL_TOKENS if special_tokens is None else special_tokens)
    missing = [t for t in TIKTOKEN_SPECIAL_TOKENS if t not in named]
    if missing:
        raise VocabError(f"--tokenizer-special-tokens must hold megatron-core's "
                         f"{' '.join(TIKTOKEN_SPECIAL_TOKENS)} (missing: {' '.join(missing)})")
    if not len(named) <= count < size:
        raise VocabError(f"TikTokenizer needs {len(named)} special tokens <= "
                         f"--tiktoken-num-special-tokens {count} < --vocab-size {size}")
    if any(not token for token in named):
        raise VocabError("--tokenizer-special-tokens: an empty token")
    tokens = named + [f"<SPECIAL_{i}>" for i in range(len(named), count)]
    twice = sorted(t for t, n in collections.Counter(tokens).items() if n > 1)
    if twice:
        raise VocabError(f"TikTokenizer's special tokens must differ: {' '.join(twice)} twice "
                         "(--tokenizer-special-tokens and the fillers <SPECIAL_i>)")
    if not path.endswith(".json"):  # megatron-core's condition
        raise VocabError(f"--tokenizer-model {path}: TikTokenizer reads a .json vocabulary")
    doc = _load_json(path, "--tokenizer-model")
    if not isinstance(doc, list):
        raise VocabError(f"--tokenizer-model {path}: expected Megatron's TikTokenizer "
                         "vocabulary, a JSON list of {rank, token_bytes, token_str}")
    inner = size - count
    if len(doc) < inner:
        raise VocabError(f"--tokenizer-model {path} has {len(doc)} tokens; --vocab-size {size} "
                         f"less {count} special tokens needs {inner} (give --vocab-size "
                         f"{len(doc) + count} for all of them)")
    ranks = {}
    for i, entry in enumerate(doc[:inner]):
        where = f"--tokenizer-model {path}: entry {i}"
        if not isinstance(entry, dict) or entry.keys() != {"rank", "token_bytes", "token_str"}:
            raise VocabError(f"{where}: expected an object of rank, token_bytes, token_str")
        if entry["rank"] != i:
            raise VocabError(f"{where}: rank {entry['rank']}, expected {i} (ranks in order)")
        try:
            token = base64.b64decode(entry["token_bytes"])
        except (binascii.Error, TypeError, ValueError) as e:
            raise VocabError(f"{where}: token_bytes is not base64 ({e})") from None
        if i < 256 and token != bytes([i]):
            raise VocabError(f"{where}: the first 256 tokens must be the bytes 0..255 in order")
        if token in ranks:
            raise VocabError(f"{where}: the bytes of entry {ranks[token] - count} again")
        ranks[token] = i + count
    return TikTokenVocabulary(ranks, {t: i for i, t in enumerate(tokens)}, size,
                              tokens.index(TIKTOKEN_EOD))


@dataclasses.dataclass(frozen=True)
class Vocab:
    size: int                 # before Megatron's padding
    eod: int | None           # the end-of-document token, None where the tokenizer has none
    eod_looked_for: str = ""  # what was looked for (for the error of a missing one)


def read(tokenizer_type: str, *, vocab_file: str | None = None, merge_file: str | None = None,
         tokenizer_model: str | None = None, vocab_size_arg: int | None = None,
         special_tokens: list[str] | None = None, tiktoken_num_special_tokens: int | None = None,
         sentencepiece_legacy: bool = False) -> Vocab:
    """The vocabulary of Megatron's tokenizer arguments (`vocab_size_arg`: --vocab-size, read
    by NullTokenizer and TikTokenizer); VocabError naming the argument and what was expected.
    The end-of-document token is megatron-core's tokenizer.eod: <|endoftext|> for GPT-2, the
    eos token of a tokenizer.json (its tokenizer_config.json's, else the first of
    EOS_CANDIDATES it has), a SentencePiece model's eos piece, TikTokenizer's </s>, 256 for
    ByteLevel, N for NullTokenizer."""
    if tokenizer_type in OTHER:
        raise VocabError(
            f"--tokenizer-type {tokenizer_type}: braid reads the vocabulary of GPT-2 BPE, "
            "Hugging Face, SentencePiece and TikToken tokenizers; for this one give "
            "--tokenizer-type NullTokenizer --vocab-size N (the data's tokens are 0..N-1), or "
            "save it as a tokenizer.json")
    if tokenizer_type not in READ:
        raise VocabError(f"--tokenizer-type {tokenizer_type}: unknown (braid reads "
                         f"{', '.join(READ)})")
    files = {"--vocab-file": vocab_file, "--merge-file": merge_file,
             "--tokenizer-model": tokenizer_model}
    wanted = {"GPT2BPETokenizer": {"--vocab-file", "--merge-file"},
              "ByteLevel": set(), "NullTokenizer": set()}.get(tokenizer_type,
                                                               {"--tokenizer-model"})
    for flag, value in files.items():
        if value is not None and flag not in wanted:
            raise VocabError(f"{flag} is not read by --tokenizer-type {tokenizer_type}"
                             + (f" (it takes {', '.join(sorted(wanted))})" if wanted else ""))
        if value is None and flag in wanted:
            raise VocabError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if tokenizer_type in SENTENCEPIECE:
        model = sentencepiece_model(tokenizer_type, tokenizer_model, sentencepiece_legacy,
                                    special_tokens)
        return Vocab(model.size, model.eod, model.eod_looked_for)
    if tokenizer_type == "TikTokenizer":
        tik = tiktoken_vocabulary(tokenizer_model, vocab_size_arg, tiktoken_num_special_tokens,
                                  special_tokens)
        return Vocab(tik.size, tik.eod)
    return Vocab(*_read(tokenizer_type, vocab_file, merge_file, tokenizer_model,
                        vocab_size_arg))


def _read(tokenizer_type, vocab_file, merge_file, tokenizer_model, vocab_size_arg):
    """(vocabulary size, end-of-document id or None, what was looked for) of checked
    arguments."""
    if tokenizer_type == "NullTokenizer":
        if vocab_size_arg is None:
            raise VocabError("--tokenizer-type NullTokenizer needs --vocab-size (the tokens are "
                             "0..N-1; Megatron adds the end-of-document token N)")
        return vocab_size_arg + 1, vocab_size_arg, ""
    if tokenizer_type == "ByteLevel":
        return BYTE_LEVEL_VOCAB_SIZE, BYTE_LEVEL_EOD, ""
    if tokenizer_type == "GPT2BPETokenizer":
        if not os.path.isfile(merge_file):
            raise VocabError(f"--merge-file {merge_file}: no such file")
        encoder = _load_json(vocab_file, "--vocab-file")
        if not isinstance(encoder, dict) or not encoder:
            raise VocabError(f"--vocab-file {vocab_file}: expected GPT-2's vocab.json, an "
                             "object of token -> id")
        return len(encoder), encoder.get("<|endoftext|>"), f"<|endoftext|> in {vocab_file}"
    size, ids, path = _hugging_face(tokenizer_model)
    named = eos_from_config(os.path.dirname(path))
    candidates = [named] if named else list(EOS_CANDIDATES)
    eod = next((ids[token] for token in candidates if token in ids), None)
    return size, eod, f"{', '.join(candidates)} in {path}"
