"""pretrain_gpt.py's decoupled learning rate and what a resumed run does with the checkpoint's
schedules, as real jobs: --decoupled-lr / --decoupled-min-lr step for step as megatron-core's own
OptimizerParamScheduler gives them, the same under every layout (both copies of tied
embeddings included); on --load, a schedule that differs from the checkpoint's is refused
exactly where megatron-core's load_state_dict refuses it, --use-checkpoint-opt_param-scheduler
continues the checkpoint's and --override-opt_param-scheduler takes the command line's."""

import json
import os
import shutil
import sys

import numpy as np
import pytest

from pretrain_job import MODEL, REPO, jsonl, losses, run, validation

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

DECOUPLED = ["--min-lr", "3e-4", "--decoupled-lr", "1e-2", "--decoupled-min-lr", "1e-4",
             "--lr-warmup-init", "1e-4"]


def megatron_rates(args: dict, steps: int, decoupled: bool = True) -> list[tuple[float, float]]:
    """(learning rate, decoupled learning rate) logged at steps 1..steps by megatron-core's
    OptimizerParamScheduler over two parameter groups, Megatron-LM's default one and its
    is_embedding_or_output_parameter one: Megatron-LM logs the optimizer's rate after
    train_step's scheduler step, so step s shows s scheduler steps' (step s + 1's rate)."""
    torch = pytest.importorskip("torch")
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Groups:  # what the scheduler touches of an optimizer
        def __init__(self):
            main = {"max_lr": args["lr"], "min_lr": args["min_lr"]}
            vocab = {"max_lr": args["decoupled_lr"], "min_lr": args["decoupled_min_lr"]} \
                if decoupled else dict(main)
            self.param_groups = [{"params": [torch.zeros(1)], **main},
                                 {"params": [torch.zeros(1)], **vocab}]

    optimizer = Groups()
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args["init"], max_lr=args["lr"], min_lr=args["min_lr"],
        lr_warmup_steps=args["warmup"], lr_decay_steps=args["decay"],
        lr_decay_style=args["style"], start_wd=0.01, end_wd=0.01, wd_incr_steps=args["decay"],
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False)
    rates = []
    for _ in range(steps):
        scheduler.step(increment=1)
        rates.append((optimizer.param_groups[0]["lr"], optimizer.param_groups[1]["lr"]))
    return rates


def rates(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in sorted(records, key=lambda r: r["step"]) if key in r]


def train(tmp_path, name: str, ranks: int, args: list[str]) -> list[dict]:
    tb = str(tmp_path / name)
    r = run(ranks, [*MODEL, "--train-iters", "20", "--tensorboard-dir", tb, *args])
    assert r.returncode == 0, r.stdout + r.stderr
    return jsonl(os.path.join(tb, "metrics.jsonl"))


@pytest.mark.parametrize("style", ["cosine", "linear", "inverse-square-root", None])
def test_decoupled_rates_are_megatrons(tmp_path, style):
    # None: no --lr-decay-style, whose default is Megatron-LM's, linear.
    records = train(tmp_path, "tb", 1, [*DECOUPLED, "--lr-decay-iters", "16",
                                        *(["--lr-decay-style", style] if style else [])])
    want = megatron_rates({"lr": 3e-3, "min_lr": 3e-4, "decoupled_lr": 1e-2,
                           "decoupled_min_lr": 1e-4, "init": 1e-4, "warmup": 3, "decay": 16,
                           "style": style or "linear"}, 20)
    np.testing.assert_allclose(rates(records, "learning-rate"), [w[0] for w in want],
                               rtol=1e-6)
    np.testing.assert_allclose(rates(records, "decoupled-learning-rate"),
                               [w[1] for w in want], rtol=1e-6)


def test_decoupled_rate_under_every_layout_equals_one_process(tmp_path):
    one = train(tmp_path, "one", 1, DECOUPLED)
    plain = train(tmp_path, "plain", 1, [])
    same = train(tmp_path, "same", 1, ["--decoupled-lr", "3e-3"])
    assert losses(same) == losses(plain)  # the decoupled rate equal to --lr: bit for bit
    assert losses(one) != losses(plain)
    layouts = {
        "tp2_pp2_zero": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                         "2", "--sequence-parallel", "--use-distributed-optimizer"],
        "dp4_zero_overlap": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                             "--overlap-param-gather"],
    }
    for name, layout in layouts.items():
        got = train(tmp_path, name, 4, [*DECOUPLED, *layout])
        np.testing.assert_allclose([losses(got)[i] for i in range(1, 21)],
                                   [losses(one)[i] for i in range(1, 21)], rtol=2e-4,
                                   err_msg=name)
        assert validation(got)[20] == pytest.approx(validation(one)[20], rel=2e-4), name


