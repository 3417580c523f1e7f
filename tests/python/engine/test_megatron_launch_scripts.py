"""Megatron-LM's own example launch scripts run under pretrain_gpt.py: the argument lists of
examples/mixtral/train_mixtral_8x7b_distributed.sh (verbatim: it is tiny already) and of
examples/llama/train_llama3_8b_h100_fp8.sh (its bf16 path, the model shrunk to fit a CPU test),
launched with mpirun instead of torchrun. Then the two flags of the Llama 3 script that change
what braid does: --grad-reduce-in-bf16 (the data-parallel reductions move bf16, the result
within bf16's rounding of one process's) and --empty-unused-memory-level (the caching
allocator gives its free blocks back, seen through --log-memory-to-tensorboard)."""

import os
import shutil

import numpy as np
import pytest

from pretrain_job import MODEL, jsonl, losses, run

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")


def mixtral_args(tokenizer_model: str) -> list[str]:
    """train_mixtral_8x7b_distributed.sh's arrays, as its torchrun line passes them (the
    commented-out lines left out, as bash does)."""
    model = ["--use-mcore-models", "--disable-bias-linear", "--seq-length", "256",
             "--max-position-embeddings", "2048", "--num-layers", "2", "--hidden-size", "256",
             "--ffn-hidden-size", "896", "--num-attention-heads", "2", "--init-method-std",
             "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization",
             "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
             "--untie-embeddings-and-output-weights", "--group-query-attention",
             "--num-query-groups", "2", "--no-masked-softmax-fusion", "--no-position-embedding",
             "--rotary-base", "1000000"]
    moe = ["--num-experts", "2", "--moe-router-topk", "2", "--moe-router-load-balancing-type",
           "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
           "--overlap-param-gather", "--overlap-grad-reduce"]
    data = ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", tokenizer_model,
            "--mock-data", "--split", "99990,8,2"]
    training = ["--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4",
                "--train-iters", "7", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
                "--clip-grad", "1.0"]
    parallel = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                "--sequence-parallel"]
    logging = ["--eval-iters", "10", "--no-load-optim", "--no-load-rng"]
    return [*model, *moe, *data, *training, *parallel, *logging]


def test_megatrons_mixtral_script_runs_unchanged(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    words = ["mixture", "of", "experts", "routes", "each", "token", "to", "two", "of", "eight"]
    rng = np.random.default_rng(0)
    text = [" ".join(rng.choice(words, size=8)) for _ in range(200)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), vocab_size=60,
                                   model_prefix=str(tmp_path / "tokenizer"), minloglevel=2,
                                   hard_vocab_limit=False)
    r = run(2, ["--device", "cpu", *mixtral_args(str(tmp_path / "tokenizer.model"))],
            timeout=300)  # GPUS_PER_NODE=2: two ranks, as the script starts
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 experts of 896 with top-2 routing" in r.stdout and "ep=2" in r.stdout, r.stdout
    assert "iteration        7/       7" in r.stdout, r.stdout
    assert "braid: --no-position-embedding has no effect" in r.stdout, r.stdout


def llama3_8b_args(checkpoint: str, tensorboard: str, cache: str) -> list[str]:
    """train_llama3_8b_h100_fp8.sh's arrays with DTYPE other than fp8 and MOCK data, in its
    order. Shrunk: 32 layers of 4096 (ffn 14336, 32 heads, 8 groups of 128) to 2 of 64 (224, 4,
    2 of 16), seq 8192 to 64, vocabulary 128256 to 512, the samples and global batch 128 to 8,
    eval 32 iterations every 100 to 2 every 4; --profile's steps to 4 to 6. --bf16 stays (the
    CPU ranks run it in float32)."""
    model = ["--use-mcore-models", "--num-layers", "2", "--hidden-size", "64",
             "--ffn-hidden-size", "224", "--num-attention-heads", "4", "--group-query-attention",
             "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "64",
             "--max-position-embeddings", "64", "--position-embedding-type", "rope",
             "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
             "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134",
             "--attention-backend", "fused", "--apply-layernorm-1p",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
    training = ["--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "96",
                "--lr-decay-samples", "88", "--lr-warmup-samples", "16", "--lr", "0.00015",
                "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr",
                "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay",
                "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--grad-reduce-in-bf16",
                "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
                "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235"]
    parallel = ["--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
                "--sequence-parallel"]
    ddp = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    data = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
            "--data-cache-path", cache, "--tiktoken-pattern", "v2", "--split", "99,1,0",
            "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers",
            "1"]
    logging = ["--log-interval", "1", "--eval-iters", "2", "--eval-interval", "4",
               "--save-interval", "1000", "--log-throughput", "--profile",
               "--profile-step-start", "4", "--profile-step-end", "6", "--ckpt-format",
               "torch_dist", "--distributed-timeout-minutes", "60", "--save", checkpoint,
               "--load", checkpoint, "--tensorboard-dir", tensorboard]
    dtype = ["--bf16"]
    return [*model, *training, *dtype, *parallel, *ddp, *data, *logging]


