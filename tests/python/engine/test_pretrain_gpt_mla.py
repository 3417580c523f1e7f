"""pretrain_gpt.py with --multi-latent-attention (DeepSeek-V3's attention, Megatron's flags):
tensor, sequence, pipeline, data, context and expert parallelism train like one process, a
checkpoint resumes in another layout, and tools/generate.py decodes it over its KV cache."""

import os
import sys

from pretrain_job import (MODEL, REPO, assert_generate_decodes_greedily,
                          assert_moe_layouts_train_alike, run, run_layouts)

# The engine tests' model without its grouped-query attention: a query latent of 24 and a
# key/value latent of 16 with their norms (--qk-layernorm, as Megatron's MLA takes it), heads of
# 12 + 8 RoPE channels, value heads of 10; DeepSeek-V3's MoE on the last three layers.
_GQA = MODEL.index("--group-query-attention")
assert MODEL[_GQA:_GQA + 3] == ["--group-query-attention", "--num-query-groups", "2"]
MLA_MODEL = MODEL[:_GQA] + MODEL[_GQA + 3:]
MLA = ["--multi-latent-attention", "--rope-type", "rope", "--q-lora-rank", "24",
       "--kv-lora-rank", "16", "--qk-head-dim", "12", "--qk-pos-emb-head-dim", "8",
       "--v-head-dim", "10", "--qk-layernorm"]
DEEPSEEK_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                "--moe-router-bias-update-rate", "0.01", "--moe-aux-loss-coeff", "0.01",
                "--moe-router-load-balancing-type", "seq_aux_loss",
                "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "[0,1,1,1]"]


def test_latent_attention_layouts_train_like_one_process_and_resume(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "python"))
    import braid

    one_ckpt, three_d_ckpt = str(tmp_path / "one_ckpt"), str(tmp_path / "3d_ckpt")
    runs, stdout = run_layouts(tmp_path, [*MLA_MODEL, *MLA, *DEEPSEEK_MOE], (
        ("one", 1, ["--save", one_ckpt, "--save-interval", "10"]),
        # tp 2 x pp 2 x dp 2, sequence parallel, ZeRO, overlapped reduction, EP 2.
        ("3d", 8, ["--exit-interval", "10", "--save", three_d_ckpt,
                   "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                   "--sequence-parallel", "--use-distributed-optimizer",
                   "--overlap-grad-reduce", "--expert-model-parallel-size", "2"]),
        # tp 2 x cp 2 with selective recomputation: the shared RoPE key turned per chunk; the
        # up projections recomputed too (DeepSeek-V3's Megatron recipe's modules).
        ("tp2_cp2", 4, ["--exit-interval", "10", "--tensor-model-parallel-size", "2",
                        "--sequence-parallel", "--context-parallel-size", "2",
                        "--recompute-granularity", "selective", "--recompute-modules",
                        "mla_up_proj", "moe_act", "layernorm"]),
        # The 3D checkpoint continues in one process, the one-process one under tp 4.
        ("3d_to_one", 1, ["--load", three_d_ckpt]),
        ("one_to_tp4", 4, ["--load", one_ckpt, "--ckpt-step", "10",
                           "--tensor-model-parallel-size", "4", "--sequence-parallel"])),
        timeout=300)
    assert_moe_layouts_train_alike(runs, {"3d": range(1, 11), "tp2_cp2": range(1, 11),
                                          "3d_to_one": range(11, 21),
                                          "one_to_tp4": range(11, 21)})
    assert "multi-latent attention (q_lora_rank 24, kv_lora_rank 16" in stdout["one"], stdout["one"]
    meta = braid.checkpoint_metadata(three_d_ckpt)
    assert meta["config"]["multi_latent_attention"] and meta["format_version"] == 3, meta
    assert_generate_decodes_greedily(three_d_ckpt, meta["config"])


def test_megatrons_yarn_default_and_a_bad_factor():
    # Without --rope-type, MLA's RoPE is Megatron's YaRN with its command line's factor 1 (the
    # plain frequencies); a factor below 1 is refused before any collective.
    bare = [a for a in MLA if a not in ("--rope-type", "rope")]
    r = run(1, [*MLA_MODEL, *bare, "--train-iters", "4", "--eval-iters", "0"], timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "YaRN RoPE (factor 1 of 4096 positions, mscale 1, mscale_all_dim 0)" in r.stdout
    r = run(2, [*MLA_MODEL, *bare, "--rotary-scaling-factor", "0.5", "--train-iters", "4"],
            timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--rotary-scaling-factor 0.5 must be >= 1" in r.stderr, r.stderr
