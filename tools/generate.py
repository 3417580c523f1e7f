#!/usr/bin/env python3
"""Sample completions from a braid checkpoint with a KV cache.

  generate.py --load DIR [--ckpt-step N] --prompt TEXT [TEXT ...]      (text prompts)
  generate.py --load DIR --prompt-ids 1,2,3 [4,5 ...]                  (token ids)

The checkpoint (saved under any tp/pp/dp layout) is loaded into one process on --device. Text
prompts are encoded with the addition demo's byte vocabulary when the checkpoint's vocabulary is
that one (256 tokens), else with --tokenizer (a local Hugging Face tokenizer directory, read with
transformers.AutoTokenizer; nothing is downloaded). Decoding is greedy (--greedy, or
--temperature 0) or sampled: temperature, then top-k, then top-p, drawn with a seeded numpy
generator (--seed). Each prompt's completion is printed on one line: the prompt and its
completion as text, or (--prompt-ids) the new token ids. A bad flag is one
"braid: error: ..." line and exit code 2. See docs/generate.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import braid  # noqa: E402
from braid import addition  # noqa: E402
from braid import generate as gen  # noqa: E402


class UsageError(Exception):
    """A bad flag: printed as one "braid: error: ..." line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_args(argv):
    p = Parser(prog="generate.py", description=__doc__.splitlines()[0],
               epilog="See docs/generate.md.")
    p.add_argument("--load", required=True, metavar="DIR", help="checkpoint directory")
    p.add_argument("--ckpt-step", type=int, default=None,
                   help="iteration to load (default: the tracker file's)")
    p.add_argument("--prompt", nargs="+", default=None, metavar="TEXT", help="text prompts")
    p.add_argument("--prompt-ids", nargs="+", default=None, metavar="IDS",
                   help="prompts as comma-separated token ids, e.g. 12,7,99")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="local Hugging Face tokenizer directory for --prompt")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (ignores sampling)")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus: the most likely tokens whose probability reaches p (1: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-token", type=int, default=None, metavar="ID",
                   help="end a completion at this token (default: newline for the addition "
                        "vocabulary, the tokenizer's eos token, none for --prompt-ids; -1: none)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    return p.parse_args(argv)


def check_args(args):
    if (args.prompt is None) == (args.prompt_ids is None):
        raise UsageError("give exactly one of --prompt and --prompt-ids")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not 0 <= args.temperature < math.inf:
        raise UsageError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0, got {args.top_k}")
    if not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    if args.stop_token is not None and args.stop_token < -1:
        raise UsageError(f"--stop-token must be a token id or -1 (none), got {args.stop_token}")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise UsageError(f"--device must be cpu, cuda or cuda:N, got '{args.device}'")
    if args.device.startswith("cuda") and not braid.cuda_available():
        raise UsageError(f"--device {args.device}: no CUDA device (or braid was built without "
                         f"CUDA)")
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        raise UsageError(f"--tokenizer {args.tokenizer}: not a directory")
    if not os.path.isdir(args.load):
        raise UsageError(f"--load {args.load}: not a directory")


def parse_ids(values: list[str], vocab: int) -> list[list[int]]:
    prompts = []
    for text in values:
        if not text.strip():
            raise UsageError(f"--prompt-ids: '{text}' holds no token id")
        try:  # every field a number: "1,,2" is a typo, not the prompt 1,2
            ids = [int(x) for x in text.split(",")]
        except ValueError:
            raise UsageError(f"--prompt-ids: '{text}' is not a comma-separated list of token "
                             f"ids") from None
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise UsageError(f"--prompt-ids: token id {bad[0]} is outside the checkpoint's "
                             f"vocabulary [0, {vocab})")
        prompts.append(ids)
    return prompts