def test_megatrons_llama3_8b_script_runs_and_resumes(tmp_path):
    ckpt, tb, cache = (str(tmp_path / name) for name in ("ckpt", "tb", "cache"))
    args = ["--device", "cpu", *llama3_8b_args(ckpt, tb, cache)]
    first = run(4, [*args, "--exit-interval", "6"])  # stopped half way, as a budget would
    assert first.returncode == 0, first.stdout + first.stderr
    for flag in ("--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
                 "--tiktoken-pattern v2", "--attention-backend fused", "--ckpt-format torch_dist"):
        assert f"braid: {flag} has no effect" in first.stdout, (flag, first.stdout)
    assert "decoupled learning rate: " in first.stdout, first.stdout
    assert "braid: --bf16 on the CPU: braid's CPU kernels compute in float32" in first.stdout
    assert os.path.exists(os.path.join(tb, "traces", "rank0.json"))
    # The same script again: it loads the checkpoint (the same schedule) and finishes.
    second = run(4, args)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "braid: loaded iteration 6" in second.stdout, second.stdout
    assert "iteration       12/      12" in second.stdout, second.stdout


def bf16_reduce_run(tmp_path, name: str, ranks: int, layout: list[str]):
    """(loss, gradient norm) of each of 20 steps."""
    tb = str(tmp_path / name)
    r = run(ranks, [*MODEL, "--train-iters", "20", "--tensorboard-dir", tb, *layout])
    assert r.returncode == 0, r.stdout + r.stderr
    records = jsonl(os.path.join(tb, "metrics.jsonl"))
    norms = {rec["step"]: rec["grad-norm"] for rec in records if "grad-norm" in rec}
    return {step: (loss, norms[step]) for step, loss in losses(records).items()}


def test_grad_reduce_in_bf16_stays_within_bf16_of_one_process(tmp_path):
    one = bf16_reduce_run(tmp_path, "one", 1, [])
    # One DP rank reduces nothing: bit for bit the f32 run.
    assert bf16_reduce_run(tmp_path, "one_bf16", 1, ["--grad-reduce-in-bf16"]) == one
    zero = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    for name, ranks, layout in (("dp4_zero", 4, zero), ("tp2_dp2", 4,
                                                        ["--tensor-model-parallel-size", "2"])):
        f32 = bf16_reduce_run(tmp_path, name, ranks, layout)
        bf16 = bf16_reduce_run(tmp_path, name + "_bf16", ranks, [*layout, "--grad-reduce-in-bf16"])
        steps = range(1, 21)
        np.testing.assert_allclose([f32[i] for i in steps], [one[i] for i in steps], rtol=2e-4)
        assert bf16 != f32, name  # the reductions did round
        # The first step's gradients are the same batch's: each element summed in bf16 is
        # within 2^-9 of the f32 sum, and those roundings average out in the norm (measured:
        # 3e-6 and 6e-6). A rank left with its own share (no reduction, or another rank's
        # shard) would be off by a factor.
        assert bf16[1][0] == pytest.approx(one[1][0], rel=1e-5)
        assert bf16[1][1] == pytest.approx(one[1][1], rel=1e-4), name
        # Gradients that close steer Adam's normalised steps alike over 20 steps (measured:
        # losses within 1.6e-5, norms within 0.2%).
        for part, rtol in ((0, 1e-3), (1, 2e-2)):
            np.testing.assert_allclose([bf16[i][part] for i in steps],
                                       [one[i][part] for i in steps], rtol=rtol, err_msg=name)


