"""Megatron's sliding-window arguments as pretrain_gpt.py and tools/plan.py read them: --window-size
W,0 and --window-attn-skip-freq (an integer or a list expression), and the per-layer list braid's
model config holds. (What the window computes: test_hf_oracle.py against Mistral and Qwen2.)"""

import argparse

import pytest

from braid import window_args


@pytest.mark.parametrize("text,window", [("4095,0", 4095), ("(128, 0)", 128), ("0,0", 0),
                                         ("-1,0", -1)])
def test_window_size_is_megatrons_tuple(text, window):
    assert window_args.window_size(text) == window


@pytest.mark.parametrize("text,message", [
    ("4096", "two integers LEFT,RIGHT"), ("a,0", "two integers"), ("128,128", "right side must be 0"),
    ("-5,0", "left side must be >= 0")])
def test_window_size_refuses(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        window_args.window_size(text)


def test_skip_freq_gives_megatrons_layers():
    # An integer N: layers N, 2N, ... (counted from 1) attend to everything (Megatron's
    # is_layer_window_attention); a list: 1 window, 0 full, one per layer.
    assert window_args.window_layers(window_args.skip_freq("2"), 4) == [1, 0, 1, 0]
    assert window_args.window_layers(window_args.skip_freq("4"), 6) == [1, 1, 1, 0, 1, 1]
    assert window_args.window_layers(window_args.skip_freq("1"), 3) == [0, 0, 0]
    assert window_args.skip_freq("[1,1,1,0]*2") == [1, 1, 1, 0, 1, 1, 1, 0]
    assert window_args.skip_freq("([0]+[1]*2)*2") == [0, 1, 1, 0, 1, 1]
    assert window_args.window_layers(None, 4) == []  # every layer windowed
    assert window_args.window_layers(window_args.skip_freq("5"), 4) == []  # no 5th layer
    assert window_args.window_layers([1, 1], 2) == []
    # The model's config: no window when none is given or the list windows no layer.
    assert window_args.model_window(7, []) == (7, [])
    assert window_args.model_window(7, [1, 0]) == (7, [1, 0])
    assert window_args.model_window(7, [0, 0]) == (-1, [])
    assert window_args.model_window(None, []) == (-1, [])
    assert window_args.model_window(-1, []) == (-1, [])
    with pytest.raises(ValueError, match="gives 3 layers; the model has --num-layers 4"):
        window_args.window_layers([1, 0, 1], 4)


@pytest.mark.parametrize("text", ["0", "x", "[1,2]", "[1]*'a'", "__import__('os')", "[1]+2",
                                  "[1,0]*(10**10)",
                                  "[1,0]*10000000000"])
def test_skip_freq_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError):
        window_args.skip_freq(text)
