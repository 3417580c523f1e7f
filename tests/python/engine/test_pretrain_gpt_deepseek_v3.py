"""DeepSeek-V3's Megatron recipe in miniature: pretrain_gpt.py with the flags of megatron's
DeepSeek-V3 launch script (MLA with YaRN, a dense first layer then sigmoid-routed grouped experts
with the auxiliary-loss-free bias, the per-sequence balancing loss, a shared expert, one MTP
depth, selective recomputation of the up projections, Megatron's pipeline layout, whole experts
under EP, ZeRO with overlapped reductions, and the implementation flags it passes) trains like
one process on 8 ranks, and its checkpoint continues in another layout."""

from pretrain_job import MODEL, run, run_layouts
from test_pretrain_gpt_mla import MLA_MODEL
from test_pretrain_gpt_mtp import assert_like_one_process

# The recipe's model flags, at the engine tests' size (4 layers of hidden 64, 4 heads).
DEEPSEEK_V3 = [
    "--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16",
    "--qk-head-dim", "12", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "10", "--qk-layernorm",
    "--rope-type", "yarn", "--rotary-scaling-factor", "40", "--mscale", "1.0",
    "--mscale-all-dim", "1.0", "--no-position-embedding", "--no-rope-fusion",
    "--num-experts", "4", "--moe-layer-freq", "([0]*1+[1]*3)", "--moe-ffn-hidden-size", "32",
    "--moe-shared-expert-intermediate-size", "32", "--moe-router-topk", "2",
    "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
    "--moe-router-topk-scaling-factor", "2.5", "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
    "--moe-router-dtype", "fp32", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
    "--moe-permute-fusion", "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1",
    "--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj", "moe_act",
    "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te", "--manual-gc",
]
assert "--num-layers" in MODEL and MODEL[MODEL.index("--num-layers") + 1] == "4"

# tp 2 x pp 2 x dp 2: the layout string puts the embedding and a layer on model chunk 0, two
# layers on chunk 1, one on chunk 2 and the MTP depth with the loss on chunk 3 (v 2); the 4 TP x
# DP ranks of a stage hold 2 whole experts each (ep 2, etp 1).
LAYOUT_8 = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tt|t|mL",
            "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def test_deepseek_v3_recipe_trains_like_one_process_and_resumes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    runs, stdout = run_layouts(tmp_path, [*MLA_MODEL, *DEEPSEEK_V3], (
        ("one", 1, []),
        ("8_ranks", 8, [*LAYOUT_8, "--exit-interval", "10", "--save", ckpt]),
        # The checkpoint continues under tp 4 x dp 2, experts split over TP (etp 4), without
        # pipeline stages.
        ("tp4", 8, ["--load", ckpt, "--tensor-model-parallel-size", "4", "--sequence-parallel",
                    "--expert-model-parallel-size", "2"])), timeout=300)
    assert_like_one_process(runs, {"8_ranks": range(1, 11), "tp4": range(11, 21)},
                            ["lm loss", "mtp_1 loss", "seq_load_balancing_loss", "grad-norm"])
    out = stdout["8_ranks"]
    assert "tp=2 pp=2 dp=2 ep=2 etp=1, 2 virtual stages, layers per stage 2 | 2" in out, out
    assert "1 multi-token prediction layer" in out, out


def test_megatrons_standalone_mtp_stage_is_refused_with_the_reason():
    # The published recipe's layout gives the MTP depth a stage of its own before the loss's.
    r = run(2, [*MLA_MODEL, *DEEPSEEK_V3, "--pipeline-model-parallel-size", "2",
                "--pipeline-model-parallel-layout", "Et|t|t|t|m|L"], timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "braid runs the MTP depths (m) in the last stage" in r.stderr, r.stderr