def test_empty_unused_memory_gives_the_cached_blocks_back(tmp_path):
    # Logits of 8 x 64 tokens over 8192 entries are 16 MiB: blocks the host allocator caches.
    big = [*MODEL, "--vocab-size", "8192", "--seq-length", "64", "--micro-batch-size", "8",
           "--train-iters", "4", "--eval-iters", "0", "--log-memory-to-tensorboard"]
    records = {}
    for level in ("0", "1"):
        tb = str(tmp_path / level)
        r = run(1, [*big, "--tensorboard-dir", tb, "--empty-unused-memory-level", level])
        assert r.returncode == 0, r.stdout + r.stderr
        records[level] = jsonl(os.path.join(tb, "metrics.jsonl"))
    for level, recs in records.items():
        assert [rec["step"] for rec in recs] == [1, 2, 3, 4]
        for rec in recs:
            allocated, reserved = rec["mem-allocated-bytes"], rec["mem-reserved-bytes"]
            assert 0 < allocated < rec["mem-max-allocated-bytes"], rec
            if level == "0":  # the step's freed logits stay cached
                assert reserved >= allocated + 16 * 2**20, rec
            else:
                assert reserved == allocated, rec
    assert losses(records["0"]) == losses(records["1"])


def test_flags_of_public_launch_scripts_parse_as_megatron_reads_them():
    # Flags an audit of public Megatron launch scripts found: the deprecated spelling of RoPE,
    # Qwen's no-op interpolation factor (any other factor interpolates), implementation and
    # bookkeeping flags braid notes as changing nothing, and ones refused with the reason.
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "python"))
    from braid.arguments import ArgumentError, parse_args
    from braid.megatron_flags import no_effect_given
    from braid.training import model_config

    base = ["--vocab-size", "300", "--mock-data", "--seq-length", "32", "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4"]
    a = parse_args([*base, "--use-rotary-position-embeddings",
                    "--rotary-seq-len-interpolation-factor", "1"], 1)
    assert a.position_embedding_type == "rope"
    assert model_config(a).rope_linear_factor == 0.0  # 1: no interpolation
    assert parse_args(base, 1).position_embedding_type == "learned_absolute"
    a = parse_args([*base, "--use-rotary-position-embeddings",
                    "--rotary-seq-len-interpolation-factor", "4"], 1)
    assert model_config(a).rope_linear_factor == 4.0
    with pytest.raises(ArgumentError, match="--rotary-seq-len-interpolation-factor needs "
                       "--position-embedding-type rope"):
        parse_args([*base, "--rotary-seq-len-interpolation-factor", "2"], 1)
    with pytest.raises(ArgumentError, match="--rotary-seq-len-interpolation-factor and "
                       "--use-rope-scaling exclude each other"):
        parse_args([*base, "--use-rotary-position-embeddings", "--use-rope-scaling",
                    "--rotary-seq-len-interpolation-factor", "2"], 1)
    noted = ["--te-rng-tracker", "--no-check-for-nan-in-loss-and-grad",
             "--ddp-average-in-collective", "--disable-gloo-process-groups",
             "--num-dataset-builder-threads", "4", "--auto-detect-ckpt-format",
             "--dist-ckpt-strictness", "log_all", "--no-async-tensor-model-parallel-allreduce",
             "--no-query-key-layer-scaling", "--data-impl", "mmap"]
    notes = no_effect_given(parse_args([*base, *noted], 1))
    assert [n.split(" has no effect")[0] for n in notes] == [
        "braid: --te-rng-tracker", "braid: --no-check-for-nan-in-loss-and-grad",
        "braid: --ddp-average-in-collective", "braid: --disable-gloo-process-groups",
        "braid: --num-dataset-builder-threads 4", "braid: --auto-detect-ckpt-format",
        "braid: --dist-ckpt-strictness log_all",
        "braid: --no-async-tensor-model-parallel-allreduce",
        "braid: --no-query-key-layer-scaling", "braid: --data-impl mmap"]
    for flag, why in (("--moe-router-force-load-balancing", "routes by the router's scores"),
                      ("--sgd-momentum", "no SGD"), ("--fp8-margin", "no FP8 kernels"),
                      ("--use-megatron-fsdp", "ZeRO-1")):
        with pytest.raises(ArgumentError, match=f"{flag} is not supported by braid: .*{why}"):
            parse_args([*base, flag], 1)


