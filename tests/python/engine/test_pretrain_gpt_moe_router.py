"""pretrain_gpt.py with DeepSeek-V3's router as Megatron's flags give it: sigmoid scores,
group-limited routing, the top-k scaling factor, auxiliary-loss-free balancing (the expert
bias), the z-loss and the per-sequence load-balancing loss. The run trains alike in one process
and under tp x pp x dp and tp x cp, logs both router losses, and its checkpoint - the expert
biases included - resumes in another layout. Token dropping (the expert capacity factor) trains
alike in one process and under tp x pp x dp. Bad combinations of the flags are refused, naming
the flag, before any rank starts."""

import os
import sys

import numpy as np
import pytest

from pretrain_job import (LAYOUT_3D, MODEL, REPO, assert_generate_decodes_greedily, jsonl,
                         run)

RATE = 0.02
ROUTER = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
          "--moe-shared-expert-intermediate-size", "48", "--moe-layer-freq", "[1,1,0,1]",
          "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
          "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
          "--moe-router-topk-scaling-factor", "2.5", "--moe-z-loss-coeff", "1e-3",
          "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2",
          # 20 x Megatron's default: a few steps move the biases enough to change the experts
          # chosen, so a resume without them would show in the losses.
          "--moe-router-bias-update-rate", str(RATE), "--moe-per-layer-logging"]
PER_LAYER = [f"moe/{loss}_layer_{i}" for loss in ("seq_load_balancing_loss", "z_loss")
             for i in (0, 1, 3)]  # the expert layers of --moe-layer-freq [1,1,0,1]


def metric(records, key):
    return {r["step"]: r[key] for r in records if key in r}


def expert_biases(ckpt, iteration):
    """name -> bias [E] of the checkpoint's expert layers, loaded into one process."""
    import braid
    from braid.generate import config_from_metadata

    model = braid.GPTModel(config_from_metadata(braid.checkpoint_metadata(ckpt)["config"]))
    braid.load_parameters(ckpt, model, iteration=iteration)
    return {name: np.asarray(bias) for name, bias in model.expert_biases().items()}


