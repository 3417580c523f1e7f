"""Megatron's tokenizer arguments: pretrain_gpt.py sizes the model's vocabulary and names the
end-of-document token from them (braid.vocab), tools/preprocess_data.py encodes with them. The
options of the SentencePiece and TikToken types are refused without the type they belong to;
pretrain_gpt.py's tokenizer is checked against --vocab-size, the data and a checkpoint's
vocabulary."""

from __future__ import annotations

import argparse
import os
from typing import Callable

from braid.vocab import SENTENCEPIECE, TIKTOKEN_NUM_SPECIAL_TOKENS, TIKTOKEN_PATTERNS, \
    TIKTOKEN_SPECIAL_TOKENS, TIKTOKEN_VOCAB_SIZE

SENTENCEPIECE_TYPES = ", ".join(SENTENCEPIECE[:-1]) + f" or {SENTENCEPIECE[-1]}"


def add_arguments(g):
    """pretrain_gpt.py's tokenizer group."""
    g.add_argument("--tokenizer-type", default=None,
                   help="GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, "
                        "GPTSentencePieceTokenizer, Llama2Tokenizer, TikTokenizer, ByteLevel or "
                        "NullTokenizer")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt")
    g.add_argument("--tokenizer-model", default=None,
                   help="HuggingFaceTokenizer: a tokenizer.json or the folder holding it; the "
                        "SentencePiece types: a .model file; TikTokenizer: Megatron's .json "
                        "vocabulary (a list of {rank, token_bytes, token_str})")
    add_options(g)


def add_options(g):
    """The SentencePiece and TikToken types' options (pretrain_gpt.py and preprocess_data.py)."""
    g.add_argument("--tokenizer-sentencepiece-legacy", action="store_true",
                   help=f"with {SENTENCEPIECE_TYPES}: megatron-core's legacy SentencePiece "
                        "mode, which takes --tokenizer-special-tokens (and names no "
                        "end-of-document token)")
    g.add_argument("--tokenizer-special-tokens", nargs="+", default=None, metavar="TOKEN",
                   help="TikTokenizer: its special tokens, ids 0, 1, ... (default "
                        f"{' '.join(TIKTOKEN_SPECIAL_TOKENS)}; a list must hold these); the "
                        "SentencePiece types with --tokenizer-sentencepiece-legacy: tokens cut "
                        "out of the text whole, those the model lacks given the next ids")
    g.add_argument("--tiktoken-special-tokens", nargs="+", default=None, metavar="TOKEN",
                   help="TikTokenizer: Megatron's older name of --tokenizer-special-tokens")
    g.add_argument("--tiktoken-pattern", default=None, choices=sorted(TIKTOKEN_PATTERNS),
                   help="TikTokenizer: how text is split before merging (default v2, "
                        "megatron-core's; v2 also splits letter runs at case changes)")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=None, metavar="N",
                   help="TikTokenizer: ids 0..N-1 are special tokens, the vocabulary file's "
                        f"tokens follow (default {TIKTOKEN_NUM_SPECIAL_TOKENS}); with "
                        f"--vocab-size V (default {TIKTOKEN_VOCAB_SIZE}) the file's first V - N "
                        "tokens are used")


def special_tokens(a: argparse.Namespace) -> list[str] | None:
    """--tokenizer-special-tokens, or its older name."""
    return a.tokenizer_special_tokens if a.tokenizer_special_tokens is not None \
        else a.tiktoken_special_tokens


def option_error(a: argparse.Namespace, pattern_alone: bool = False) -> str | None:
    """The first option given without the tokenizer type it belongs to, or None.
    pattern_alone: --tiktoken-pattern is let through without TikTokenizer (pretrain_gpt.py, as
    Megatron's does: notes() says it changes nothing)."""
    kind = a.tokenizer_type
    tik, sentencepiece = kind == "TikTokenizer", kind in SENTENCEPIECE
    got = f" (got {kind})" if kind else ""
    if a.tokenizer_special_tokens is not None and a.tiktoken_special_tokens is not None:
        return ("give --tokenizer-special-tokens or its older name --tiktoken-special-tokens, "
                "not both")
    for flag, value in (("--tiktoken-pattern", None if pattern_alone else a.tiktoken_pattern),
                        ("--tiktoken-num-special-tokens", a.tiktoken_num_special_tokens),
                        ("--tiktoken-special-tokens", a.tiktoken_special_tokens)):
        if value is not None and not tik:
            return f"{flag} needs --tokenizer-type TikTokenizer{got}"
    if a.tokenizer_sentencepiece_legacy and not sentencepiece:
        return f"--tokenizer-sentencepiece-legacy needs --tokenizer-type {SENTENCEPIECE_TYPES}{got}"
    if a.tokenizer_special_tokens is not None and not tik:
        if sentencepiece and not a.tokenizer_sentencepiece_legacy:
            return (f"--tokenizer-special-tokens with --tokenizer-type {kind} needs "
                    "--tokenizer-sentencepiece-legacy (megatron-core's SentencePiece wrapper "
                    "takes special tokens only in its legacy mode)")
        if not sentencepiece:
            return ("--tokenizer-special-tokens needs --tokenizer-type TikTokenizer, or a "
                    f"SentencePiece type with --tokenizer-sentencepiece-legacy{got}")
    return None


