#!/usr/bin/env python3
"""Pretrain a GPT or Llama model with braid, Megatron-LM style:

    mpirun -np 8 python pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 128 \\
        --num-attention-heads 4 --micro-batch-size 8 --global-batch-size 64 --train-iters 500

Megatron's argument names (docs/arguments.md); without --data-path it trains on the embedded
addition problems. The loop is braid.training.
"""

import os
import sys

try:
    import braid  # noqa: F401  (installed with pip, or on PYTHONPATH)
except ImportError:  # a source checkout: the package and its built extension live in python/
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "python"))

from braid.training import main

if __name__ == "__main__":
    sys.exit(main())
