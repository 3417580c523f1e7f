#!/usr/bin/env python3
"""Tokenizes JSONL or plain-text files into Megatron indexed datasets (.bin/.idx).

Megatron-LM's tools/preprocess_data.py, with its argument names, written through braid's
IndexedDatasetWriter: the output is the same pair of files megatron-core's IndexedDatasetBuilder
writes, named {output_prefix}_{key}_document.bin/.idx, one pair per --json-keys key.
"""

import argparse
import collections
import glob
import gzip
import json
import multiprocessing
import os
import re
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

# pretrain_gpt.py reads the same vocabularies and finds the same end-of-document tokens.
from braid import tokenizer_args  # noqa: E402
from braid.vocab import BYTE_LEVEL_EOD, BYTE_LEVEL_VOCAB_SIZE, EOS_CANDIDATES, SENTENCEPIECE, \
    TIKTOKEN_PATTERNS, VocabError, eos_from_config, library, read, sentencepiece_model, \
    tiktoken_vocabulary  # noqa: E402

EXIT_SKIPPED = 3

EPILOG = f"""\
input formats:
  Files named *.jsonl, *.json or *.ndjson (optionally .gz) hold one JSON object per line; every
  --json-keys field is a string (one sequence) or a list of strings (one sequence each, as
  Megatron treats pre-split sentences). Other files are plain text: each non-blank line is one
  document (key "text"). --input-format overrides the guess. Blank lines are ignored.

output:
  {{output_prefix}}_{{key}}_document.bin/.idx per key, in input order (files as given, globs
  sorted; lines in file order, whatever --workers is). Token type: u16 when the vocabulary has
  fewer than 65500 tokens, else i32 (Megatron's rule). An empty text is an empty document, as in
  Megatron. The files appear only when complete (written under temporary names, then renamed),
  and only when a record was valid: an input with none (all skipped, empty files) writes nothing
  and leaves the files of an earlier run as they were.

bad input:
  A record that cannot be used -- invalid JSON, invalid UTF-8, a missing or non-string field, a
  text the tokenizer rejects -- is skipped and reported on stderr as FILE:LINE: reason (the first
  --max-reported of them; then only counted); an empty input file is reported too. Every valid
  record is still written. The run ends with a summary, and exits with
    0  every record was written,
    {EXIT_SKIPPED}  the output is complete but records were skipped (0 with --allow-skipped: by
       default a pipeline notices lost data unless it says that it expects some),
    1  no output (a missing input or tokenizer, an unwritable output folder, no valid record,
       ...),
    2  bad arguments.
"""


# ---- tokenizers ----------------------------------------------------------------------------


class RecordError(Exception):
    """A record that cannot be used; the message says why."""


class ByteLevelTokenizer:
    """Each UTF-8 byte is a token (0-255); the end-of-document token is 256."""

    vocab_size = BYTE_LEVEL_VOCAB_SIZE
    eod = BYTE_LEVEL_EOD

    def encode_batch(self, texts):
        return [self.encode_one(t) for t in texts]

    @staticmethod
    def encode_one(text):
        try:
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        except UnicodeEncodeError as e:
            return RecordError(f"the text holds an unpaired surrogate at character {e.start}")


