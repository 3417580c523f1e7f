"""Pipeline layouts in the planner (braid.planner_split, braid.planner; tools/plan.py
--pipeline-model-parallel-layout and --account-for-embedding/loss-in-pipeline-split, also from a
run's own arguments after --): every model chunk's layers as braid's engine splits them
(engine::stage_layers), timed and held chunk by chunk, bad layouts refused with pretrain_gpt.py's
messages, and the accounted split searched beside the uneven first and last stages."""

import dataclasses
import json
import os
import sys

import pytest

from braid import _C, pipeline_args, planner, planner_split
from braid.arguments import without_source

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "tools"))
import plan  # noqa: E402

CLUSTER = ["--gpu", "h100-80g", "--num-gpus", "8", "--nvlink-bw", "450GB/s", "--net-bw",
           "400Gb/s"]
# 8 layers (hidden 2048, 16 heads, MLP 8192, 2048-token sequences) and a 512k vocabulary: at
# TP 2 the LM head and loss take as long as 12 layers.
HEAVY = planner.ModelShape(8, 2048, 16, 16, 8192, 512 * 1024, 2048)
SHAPE = ["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16",
         "--ffn-hidden-size", "8192", "--vocab-size", str(512 * 1024), "--seq-length", "2048"]
FIXED = ["--tp", "2", "--micro-batch-size", "1", "--recompute", "none", "--sequence-parallel",
         "false", "--zero", "false", "--global-batch", "16"]
H100 = planner.Cluster(planner.GPUS["h100-80g"], 8, 8, 450e9, 50e9)


def _rows(capsys, *args):
    assert plan.main(["--json", *CLUSTER, *args]) == 0
    return json.loads(capsys.readouterr().out)


def _refused(capsys, *args) -> str:
    """What plan.py says refusing args (argparse's exit 2, "plan.py: error: ...")."""
    with pytest.raises(SystemExit) as e:
        plan.parse_args([*CLUSTER, *args])
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1].split(": error: ", 1)[1]