def test_tied_embeddings_both_copies_take_the_decoupled_rate(tmp_path):
    # Under pp the last stage holds its own copy of tied embeddings: stepped with another rate
    # than the first stage's, the two would part and the losses with them.
    tied = [x for x in MODEL if x != "--untie-embeddings-and-output-weights"]
    assert len(tied) == len(MODEL) - 1

    def tied_run(name, ranks, layout):
        tb = str(tmp_path / name)
        args = [*tied, "--train-iters", "20", "--tensorboard-dir", tb, *DECOUPLED, *layout]
        r = run(ranks, args)
        assert r.returncode == 0, r.stdout + r.stderr
        return losses(jsonl(os.path.join(tb, "metrics.jsonl")))

    one = tied_run("one", 1, [])
    got = tied_run("pp4", 4, ["--pipeline-model-parallel-size", "4"])
    np.testing.assert_allclose([got[i] for i in range(1, 21)], [one[i] for i in range(1, 21)],
                               rtol=2e-4)


# ---- the checkpoint's schedule on --load -----------------------------------------------------

BASE = {"--lr": "3e-3", "--min-lr": "3e-4", "--lr-warmup-iters": "3", "--lr-decay-iters": "12",
        "--lr-decay-style": "cosine", "--weight-decay": "0.01", "--global-batch-size": "16"}


def flags(changes: dict) -> list[str]:
    merged = {**BASE, **changes}
    model = [x for i, x in enumerate(MODEL) if not (x in BASE or (i and MODEL[i - 1] in BASE))]
    return [*model, *[x for kv in merged.items() for x in kv]]


def megatron_refuses(changes: dict) -> bool:
    """Whether megatron-core's OptimizerParamScheduler.load_state_dict, given the checkpoint's
    state and the changed arguments, asserts that they differ."""
    torch = pytest.importorskip("torch")
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Groups:
        param_groups = [{"params": [torch.zeros(1)]}]

    def scheduler(values):  # in samples, as Megatron-LM's training.py builds it
        v = {**BASE, **values}
        wd, batch = float(v["--weight-decay"]), int(v["--global-batch-size"])
        return OptimizerParamScheduler(
            Groups(), init_lr=0.0, max_lr=float(v["--lr"]), min_lr=float(v["--min-lr"]),
            lr_warmup_steps=int(v["--lr-warmup-iters"]) * batch,
            lr_decay_steps=int(v["--lr-decay-iters"]) * batch,
            lr_decay_style=v["--lr-decay-style"], start_wd=wd, end_wd=wd,
            wd_incr_steps=20 * batch, wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False)

    saved = scheduler({}).state_dict()
    try:
        scheduler(changes).load_state_dict(saved)
    except AssertionError:
        return True
    return False


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """Twelve iterations in one job, and the same stopped after six with a checkpoint."""
    root = tmp_path_factory.mktemp("schedule")
    whole = str(root / "whole")
    r = run(1, [*flags({}), "--train-iters", "12", "--eval-iters", "0", "--tensorboard-dir",
                whole])
    assert r.returncode == 0, r.stdout + r.stderr
    ckpt = str(root / "ckpt")
    r = run(1, [*flags({}), "--train-iters", "12", "--eval-iters", "0", "--exit-interval", "6",
                "--save", ckpt])
    assert r.returncode == 0, r.stdout + r.stderr
    return jsonl(os.path.join(whole, "metrics.jsonl")), ckpt


CHANGES = [{}, {"--lr": "1e-3"}, {"--min-lr": "1e-4"}, {"--lr-warmup-iters": "2"},
           {"--lr-decay-iters": "14"}, {"--lr-decay-style": "linear"},
           {"--weight-decay": "0.05"}, {"--global-batch-size": "32"}]