class NullTokenizer:
    """Megatron's NullTokenizer: the text is its token ids, written as integers separated by
    single spaces; --vocab-size N makes them 0..N-1 and the end-of-document token N."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size + 1
        self.eod = vocab_size

    def encode_batch(self, texts):
        return [self.encode_one(t) for t in texts]

    def encode_one(self, text):
        if not text:
            return np.zeros(0, dtype=np.int64)
        try:
            ids = np.array([int(x) for x in text.split(" ")], dtype=np.int64)
        except (ValueError, OverflowError):
            return RecordError(f"NullTokenizer reads token ids as integers separated by single "
                               f"spaces, got {text[:40]!r}")
        outside = ids[(ids < 0) | (ids >= self.eod)]
        if outside.size:
            return RecordError(f"token {outside[0]} is outside the vocabulary [0, {self.eod}) "
                               f"of --vocab-size {self.eod}")
        return ids


class HuggingFaceTokenizer:
    """A tokenizer.json loaded by the `tokenizers` library. Its special tokens (a BOS, say) are
    added only with include_special_tokens, as in Megatron's HuggingFaceTokenizer."""

    def __init__(self, model, eod_token=None, include_special_tokens=False):
        from tokenizers import Tokenizer

        path = os.path.join(model, "tokenizer.json") if os.path.isdir(model) else model
        if not os.path.isfile(path):
            raise SystemExit(
                f"preprocess_data: error: --tokenizer-model {model}: no tokenizer.json")
        try:  # braid's reading first: pretrain_gpt.py's checks and words for a bad file
            read("HuggingFaceTokenizer", tokenizer_model=model)
            self.tokenizer = Tokenizer.from_file(path)
        except VocabError as e:
            raise SystemExit(f"preprocess_data: error: {e}") from None
        except Exception as e:  # JSON that the tokenizers library does not read as a tokenizer
            raise SystemExit(f"preprocess_data: error: --tokenizer-model {path}: not a "
                             f"tokenizer.json the tokenizers library reads ({e})") from None
        self.special = include_special_tokens
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.eod = None
        name = eod_token or eos_from_config(os.path.dirname(path))
        candidates = [name] if name else list(EOS_CANDIDATES)
        for candidate in candidates:
            self.eod = self.tokenizer.token_to_id(candidate)
            if self.eod is not None:
                break
        if name and self.eod is None:
            raise SystemExit(
                f"preprocess_data: error: end-of-document token {name!r} is not in {path}")
        self.eod_missing = f"none of {', '.join(EOS_CANDIDATES)}; name it with --eod-token"

    def encode_batch(self, texts):
        try:
            encodings = self.tokenizer.encode_batch(texts, add_special_tokens=self.special)
            return [np.asarray(e.ids, dtype=np.int64) for e in encodings]
        except Exception:  # one text spoils the batch: encode one by one to find it
            return [self.encode_one(t) for t in texts]

    def encode_one(self, text):
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=self.special).ids
            return np.asarray(ids, dtype=np.int64)
        except Exception as e:
            return RecordError(f"the tokenizer rejects the text: {e}")