class Vocabulary:
    """Text <-> ids: the addition demo's bytes, or a Hugging Face tokenizer."""

    def __init__(self, args, vocab_size: int):
        self.tokenizer = None
        if args.tokenizer is not None:
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise UsageError("--tokenizer needs the transformers package") from None
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer,
                                                               local_files_only=True)
            except Exception as e:  # transformers raises OSError/ValueError/... by case
                raise UsageError(f"--tokenizer {args.tokenizer}: {e}".splitlines()[0]) from None
            if len(self.tokenizer) > vocab_size:
                raise UsageError(f"--tokenizer {args.tokenizer}: {len(self.tokenizer)} tokens, "
                                 f"more than the checkpoint's vocabulary of {vocab_size}")
        elif vocab_size != addition.VOCAB_SIZE:
            raise UsageError(f"--prompt: the checkpoint's vocabulary ({vocab_size} tokens) is "
                             f"not the addition demo's ({addition.VOCAB_SIZE}); give "
                             f"--tokenizer PATH or --prompt-ids")

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return list(self.tokenizer.encode(text))
        try:
            return addition.encode(text)
        except UnicodeEncodeError:
            raise UsageError(f"--prompt: '{text}' is not ASCII (the addition vocabulary is "
                             f"bytes 0-127 of text)") from None

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids)
        return bytes(ids).decode("ascii", errors="replace")

    def default_stop(self) -> int | None:
        if self.tokenizer is not None:
            return self.tokenizer.eos_token_id
        return addition.PAD


def checkpoint_metadata(args) -> tuple[int, dict]:
    """(iteration, metadata.json) of the checkpoint to load; a metadata.json or shard that is not
    a file, or metadata.json not holding a JSON object, is a UsageError naming it."""
    flag = "--ckpt-step" if args.ckpt_step is not None else "--load"
    try:
        iteration, meta = gen.checkpoint_metadata(args.load, args.ckpt_step)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None
    folder = braid.iteration_directory(args.load, iteration)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors") and not os.path.isfile(os.path.join(folder, name)):
            raise UsageError(f"{flag}: {os.path.join(folder, name)} is not a file, expected a "
                             ".safetensors shard")
    return iteration, meta


def run(args) -> int:
    check_args(args)
    iteration, meta = checkpoint_metadata(args)
    vocab_size = int(meta["config"]["vocab_size"])
    max_positions = int(meta["config"]["max_position_embeddings"])
    vocab = None
    if args.prompt is not None:
        vocab = Vocabulary(args, vocab_size)
        prompts = [vocab.encode(text) for text in args.prompt]
        stop = vocab.default_stop()
        if any(not p for p in prompts):
            raise UsageError("--prompt: an empty prompt; give at least one character")
    else:
        prompts = parse_ids(args.prompt_ids, vocab_size)
        stop = None
    if args.stop_token is not None:
        if args.stop_token >= vocab_size:
            raise UsageError(f"--stop-token {args.stop_token} is outside the checkpoint's "
                             f"vocabulary [0, {vocab_size}) (-1: none)")
        stop = None if args.stop_token < 0 else args.stop_token
    longest = max(len(p) for p in prompts)
    if longest + args.max_new_tokens > max_positions:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: a prompt of {longest} tokens "
                         f"+ {args.max_new_tokens} new tokens exceed the model's "
                         f"max_position_embeddings {max_positions}")
    try:
        model, _ = gen.load_model(args.load, iteration, args.device)
    except ValueError as e:  # braid's ConfigError: a file missing, truncated or not this model
        raise UsageError(f"--load {args.load}: {e}") from None
    sampling = gen.Sampling(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p)
    completions = gen.generate(model, prompts, args.max_new_tokens, sampling, seed=args.seed,
                               stop_token=stop)
    for text_or_ids, new in zip(args.prompt or args.prompt_ids, completions):
        if vocab is None:
            print(" ".join(str(t) for t in new), flush=True)
        else:
            if stop is not None and new and new[-1] == stop:
                new = new[:-1]
            print(f"{text_or_ids}{vocab.decode(new)}", flush=True)
    return 0


def main(argv=None) -> int:
    try:
        return run(parse_args(argv))
    except UsageError as e:
        print(f"braid: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
