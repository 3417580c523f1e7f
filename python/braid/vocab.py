"""The vocabulary size Megatron's tokenizer arguments imply.

braid trains on data tokenized beforehand (tools/preprocess_data.py), so at training time a
tokenizer only sizes the model's vocabulary - as in Megatron, whose padded vocabulary starts
from the tokenizer's size. This reads that size from the tokenizer's own files, with Megatron's
argument names, so a Megatron launch script's tokenizer flags work unchanged:

  GPT2BPETokenizer      --vocab-file vocab.json --merge-file merges.txt: the vocab.json entries
  HuggingFaceTokenizer  --tokenizer-model DIR or tokenizer.json: its vocabulary with the added
                        tokens (the `tokenizers` library's get_vocab_size(with_added_tokens=True))
  ByteLevel             braid's own (tools/preprocess_data.py): 256 bytes and an end-of-document
  NullTokenizer         --vocab-size N: tokens 0..N-1 and Megatron's end-of-document token N
"""

from __future__ import annotations

import json
import os

BYTE_LEVEL_VOCAB_SIZE = 257

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


def _hugging_face_size(model: str) -> int:
    path = os.path.join(model, "tokenizer.json") if os.path.isdir(model) else model
    doc = _load_json(path, "--tokenizer-model")
    vocab = doc.get("model", {}).get("vocab") if isinstance(doc, dict) else None
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        ids = set(vocab.values())
    elif isinstance(vocab, list):  # Unigram: [token, score] in id order
        ids = set(range(len(vocab)))
    else:
        raise VocabError(f"--tokenizer-model {path}: no model.vocab (not a tokenizer.json of the "
                         "Hugging Face tokenizers library)")
    ids |= {t["id"] for t in doc.get("added_tokens", []) if isinstance(t, dict) and "id" in t}
    return len(ids)


def vocab_size(tokenizer_type: str, *, vocab_file: str | None = None,
               merge_file: str | None = None, tokenizer_model: str | None = None,
               null_vocab_size: int | None = None) -> int:
    """The tokenizer's vocabulary size, before Megatron's padding; VocabError naming the
    argument and what was expected."""
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
    if tokenizer_type == "NullTokenizer":
        if null_vocab_size is None:
            raise VocabError("--tokenizer-type NullTokenizer needs --vocab-size (the tokens are "
                             "0..N-1; Megatron adds the end-of-document token N)")
        return null_vocab_size + 1
    if tokenizer_type == "ByteLevel":
        return BYTE_LEVEL_VOCAB_SIZE
    if tokenizer_type == "GPT2BPETokenizer":
        if not os.path.isfile(merge_file):
            raise VocabError(f"--merge-file {merge_file}: no such file")
        encoder = _load_json(vocab_file, "--vocab-file")
        if not isinstance(encoder, dict) or not encoder:
            raise VocabError(f"--vocab-file {vocab_file}: expected GPT-2's vocab.json, an "
                             "object of token -> id")
        return len(encoder)
    return _hugging_face_size(tokenizer_model)