def test_deepseek_router_trains_like_one_process_and_resumes_in_another_layout(tmp_path):
    # One process trains 10 iterations (saving at 5); tp 2 x pp 2 x dp 2 (sequence parallel,
    # distributed optimizer, overlapped reduction; saving at 5 and 10) and tp 2 x cp 2 (sequence
    # parallel) train alike, with the same lm loss, load-balancing loss and z-loss; the 3D run's
    # checkpoint at 5 resumes in one process and gives the one-process iterations 6 to 10.
    sys.path.insert(0, os.path.join(REPO, "python"))
    import braid

    ckpt, ckpt_one = str(tmp_path / "ckpt"), str(tmp_path / "ckpt_one")
    runs = {}
    for name, n, extra in (
            ("one", 1, ["--save", ckpt_one, "--save-interval", "5"]),
            ("3d", 8, [*LAYOUT_3D, "--save", ckpt, "--save-interval", "5"]),
            ("tp_cp", 4, ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                          "--sequence-parallel"]),
            ("resumed", 1, ["--load", ckpt, "--ckpt-step", "5"])):
        tb = str(tmp_path / name)
        r = run(n, [*MODEL, *ROUTER, *extra, "--train-iters", "10", "--eval-iters", "0",
                    "--tensorboard-dir", tb])
        assert r.returncode == 0, r.stdout + r.stderr
        # seq_aux_loss's under Megatron's name for it
        assert "| seq_load_balancing_loss: " in r.stdout and "| z_loss: " in r.stdout, r.stdout
        runs[name] = jsonl(os.path.join(tb, "metrics.jsonl"))
    one = {key: metric(runs["one"], key)
           for key in ("lm loss", "seq_load_balancing_loss", "z_loss", *PER_LAYER)}
    assert all(sorted(v) == list(range(1, 11)) for v in one.values()), one
    # --moe-per-layer-logging: each expert layer's losses (none for the dense layer 2), whose
    # mean is the logged one; the 3D run's pipeline stages each report their own layers.
    assert not any("layer_2" in key for r in runs["one"] for key in r)
    for loss in ("seq_load_balancing_loss", "z_loss"):
        for step, value in one[loss].items():
            layers = [one[f"moe/{loss}_layer_{i}"][step] for i in (0, 1, 3)]
            assert abs(sum(layers) / 3 - value) <= 1e-6 * value, (loss, step, layers, value)
    # Perfect balance gives 1; top-2 of 4 experts at most 2 (every token on the same two).
    assert all(0.5 < v < 2.0 for v in one["seq_load_balancing_loss"].values()), one
    # logsumexp(logits)^2: (log 4)^2 = 1.92 for logits of 0, which the initialisation is close to.
    assert all(1.0 < v < 3.0 for v in one["z_loss"].values()), one
    for name, steps in (("3d", range(1, 11)), ("tp_cp", range(1, 11)),
                        ("resumed", range(6, 11))):
        for key, want in one.items():
            got = metric(runs[name], key)
            assert sorted(got) == list(steps), (name, key)
            np.testing.assert_allclose([got[i] for i in steps], [want[i] for i in steps],
                                       rtol=1e-5, err_msg=f"{name}: {key}")

    c = braid.checkpoint_metadata(ckpt)["config"]
    assert (c["moe_router_score_function"], c["moe_router_enable_expert_bias"],
            c["moe_router_num_groups"], c["moe_router_group_topk"],
            c["moe_router_topk_scaling_factor"]) == ("sigmoid", True, 2, 1, 2.5), c
    # The biases the 3D run saved at 5 are the one-process run's: Megatron's update, the
    # tokens counted over the global batch, every step a multiple of the rate.
    got, want = expert_biases(ckpt, 5), expert_biases(ckpt_one, 5)
    assert sorted(got) == sorted(want) == [
        f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (0, 1, 3)]
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-6, err_msg=name)
        np.testing.assert_allclose(want[name] / RATE, np.round(want[name] / RATE), atol=1e-4)
    assert any(np.abs(b).max() > 0 for b in want.values()), want

    assert_generate_decodes_greedily(ckpt, c)

    # --use-checkpoint-args takes the router back (not its losses' coefficients); another
    # scaling factor loads with a warning; a model without the expert biases is another model.
    r = run(1, [*MODEL, "--use-checkpoint-args", "--load", ckpt,
                "--override-opt_param-scheduler", "--train-iters", "11",
                "--eval-iters", "0"])
    assert r.returncode == 0, r.stdout + r.stderr
    for line in ("--moe-router-score-function sigmoid", "--moe-router-enable-expert-bias True",
                 "--moe-router-num-groups 2", "--moe-router-group-topk 1",
                 "--moe-router-topk-scaling-factor 2.5"):
        assert f"braid: {line} from the checkpoint" in r.stdout, r.stdout
    assert "| z_loss: " not in r.stdout and "| load_balancing_loss: " not in r.stdout, r.stdout
    scaled = [*ROUTER[:ROUTER.index("--moe-router-topk-scaling-factor") + 1], "1.5",
              *ROUTER[ROUTER.index("--moe-router-topk-scaling-factor") + 2:]]
    r = run(1, [*MODEL, *scaled, "--load", ckpt, "--override-opt_param-scheduler",
                "--train-iters", "11", "--eval-iters", "0"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("the checkpoint's model has moe_router_topk_scaling_factor 2.5, this run's 1.5 "
            "(--moe-router-topk-scaling-factor)") in r.stdout, r.stdout
    unbiased = [f for f in ROUTER[:ROUTER.index("--moe-router-bias-update-rate")]
                if f != "--moe-router-enable-expert-bias"]
    r = run(1, [*MODEL, *unbiased, "--load", ckpt, "--override-opt_param-scheduler",
                "--train-iters", "11", "--eval-iters", "0"])
    assert r.returncode != 0
    assert "a different model - moe_router_enable_expert_bias" in r.stdout + r.stderr, r.stderr


def test_the_expert_bias_and_the_z_loss_change_training(tmp_path):
    # Without the expert bias, or without the z-loss (which is then not logged), the losses
    # differ from those with both.
    def without(*flags):
        out, i = [], 0
        while i < len(ROUTER):
            if ROUTER[i] in flags:
                i += 1 if ROUTER[i] == "--moe-router-enable-expert-bias" else 2
            else:
                out.append(ROUTER[i])
                i += 1
        return out

    final = {}
    for name, flags in (("all", ROUTER),
                        ("no_bias", without("--moe-router-enable-expert-bias",
                                            "--moe-router-bias-update-rate")),
                        ("no_z", without("--moe-z-loss-coeff"))):
        r = run(1, [*MODEL, *flags, "--train-iters", "8", "--eval-iters", "0"])
        assert r.returncode == 0, r.stdout + r.stderr
        assert ("| z_loss: " in r.stdout) == (name != "no_z"), r.stdout
        final[name] = float(r.stdout.rsplit("final lm loss ", 1)[1].split()[0])
    for name in ("no_bias", "no_z"):
        assert abs(final[name] / final["all"] - 1) > 1e-6, final


DROPPING = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
            "--moe-expert-capacity-factor", "0.5", "--moe-token-drop-policy", "position"]


def test_token_dropping_trains_like_one_process(tmp_path):
    # Capacity factor 0.5, position policy: each expert keeps the first 16 of the 64 tokens x 2
    # choices of a microbatch routed to it (32 on average). tp 2 x pp 2 x dp 2 (sequence
    # parallel) routes every token of a microbatch on each TP rank, so it drops what one process
    # drops: the same losses, validation included. --moe-pad-expert-input-to-capacity changes
    # nothing (the one-process run has it); without the capacity factor the run is dropless
    # (--moe-token-drop-policy alone does nothing, as in Megatron) and trains otherwise.
    sys.path.insert(0, os.path.join(REPO, "python"))
    import braid
    from braid.checkpoint_args import model_args
    from braid.generate import config_from_metadata

    ckpt = str(tmp_path / "ckpt")
    dropless = [f for f in DROPPING if f not in ("--moe-expert-capacity-factor", "0.5")]
    runs = {}
    for name, n, flags in (("one", 1, [*DROPPING, "--moe-pad-expert-input-to-capacity"]),
                           ("3d", 8, [*DROPPING, *LAYOUT_3D, "--save", ckpt,
                                      "--save-interval", "8"]),
                           ("dropless", 1, dropless)):
        tb = str(tmp_path / name)
        r = run(n, [*MODEL, *flags, "--train-iters", "8", "--eval-interval", "8",
                    "--eval-iters", "1", "--tensorboard-dir", tb])
        assert r.returncode == 0, r.stdout + r.stderr
        runs[name] = jsonl(os.path.join(tb, "metrics.jsonl"))
        if name == "one":
            assert "braid: --moe-pad-expert-input-to-capacity has no effect" in r.stdout, r.stdout
        if name == "dropless":
            assert ("braid: --moe-token-drop-policy position has no effect: without "
                    "--moe-expert-capacity-factor no token is dropped") in r.stdout, r.stdout
    steps = list(range(1, 9))
    one = {key: metric(runs["one"], key) for key in ("lm loss", "lm loss validation",
                                                     "grad-norm")}
    assert sorted(one["lm loss"]) == steps and sorted(one["lm loss validation"]) == [8], one
    errors = {}
    for key, want in one.items():
        got = metric(runs["3d"], key)
        assert sorted(got) == sorted(want), key
        np.testing.assert_allclose([got[i] for i in sorted(want)],
                                   [want[i] for i in sorted(want)], rtol=1e-5, err_msg=key)
        errors[key] = max(abs(got[i] / want[i] - 1) for i in want)
    # The experts move the losses of a fresh model little (up to 1e-4 here), its gradients more.
    moved = {key: max(abs(metric(runs["dropless"], key)[i] / want[i] - 1) for i in want)
             for key, want in one.items()}
    assert moved["grad-norm"] > 1e-3, moved
    print(f"tp x pp x dp against one process: {errors}; dropless: {moved}")

    # The checkpoint's config records the dropping; --use-checkpoint-args takes it, and a run
    # of another capacity factor loads it with a warning.
    c = braid.checkpoint_metadata(ckpt)["config"]
    assert (c["moe_expert_capacity_factor"], c["moe_token_drop_policy"]) == (0.5, "position"), c
    cfg = config_from_metadata(c)
    assert (cfg.moe_expert_capacity_factor, cfg.moe_token_drop_policy) == (0.5, "position")
    args = dict(model_args(c))
    assert (args["moe_expert_capacity_factor"], args["moe_token_drop_policy"]) == (0.5,
                                                                                   "position")
    factor = DROPPING.index("--moe-expert-capacity-factor") + 1
    other = [*DROPPING[:factor], "1.2", *DROPPING[factor + 1:]]
    r = run(1, [*MODEL, *other, "--load", ckpt, "--override-opt_param-scheduler",
                "--train-iters", "9", "--eval-iters", "0"])
    assert r.returncode == 0, r.stdout + r.stderr
    warning = [line for line in r.stdout.splitlines()
               if "the checkpoint's model has moe_expert_capacity_factor 0.5, this run's 1.2"
               in line]
    assert len(warning) == 1 and "(--moe-expert-capacity-factor)" in warning[0], r.stdout


E4 = ["--num-experts", "4"]


@pytest.mark.parametrize("args, message", [
    ([*E4, "--moe-router-enable-expert-bias"],
     "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"),
    ([*E4, "--moe-router-score-function", "sigmoid", "--moe-router-pre-softmax"],
     "--moe-router-pre-softmax is for --moe-router-score-function softmax"),
    ([*E4, "--moe-router-score-function", "sigmoid", "--moe-router-bias-update-rate", "0.01"],
     "--moe-router-bias-update-rate needs --moe-router-enable-expert-bias"),
    ([*E4, "--moe-router-num-groups", "2"],
     "--moe-router-num-groups needs --moe-router-group-topk"),
    ([*E4, "--moe-router-group-topk", "1"],
     "--moe-router-group-topk needs --moe-router-num-groups"),
    ([*E4, "--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
     "--moe-router-num-groups 3 does not divide --num-experts 4"),
    ([*E4, "--moe-router-num-groups", "2", "--moe-router-group-topk", "3"],
     "--moe-router-group-topk 3 is more than --moe-router-num-groups 2"),
    ([*E4, "--moe-router-topk", "3", "--moe-router-num-groups", "2",
      "--moe-router-group-topk", "2"],
     "--moe-router-topk 3 is not divisible by --moe-router-group-topk 2"),
    ([*E4, "--moe-router-num-groups", "4", "--moe-router-group-topk", "1"],
     "more than a group's 1"),
    ([*E4, "--moe-router-topk-scaling-factor", "0"],
     "--moe-router-topk-scaling-factor must be > 0"),
    ([*E4, "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"],
     "--moe-router-load-balancing-type aux_loss seq_aux_loss: braid takes one load-balancing "
     "type"),
    ([*E4, "--moe-router-load-balancing-type", "global_aux_loss"],
     "--moe-router-load-balancing-type global_aux_loss is not implemented"),
    ([*E4, "--moe-aux-loss-coeff", "0.01", "0.001"],
     "--moe-aux-loss-coeff 0.01 0.001: braid takes one coefficient"),
    (["--moe-z-loss-coeff", "1e-3"], "--moe-z-loss-coeff needs --num-experts"),
    (["--moe-router-score-function", "sigmoid"],
     "--moe-router-score-function sigmoid needs --num-experts"),
    (["--moe-expert-capacity-factor", "1.0"], "--moe-expert-capacity-factor needs --num-experts"),
    ([*E4, "--moe-expert-capacity-factor", "0"],
     "argument --moe-expert-capacity-factor: must be > 0, got 0"),
    ([*E4, "--moe-expert-capacity-factor", "inf"],
     "--moe-expert-capacity-factor must be finite, got inf"),
    ([*E4, "--moe-token-drop-policy", "last"],
     "argument --moe-token-drop-policy: invalid choice: 'last'"),
    ([*E4, "--moe-pad-expert-input-to-capacity"],
     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    ([*E4, "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
      "--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"],
     "--moe-pad-expert-input-to-capacity with --moe-router-enable-expert-bias is not "
     "implemented"),
])
def test_bad_router_flags_are_refused_naming_the_flag(args, message):
    r = run(1, [*MODEL, *args, "--train-iters", "1"], timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