def notes(a: argparse.Namespace) -> list[str]:
    """Log lines of tokenizer options given where they change nothing: --tiktoken-pattern
    without TikTokenizer (Megatron's own Llama 3 launch script passes it with NullTokenizer)."""
    if a.tiktoken_pattern is not None and a.tokenizer_type != "TikTokenizer":
        return [f"braid: --tiktoken-pattern {a.tiktoken_pattern} has no effect: it is "
                f"TikTokenizer's, and the tokenizer is {a.tokenizer_type or 'none'}"]
    return []


def read_options(a: argparse.Namespace) -> dict:
    """braid.vocab.read's keyword arguments of these options."""
    return dict(special_tokens=special_tokens(a),
                tiktoken_num_special_tokens=a.tiktoken_num_special_tokens,
                sentencepiece_legacy=a.tokenizer_sentencepiece_legacy)


def validate(a: argparse.Namespace, check: Callable[[bool, str], None], check_files: bool):
    """pretrain_gpt.py's tokenizer arguments (check(ok, message) raises the argument error).
    Sets a.vocab_size to the tokenizer's (the checkpoint's with --use-checkpoint-args) and
    a.eod to its end-of-document token (None: it has none)."""
    error = option_error(a, pattern_alone=True)
    check(error is None, error)
    eod_flags = [flag for flag, given in (("--eod-mask-loss", a.eod_mask_loss),
                                          ("--reset-attention-mask", a.reset_attention_mask),
                                          ("--reset-position-ids", a.reset_position_ids))
                 if given]
    if a.tokenizer_type is None:
        for flag, value in (("--vocab-file", a.vocab_file), ("--merge-file", a.merge_file),
                            ("--tokenizer-model", a.tokenizer_model)):
            check(value is None, f"{flag} needs --tokenizer-type")
        for flag in eod_flags:
            check(False, f"{flag} needs --tokenizer-type (it names the end-of-document token)")
        return
    check(not a.addition_data, f"--tokenizer-type {a.tokenizer_type}: the embedded addition "
          "data has its own byte vocabulary; a tokenizer is for --data-path or --mock-data")
    from braid.vocab import VocabError, read
    # --use-checkpoint-args set the model's (padded, for converted HF models) vocabulary: the
    # tokenizer then names the EOD and must fit in it. NullTokenizer's N + 1 is saved.
    from_checkpoint = a.checkpoint_vocab
    given = a.vocab_size - 1 if from_checkpoint and a.tokenizer_type == "NullTokenizer" \
        else a.vocab_size
    files = [f for f in (a.vocab_file, a.merge_file, a.tokenizer_model) if f]
    if not check_files and a.vocab_size and not all(os.path.exists(f) for f in files):
        size, a.eod = a.vocab_size, None  # planning elsewhere: --vocab-size stands for it
    else:
        vocab, error = None, None
        try:
            vocab = read(a.tokenizer_type, vocab_file=a.vocab_file, merge_file=a.merge_file,
                         tokenizer_model=a.tokenizer_model, vocab_size_arg=given,
                         **read_options(a))
        except VocabError as e:
            error = str(e) + ("" if check_files else
                              " (planning where it is not: give --vocab-size)")
        check(vocab is not None, error)
        size, a.eod = vocab.size, vocab.eod
        for flag in eod_flags:
            check(a.eod is not None, f"{flag}: --tokenizer-type {a.tokenizer_type} has no "
                  f"end-of-document token (looked for {vocab.eod_looked_for})")
    if from_checkpoint:
        check(size <= a.vocab_size, f"--tokenizer-type {a.tokenizer_type}: its {size} tokens "
              f"do not fit the checkpoint's vocabulary of {a.vocab_size}")
        size = a.vocab_size
    # NullTokenizer and TikTokenizer take --vocab-size as their own.
    check(a.vocab_size in (None, size) or a.tokenizer_type == "NullTokenizer",
          f"--vocab-size {a.vocab_size} disagrees with --tokenizer-type {a.tokenizer_type}, "
          f"whose vocabulary has {size} tokens (drop --vocab-size)")
    a.vocab_size = size