def test_num_zeros_in_grad_counts_each_element_once_under_any_layout(tmp_path):
    # Megatron's --log-num-zeros-in-grad. The (untied) embedding rows of tokens a batch lacks
    # have zero gradients: thousands of elements a step here. Every layout counts each element
    # once - TP replicas of norms, DP copies, ZeRO shards - so the counts equal one process's
    # step for step.

    def zeros(name, ranks, layout):
        tb = str(tmp_path / name)
        r = run(ranks, [*MODEL, "--train-iters", "10", "--eval-iters", "0", "--tensorboard-dir",
                        tb, "--log-num-zeros-in-grad", *layout])
        assert r.returncode == 0, r.stdout + r.stderr
        assert "| num zeros: " in r.stdout, r.stdout
        return {rec["step"]: rec["num-zeros"] for rec in jsonl(os.path.join(tb, "metrics.jsonl"))}

    one = zeros("one", 1, [])
    assert sorted(one) == list(range(1, 11)) and all(v >= 64 for v in one.values()), one
    assert all(v % 64 == 0 for v in one.values()), one  # whole embedding rows of hidden 64
    for name, layout in (("tp2_pp2_zero", ["--tensor-model-parallel-size", "2",
                                           "--pipeline-model-parallel-size", "2",
                                           "--sequence-parallel", "--use-distributed-optimizer"]),
                         ("dp4_zero", ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
                         ("tp4", ["--tensor-model-parallel-size", "4"])):
        assert zeros(name, 4, layout) == one, name


def test_gelu_takes_megatrons_form():
    # megatron-core's GELU is the tanh form only in its fused bias-GELU (biases, no
    # --no-bias-gelu-fusion) or with --openai-gelu; the exact (erf) form otherwise.
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "python"))
    from braid.arguments import parse_args
    from braid.checkpoint_args import model_args
    from braid.megatron_flags import activation

    base = ["--vocab-size", "300", "--mock-data", "--seq-length", "32", "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4"]
    for flags, want in (([], "gelu"), (["--openai-gelu"], "gelu"),
                        (["--no-bias-gelu-fusion"], "gelu_exact"),
                        (["--disable-bias-linear"], "gelu_exact"),
                        (["--disable-bias-linear", "--openai-gelu"], "gelu"),
                        (["--disable-bias-linear", "--swiglu"], "swiglu"),
                        (["--no-bias-gelu-fusion", "--squared-relu"], "squared_relu")):
        a = parse_args([*base, *flags], 1)
        assert activation(a) == want, flags
        # --use-checkpoint-args gives the same form back from a checkpoint's config.
        config = {"activation": want, "add_bias_linear": "--disable-bias-linear" not in flags}
        b = parse_args(base, 1)
        for dest, value in model_args_of(config, model_args):
            setattr(b, dest, value)
        assert activation(b) == want, flags


def model_args_of(config, model_args):
    """The GELU and bias arguments model_args gives for a config holding just those."""
    full = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 4,
            "ffn_hidden_size": 256, "vocab_size": 300, "max_position_embeddings": 32,
            "normalization": "layernorm", "position_embedding": "learned", "add_qkv_bias": False,
            "qk_layernorm": False, "tie_embeddings": True, "rope_theta": 10000.0,
            "rotary_percent": 1.0, "rope_scaling_factor": 0.0, "norm_eps": 1e-5, **config}
    keep = {"swiglu", "squared_relu", "openai_gelu", "no_bias_gelu_fusion",
            "disable_bias_linear"}
    return [(dest, value) for dest, value in model_args(full) if dest in keep]


def test_exact_gelu_trains_alike_under_any_layout_and_is_saved(tmp_path):
    # A GELU model without biases: Megatron-LM computes the exact (erf) GELU (its fusion is off
    # without biases). tp 2 x pp 2 trains like one process; the checkpoint says gelu_exact;
    # --openai-gelu (the tanh form) trains differently.
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "python"))
    import braid

    gelu = [x for x in MODEL if x != "--swiglu"]
    assert len(gelu) == len(MODEL) - 1 and "--disable-bias-linear" in gelu

    def train(name, ranks, extra):
        tb = str(tmp_path / name)
        r = run(ranks, [*gelu, "--train-iters", "10", "--eval-iters", "0", "--tensorboard-dir",
                        tb, "--save", str(tmp_path / name / "ckpt"), *extra])
        assert r.returncode == 0, r.stdout + r.stderr
        return losses(jsonl(os.path.join(tb, "metrics.jsonl")))

    one = train("one", 1, [])
    assert braid.checkpoint_metadata(str(tmp_path / "one" / "ckpt"))["config"]["activation"] \
        == "gelu_exact"
    layout = train("tp2_pp2", 4, ["--tensor-model-parallel-size", "2",
                                  "--pipeline-model-parallel-size", "2", "--sequence-parallel"])
    np.testing.assert_allclose([layout[i] for i in range(1, 11)],
                               [one[i] for i in range(1, 11)], rtol=2e-4)
    tanh = train("tanh", 1, ["--openai-gelu"])
    assert braid.checkpoint_metadata(str(tmp_path / "tanh" / "ckpt"))["config"]["activation"] \
        == "gelu"
    assert tanh[1] == pytest.approx(one[1], rel=1e-3) and tanh != one
