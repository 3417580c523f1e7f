"""tools/plan.py's refusals and explanations: units, numbers, a fixed layout that breaks a rule
(named), a model that fits nowhere (its smallest layout's memory), and the values that a run's
own training arguments after -- give, which plan.py's flags may not give again."""

import json
import os
import subprocess
import sys

import pytest

from braid import planner

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "tools"))
import plan  # noqa: E402

H100 = ["--gpu", "h100-80g", "--gpus-per-node", "8", "--nvlink-bw", "450GB/s", "--net-bw",
        "400Gb/s"]
SMALL = ["--num-layers", "4", "--hidden-size", "768", "--num-attention-heads", "12",
         "--ffn-hidden-size", "3072", "--vocab-size", "50304", "--seq-length", "1024"]


def _plan(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "plan.py"), *args],
                          capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.path.join(REPO, "python")))


def test_bandwidth_units():
    assert planner.parse_bandwidth("300GB/s", "--nvlink-bw") == pytest.approx(300e9)
    assert planner.parse_bandwidth("200Gb/s", "--net-bw") == pytest.approx(25e9)
    assert planner.parse_bandwidth("100 Gbps", "--net-bw") == pytest.approx(12.5e9)
    assert planner.parse_bandwidth("1.5TB/s", "--nvlink-bw") == pytest.approx(1.5e12)
    assert planner.parse_bandwidth("1GiB/s", "--net-bw") == pytest.approx(2 ** 30)
    assert planner.parse_bandwidth("450GB/S", "--nvlink-bw") == pytest.approx(450e9)
    for bad in ["300", "300G", "fast", "-3GB/s", "", "1e400GB/s", "infGB/s"]:
        with pytest.raises(ValueError, match="--net-bw"):
            planner.parse_bandwidth(bad, "--net-bw")


def test_plan_cli_rejects_a_bare_number_naming_the_flag():
    out = _plan("--model", "llama2-7b", "--gpu", "h100-80g", "--num-gpus", "8",
                "--nvlink-bw", "450", "--net-bw", "400Gb/s", "--global-batch", "64")
    assert out.returncode == 2 and "--nvlink-bw" in out.stderr and "unit" in out.stderr


def test_none_fits_says_why():
    model = planner.PRESETS["llama3-405b"]
    small = planner.Cluster(planner.GPUS["a100-40g"], 8, 8, 300e9, 25e9)
    results, _ = planner.search(model, small, 8)
    assert results == []
    why = planner.why_nothing_fits(model, small, 8, {})
    assert "no layout fits in 40 GB" in why and "optimizer" in why and "more GPUs" in why
    out = _plan("--model", "llama3-405b", "--gpu", "a100-40g", "--num-gpus", "8",
                "--nvlink-bw", "300GB/s", "--net-bw", "200Gb/s", "--global-batch", "8")
    assert out.returncode == 1 and "no layout fits" in out.stderr


def test_invalid_fixed_layout_says_why():
    out = _plan("--model", "llama2-7b", "--gpu", "h100-80g", "--num-gpus", "16",
                "--nvlink-bw", "450GB/s", "--net-bw", "400Gb/s", "--global-batch", "64",
                "--tp", "3", "--pp", "1", "--micro-batch-size", "1", "--virtual-stages", "1")
    assert out.returncode == 1 and "tp 3" in out.stderr


