"""The GPT-OSS presets of braid.planner and tools/plan.py: their parameters are transformers'
GptOssForCausalLM's for openai/gpt-oss-120b's and -20b's config.json (built on the meta device:
no weights), and the planner plans them."""

import json
import os
import subprocess
import sys

import pytest

from braid import planner

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


@pytest.mark.parametrize("preset, layers, experts", [("gpt-oss-120b", 36, 128),
                                                     ("gpt-oss-20b", 24, 32)])
def test_presets_are_transformers_gpt_oss(preset, layers, experts):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    # openai/gpt-oss-*'s config.json, the fields that set the parameters and the windows.
    hf = transformers.GptOssConfig(
        num_hidden_layers=layers, num_local_experts=experts, hidden_size=2880,
        intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        vocab_size=201088, num_experts_per_tok=4, sliding_window=128,
        tie_word_embeddings=False, initial_context_length=4096)
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(hf)
    shape = planner.PRESETS[preset]
    # The planner's count leaves out the final norm (model.norm.weight).
    assert shape.num_params() + 2880 == sum(p.numel() for p in model.parameters())
    assert shape.window_size == hf.sliding_window - 1  # HF counts the query's own position
    assert list(shape.window_layers) == [int(k == "sliding_attention") for k in hf.layer_types]
    assert (shape.moe_router_topk, shape.seq_length) == (4, hf.initial_context_length)


def test_plan_proposes_layouts_for_gpt_oss_120b():
    def plan(*args):
        r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "plan.py"), "--model",
                            "gpt-oss-120b", "--gpu", "h100-80g", "--num-gpus", "64",
                            "--nvlink-bw", "450GB/s", "--net-bw", "400Gb/s", "--global-batch",
                            "512", *args], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=os.path.join(REPO, "python")))
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert plan("--top", "1").startswith("116.8B parameters on 64 x h100-80g")
    layouts = json.loads(plan("--json"))
    assert layouts and all(x["memory_gb_per_gpu"] <= 80 for x in layouts)
    # 116.8B parameters hold 701 GB of bf16 weights and f32 gradients: no layout keeps every
    # expert whole on each rank of a pipeline stage of 8 or fewer.
    assert not any(x["ep"] == 1 and x["expert_tensor_parallel_size"] == 1 and x["pp"] <= 8
                   for x in layouts)