def _engine(num_layers, pp, v, chunks):
    """(each rank's layers, each model chunk's) as braid's engine splits them."""
    ranges = _C.stage_layers(num_layers, pp, v, None, None, list(chunks))
    return ([sum(e - b for b, e in rank) for rank in ranges],
            [ranges[k % pp][k // pp][1] - ranges[k % pp][k // pp][0] for k in range(pp * v)])


@pytest.mark.parametrize("pp,layout,v", [(4, "E|t*4|t*4|L", 1), (4, "Et*3|tt|tt|tL", 1),
                                         (2, "Et|(tt|)*2tttL", 2), (2, "E|t|t|t|t|t|t|ttL", 4)])
def test_a_layout_is_the_engines_split(capsys, pp, layout, v):
    counts, stages = pipeline_args.layout_chunk_layers(layout, pp, 8, 0)
    ranks, chunks = _engine(8, pp, stages, counts)
    [row] = _rows(capsys, *SHAPE, *FIXED, "--pp", str(pp),
                  "--pipeline-model-parallel-layout", layout)
    assert (row["pp"], row["virtual_stages"], stages) == (pp, v, v)
    assert row["model_chunk_layers"] == counts == chunks and row["stage_layers"] == ranks
    # The same run from its own arguments after --, as pretrain_gpt.py parses them.
    training = ["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16",
                "--ffn-hidden-size", "8192", "--swiglu", "--untie-embeddings-and-output-weights",
                "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                "--disable-bias-linear", "--seq-length", "2048", "--tokenizer-type",
                "NullTokenizer", "--vocab-size", str(512 * 1024 - 1), "--data-path", "x",
                "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "10",
                "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", str(pp),
                "--overlap-grad-reduce", "--bf16", "--pipeline-model-parallel-layout", layout]
    [run] = _rows(capsys, "--", *training)
    assert run["model_chunk_layers"] == counts and run["stage_layers"] == ranks
    assert run["step_time_s"] == pytest.approx(row["step_time_s"])
    assert run["memory_gb_per_gpu"] == pytest.approx(row["memory_gb_per_gpu"])


def test_the_accounted_split_is_pipeline_args_and_the_engines(capsys):
    # 30 layers with the embedding and the loss a layer each: 32 over pp 4 x v for every v the
    # search tries, 7 8 8 7 at v 1 down to 0 1 ... 1 0 at v 8.
    shape = ["--num-layers", "30", *SHAPE[2:]]
    both = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    rows = _rows(capsys, *shape, *FIXED, "--pp", "4", *both)
    assert sorted({r["virtual_stages"] for r in rows}) == [1, 2, 4, 8]
    for r in rows:
        want = pipeline_args.accounted_chunk_layers(30, 4, r["virtual_stages"], True, True)
        assert r["model_chunk_layers"] == want
        assert r["stage_layers"] == _engine(30, 4, r["virtual_stages"], want)[0]
    assert {tuple(r["stage_layers"]) for r in rows if r["virtual_stages"] == 1} == {(7, 8, 8, 7)}
    # The embedding alone: 31 layers + 1 over pp 4 (searched: only pp > 1, where it divides).
    shape = ["--num-layers", "31", *SHAPE[2:]]
    rows = _rows(capsys, *shape, *FIXED, "--virtual-stages", "1", both[0])
    assert {r["pp"] for r in rows} == {2, 4}  # pp 1 has no split; at pp 2, 32 / 2 = 16
    for r in rows:
        want = pipeline_args.accounted_chunk_layers(31, r["pp"], 1, True, False)
        assert r["model_chunk_layers"] == want and r["stage_layers"] == want
    # What the table shows: the model chunks' layers, runs counted.
    assert plan.main([*CLUSTER, *shape, *FIXED, "--pp", "4", both[0]]) == 0
    assert "7|8*3" in capsys.readouterr().out
    assert plan.stages([3, 4], [0, 1, 1, 1, 1, 1, 1, 0]) == "0|1*6|0"


def test_an_embedding_chunk_and_a_loss_chunk_shorten_a_step_the_head_dominates():
    # At TP 2 the head takes 12 layers' time. Even (2 | 2 | 2 | 2) the last stage runs 2
    # layers and the head; lighter ends (1 | 3 | 3 | 1, the best first/last split the search
    # tries at pp 4) one layer and the head; E|t*4|t*4|L gives the head a stage of its own.
    even = planner.predict(HEAVY, H100, planner.Layout(2, 4, 1, 1), 16)
    ends = planner.predict(HEAVY, H100, planner.Layout(2, 4, 1, 1, first_stage_layers=1,
                                                       last_stage_layers=1), 16)
    own = planner.predict(HEAVY, H100, planner.Layout(2, 4, 1, 1,
                                                      model_chunk_layers=(0, 4, 4, 0)), 16)
    layer = planner.layer_cost(HEAVY, H100, planner.Layout(2, 4, 1, 1))
    head = planner.head_cost(HEAVY, H100, planner.Layout(2, 4, 1, 1))
    assert sum(head) / (layer.forward + layer.backward) == pytest.approx(12.06, abs=0.01)
    assert own["step_time_s"] == pytest.approx(0.3195, abs=1e-4)   # 319.5 ms
    assert ends["step_time_s"] == pytest.approx(0.3432, abs=1e-4)  # 343.2 ms
    assert even["step_time_s"] == pytest.approx(0.3669, abs=1e-4)  # 366.9 ms
    # The last rank - the head's weights and logits make it the fullest - holds no layer.
    assert own["memory_gb_per_gpu"] < ends["memory_gb_per_gpu"] < even["memory_gb_per_gpu"]
    assert even["memory_parts_gb"]["params"] - own["memory_parts_gb"]["params"] == \
        pytest.approx(2 * 2 * HEAVY.layer_params(2) / planner.GB)


@pytest.mark.parametrize("lay", [planner.Layout(2, 4, 1, 1, first_stage_layers=1,
                                                last_stage_layers=1),
                                 planner.Layout(2, 4, 1, 1, virtual_stages=2),
                                 planner.Layout(2, 4, 1, 1, 2, "full", recompute_method="block",
                                                recompute_num_layers=1)])
def test_a_split_given_chunk_by_chunk_predicts_what_it_does_otherwise(lay):
    chunks = planner_split.chunk_layers(8, 4, lay.virtual_stages, lay.first_stage_layers,
                                        lay.last_stage_layers)
    same = dataclasses.replace(lay, first_stage_layers=None, last_stage_layers=None,
                               model_chunk_layers=chunks)
    want, got = planner.predict(HEAVY, H100, lay, 16), planner.predict(HEAVY, H100, same, 16)
    assert got.pop("model_chunk_layers") == list(chunks)
    for key in ("first_stage_layers", "last_stage_layers"):
        want.pop(key), got.pop(key)
    assert got == want


def _layout_error(layout, pp, layers=8, mtp=0):
    with pytest.raises(ValueError) as e:
        pipeline_args.layout_chunk_layers(layout, pp, layers, mtp)
    return str(e.value)


@pytest.mark.parametrize("layout", ["E|t*4|t*4L", "t*2|t*2|t*2|t*2L", "Et*2|t*2|t*2|t*2",
                                    "Et*2|t*2|t*2|t*3L", "Et*2|t*2|t*2|t*2xL",
                                    "Et*2|t*2|t*2|t*2mL"])
def test_a_bad_layout_is_refused_with_pretrain_gpts_message(capsys, layout):
    want = _layout_error(layout, 4)
    assert _refused(capsys, *SHAPE, *FIXED, "--pp", "4", "--pipeline-model-parallel-layout",
                    layout) == want


def test_layouts_and_accounted_splits_the_engine_or_the_flags_refuse(capsys):
    with pytest.raises(ValueError) as e:  # a middle stage without a layer: the engine's rule
        _C.stage_layers(8, 4, 1, None, None, [0, 8, 0, 0])
    assert _refused(capsys, *SHAPE, *FIXED, "--pp", "4", "--pipeline-model-parallel-layout",
                    "E|t*8||L") == without_source(e.value)
    layout = ["--pipeline-model-parallel-layout", "E|t*4|t*4|L"]
    both = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    for args, message in [
            (layout, "--pipeline-model-parallel-layout needs --pp"),
            ([*layout, "--pp", "4", "--decoder-first-pipeline-num-layers", "2"],
             "--pipeline-model-parallel-layout excludes --decoder-first-pipeline-num-layers"),
            ([*layout, "--pp", "4", both[0]], "places the embedding and the loss itself"),
            ([*layout, "--pp", "4", "--virtual-stages", "2"],
             "--virtual-stages 2: the layout's 4 stages over --pp 4 are 1 virtual stages"),
            ([*both, "--pp", "4"], "--num-layers 8 + 1 (the embedding) + 1 (the loss) = 10 is "
                                   "not divisible by the 4 model chunks"),
            ([both[1], "--pp", "1"], "needs --pipeline-model-parallel-size > 1"),
            ([both[1], "--decoder-last-pipeline-num-layers", "2"],
             "--account-for-embedding/loss-in-pipeline-split excludes")]:
        assert message in _refused(capsys, *SHAPE, *FIXED, *args)
    # After --, pretrain_gpt.py's own parser refuses it.
    out = _refused(capsys, "--", "--num-layers", "8", "--hidden-size", "2048",
                   "--num-attention-heads", "16", "--seq-length", "2048", "--max-position-"
                   "embeddings", "2048", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                   "1023", "--data-path", "x", "--micro-batch-size", "1", "--global-batch-size",
                   "16", "--pipeline-model-parallel-size", "4",
                   "--pipeline-model-parallel-layout", "E|t*4|t*4L")
    assert out == f"the training arguments: {_layout_error('E|t*4|t*4L', 4)}"


def test_the_search_adds_the_accounted_split_where_it_is_new():
    splits = planner.stage_splits
    # Where it is one of the even or first/last splits it is not tried twice.
    assert planner_split.searched(126, 16, 1) == tuple((f, l, ()) for f, l in splits(126, 16, 1))
    assert planner_split.searched(32, 2, 1) == tuple((f, l, ()) for f, l in splits(32, 2, 1))
    assert planner_split.searched(30, 4, 1) == tuple((f, l, ()) for f, l in splits(30, 4, 1))
    # Interleaved, or with an end of no layer, it is new: Llama 3 405B's 126 layers over pp 16 x
    # v 8, where neither the even split nor lighter ends divide.
    assert splits(126, 16, 8) == []
    assert planner_split.searched(126, 16, 8) == ((None, None, (0,) + (1,) * 126 + (0,)),)
    assert planner_split.searched(30, 4, 2)[-1] == (None, None, (3,) + (4,) * 6 + (3,))


def test_plans_without_the_accounted_split_are_unchanged(monkeypatch):
    # Llama 3 405B on 16384 H100s at TP 8, PP 16 (micro batch 1, selective, SP, ZeRO): with the
    # accounted split at v 8 - a model chunk of the embedding, 126 of one layer, one of the
    # head - the step falls from 7.744 s (8 | 8 .. | 6 at v 2) to 5.994 s; every other plan is
    # the search's without it, in the same order.
    fixed = dict(tp=8, cp=1, pp=16, micro_batch_size=1, recompute="selective",
                 sequence_parallel=True, zero=True)
    model = planner.PRESETS["llama3-405b"]
    cluster = planner.Cluster(planner.GPUS["h100-80g"], 8, 16384, 450e9, 50e9)
    results, _ = planner.search(model, cluster, 2048, fixed)
    best = results[0]
    assert best["model_chunk_layers"] == [0] + [1] * 126 + [0]
    assert best["virtual_stages"] == 8 and best["step_time_s"] == pytest.approx(5.994, abs=1e-3)
    monkeypatch.setattr(planner_split, "searched", lambda n, p, v: tuple(
        (f, l, ()) for f, l in planner.stage_splits(n, p, v)))
    without, _ = planner.search(model, cluster, 2048, fixed)
    assert [r for r in results if "model_chunk_layers" not in r] == without
    assert without[0]["stage_layers"] == [8] * 15 + [6]
    assert without[0]["step_time_s"] == pytest.approx(7.744, abs=1e-3)


@pytest.mark.parametrize("args,step,memory", [
    # docs/planner.md's run from its own arguments (Llama 2 70B-like, TP 8, PP 4, v 2)
    (["--gpu", "h100-80g", "--num-gpus", "64", "--nvlink-bw", "450GB/s", "--net-bw", "400Gb/s",
      "--", "--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
      "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "28672",
      "--swiglu", "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm",
      "--position-embedding-type", "rope", "--disable-bias-linear", "--seq-length", "4096",
      "--tokenizer-type", "NullTokenizer", "--vocab-size", "31999", "--data-path", "x",
      "--micro-batch-size", "1", "--global-batch-size", "64", "--train-iters", "1000",
      "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
      "--num-layers-per-virtual-pipeline-stage", "10", "--sequence-parallel",
      "--use-distributed-optimizer", "--overlap-grad-reduce", "--recompute-granularity",
      "selective", "--bf16"], 5.3950242263520485, 40.45816832),
    # its partial recomputation, uneven stages 19 | 21 | 21 | 19
    (["--model", "llama2-70b", "--gpu", "h100-80g", "--num-gpus", "64", "--nvlink-bw",
      "450GB/s", "--net-bw", "400Gb/s", "--global-batch", "64", "--tp", "8", "--pp", "4",
      "--micro-batch-size", "8", "--virtual-stages", "1", "--sequence-parallel", "true",
      "--zero", "true", "--decoder-first-pipeline-num-layers", "19",
      "--decoder-last-pipeline-num-layers", "19"], 9.103223222765834, 77.327976448)])
def test_plans_before_pipeline_layouts_are_unchanged(capsys, args, step, memory):
    # tools/plan.py --json's best of these before layouts came to the planner, to the bit.
    assert plan.main(["--json", *args]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    assert "model_chunk_layers" not in best
    assert (best["step_time_s"], best["memory_gb_per_gpu"]) == (step, memory)
