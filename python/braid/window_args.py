"""Sliding-window attention as Megatron's arguments give it (docs/arguments.md):

--window-size W,0              each query of a windowed layer sees itself and the W keys before it
                               (flash-attention's and Transformer Engine's window_size (W, 0);
                               HF's sliding_window is W + 1); W = -1: no window
--window-attn-skip-freq N      layers N, 2N, ... (counted from 1) attend to everything, the others
                               in the window
--window-attn-skip-freq "[1,1,1,0]*3"
                               one entry per layer: 1 window, 0 full attention

braid's model config holds the list form (TransformerConfig.window_layers)."""

from __future__ import annotations

import argparse
import ast
import re


def window_size(text: str) -> int:
    """Megatron's tuple "W,0" (or "(W, 0)") -> W; -1: no window."""
    parts = text.strip().strip("()").split(",")
    try:
        left, right = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be two integers LEFT,RIGHT (e.g. 4095,0), got {text!r}") from None
    if right != 0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the window's right side must be 0 (braid's attention is causal)")
    if left < -1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the left side must be >= 0 (keys before each query) or -1 (no window)")
    return left


window_size.__name__ = "window size"


MAX_LAYERS = 100_000  # a pattern longer than any model is a typo, not a request for memory


def _pattern_value(node):
    """The value of a list expression of integers, + and * only (Megatron's pattern syntax)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_pattern_value(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern_value(node.left), _pattern_value(node.right)
        if isinstance(node.op, ast.Add) and type(left) is type(right):
            return left + right
        if isinstance(node.op, ast.Mult) and int in (type(left), type(right)):
            count, items = (left, right) if type(left) is int else (right, left)
            if isinstance(items, list) and count * len(items) > MAX_LAYERS:
                raise ValueError(f"more than {MAX_LAYERS} layers")
            return left * right
    raise ValueError("not a list expression")


def skip_freq(text: str) -> int | list[int]:
    """Megatron's --window-attn-skip-freq: an integer N >= 1, or a list expression of 0s and 1s
    ("[1,1,1,0]*3", "([1]*3+[0])*2")."""
    text = text.strip()
    if "[" not in text:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"must be an integer >= 1 or a list, got {text!r}")
        return n
    try:
        if re.search(r"[^\d\[\]\(\),+* ]", text):
            raise ValueError("unexpected characters")
        pattern = _pattern_value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, MemoryError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list expression of 0s and 1s (e.g. \"[1,1,1,0]*3\")") from None
    if not isinstance(pattern, list) or any(v not in (0, 1) or type(v) is not int
                                            for v in pattern):
        raise argparse.ArgumentTypeError(f"{text!r} must give a list of 0s and 1s")
    return pattern


skip_freq.__name__ = "skip frequency"


def window_layers(freq: int | list[int] | None, num_layers: int) -> list[int]:
    """One entry per layer, 1: window, 0: full attention ([] when every layer is windowed);
    ValueError naming the flag when a list's length is not the number of layers."""
    if freq is None:
        return []
    if isinstance(freq, int):
        layers = [int((layer + 1) % freq != 0) for layer in range(num_layers)]
    elif len(freq) != num_layers:
        raise ValueError(f"--window-attn-skip-freq gives {len(freq)} layers; the model has "
                         f"--num-layers {num_layers}")
    else:
        layers = list(freq)
    return [] if all(layers) else layers


def model_window(size: int | None, layers: list[int]) -> tuple[int, list[int]]:
    """The (window_size, window_layers) of braid's model config: (-1, []) for no window, also
    when the list windows no layer (--window-attn-skip-freq 1)."""
    if size is None or size < 0 or (layers and not any(layers)):
        return -1, []
    return size, layers