@pytest.mark.parametrize("changes", CHANGES, ids=lambda c: ",".join(c) or "same")
def test_a_changed_schedule_is_refused_where_megatron_refuses_it(tmp_path, saved_run, changes):
    _, ckpt = saved_run
    copy = str(tmp_path / "ckpt")
    shutil.copytree(ckpt, copy)
    r = run(1, [*flags(changes), "--train-iters", "12", "--eval-iters", "0", "--load", copy,
                "--save", copy])
    refused = megatron_refuses(changes)
    assert refused == bool(changes)
    if refused:
        assert r.returncode == 2, r.stdout + r.stderr
        assert "the learning-rate schedule differs from the checkpoint's" in r.stderr
        assert "--override-opt_param-scheduler" in r.stderr and \
            "--use-checkpoint-opt_param-scheduler" in r.stderr, r.stderr
        name = {"--lr": "learning rate: 0.001", "--min-lr": "minimum learning rate: 0.0001",
                "--lr-warmup-iters": "warmup iterations: 2",
                "--lr-decay-iters": "total number of iterations: 14",
                "--lr-decay-style": "learning rate decay style: linear",
                "--weight-decay": "weight decay",
                "--global-batch-size": "the decay in samples: 12 iterations x global batch 32 = "
                "384 (the checkpoint: 12 x 16 = 192)"}[next(iter(changes))]
        assert name in r.stderr, r.stderr
        sys.path.insert(0, os.path.join(REPO, "python"))
        import braid
        assert braid.latest_iteration(copy) == 6  # nothing saved is lost
    else:
        assert r.returncode == 0, r.stdout + r.stderr


def test_use_checkpoint_scheduler_continues_the_checkpoints(tmp_path, saved_run):
    whole, ckpt = saved_run
    tb = str(tmp_path / "tb")
    r = run(1, [*flags({"--lr": "1e-3", "--lr-decay-iters": "30", "--weight-decay": "0.05"}),
                "--train-iters", "12", "--eval-iters", "0", "--load", ckpt,
                "--use-checkpoint-opt_param-scheduler", "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the checkpoint's learning-rate schedule" in r.stdout
    got = jsonl(os.path.join(tb, "metrics.jsonl"))
    want = {rec["step"]: rec for rec in whole}
    for rec in got:  # the uninterrupted run's rates and losses
        assert rec["learning-rate"] == want[rec["step"]]["learning-rate"]
        assert rec["lm loss"] == pytest.approx(want[rec["step"]]["lm loss"], rel=1e-5)
    assert sorted(rec["step"] for rec in got) == list(range(7, 13))


def test_override_scheduler_takes_the_command_lines(tmp_path, saved_run):
    _, ckpt = saved_run
    tb = str(tmp_path / "tb")
    r = run(1, [*flags({"--lr": "1e-3", "--lr-decay-iters": "20"}), "--train-iters", "12",
                "--eval-iters", "0", "--load", ckpt, "--override-opt_param-scheduler",
                "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    want = megatron_rates({"lr": 1e-3, "min_lr": 3e-4, "init": 0.0, "warmup": 3, "decay": 20,
                           "style": "cosine"}, 12, decoupled=False)
    got = jsonl(os.path.join(tb, "metrics.jsonl"))
    np.testing.assert_allclose(rates(got, "learning-rate"), [w[0] for w in want[6:]], rtol=1e-6)


def test_scheduler_flags_are_checked(tmp_path, saved_run):
    _, ckpt = saved_run
    both = run(1, [*flags({}), "--train-iters", "12", "--load", ckpt,
                   "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"])
    assert both.returncode == 2 and "not both" in both.stderr, both.stderr
    floor = run(1, [*flags({}), "--train-iters", "2", "--decoupled-min-lr", "1e-4"])
    assert floor.returncode == 2 and "--decoupled-min-lr needs --decoupled-lr" in floor.stderr
    above = run(1, [*flags({}), "--train-iters", "2", "--decoupled-lr", "1e-4"])
    assert above.returncode == 2 and "exceeds --decoupled-lr" in above.stderr, above.stderr
    # --finetune and --no-load-optim restart the optimizer, and with it the schedule: no check,
    # and --use-checkpoint-opt_param-scheduler says it has nothing to take.
    for restart in ("--finetune", "--no-load-optim"):
        r = run(1, [*flags({"--lr": "1e-3"}), "--train-iters", "8", "--eval-iters", "0",
                    "--load", ckpt, restart, "--use-checkpoint-opt_param-scheduler"])
        assert r.returncode == 0, restart + r.stdout + r.stderr
        assert "--use-checkpoint-opt_param-scheduler: the run restarts the optimizer" in \
            r.stdout and "the command line's learning-rate schedule is used" in r.stdout, r.stdout
    # A checkpoint without a recorded schedule (an older braid's): said, not silently passed.
    old = tmp_path / "old"
    shutil.copytree(ckpt, old)
    meta = old / "iter_0000006" / "metadata.json"
    edited = json.loads(meta.read_text())
    del edited["lr_schedule"]
    meta.write_text(json.dumps(edited))
    r = run(1, [*flags({}), "--train-iters", "8", "--eval-iters", "0", "--load", str(old),
                "--use-checkpoint-opt_param-scheduler"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--use-checkpoint-opt_param-scheduler: the checkpoint records no learning-rate " \
        "schedule" in r.stdout, r.stdout