@pytest.mark.parametrize("flags,message", [
    (["--tp", "0"], "argument --tp: must be > 0, got 0"),
    (["--global-batch", "-64"], "argument --global-batch: must be > 0, got -64"),
    (["--num-gpus", "0"], "argument --num-gpus: must be > 0, got 0"),
    (["--top", "-1"], "argument --top: must be > 0, got -1"),
    (["--train-tokens=-1e9"], "argument --train-tokens: must be > 0 and finite, got -1e9"),
    (["--gpu-hour-price", "nan"], "argument --gpu-hour-price: must be > 0 and finite, got nan"),
    (["--num-attention-heads", "7"], "error: --hidden-size 4096 is not divisible by "
     "--num-attention-heads 7 (or give the head width with --kv-channels)"),
    (["--num-query-groups", "3"], "error: --num-attention-heads 32 is not divisible by "
     "--num-query-groups 3"),
    (["--gpus-per-node", "3"], "error: --num-gpus 16 is not a whole number of nodes of "
     "--gpus-per-node 3"),
])
def test_plan_cli_refuses_bad_numbers_up_front(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        plan.parse_args(["--model", "llama3-8b", "--gpu", "h100-80g", "--num-gpus", "16",
                         "--nvlink-bw", "450GB/s", "--net-bw", "400Gb/s", "--global-batch", "64",
                         *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: ") and message in err, err


@pytest.mark.parametrize("flags,rule", [
    # A fixed dp that does not multiply out: the rule, not a layout of another dp that fits.
    (["--model", "llama2-7b", "--global-batch", "64", "--tp", "2", "--pp", "2", "--dp", "2"],
     "tp 2 x pp 2 x dp 2 = 8 != 16 GPUs"),
    ([*SMALL, "--global-batch", "60", "--tp", "3", "--pp", "1", "--dp", "5"],
     "tp 3 x pp 1 x dp 5 = 15 != 16 GPUs"),
    ([*SMALL, "--global-batch", "60", "--cp", "3"], "x cp 3 x pp 1 x dp 5 = 15 != 16 GPUs"),
])
def test_an_invalid_fixed_layout_names_the_rule_it_breaks(flags, rule):
    out = _plan(*H100, "--num-gpus", "16", *flags)
    assert out.returncode == 1 and rule in out.stderr and "fits" not in out.stderr, out.stderr


def test_none_fits_shows_the_fixed_recomputation():
    # Block recomputation of one layer a chunk, fixed: its memory, not uniform recomputation's.
    layout = ["--model", "llama2-70b", "--num-gpus", "64", "--global-batch", "64", "--tp", "8",
              "--pp", "4", "--micro-batch-size", "8", "--virtual-stages", "1",
              "--sequence-parallel", "true", "--zero", "true", "--recompute", "full"]
    block = _plan(*H100, *layout, "--recompute-method", "block", "--recompute-num-layers", "1")
    assert block.returncode == 1 and "recompute full block 1 ZeRO" in block.stderr, block.stderr
    need = float(block.stderr.split("needs ")[1].split(" GB")[0])
    uniform = _plan(*H100, *layout, "--json")
    assert uniform.returncode == 0 and need > 80 > json.loads(uniform.stdout)[0][
        "memory_gb_per_gpu"]


TRAINING = [*SMALL, "--micro-batch-size", "1", "--global-batch-size", "64", "--train-iters",
            "1000", "--tensor-model-parallel-size", "2", "--bf16", "--mock-data"]


@pytest.mark.parametrize("flags,message", [
    (["--global-batch", "128"], "--global-batch: with training arguments after --, the run's "
     "--global-batch-size gives it"),
    (["--train-tokens", "1e9"], "--train-tokens: with training arguments after --, the run's "
     "--train-iters or --train-samples gives it"),
])
def test_the_runs_own_values_are_not_given_twice(flags, message):
    out = _plan(*H100, "--num-gpus", "8", *flags, "--", *TRAINING)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    out = _plan(*H100, "--num-gpus", "8", "--gpu-hour-price", "3", "--", *TRAINING,
                "--gpu-hour-price", "2.5")
    assert out.returncode == 2 and "--gpu-hour-price 3 here and 2.5 in the training arguments" \
        in out.stderr, out.stderr
    # A price the training arguments do not give comes from plan.py: 8 GPUs x the run's hours.
    out = _plan(*H100, "--num-gpus", "8", "--gpu-hour-price", "3", "--json", "--", *TRAINING)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)[0]
    assert row["cost"] == pytest.approx(3 * row["gpu_hours"])
    assert row["days_to_train"] == pytest.approx(1000 * 64 * 1024 / row["tokens_per_s"] / 86400)


def test_expert_tp_refusals_name_plan_flags():
    out = _plan(*H100, "--num-gpus", "8", "--model", "mixtral-8x7b", "--global-batch", "64",
                "--expert-tensor-parallel-size", "3")
    assert out.returncode == 2 and "is not divisible by --tp 3" in out.stderr, out.stderr
    assert "--tensor-model-parallel-size" not in out.stderr


def test_zero_over_one_rank_is_not_a_second_row():
    out = _plan(*H100, "--num-gpus", "16", "--model", "llama2-7b", "--global-batch", "64",
                "--tp", "16", "--json")
    rows = json.loads(out.stdout)
    assert rows and all(r["dp"] * r["cp"] > 1 or not r["zero"] for r in rows)
    keys = [tuple(sorted((k, str(v)) for k, v in r.items())) for r in rows]
    assert len(keys) == len(set(keys))


def test_an_odd_sequence_needs_no_context_parallelism():
    # Only CP splits each sequence into 2 x cp chunks: seq 1023 plans at cp 1, and CP is refused.
    out = _plan(*H100, "--num-gpus", "8", *SMALL, "--seq-length", "1023", "--global-batch", "64",
                "--json")
    assert out.returncode == 0 and all(r["cp"] == 1 for r in json.loads(out.stdout)), out.stderr
    out = _plan(*H100, "--num-gpus", "8", *SMALL, "--seq-length", "1023", "--global-batch", "64",
                "--cp", "2")
    assert out.returncode == 1 and "does not split into 2 x cp chunks" in out.stderr, out.stderr