class GPT2BPETokenizer(HuggingFaceTokenizer):
    """Megatron's GPT2BPETokenizer: GPT-2's byte-level BPE of a vocab.json and a merges.txt (the
    `tokenizers` library's ByteLevelBPETokenizer, which splits and merges as GPT-2's own
    encoder); the end of document is <|endoftext|>."""

    def __init__(self, vocab_file, merge_file):  # its own reading, not a tokenizer.json's
        from tokenizers import ByteLevelBPETokenizer

        try:  # braid's reading first: pretrain_gpt.py's checks and words for a bad file
            vocab = read("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
            self.tokenizer = ByteLevelBPETokenizer(vocab_file, merge_file)
        except VocabError as e:
            raise SystemExit(f"preprocess_data: error: {e}") from None
        except Exception as e:  # a merges.txt the library does not read, say
            raise SystemExit(f"preprocess_data: error: --vocab-file {vocab_file}, --merge-file "
                             f"{merge_file}: not GPT-2 BPE files the tokenizers library reads "
                             f"({e})") from None
        self.special = False
        self.vocab_size, self.eod = vocab.size, vocab.eod
        self.eod_missing = f"no <|endoftext|> in {vocab_file}"


def surrogate_error(text):
    """A RecordError for a text no UTF-8 encoder takes, else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return RecordError(f"the text holds an unpaired surrogate at character {e.start}")
    return None


class SentencePieceTokenizer:
    """A SentencePiece .model as megatron-core encodes with it for SentencePieceTokenizer,
    GPTSentencePieceTokenizer and Llama2Tokenizer alike: its ids, no BOS or EOS. In legacy mode
    the special tokens are cut out of the text whole (the earliest first; at one place, the
    first given), the pieces between them encoded, and a lone word-boundary piece right after a
    special token dropped (megatron-core's rule for chat templates; not after the last one)."""

    def __init__(self, model):
        self.processor = model.processor
        self.special = model.special
        self.vocab_size = model.size
        self.eod = model.eod
        self.eod_missing = f"looked for {model.eod_looked_for}"
        self.separator = self.processor.piece_to_id("\u2581")

    def encode_batch(self, texts):
        if self.special:
            return [self.encode_one(t) for t in texts]
        try:
            return [np.asarray(ids, dtype=np.int64) for ids in self.processor.encode(texts)]
        except Exception:  # one text spoils the batch: encode one by one to find it
            return [self.encode_one(t) for t in texts]

    def encode_one(self, text):
        error = surrogate_error(text)
        if error:
            return error
        try:
            return np.asarray(self.ids(text), dtype=np.int64)
        except Exception as e:
            return RecordError(f"the tokenizer rejects the text: {e}")

    def ids(self, text):
        if not self.special:
            return self.processor.encode(text)
        ids, start, after_special = [], 0, False
        while True:
            found = None  # (where, token)
            for token in self.special:
                where = text.find(token, start)
                if where >= 0 and (found is None or where < found[0]):
                    found = (where, token)
            if found is None:
                return ids + self.processor.encode(text[start:])
            where, token = found
            pieces = self.processor.encode(text[start:where])
            if after_special and pieces and pieces[0] == self.separator:
                pieces = pieces[1:]
            ids += pieces
            ids.append(self.special[token])
            start, after_special = where + len(token), True


class TikTokenizer:
    """Megatron's TikTokenizer JSON vocabulary as megatron-core encodes with it: tiktoken's byte
    pair merging over the --tiktoken-pattern split, the file's tokens shifted past the special
    ones; the special tokens are recognised in the text (their ids, not their characters')."""

    def __init__(self, vocabulary, pattern):
        tiktoken = library("tiktoken", "TikTokenizer")
        self.encoding = tiktoken.Encoding(name="megatron-tiktoken", pat_str=pattern,
                                          mergeable_ranks=vocabulary.ranks,
                                          special_tokens=vocabulary.special)
        self.vocab_size = vocabulary.size
        self.eod = vocabulary.eod
        # tiktoken takes the allowed special tokens anew on every call (50 times the cost of
        # the encoding with 1000 of them): only texts that hold one go that way.
        self.special = frozenset(vocabulary.special)
        self.find_special = re.compile("|".join(map(re.escape, vocabulary.special)))

    def encode_batch(self, texts):
        return [self.encode_one(t) for t in texts]

    def encode_one(self, text):
        try:  # tiktoken replaces an unpaired surrogate by U+FFFD, as it does in Megatron
            if self.find_special.search(text):
                ids = self.encoding.encode(text, allowed_special=self.special)
            else:
                ids = self.encoding.encode_ordinary(text)
            return np.asarray(ids, dtype=np.int64)
        except Exception as e:
            return RecordError(f"the tokenizer rejects the text: {e}")


def build_tokenizer(args):
    if args.tokenizer_type == "ByteLevel":
        return ByteLevelTokenizer()
    if args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None or args.vocab_size < 1:
            raise SystemExit("preprocess_data: error: NullTokenizer needs --vocab-size N (the "
                             "tokens are 0..N-1, the end of document N)")
        return NullTokenizer(args.vocab_size)
    if args.tokenizer_type == "GPT2BPETokenizer":
        if args.vocab_file is None or args.merge_file is None:
            raise SystemExit("preprocess_data: error: GPT2BPETokenizer needs --vocab-file "
                             "vocab.json and --merge-file merges.txt")
        return GPT2BPETokenizer(args.vocab_file, args.merge_file)
    if not args.tokenizer_model:
        raise SystemExit(f"preprocess_data: error: {args.tokenizer_type} needs --tokenizer-model")
    if args.tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(args.tokenizer_model, args.eod_token,
                                    args.tokenizer_hf_include_special_tokens)
    try:
        if args.tokenizer_type in SENTENCEPIECE:
            return SentencePieceTokenizer(sentencepiece_model(
                args.tokenizer_type, args.tokenizer_model, args.tokenizer_sentencepiece_legacy,
                tokenizer_args.special_tokens(args)))
        vocabulary = tiktoken_vocabulary(args.tokenizer_model, args.vocab_size,
                                         args.tiktoken_num_special_tokens,
                                         tokenizer_args.special_tokens(args))
        return TikTokenizer(vocabulary, TIKTOKEN_PATTERNS[args.tiktoken_pattern or "v2"])
    except VocabError as e:
        raise SystemExit(f"preprocess_data: error: {e}") from None


# ---- workers -------------------------------------------------------------------------------


_worker = {}


def init_worker(args, pooled=False):
    if pooled:  # a process per core already: no thread pool per process on top
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _worker["args"] = args
    _worker["tokenizer"] = build_tokenizer(args)


def parse_record(line, fmt, keys):
    """The texts of one line, {key: [sentence, ...]}; raises RecordError."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordError(f"invalid UTF-8 at byte {e.start}") from None
    if fmt == "text":
        return {"text": [text]}
    try:
        record = json.loads(text)
    except ValueError as e:
        raise RecordError(f"invalid JSON: {e}") from None
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {type(record).__name__}")
    texts = {}
    for key in keys:
        if key not in record:
            raise RecordError(f"no field {key!r} (fields: {', '.join(list(record)[:8])})")
        value = record[key]
        if isinstance(value, str):
            texts[key] = [value]
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            texts[key] = value
        else:
            raise RecordError(f"field {key!r} is {type(value).__name__}, not a string")
    return texts


def encode_chunk(chunk):
    """Tokenizes one chunk of lines. Returns, per key, the tokens of the good records back to
    back, their sequence lengths and the number of sequences of each record; and the bad
    records as (line number, reason)."""
    file_index, numbers, lines, fmt, nbytes = chunk
    args, tokenizer = _worker["args"], _worker["tokenizer"]
    keys = ["text"] if fmt == "text" else args.json_keys
    bad = []
    records = []  # (line number, {key: [text, ...]})
    for number, line in zip(numbers, lines):
        try:
            records.append((number, parse_record(line, fmt, keys)))
        except RecordError as e:
            bad.append((number, str(e)))
    encoded = {}
    for key in keys:
        flat = tokenizer.encode_batch([t for _, texts in records for t in texts[key]])
        position, encoded[key] = 0, []
        for _, texts in records:
            encoded[key].append(flat[position:position + len(texts[key])])
            position += len(texts[key])
    good = []
    for r, (number, _) in enumerate(records):
        errors = [e for key in keys for e in encoded[key][r] if isinstance(e, RecordError)]
        if errors:
            bad.append((number, str(errors[0])))  # dropped from every key, to keep them aligned
        else:
            good.append(r)
    out = {}
    eod = np.array([tokenizer.eod if args.append_eod else 0], dtype=np.int32)
    for key in keys:
        tokens, lengths, per_record = [], [], []
        for r in good:
            # As Megatron: empty sequences are dropped, the end-of-document token joins the last.
            ids = [i for i in encoded[key][r] if len(i) > 0]
            tokens.extend(ids)
            lengths.extend(len(i) for i in ids)
            per_record.append(len(ids))
            if ids and args.append_eod:
                tokens.append(eod)
                lengths[-1] += 1
        flat = np.concatenate(tokens).astype(np.int32) if tokens else np.zeros(0, np.int32)
        out[key] = (flat, np.asarray(lengths, dtype=np.int64), np.asarray(per_record, np.int64))
    return file_index, out, sorted(bad), nbytes


# ---- input ---------------------------------------------------------------------------------


def input_format(path, choice):
    if choice != "auto":
        return choice
    name = path[:-3] if path.endswith(".gz") else path
    return "jsonl" if name.endswith((".jsonl", ".json", ".ndjson")) else "text"


def expand_inputs(patterns):
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise SystemExit(f"preprocess_data: error: --input {pattern}: no file matches")
        for path in matches:
            if not os.path.isfile(path):
                raise SystemExit(f"preprocess_data: error: --input {path}: not a readable file")
            files.append(path)
    return files


def read_chunks(files, fmt_choice, chunk_bytes, report):
    """(file index, line numbers, lines, format, bytes read) chunks in input order; blank lines
    are dropped (their bytes count)."""
    for file_index, path in enumerate(files):
        fmt = input_format(path, fmt_choice)
        opener = gzip.open if path.endswith(".gz") else open
        numbers, lines, size, records = [], [], 0, 0
        try:
            with opener(path, "rb") as f:
                for number, line in enumerate(f, start=1):
                    size += len(line)
                    if number == 1 and line.startswith(b"\xef\xbb\xbf"):
                        line = line[3:]  # a UTF-8 byte order mark
                    line = line.rstrip(b"\r\n")
                    if not line.strip():
                        continue
                    numbers.append(number)
                    lines.append(line)
                    records += 1
                    if size >= chunk_bytes:
                        yield file_index, numbers, lines, fmt, size
                        numbers, lines, size = [], [], 0
        except (OSError, EOFError) as e:  # unreadable, a corrupt .gz
            raise SystemExit(f"preprocess_data: error: {path}: cannot read: {e}") from None
        if lines or size:
            yield file_index, numbers, lines, fmt, size
        if records == 0:
            report.empty_file(path)


# ---- progress and problems -----------------------------------------------------------------


class Report:
    def __init__(self, files, max_reported, interval):
        self.files = files
        self.max_reported = max_reported
        self.skipped = 0
        self.empty_files = 0
        # Bytes of input; unknown ahead for compressed files (no percentage then).
        compressed = any(f.endswith(".gz") for f in files)
        self.total = 0 if compressed else sum(os.path.getsize(f) for f in files)
        self.done = 0
        self.documents = 0
        self.tokens = 0
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.interval = 0.25 if self.tty else interval
        self.last = self.start
        self.line_open = False

    def _print(self, message):
        if self.line_open:
            sys.stderr.write("\n")
            self.line_open = False
        print(message, file=sys.stderr, flush=True)

    def bad_record(self, file_index, line, reason):
        self.skipped += 1
        if self.skipped <= self.max_reported:
            self._print(f"{self.files[file_index]}:{line}: skipped: {reason}")
        elif self.skipped == self.max_reported + 1:
            self._print("preprocess_data: more records skipped; only counting them from here")

    def empty_file(self, path):
        self.empty_files += 1
        self._print(f"{path}: empty file (no records)")

    def status(self):
        elapsed = max(time.monotonic() - self.start, 1e-9)
        mb = self.done / 1e6
        pct = f"{100 * self.done / self.total:5.1f}% " if self.total else ""
        return (f"{pct}{mb:,.1f} MB, {self.documents:,} documents, {self.tokens:,} tokens, "
                f"{mb / elapsed:,.1f} MB/s")

    def progress(self, nbytes, documents, tokens, force=False):
        self.done += nbytes
        self.documents += documents
        self.tokens += tokens
        now = time.monotonic()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        if self.tty:
            width = 30
            filled = int(width * self.done / self.total) if self.total else width
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.status()}")
            sys.stderr.flush()
            self.line_open = True
        else:
            self._print(f"preprocess_data: {self.status()}")


# ---- main ----------------------------------------------------------------------------------


def get_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="preprocess_data.py", description=__doc__.split("\n\n")[0], epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True, metavar="PATH",
                       help="input files: one or several paths or globs (quote globs)")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="JSON fields to tokenize, one dataset each (default: text)")
    group.add_argument("--input-format", choices=["auto", "jsonl", "text"], default="auto",
                       help="auto: JSONL for *.jsonl/*.json/*.ndjson(.gz), plain text otherwise")
    group.add_argument("--split-sentences", action="store_true",
                       help="not supported (Megatron splits with NLTK); give lists of strings")
    group.add_argument("--keep-newlines", action="store_true",
                       help="Megatron's, for --split-sentences only: no effect")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True,
                       choices=["ByteLevel", "GPT2BPETokenizer", "HuggingFaceTokenizer",
                                *SENTENCEPIECE, "TikTokenizer", "NullTokenizer"],
                       help="ByteLevel: a token per UTF-8 byte, end of document 256; "
                            "GPT2BPETokenizer: GPT-2's vocab.json and merges.txt, end of "
                            "document <|endoftext|>; HuggingFaceTokenizer: a local "
                            "tokenizer.json; "
                            f"{tokenizer_args.SENTENCEPIECE_TYPES}: a SentencePiece .model "
                            "(megatron-core encodes all three alike: no BOS), end of document "
                            "its eos piece; TikTokenizer: Megatron's .json vocabulary, end of "
                            "document </s>; NullTokenizer: the text is its ids (integers "
                            "separated by spaces), --vocab-size N, end of document N")
    group.add_argument("--tokenizer-model", metavar="PATH",
                       help="tokenizer.json or a folder holding it; a .model; a .json")
    group.add_argument("--vocab-file", metavar="PATH", help="GPT2BPETokenizer's vocab.json")
    group.add_argument("--merge-file", metavar="PATH", help="GPT2BPETokenizer's merges.txt")
    group.add_argument("--vocab-size", type=int, metavar="N",
                       help="TikTokenizer: its vocabulary, special tokens included (default "
                            "2^17, megatron-core's); NullTokenizer: N, the ids below the end of "
                            "document (required)")
    tokenizer_args.add_options(group)
    group.add_argument("--eod-token", metavar="TOKEN",
                       help="the end-of-document token of a HuggingFace tokenizer (default: "
                            "eos_token of tokenizer_config.json beside it, else the first of "
                            + ", ".join(EOS_CANDIDATES) + " it knows)")
    group.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                       help="let the HuggingFace tokenizer add its special tokens (its "
                            "post-processor's BOS, say), as Megatron's flag of that name does")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to every non-empty document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="writes {prefix}_{key}_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1,
                       help="tokenizing processes (default 1); the output order never depends "
                            "on it")
    group.add_argument("--partitions", type=int, default=1, metavar="N",
                       help="Megatron's input partitions, tokenized in parallel and merged: no "
                            "effect (--workers tokenize in parallel, in input order)")
    group.add_argument("--chunk-bytes", type=int, default=1 << 20, metavar="N",
                       help="input bytes per task sent to a worker (default 1 MiB)")
    group.add_argument("--log-interval", type=float, default=30.0, metavar="SECONDS",
                       help="seconds between progress lines when stderr is not a terminal "
                            "(a terminal gets a progress bar)")
    group.add_argument("--max-reported", type=int, default=20, metavar="N",
                       help="bad records reported one by one (default 20); the rest are counted")
    group.add_argument("--allow-skipped", action="store_true",
                       help=f"exit 0, not {EXIT_SKIPPED}, when records were skipped")
    args = parser.parse_args(argv)
    if args.split_sentences:
        parser.error("--split-sentences is not supported; give each document as a JSON list of "
                     "sentences instead (each becomes one sequence)")
    if not os.path.basename(args.output_prefix):
        parser.error(f"--output-prefix {args.output_prefix!r}: give a path ending in a file name "
                     "prefix, e.g. data/corpus (writes data/corpus_text_document.bin/.idx)")
    if args.workers < 1 or args.partitions < 1:
        parser.error("--workers and --partitions must be at least 1")
    if args.chunk_bytes < 1:
        parser.error("--chunk-bytes must be at least 1")
    if len(set(args.json_keys)) != len(args.json_keys):
        parser.error("--json-keys has a key twice")
    error = tokenizer_args.option_error(args)
    if error:
        parser.error(error)
    hugging_face = args.tokenizer_type == "HuggingFaceTokenizer"
    for flag, given, wanted in (
            ("--tokenizer-model", args.tokenizer_model,
             args.tokenizer_type not in ("ByteLevel", "NullTokenizer", "GPT2BPETokenizer")),
            ("--vocab-file", args.vocab_file, args.tokenizer_type == "GPT2BPETokenizer"),
            ("--merge-file", args.merge_file, args.tokenizer_type == "GPT2BPETokenizer"),
            ("--vocab-size", args.vocab_size,
             args.tokenizer_type in ("TikTokenizer", "NullTokenizer")),
            ("--eod-token", args.eod_token, hugging_face),
            ("--tokenizer-hf-include-special-tokens", args.tokenizer_hf_include_special_tokens
             or None, hugging_face)):
        if given is not None and not wanted:
            parser.error(f"{flag} is not read by --tokenizer-type {args.tokenizer_type}")
    return args


def ordered_results(args, chunks):
    """Encoded chunks in input order: in this process, or from a pool with a bounded number of
    chunks in flight (Pool.imap would read the whole input ahead of slow workers)."""
    if args.workers == 1:
        init_worker(args)
        for chunk in chunks:
            yield encode_chunk(chunk)
        return
    context = multiprocessing.get_context("fork")
    with context.Pool(args.workers, initializer=init_worker, initargs=(args, True)) as pool:
        pending = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(encode_chunk, (chunk,)))
            if len(pending) >= 4 * args.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def main(argv=None):
    args = get_args(argv)
    files = expand_inputs(args.input)
    formats = {input_format(f, args.input_format) for f in files}
    keys = args.json_keys if "jsonl" in formats else ["text"]
    if "text" in formats and keys != ["text"]:
        raise SystemExit("preprocess_data: error: plain-text inputs have the one key 'text'; "
                         f"--json-keys {' '.join(args.json_keys)} needs JSONL inputs only")
    tokenizer = build_tokenizer(args)
    if args.append_eod and tokenizer.eod is None:
        raise SystemExit("preprocess_data: error: --append-eod: the tokenizer has no "
                         f"end-of-document token ({tokenizer.eod_missing})")

    from braid.data import IndexedDatasetWriter, smallest_token_type

    token_type = smallest_token_type(tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise SystemExit(f"preprocess_data: error: --output-prefix: no folder {out_dir}")
    report = Report(files, args.max_reported, args.log_interval)
    print(f"preprocess_data: {len(files)} file(s), tokenizer "
          f"{args.tokenizer_type} ({tokenizer.vocab_size} tokens, {token_type}), "
          f"{args.workers} worker(s)", file=sys.stderr)
    writers = {key: IndexedDatasetWriter(f"{args.output_prefix}_{key}_document", token_type)
               for key in keys}
    try:
        chunks = read_chunks(files, args.input_format, args.chunk_bytes, report)
        for file_index, out, bad, nbytes in ordered_results(args, chunks):
            for line, reason in bad:
                report.bad_record(file_index, line, reason)
            documents, tokens = len(out[keys[0]][2]), 0
            for key in keys:
                flat, lengths, per_record = out[key]
                writers[key].add_documents(flat, lengths, per_record)
                tokens += len(flat)
            report.progress(nbytes, documents, tokens)
        report.progress(0, 0, 0, force=True)
        if not report.documents:  # an empty dataset would replace an earlier run's
            raise SystemExit(
                f"preprocess_data: error: no valid record in the input (skipped "
                f"{report.skipped} record(s), {report.empty_files} empty file(s)); wrote nothing "
                f"to {', '.join(f'{w.path_prefix}.bin/.idx' for w in writers.values())}")
        for writer in writers.values():
            writer.finalize()
    except BaseException:
        for writer in writers.values():
            writer.discard()
        raise
    elapsed = time.monotonic() - report.start
    outputs = ", ".join(f"{w.path_prefix}.bin/.idx" for w in writers.values())
    problems = report.skipped + report.empty_files
    print(f"preprocess_data: wrote {outputs}: {report.documents:,} documents, "
          f"{report.tokens:,} tokens in {elapsed:.1f} s; skipped {report.skipped} record(s), "
          f"{report.empty_files} empty file(s)", file=sys.stderr)
    if problems and not args.allow_skipped:
        return EXIT_SKIPPED
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # main() has discarded its partial outputs
        sys.stderr.write("preprocess_data: interrupted; wrote nothing, earlier outputs kept\n")
        sys.exit(130)
