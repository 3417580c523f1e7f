"""The vocabulary size (and end-of-document token) Megatron's tokenizer arguments imply.

braid trains on data tokenized beforehand (tools/preprocess_data.py), so at training time a
tokenizer only sizes the model's vocabulary - as in Megatron, whose padded vocabulary starts
from the tokenizer's size - and names the end-of-document token (--eod-mask-loss). This reads
both from the tokenizer's own files, with Megatron's argument names, so a Megatron launch
script's tokenizer flags work unchanged:

  GPT2BPETokenizer      --vocab-file vocab.json --merge-file merges.txt: the vocab.json entries
  HuggingFaceTokenizer  --tokenizer-model DIR or tokenizer.json: its vocabulary with the added
                        tokens (the `tokenizers` library's get_vocab_size(with_added_tokens=True))
  ByteLevel             braid's own (tools/preprocess_data.py): 256 bytes and an end-of-document
  NullTokenizer         --vocab-size N: tokens 0..N-1 and Megatron's end-of-document token N
"""

from __future__ import annotations

import dataclasses
import json
import os

BYTE_LEVEL_VOCAB_SIZE = 257
BYTE_LEVEL_EOD = 256
# A tokenizer.json's end-of-document token when its tokenizer_config.json names no eos_token:
# the first of these it has (tools/preprocess_data.py appends the same one).
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")

READ = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "ByteLevel", "NullTokenizer")
# Megatron's other types: their files need libraries braid does not take on for a number.
OTHER = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
         "TikTokenizer", "BertWordPieceLowerCase", "BertWordPieceCase", "MultimodalTokenizer")


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


@dataclasses.dataclass(frozen=True)
class Vocab:
    size: int                 # before Megatron's padding
    eod: int | None           # the end-of-document token, None where the tokenizer has none
    eod_looked_for: str = ""  # what was looked for (for the error of a missing one)


def read(tokenizer_type: str, *, vocab_file: str | None = None, merge_file: str | None = None,
         tokenizer_model: str | None = None, null_vocab_size: int | None = None) -> Vocab:
    """The vocabulary of Megatron's tokenizer arguments; VocabError naming the argument and
    what was expected. The end-of-document token is Megatron's tokenizer.eod: <|endoftext|> for
    GPT-2, the eos token of a tokenizer.json (its tokenizer_config.json's, else the first of
    EOS_CANDIDATES it has), 256 for ByteLevel, N for NullTokenizer."""
    if tokenizer_type in OTHER:
        raise VocabError(
            f"--tokenizer-type {tokenizer_type}: braid reads the vocabulary of "
            f"{', '.join(READ[:3])} tokenizers; for this one give --tokenizer-type NullTokenizer "
            "--vocab-size N (the data's tokens are 0..N-1), or save it as a tokenizer.json")
    if tokenizer_type not in READ:
        raise VocabError(f"--tokenizer-type {tokenizer_type}: unknown (braid reads "
                         f"{', '.join(READ)})")
    files = {"--vocab-file": vocab_file, "--merge-file": merge_file,
             "--tokenizer-model": tokenizer_model}
    wanted = {"GPT2BPETokenizer": {"--vocab-file", "--merge-file"},
              "HuggingFaceTokenizer": {"--tokenizer-model"}}.get(tokenizer_type, set())
    for flag, value in files.items():
        if value is not None and flag not in wanted:
            raise VocabError(f"{flag} is not read by --tokenizer-type {tokenizer_type}"
                             + (f" (it takes {', '.join(sorted(wanted))})" if wanted else ""))
        if value is None and flag in wanted:
            raise VocabError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    return Vocab(*_read(tokenizer_type, vocab_file, merge_file, tokenizer_model,
                        null_vocab_size))


def vocab_size(tokenizer_type: str, **files) -> int:
    """read(...).size."""
    return read(tokenizer_type, **files).size


def eod_id(tokenizer_type: str, **files) -> int:
    """read(...).eod, or VocabError when the tokenizer has none."""
    vocab = read(tokenizer_type, **files)
    if vocab.eod is None:
        raise VocabError(f"--tokenizer-type {tokenizer_type}: the tokenizer has no "
                         f"end-of-document token (looked for {vocab.eod_looked_for})")
    return vocab.eod


def _read(tokenizer_type, vocab_file, merge_file, tokenizer_model, null_vocab_size):
    """(vocabulary size, end-of-document id or None, what was looked for) of checked
    arguments."""
    if tokenizer_type == "NullTokenizer":
        if null_vocab_size is None:
            raise VocabError("--tokenizer-type NullTokenizer needs --vocab-size (the tokens are "
                             "0..N-1; Megatron adds the end-of-document token N)")
        return null_vocab_size + 1, null_vocab_size, ""
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
