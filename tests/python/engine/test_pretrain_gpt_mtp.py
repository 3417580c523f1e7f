"""pretrain_gpt.py with --mtp-num-layers (DeepSeek-V3's multi-token prediction, Megatron's
flags): the MTP layers train like one process under tensor (with sequence), pipeline, context,
data (ZeRO, overlapped) and expert parallelism, with tied and untied output layers and one or
two layers; every depth's loss is logged as Megatron logs it; checkpoints resume in another
layout; the MTP loss's weight and evaluation leave the main model's loss as it is; bad flags
are refused before MPI."""

import os
import re
import sys

import numpy as np
import pytest

from pretrain_job import (MODEL, REPO, assert_generate_decodes_greedily, jsonl, log_lines, run,
                          run_layouts)
from test_pretrain_gpt_expert_parallel import EXPERTS
from test_pretrain_gpt_moe_router import expert_biases

MTP = ["--mtp-num-layers", "1"]
TIED = [a for a in MODEL if a != "--untie-embeddings-and-output-weights"]
assert len(TIED) == len(MODEL) - 1


def series(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


def assert_like_one_process(runs: dict, steps: dict, keys: list[str], rtol: float = 1e-5):
    """Of run_layouts' `runs`, "one" records every key at steps 1 to 20, and each run `name`
    of `steps` at exactly steps[name], with the one-process run's values (rtol)."""
    one = runs["one"]
    for key in keys:
        assert sorted(series(one, key)) == list(range(1, 21)), key
    for name, its_steps in steps.items():
        for key in keys:
            got, want = series(runs[name], key), series(one, key)
            assert sorted(got) == list(its_steps), (name, key)
            np.testing.assert_allclose([got[i] for i in its_steps],
                                       [want[i] for i in its_steps], rtol=rtol,
                                       err_msg=f"{name}: {key}")


def logged(stdout: str) -> dict[int, dict[str, float]]:
    """The log lines' losses by iteration: {step: {"lm loss": x, "mtp_1 loss": y, ...}}."""
    out = {}
    for line in log_lines(stdout):
        step = int(re.search(r"\] iteration +(\d+)/", line).group(1))
        out[step] = {name: float(value) for name, value in
                     re.findall(r"\| ((?:lm|mtp_\d+) loss): ([0-9.E+-]+) (?=\|)", line)}
    return out


def interval_mean(records: list[dict], key: str, logged_steps, step: int) -> float:
    """What the log line at `step` shows of `key`, as Megatron logs it: the mean of the
    iterations since the job's previous line (or its start)."""
    values = series(records, key)
    after = max((s for s in logged_steps if s < step), default=min(values) - 1)
    return float(np.mean([values[s] for s in range(after + 1, step + 1)]))


def test_mtp_layouts_train_like_one_process_and_resume(tmp_path):
    # A Llama-style model (untied output layer) with one MTP layer: one process trains 20
    # iterations, saving at 10; tp 2 with sequence parallelism, pp 2 (the MTP layer on the last
    # stage, which also needs the word embedding), cp 2 and dp 2 with ZeRO and overlapped
    # reduction and gathers train the first 10 alike. The pp 2 checkpoint continues under tp 2
    # and, taking the model from the checkpoint, in one process; the one-process checkpoint
    # under pp 2.
    sys.path.insert(0, os.path.join(REPO, "python"))
    import braid

    one_ckpt, pp_ckpt = str(tmp_path / "one_ckpt"), str(tmp_path / "pp_ckpt")
    runs, stdout = run_layouts(tmp_path, MODEL, (
        ("one", 1, [*MTP, "--save", one_ckpt, "--save-interval", "10"]),
        ("tp2", 2, [*MTP, "--exit-interval", "10", "--tensor-model-parallel-size", "2",
                    "--sequence-parallel"]),
        ("pp2", 2, [*MTP, "--exit-interval", "10", "--pipeline-model-parallel-size", "2",
                    "--save", pp_ckpt]),
        ("cp2", 2, [*MTP, "--exit-interval", "10", "--context-parallel-size", "2"]),
        ("dp2", 2, [*MTP, "--exit-interval", "10", "--use-distributed-optimizer",
                    "--overlap-grad-reduce", "--overlap-param-gather"]),
        ("pp2_to_tp2", 2, [*MTP, "--load", pp_ckpt, "--tensor-model-parallel-size", "2",
                           "--sequence-parallel"]),
        ("pp2_to_one", 1, ["--load", pp_ckpt, "--use-checkpoint-args"]),
        ("one_to_pp2", 2, [*MTP, "--load", one_ckpt, "--ckpt-step", "10",
                           "--pipeline-model-parallel-size", "2"])))
    assert_like_one_process(runs, {"tp2": range(1, 11), "pp2": range(1, 11), "cp2": range(1, 11),
                                   "dp2": range(1, 11), "pp2_to_tp2": range(11, 21),
                                   "pp2_to_one": range(11, 21), "one_to_pp2": range(11, 21)},
                            ["lm loss", "mtp_1 loss", "grad-norm"])
    # A next-but-one token of 300 random ones: about ln 300 = 5.70 to start with.
    first = series(runs["one"], "mtp_1 loss")[1]
    assert 5.0 < first < 6.5, first
    assert "mtp_2 loss" not in runs["one"][0]
    # The log line: Megatron's "mtp_1 loss: X |" after the lm loss, the metrics' values
    # averaged over the iterations since the previous line.
    for name, out in stdout.items():
        assert ", 1 multi-token prediction layer (loss scaling factor 0.1)) on" in out, out
        lines = logged(out)
        assert sorted(lines) == ([5, 10, 15, 20] if name == "one" else [15, 20]
                                 if "_to_" in name else [5, 10]), (name, out)
        for step, losses in lines.items():
            assert list(losses) == ["lm loss", "mtp_1 loss"], (name, losses)
            for key, value in losses.items():
                assert value == pytest.approx(interval_mean(runs[name], key, lines, step),
                                              rel=1e-6)
    assert "braid: --mtp-num-layers 1 from the checkpoint" in stdout["pp2_to_one"]

    # HF DeepSeek-V3's names for the MTP layer after the 4 of the model: layer 4.
    meta = braid.checkpoint_metadata(pp_ckpt)
    assert meta["config"]["mtp_num_layers"] == 1, meta["config"]
    assert meta["config"]["mtp_loss_scaling_factor"] == pytest.approx(0.1), meta["config"]
    tensors = meta["tensors"]
    for name, shape in (("enorm.weight", [64]), ("hnorm.weight", [64]),
                        ("eh_proj.weight", [64, 128]), ("shared_head.norm.weight", [64]),
                        ("input_layernorm.weight", [64]), ("post_attention_layernorm.weight",
                                                          [64]),
                        ("mlp.down_proj.weight", tensors["model.layers.3.mlp.down_proj.weight"]
                         ["shape"])):
        assert tensors[f"model.layers.4.{name}"]["shape"] == shape, name
    assert not any(n.startswith("model.layers.5.") for n in tensors), sorted(tensors)
    assert_generate_decodes_greedily(pp_ckpt, meta["config"])
    # A model without the MTP layer is another model.
    r = run(1, [*MODEL, "--load", pp_ckpt, "--override-opt_param-scheduler", "--train-iters",
                "11", "--eval-iters", "0"])
    assert r.returncode != 0
    assert ("mtp_num_layers (--mtp-num-layers) is 1 in the checkpoint and 0 in this run"
            in r.stdout + r.stderr), r.stdout + r.stderr


def test_the_mtp_loss_weight_and_evaluation(tmp_path):
    # With --mtp-loss-scaling-factor 0 the MTP layer is trained on nothing: the main model
    # trains exactly as without MTP (losses, gradient norms, validation), and the MTP loss is
    # still logged. With the default 0.1 the first step's losses are the same (the MTP layer
    # adds parameters, not a change to the model's forward) and training then differs.
    # Evaluation never runs the MTP layers.
    runs = {}
    for name, flags in (("none", []), ("zero", [*MTP, "--mtp-loss-scaling-factor", "0"]),
                        ("default", MTP)):
        tb = str(tmp_path / name)
        r = run(1, [*MODEL, *flags, "--train-iters", "20", "--tensorboard-dir", tb])
        assert r.returncode == 0, r.stdout + r.stderr
        runs[name] = jsonl(os.path.join(tb, "metrics.jsonl"))
    steps = range(1, 21)
    for key in ("lm loss", "grad-norm"):
        none, zero = series(runs["none"], key), series(runs["zero"], key)
        np.testing.assert_allclose([zero[i] for i in steps], [none[i] for i in steps],
                                   rtol=1e-6, err_msg=key)
    for key in ("lm loss validation", "lm loss validation ppl"):
        none, zero = series(runs["none"], key), series(runs["zero"], key)
        assert sorted(none) == sorted(zero) == [10, 20], key
        assert [zero[10], zero[20]] == pytest.approx([none[10], none[20]], rel=1e-6), key
    assert sorted(series(runs["zero"], "mtp_1 loss")) == list(steps)
    assert not series(runs["none"], "mtp_1 loss")
    none, weighted = series(runs["none"], "lm loss"), series(runs["default"], "lm loss")
    assert weighted[1] == pytest.approx(none[1], rel=1e-6)
    assert max(abs(weighted[i] / none[i] - 1) for i in steps) > 1e-4, (weighted, none)
    zero_mtp, mtp = series(runs["zero"], "mtp_1 loss"), series(runs["default"], "mtp_1 loss")
    assert zero_mtp[1] == pytest.approx(mtp[1], rel=1e-6)
    # Evaluation is the main output's loss alone: the initial model's, with the MTP loss weighted
    # or not, is the model's without MTP.
    for name, flags in (("none", []), ("default", MTP)):
        tb = str(tmp_path / f"{name}_eval")
        r = run(1, [*MODEL, *flags, "--skip-train", "--tensorboard-dir", tb])
        assert r.returncode == 0, r.stdout + r.stderr
        runs[name] = series(jsonl(os.path.join(tb, "metrics.jsonl")), "lm loss validation")
    assert list(runs["none"]) == list(runs["default"]) == [0], runs
    assert runs["default"][0] == pytest.approx(runs["none"][0], rel=1e-6)


def test_two_mtp_layers_with_tied_embeddings(tmp_path):
    # Two MTP layers (layers 4 and 5) on a model whose output layer is the word embedding: one
    # process, tp 2 x pp 2 (sequence parallel, ZeRO) and cp 2 x dp 2 train alike, each depth's
    # loss logged in order; depth 1 of the two starts as the one-layer model's.
    two = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]
    runs, stdout = run_layouts(tmp_path, TIED, (
        ("one", 1, two),
        ("tp2_pp2", 4, [*two, "--exit-interval", "10", "--tensor-model-parallel-size", "2",
                        "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                        "--use-distributed-optimizer"]),
        ("cp2_dp2", 4, [*two, "--exit-interval", "10", "--context-parallel-size", "2",
                        "--use-distributed-optimizer", "--overlap-grad-reduce"]),
        ("depth1", 1, [*MTP, "--mtp-loss-scaling-factor", "0.3", "--exit-interval", "1"])))
    assert_like_one_process(runs, {"tp2_pp2": range(1, 11), "cp2_dp2": range(1, 11)},
                            ["lm loss", "mtp_1 loss", "mtp_2 loss", "grad-norm"])
    one, depth1 = runs["one"][0], runs["depth1"][0]
    assert one["step"] == depth1["step"] == 1
    assert depth1["mtp_1 loss"] == pytest.approx(one["mtp_1 loss"], rel=1e-6)
    assert depth1["lm loss"] == pytest.approx(one["lm loss"], rel=1e-6)
    assert "mtp_2 loss" not in depth1 and "mtp_3 loss" not in one
    assert ", 2 multi-token prediction layers (loss scaling factor 0.3)) on" in stdout["one"]
    for name in ("one", "tp2_pp2"):
        lines = logged(stdout[name])
        assert lines, stdout[name]
        for step, losses in lines.items():
            assert list(losses) == ["lm loss", "mtp_1 loss", "mtp_2 loss"], losses
            for key, value in losses.items():
                assert value == pytest.approx(interval_mean(runs[name], key, lines, step),
                                              rel=1e-6)


def test_mtp_with_experts_and_expert_parallelism(tmp_path):
    # EXPERTS (8 experts, DeepSeek-V3's sigmoid router with the expert bias, aux loss and z-loss,
    # a gated shared expert; layers 0, 1 and 3) with one MTP layer: the last layer has experts,
    # so the MTP layer (4) has them too, and its router losses count among the layers' as
    # Megatron counts them. dp 2 x ep 2 (ZeRO, overlapped) and pp 2 x dp 2 x ep 2 train like one
    # process; the latter's checkpoint continues in one process, its expert biases (the MTP
    # layer's too) the one-process run's.
    per_layer = [f"moe/{loss}_layer_{i}" for loss in ("load_balancing_loss", "z_loss")
                 for i in (0, 1, 3, 4)]
    one_ckpt, ep_ckpt = str(tmp_path / "one_ckpt"), str(tmp_path / "ep_ckpt")
    runs, stdout = run_layouts(tmp_path, [*MODEL, *EXPERTS, *MTP, "--moe-per-layer-logging"], (
        ("one", 1, ["--save", one_ckpt, "--save-interval", "5"]),
        ("dp2_ep2", 2, ["--exit-interval", "10", "--expert-model-parallel-size", "2",
                        "--use-distributed-optimizer", "--overlap-grad-reduce"]),
        ("pp2_dp2_ep2", 4, ["--exit-interval", "10", "--save", ep_ckpt,
                            "--pipeline-model-parallel-size", "2",
                            "--expert-model-parallel-size", "2"]),
        ("ep2_to_one", 1, ["--load", ep_ckpt])), timeout=300)
    assert_like_one_process(runs, {"dp2_ep2": range(1, 11), "pp2_dp2_ep2": range(1, 11),
                                   "ep2_to_one": range(11, 21)},
                            ["lm loss", "mtp_1 loss", "load_balancing_loss", "z_loss",
                             *per_layer])
    assert not any("layer_2" in key or "layer_5" in key for r in runs["one"] for key in r)
    one = runs["one"]
    for loss in ("load_balancing_loss", "z_loss"):
        for step, value in series(one, loss).items():
            layers = [series(one, f"moe/{loss}_layer_{i}")[step] for i in (0, 1, 3, 4)]
            assert abs(sum(layers) / 4 - value) <= 1e-6 * value, (loss, step, layers, value)
    assert ": tp=1 pp=2 dp=2 ep=2" in stdout["pp2_dp2_ep2"], stdout["pp2_dp2_ep2"]
    line = log_lines(stdout["one"])[0]
    assert re.search(r"\| lm loss: \S+ \| load_balancing_loss: \S+ \| z_loss: \S+ \| "
                     r"mtp_1 loss: \S+ \| loss scale:", line), line
    got, want = expert_biases(ep_ckpt, 10), expert_biases(one_ckpt, 10)
    assert sorted(got) == sorted(want) == [
        f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (0, 1, 3, 4)]
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-6, err_msg=name)
    # The MTP layer's bias trains: after 5 sign updates of +-rate it cannot be back at 0 (after
    # an even number it may be, as at 10 on Megatron's mock data, whose balance oscillates).
    moved = expert_biases(one_ckpt, 5)["model.layers.4.mlp.gate.e_score_correction_bias"]
    assert np.abs(moved).max() > 0


@pytest.mark.parametrize("ranks, args, message", [
    (2, ["--mtp-num-layers", "0"],
     "--mtp-num-layers must be >= 1, got 0 (omit it for no multi-token prediction)"),
    (2, ["--mtp-num-layers", "-2"], "--mtp-num-layers must be >= 1, got -2"),
    (1, ["--mtp-loss-scaling-factor", "0.2"], "--mtp-loss-scaling-factor needs --mtp-num-layers"),
    (1, [*MTP, "--mtp-loss-scaling-factor", "-1"],
     "argument --mtp-loss-scaling-factor: must be >= 0, got -1"),
    (2, [*MTP, "--position-embedding-type", "learned_absolute"],
     "--mtp-num-layers needs --position-embedding-type rope, got learned_absolute"),
])
def test_bad_mtp_flags_are_refused(ranks, args, message):
    r = run(ranks, [*MODEL, *args, "--train-iters", "1"], timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
    assert not log_lines(r.stdout), r.stdout
