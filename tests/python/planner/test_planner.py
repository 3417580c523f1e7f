"""The cluster planner (python/braid/planner.py, tools/plan.py) and the schedule bindings it
times pipelines with (braid._C.make_1f1b & co., simulate)."""

import pytest

from braid import _C

# ---- schedule bindings -------------------------------------------------------------------


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 16), (4, 4)])
def test_1f1b_bubble_is_p_minus_1_over_m(pp, m):
    result = _C.simulate(_C.make_1f1b(pp, m), forward=1.0, backward=2.0)
    assert result.ok and result.error == ""
    assert result.bubble_fraction == pytest.approx((pp - 1) / m)
    assert result.makespan == pytest.approx(3.0 * (m + pp - 1))
    assert result.max_in_flight == [min(pp - r, m) for r in range(pp)]


def test_gpipe_bubble_and_memory():
    result = _C.simulate(_C.make_gpipe(4, 8))
    assert result.bubble_fraction == pytest.approx(3 / 8)
    assert result.max_in_flight == [8] * 4


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 2)])
def test_interleaved_bubble_is_p_minus_1_over_vm(pp, m, v):
    schedule = _C.make_interleaved_1f1b(pp, m, v)
    assert (schedule.pp, schedule.microbatches, schedule.virtual_stages) == (pp, m, v)
    assert schedule.num_model_chunks == pp * v
    result = _C.simulate(schedule, forward=1.0 / v, backward=2.0 / v)
    assert result.bubble_fraction == pytest.approx((pp - 1) / (v * m))
    warmup = [_C.interleaved_warmup_steps(pp, m, v, r) for r in range(pp)]
    assert result.max_in_flight == [min(w + 1, v * m) for w in warmup]


def test_per_chunk_costs_and_their_shape():
    schedule = _C.make_1f1b(2, 4)
    slow_last = _C.simulate(schedule, forward_by_chunk=[[1.0], [2.0]],
                            backward_by_chunk=[[2.0], [4.0]])
    assert slow_last.busy == pytest.approx([12.0, 24.0])
    assert slow_last.makespan > _C.simulate(schedule).makespan
    with pytest.raises(ValueError, match="one row per pipeline rank"):
        _C.simulate(schedule, forward_by_chunk=[[1.0]])
    with pytest.raises(ValueError, match="chunks per rank"):
        _C.simulate(schedule, forward_by_chunk=[[1.0, 1.0], [1.0, 1.0]])


def test_p2p_cost_and_semantics():
    schedule = _C.make_1f1b(4, 8)
    base = _C.simulate(schedule)
    slow = _C.simulate(schedule, p2p=0.5)
    eager = _C.simulate(schedule, p2p=0.5, semantics=_C.P2PSemantics.eager)
    assert slow.makespan > base.makespan
    assert eager.ok and eager.makespan <= slow.makespan


def test_forward_only_and_stage_layers():
    result = _C.simulate(_C.make_forward_only(4, 8))
    assert result.ok and result.busy == pytest.approx([8.0] * 4)
    assert _C.stage_layers(8, 2, 2) == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    assert _C.stage_layers(10, 2, 1, first_stage_layers=4) == [[(0, 4)], [(4, 10)]]
    with pytest.raises(ValueError):
        _C.stage_layers(10, 4)
    with pytest.raises(ValueError):
        _C.make_interleaved_1f1b(4, 6, 2)  # m % pp != 0


def test_deadlock_surfaces_as_an_error():
    # GPipe, pp 2, one microbatch, with rank 0 waiting for the gradient before it sends the
    # activation: rank 1 waits for that activation, rank 0 for the gradient.
    P = _C.P2PKind
    schedule = _C.make_gpipe(2, 1)
    ranks = schedule.ranks
    ranks[0] = [_C.Action.forward(0, 0),
                _C.Action.exchange([_C.P2POp(P.recv_grad, 0, 0, 1)]),
                _C.Action.exchange([_C.P2POp(P.send_activation, 0, 0, 1)]),
                _C.Action.backward(0, 0)]
    schedule.ranks = ranks
    result = _C.simulate(schedule)
    assert not result.ok
    assert "deadlock" in result.error
    assert sorted(result.blocked_ranks) == [0, 1]


def test_mismatched_schedule_surfaces_as_an_error():
    schedule = _C.make_1f1b(2, 4)
    ranks = schedule.ranks
    ranks[1] = list(reversed(ranks[1]))
    schedule.ranks = ranks
    result = _C.simulate(schedule)
    assert not result.ok and "mismatched" in result.error


# ---- the planner ---------------------------------------------------------------------------

import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from braid import planner, planner_split  # noqa: E402
from braid.data import BatchLayout  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
PLAN = os.path.join(REPO, "tools", "plan.py")
CSV = os.path.join(REPO, "..", "shared", "published_runs.csv")
sys.path.insert(0, os.path.join(REPO, "tools"))
import plan  # noqa: E402


def _plan(*args):
    return subprocess.run([sys.executable, PLAN, *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.path.join(REPO, "python")))


def test_plan_cli_json_best_first_with_the_fields():
    out = _plan("--model", "llama2-7b", "--gpu", "h100-80g", "--num-gpus", "16",
                "--nvlink-bw", "450GB/s", "--net-bw", "400Gb/s", "--global-batch", "64",
                "--train-tokens", "1e11", "--gpu-hour-price", "2.5", "--zero", "true",
                "--micro-batch-size", "1", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert rows and [r["tokens_per_s"] for r in rows] == sorted(
        (r["tokens_per_s"] for r in rows), reverse=True)
    for key in ["tp", "pp", "dp", "micro_batch_size", "virtual_stages", "recompute",
                "step_time_s", "tokens_per_s", "mfu", "hfu", "memory_gb_per_gpu",
                "scaling_efficiency", "days_to_train", "cost"]:
        assert key in rows[0]
    assert set(rows[0]["memory_parts_gb"]) >= {"params", "grads", "optimizer", "activations"}
    assert all(r["zero"] and r["micro_batch_size"] == 1 for r in rows)
    assert all(r["memory_gb_per_gpu"] <= 80 for r in rows)
    assert 0 < rows[0]["mfu"] < 1 and 0 < rows[0]["scaling_efficiency"] <= 1.0 + 1e-9


H100 = planner.Cluster(planner.GPUS["h100-80g"], 8, 64, 450e9, 50e9)


def test_a_layout_that_cannot_fit_is_never_proposed():
    model = planner.PRESETS["llama2-70b"]
    # tp 1 pp 1: 70B parameters' state on one GPU cannot fit; all the others are checked.
    lay = planner.Layout(1, 1, 64, 1, recompute="full", zero=True)
    with pytest.raises(planner.DoesNotFit, match="GB per GPU"):
        planner.predict(model, H100, lay, 64)
    results, rejected = planner.search(model, H100, 64)
    assert results and rejected.get("out of memory", 0) > 0
    assert all((r["tp"], r["pp"]) != (1, 1) for r in results)
    assert all(r["memory_gb_per_gpu"] <= 80 for r in results)


@pytest.mark.parametrize("pp,v", [(4, 1), (4, 2), (8, 2)])
def test_simulated_bubble_of_a_uniform_stack(pp, v, monkeypatch):
    # Uniform layers without an LM head (vocab_size 0), free p2p (one big
    # node, no latency): the planner's simulated pipeline has Narayanan's bubble (p - 1) / (v m).
    monkeypatch.setattr(planner, "NVLINK_ALPHA_S", 0.0)
    model = planner.ModelShape(32, 4096, 32, 32, 16384, 0, 2048, "gelu")
    cluster = planner.Cluster(planner.GPUS["h100-80g"], 64, 64, 1e18, 50e9)
    lay = planner.Layout(8, pp, 64 // (8 * pp), 1, v, "selective", True, True)
    r = planner.predict(model, cluster, lay, 16 * (64 // (8 * pp)), baseline=False)
    m = r["microbatches"]
    assert r["bubble_fraction"] == pytest.approx((pp - 1) / (v * m), rel=0.01)
    # with the real p2p cost (NVLink latency and bandwidth) the bubble only grows
    monkeypatch.undo()
    real = planner.Cluster(planner.GPUS["h100-80g"], 64, 64, 450e9, 50e9)
    assert planner.predict(model, real, lay, 16 * (64 // (8 * pp)),
                           baseline=False)["bubble_fraction"] > r["bubble_fraction"]


def test_dp_overlap_per_chunk():
    # A slow network (2 GB/s per GPU) so the DP reduction matters: overlapping it hides part of
    # it, and interleaving hides more, since a rank's later chunks complete their gradients
    # while its earlier chunks are still in backward.
    model = planner.PRESETS["llama2-7b"]
    slow = planner.Cluster(planner.GPUS["h100-80g"], 8, 64, 450e9, 2e9)

    def exposed(v, overlap):
        lay = planner.Layout(2, 4, 8, 1, v, "selective", True, False, overlap)
        return planner.predict(model, slow, lay, 64, baseline=False)["exposed_dp_s"]

    assert 0 < exposed(1, True) < exposed(1, False)
    assert exposed(2, True) < exposed(1, True)
    assert exposed(4, True) < exposed(2, True)
    # Without overlap the whole buffer waits: the same exposed time whatever the chunking.
    assert exposed(4, False) == pytest.approx(exposed(1, False), rel=1e-9)
    # Each chunk's parameters add up to its rank's, and the ranks' to the model's TP shard (up
    # to the final norm, which every TP rank holds whole).
    lay = planner.Layout(2, 4, 8, 1, 4)
    chunks = planner.chunk_params(model, lay)
    assert [sum(c) for c in chunks] == planner.stage_params(model, lay)
    assert sum(map(sum, chunks)) == pytest.approx(model.num_params() / 2, abs=model.hidden_size)
    assert chunks[0][0] > chunks[1][0] and chunks[3][3] > chunks[3][2]  # embedding, LM head


def test_memory_parts_add_up_and_zero_shards_the_optimizer():
    model = planner.PRESETS["llama2-7b"]
    base = planner.Layout(2, 2, 16, 1, recompute="selective", sequence_parallel=True)
    plain = planner.predict(model, H100, base, 64)
    zero = planner.predict(model, H100, planner.Layout(2, 2, 16, 1, 1, "selective", True, True),
                           64)
    for r in (plain, zero):
        assert r["memory_gb_per_gpu"] == pytest.approx(sum(r["memory_parts_gb"].values()))
    pz, pp_ = zero["memory_parts_gb"], plain["memory_parts_gb"]
    assert pz["optimizer"] == pytest.approx(pp_["optimizer"] / 16)
    assert pz["params"] == pp_["params"] and pz["grads"] == pp_["grads"]
    # braid's accounting: bf16 params, f32 grads, f32 master + 2 moments = 2 : 4 : 12
    assert pp_["grads"] == pytest.approx(2 * pp_["params"])
    assert pp_["optimizer"] == pytest.approx(6 * pp_["params"])
    # activations: docs/memory.md's GPT block, none = 32sbh + 16sb + 4abs bytes without TP
    gpt = planner.ModelShape(1, 1024, 16, 16, 4096, 8, 512, "gelu")
    one = planner.Layout(1, 1, 1, 1)
    assert planner.layer_activation_bytes(gpt, one, "none") == 32 * 512 * 1024 + 16 * 512 \
        + 4 * 16 * 512
    assert planner.layer_activation_bytes(gpt, one, "selective") == 20 * 512 * 1024 + 4 * 16 * 512
    # SP divides everything by t exactly (docs/memory.md, measured to the byte)
    sp4 = planner.Layout(4, 1, 1, 1, sequence_parallel=True)
    assert planner.layer_activation_bytes(gpt, sp4, "none") == pytest.approx(
        planner.layer_activation_bytes(gpt, one, "none") / 4)
    # --qk-layernorm keeps q and k before their norms too (none: 4sbh + their statistics, 8
    # bytes a head for layernorm's mean and rstd); selective keeps them in place of q and k.
    qk = dataclasses.replace(gpt, qk_layernorm=True)
    assert planner.layer_activation_bytes(qk, one, "none") == \
        planner.layer_activation_bytes(gpt, one, "none") + 4 * 512 * 1024 + 8 * 32 * 512
    assert planner.layer_activation_bytes(qk, one, "selective") == \
        planner.layer_activation_bytes(gpt, one, "selective")


def test_presets_count_the_published_parameters():
    # Meta's Llama 3 8B has 8,030,261,248; braid counts its preset without allocating it (what
    # pretrain_gpt.py logs on rank 0), and the planner's preset agrees but for the final norm.
    import braid

    cfg = braid.TransformerConfig.preset("llama3-8b")
    assert cfg.num_parameters() == 8_030_261_248
    cfg.params_dtype = "bf16"  # a GPU run's config: a CPU GPTModel of it cannot even be built
    assert cfg.num_parameters() == 8_030_261_248
    assert planner.PRESETS["llama3-8b"].num_params() + 4096 == cfg.num_parameters()


def test_wide_heads_count_what_braid_builds():
    # --kv-channels (Qwen3-0.6B: 16 heads of 128 on hidden 1024): the queries and the attention
    # output are heads x kv_channels wide, not hidden.
    import braid
    from braid import flops

    for act, qk, kv_channels in (("swiglu", True, 32), ("gelu", False, 8)):
        shape = planner.ModelShape(2, 64, 4, 2 if act == "swiglu" else 4, 160, 97, 32, act,
                                   act == "gelu", qk, kv_channels)
        cfg = braid.TransformerConfig.preset("llama-tiny" if act == "swiglu" else "gpt2-tiny")
        cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads = 2, 64, 4
        cfg.num_query_groups, cfg.ffn_hidden_size, cfg.vocab_size = shape.kv_heads, 160, 97
        cfg.max_position_embeddings, cfg.qk_layernorm, cfg.kv_channels = 32, qk, kv_channels
        model = braid.GPTModel(cfg, device="cpu", seed=1)
        # Not in num_params: the final norm (weight, and bias with layernorm) and GPT-2's learned
        # positions.
        extra = 64 + (64 + 32 * 64 if act == "gelu" else 0)
        assert shape.num_params() + extra == model.num_parameters(), act
        assert cfg.num_parameters() == model.num_parameters()  # counted without building it
        # Model FLOPs: every GEMM of the layer at its real width, attention over q's width.
        q, kv, s = 4 * kv_channels, shape.kv_heads * kv_channels, 32
        mlp = (3 if act == "swiglu" else 2) * 64 * 160
        want = 2 * (2 * (64 * (q + 2 * kv) + q * 64 + mlp) + 4 * s * q) + 2 * 64 * 97
        assert flops.forward_flops_per_token(shape, s) == want
        assert flops.forward_flops_per_token(cfg, s) == want
    # Activations: q, k, v and the attention output at their widths (2 bytes each), as
    # test_recompute.cpp measures them.
    base = planner.ModelShape(1, 64, 4, 2, 160, 0, 32)
    wide = dataclasses.replace(base, kv_channels=32)
    one = planner.Layout(1, 1, 1, 1)
    for rec in ("none", "selective"):
        extra = planner.layer_activation_bytes(wide, one, rec) - \
            planner.layer_activation_bytes(base, one, rec)
        assert extra == 32 * 2 * (2 * 4 * 16 + 2 * 2 * 16)
    assert planner.layer_activation_bytes(wide, one, "full") == \
        planner.layer_activation_bytes(base, one, "full")
    # tools/plan.py takes --kv-channels, and from a run's own arguments.
    cluster = ["--gpu", "h100-80g", "--num-gpus", "8", "--nvlink-bw", "450GB/s", "--net-bw",
               "400Gb/s", "--json", "--tp", "1", "--pp", "1", "--micro-batch-size", "1",
               "--recompute", "none", "--sequence-parallel", "false", "--zero", "false"]
    shape = ["--num-layers", "28", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--num-query-groups", "8", "--ffn-hidden-size", "3072", "--vocab-size", "151936",
             "--seq-length", "4096"]
    qwen3 = planner.ModelShape(28, 1024, 16, 8, 3072, 151936, 4096, kv_channels=128)
    want = planner.predict(qwen3, planner.Cluster(planner.GPUS["h100-80g"], 8, 8, 450e9, 50e9),
                           planner.Layout(1, 1, 8, 1, overlap_grad_reduce=False), 64)
    out = _plan(*cluster, *shape, "--kv-channels", "128", "--global-batch", "64",
                "--no-overlap-grad-reduce")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[0]["step_time_s"] == pytest.approx(want["step_time_s"])
    assert json.loads(out.stdout)[0]["memory_gb_per_gpu"] == pytest.approx(
        want["memory_gb_per_gpu"])


def test_uneven_stage_splits_the_search_tries():
    assert planner.stage_splits(8, 1, 1) == [(None, None)]
    assert planner.stage_splits(8, 2, 1) == [(None, None), (5, 3)]
    # Llama 3 405B's 126 layers over pp 16: no even split; ends of 6 to 8 around middles of 8.
    assert planner.stage_splits(126, 16, 1) == [(6, 8), (7, 7), (8, 6)]
    assert planner.stage_splits(126, 16, 2) == [(6, 8), (8, 6)]
    assert planner.stage_splits(126, 16, 4) == []
    # Every split is one braid's engine takes (stage_layers would raise otherwise).
    for layers, pp, v in [(128, 16, 1), (30, 4, 2), (126, 16, 2), (40, 3, 1), (24, 2, 2)]:
        for first, last in planner.stage_splits(layers, pp, v):
            ranges = _C.stage_layers(layers, pp, v, first, last)
            assert ranges[-1][-1][1] == layers


def test_uneven_stages_plan_a_model_whose_layers_do_not_divide():
    # Llama 3 405B on 16384 H100s: without uneven stages only pp 1, 2 (which do not fit) divide
    # its 126 layers; with them the best layout is the one Meta trained it with, TP 8 PP 16.
    model = planner.PRESETS["llama3-405b"]
    cluster = planner.Cluster(planner.GPUS["h100-80g"], 8, 16384, 450e9, 50e9)
    results, _ = planner.search(model, cluster, 2048, {"tp": 8, "micro_batch_size": 1,
                                                       "recompute": "selective"})
    assert results and (results[0]["tp"], results[0]["pp"]) == (8, 16)
    for r in results:
        assert sum(r["stage_layers"]) == 126 and r["memory_gb_per_gpu"] <= 80
        assert r["first_stage_layers"] is not None or r["last_stage_layers"] is not None \
            or 126 % r["pp"] == 0 or r["model_chunk_layers"] == list(  # the accounted split
                planner_split.accounted(126, r["pp"], r["virtual_stages"], True, True))
    # A fixed split is kept, and a split the layers do not allow is an error naming the rule.
    out = _plan("--model", "llama3-405b", "--gpu", "h100-80g", "--num-gpus", "16384",
                "--nvlink-bw", "450GB/s", "--net-bw", "400Gb/s", "--global-batch", "2048",
                "--pp", "16", "--decoder-first-pipeline-num-layers", "7",
                "--decoder-last-pipeline-num-layers", "7", "--json")
    assert out.returncode == 0, out.stderr
    assert {tuple(r["stage_layers"]) for r in json.loads(out.stdout)} == {(7,) + (8,) * 14 + (7,)}
    out = _plan("--model", "llama3-405b", "--gpu", "h100-80g", "--num-gpus", "16384",
                "--nvlink-bw", "450GB/s", "--net-bw", "400Gb/s", "--global-batch", "2048",
                "--pp", "16", "--decoder-last-pipeline-num-layers", "5")
    assert out.returncode == 1 and "leaves 121 layers, which must split evenly" in out.stderr


def test_a_lighter_last_stage_balances_a_heavy_head():
    # 8 layers and a 512k vocabulary: the LM head is worth several layers, so the last of 2
    # stages holding 3 layers to the first's 5 shortens the step, and a heavier one lengthens it.
    # The plan's memory follows the layers each rank holds: the last rank (the head's weights
    # and logits make it the fullest) keeps one microbatch's activations of one layer fewer.
    model = planner.ModelShape(8, 2048, 16, 16, 8192, 512 * 1024, 2048)
    cluster = planner.Cluster(planner.GPUS["h100-80g"], 8, 8, 450e9, 50e9)
    even = planner.predict(model, cluster, planner.Layout(4, 2, 1, 1), 16)
    light = planner.predict(model, cluster, planner.Layout(4, 2, 1, 1, last_stage_layers=3,
                                                           first_stage_layers=5), 16)
    assert even["stage_layers"] == [4, 4] and light["stage_layers"] == [5, 3]
    heavy = planner.predict(model, cluster, planner.Layout(4, 2, 1, 1, last_stage_layers=5,
                                                           first_stage_layers=3), 16)
    assert light["step_time_s"] < even["step_time_s"] < heavy["step_time_s"]
    layer = planner.layer_activation_bytes(model, planner.Layout(4, 2, 1, 1)) / planner.GB
    assert even["memory_parts_gb"]["activations"] - light["memory_parts_gb"]["activations"] \
        == pytest.approx(layer)


def test_recompute_methods_memory_time_and_hfu():
    # Megatron's --recompute-method per model chunk, as braid's GPTModel runs it: block k keeps
    # k inputs and the rest whole, recomputes k forwards; uniform N keeps one input per group.
    model = planner.PRESETS["llama2-70b"]
    lay = planner.Layout(8, 4, 2, 1, 1, "full", True, True)
    inp = planner.layer_activation_bytes(model, lay, "full")
    every = planner.layer_activation_bytes(model, lay, "none")
    assert planner.chunk_activation_bytes(model, lay, 20) == (20 * inp, every)
    uniform4 = dataclasses.replace(lay, recompute_num_layers=4)
    assert planner.chunk_activation_bytes(model, uniform4, 20) == (5 * inp, 4 * every)
    blocks = [dataclasses.replace(lay, recompute_method="block", recompute_num_layers=k)
              for k in (1, 5, 10, 20, 30)]
    assert [planner.chunk_activation_bytes(model, b, 20)[0] for b in blocks] == [
        k * inp + (20 - k) * every for k in (1, 5, 10, 20, 20)]
    runs = [planner.predict(model, H100, b, 64) for b in blocks]
    full = planner.predict(model, H100, lay, 64)
    steps = [r["step_time_s"] for r in runs]
    assert steps == sorted(steps) and steps[0] < steps[2] < steps[3] == full["step_time_s"]
    assert runs[4]["step_time_s"] == full["step_time_s"]  # more than the chunk has: all of it
    # HFU counts the recomputed forwards: k of each chunk's 20 (FLOPs: utilisation x time).
    def rerun(r):
        return (r["hfu"] - r["mfu"]) * r["step_time_s"]

    for k, r in zip((1, 5, 10, 20), runs):
        assert rerun(r) == pytest.approx(rerun(full) * k / 20)
    with pytest.raises(ValueError, match="needs recompute full"):
        planner.predict(model, H100, dataclasses.replace(blocks[0], recompute="selective"), 64)


def test_search_finds_the_fewest_recomputed_layers_that_fit():
    # Micro batch 8: neither none nor selective fits in 80 GB; full recomputation of every layer
    # does, and so does block with 9 of each chunk's 20 layers, which is faster.
    model = planner.PRESETS["llama2-70b"]
    fixed = {"tp": 8, "pp": 4, "micro_batch_size": 8, "virtual_stages": 1,
             "sequence_parallel": True, "zero": True}
    results, rejected = planner.search(model, H100, 64, fixed)
    assert rejected.get("out of memory", 0) > 0
    assert all(r["recompute"] == "full" and r["memory_gb_per_gpu"] <= 80 for r in results)
    even = [r for r in results if r["stage_layers"] == [20, 20, 20, 20]]
    best = even[0]
    assert best["recompute_method"] == "block"
    k = best["recompute_num_layers"]
    assert 1 < k < 20
    lay = planner.Layout(8, 4, 2, 8, 1, "full", True, True, recompute_method="block",
                         recompute_num_layers=k - 1)
    with pytest.raises(planner.DoesNotFit):  # one layer fewer no longer fits
        planner.predict(model, H100, lay, 64)
    uniform = [r for r in even if r["recompute_method"] == "uniform"]
    assert uniform and best["step_time_s"] < uniform[0]["step_time_s"]
    # Fixed on the command line: kept; and only with --recompute full.
    out = _plan("--model", "llama2-70b", "--gpu", "h100-80g", "--num-gpus", "64",
                "--nvlink-bw", "450GB/s", "--net-bw", "400Gb/s", "--global-batch", "64",
                "--tp", "8", "--pp", "4", "--recompute", "full", "--recompute-method", "block",
                "--recompute-num-layers", "12", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert rows and all((r["recompute_method"], r["recompute_num_layers"]) == ("block", 12)
                        for r in rows)
    out = _plan("--model", "llama2-70b", "--gpu", "h100-80g", "--num-gpus", "64",
                "--nvlink-bw", "450GB/s", "--net-bw", "400Gb/s", "--global-batch", "64",
                "--recompute-method", "block")
    assert out.returncode == 2 and "need --recompute full" in out.stderr


TRAINING = ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
            "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "28672",
            "--swiglu", "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm",
            "--position-embedding-type", "rope", "--disable-bias-linear", "--seq-length", "4096",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "31999",
            "--data-path", "/not/here/on/the/planning/machine", "--micro-batch-size", "1",
            "--global-batch-size", "64", "--train-iters", "1000",
            "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
            "--num-layers-per-virtual-pipeline-stage", "10", "--sequence-parallel",
            "--use-distributed-optimizer", "--overlap-grad-reduce",
            "--recompute-granularity", "selective", "--bf16", "--gpu-hour-price", "2.5"]
CLUSTER = ["--gpu", "h100-80g", "--num-gpus", "64", "--nvlink-bw", "450GB/s", "--net-bw",
           "400Gb/s"]


def test_plan_from_the_runs_own_training_arguments():
    # pretrain_gpt.py's arguments after --: the prediction for exactly that run (its layout,
    # even stages, recomputation, overlap flags, batch, iterations and price) on this cluster.
    out = _plan(*CLUSTER, "--json", "--", *TRAINING)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 1
    model = planner.ModelShape(80, 8192, 64, 8, 28672, 32000, 4096)  # NullTokenizer: N + 1
    cluster = planner.Cluster(planner.GPUS["h100-80g"], 8, 64, 450e9, 50e9)
    lay = planner.Layout(8, 4, 2, 1, 2, "selective", True, True, overlap_grad_reduce=True,
                         overlap_param_gather=False)
    want = planner.predict(model, cluster, lay, 64)
    assert rows[0]["step_time_s"] == pytest.approx(want["step_time_s"], rel=1e-12)
    assert rows[0]["stage_layers"] == [20, 20, 20, 20]
    # Its --kv-channels: heads twice hidden / heads wide.
    out = _plan(*CLUSTER, "--json", "--", *TRAINING, "--kv-channels", "256")
    assert out.returncode == 0, out.stderr
    wide = planner.predict(dataclasses.replace(model, kv_channels=256), cluster, lay, 64)
    assert json.loads(out.stdout)[0]["step_time_s"] == pytest.approx(wide["step_time_s"])
    assert wide["step_time_s"] > want["step_time_s"]
    tokens = 1000 * 64 * 4096
    assert rows[0]["days_to_train"] == pytest.approx(tokens / want["tokens_per_s"] / 86400)
    assert rows[0]["cost"] == pytest.approx(rows[0]["gpu_hours"] * 2.5)
    # The same samples with Megatron's --rampup-batch-size 16 16 6400: the run's tokens, the
    # ramp's steps each at its own batch's step time (16, 32 and 48 samples: 8, 16 and 24
    # microbatches per replica, more of the step in the pipeline's bubble), the rest at the
    # full batch's rate.
    ramped = [x for x in TRAINING if x not in ("--train-iters", "1000")]
    out = _plan(*CLUSTER, "--json", "--", *ramped, "--train-samples", "64010",
                "--rampup-batch-size", "16", "16", "6400")
    assert out.returncode == 0, out.stderr
    ramp = BatchLayout(1, 64, dp_size=2, rampup_batch_size=(16, 16, 6400))
    samples = ramp.samples_after(ramp.steps_between(0, 64010))  # whole steps only
    assert 64010 - 64 < samples <= 64010
    phases = plan.rampup_phases(ramp, samples)
    assert [batch for batch, _ in phases] == [16, 32, 48]
    assert sum(batch * steps for batch, steps in phases) == ramp.samples_after(
        sum(steps for _, steps in phases))  # the steps before the first of 64
    assert ramp.global_batch_size_at(sum(batch * steps for batch, steps in phases)) == 64
    ramp_s = sum(steps * planner.predict(model, cluster, lay, batch)["step_time_s"]
                 for batch, steps in phases)
    ramp_samples = sum(batch * steps for batch, steps in phases)
    slower = [planner.predict(model, cluster, lay, batch)["tokens_per_s"] for batch, _ in phases]
    assert max(slower) < want["tokens_per_s"]  # smaller batches: a larger share of bubble
    days = (ramp_s + (samples - ramp_samples) * 4096 / want["tokens_per_s"]) / 86400
    assert json.loads(out.stdout)[0]["days_to_train"] == pytest.approx(days, rel=1e-12)
    assert days > samples * 4096 / want["tokens_per_s"] / 86400
    # --search: every layout for that model and batch.
    out = _plan(*CLUSTER, "--json", "--search", "--", *TRAINING)
    assert out.returncode == 0 and len(json.loads(out.stdout)) > 100, out.stderr
    # The tokenizer files of a real launch script need not be here either: --vocab-size stands.
    gpt2 = [x for x in TRAINING if x not in ("NullTokenizer", "31999")]
    gpt2[gpt2.index("--tokenizer-type") + 1:gpt2.index("--tokenizer-type") + 1] = [
        "GPT2BPETokenizer", "--vocab-file", "/not/here/vocab.json", "--merge-file",
        "/not/here/merges.txt"]
    gpt2.remove("--vocab-size")
    out = _plan(*CLUSTER, "--json", "--", *gpt2, "--vocab-size", "32000")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[0]["step_time_s"] == pytest.approx(want["step_time_s"])
    out = _plan(*CLUSTER, "--", *gpt2)
    assert out.returncode == 2 and "(planning where it is not: give --vocab-size)" in out.stderr
    out = _plan(*CLUSTER, "--tp", "4", "--", *TRAINING)
    assert out.returncode == 2 and "--tp: with training arguments after --" in out.stderr
    out = _plan(*CLUSTER, "--", *TRAINING, "--tensor-model-parallel-size", "3")
    assert out.returncode == 2 and "the training arguments: the job's 64 processes" in out.stderr


@pytest.mark.skipif(not os.path.exists(CSV), reason="../shared/published_runs.csv not present")
def test_published_runs_within_ten_percent():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import planner_validation
    rows = planner_validation.validate(CSV)
    assert len(rows) >= 5
    for r in rows:
        assert abs(r["error"]) <= planner_validation.TOLERANCE, r
    # like with like: the Narayanan rows were run and counted with full recomputation
    assert all(r["recompute"] == "full" for r in rows if r["accounting"].startswith("eq3"))


def test_context_parallelism_splits_each_sequence_over_its_ranks():
    # Llama 3 8B at 32k tokens on 64 H100s: each CP rank computes and keeps 1/cp of every
    # sequence, gathers the keys and values per layer, and the gradients (and ZeRO's shards)
    # span dp x cp.
    model = dataclasses.replace(planner.PRESETS["llama3-8b"], seq_length=32768)
    one = planner.Layout(2, 1, 32, 1, recompute="selective", sequence_parallel=True, zero=True)
    cp4 = dataclasses.replace(one, dp=8, cp=4)
    for rec in ("none", "selective", "full"):
        assert planner.layer_activation_bytes(model, cp4, rec) == pytest.approx(
            planner.layer_activation_bytes(model, one, rec) / 4)
    lc_one, lc_cp = planner.layer_cost(model, H100, one), planner.layer_cost(model, H100, cp4)
    assert lc_cp.model_flops == pytest.approx(lc_one.model_flops / 4)
    no_comm = planner.layer_cost(model, dataclasses.replace(H100, nvlink_bw=1e30, net_bw=1e30),
                                 cp4)
    assert lc_cp.forward > no_comm.forward and lc_cp.backward > no_comm.backward
    with pytest.raises(planner.DoesNotFit):  # 32k tokens' activations on one TP pair
        planner.predict(model, H100, one, 64)
    r_one = planner.predict(model, H100, one, 64, baseline=False)  # timed all the same
    r_cp = planner.predict(model, H100, cp4, 64)
    assert (r_cp["tp"], r_cp["cp"], r_cp["pp"], r_cp["dp"]) == (2, 4, 1, 8)
    assert r_cp["memory_parts_gb"]["optimizer"] == pytest.approx(
        r_one["memory_parts_gb"]["optimizer"])  # sharded over dp x cp = 32 both
    assert r_cp["memory_parts_gb"]["activations"] < r_one["memory_parts_gb"]["activations"] / 3
    # The same model FLOPs per step, whoever computes them.
    assert r_cp["mfu"] * r_cp["step_time_s"] == pytest.approx(r_one["mfu"] * r_one["step_time_s"])
    with pytest.raises(ValueError, match="tp 2 x cp 4 x pp 1 x dp 32 = 256 != 64 GPUs"):
        planner.check_layout(model, H100, dataclasses.replace(one, cp=4), 64)
    with pytest.raises(ValueError, match=r"cp 4: the sequence \(4100\)"):
        planner.check_layout(dataclasses.replace(model, seq_length=4100), H100, cp4, 64)
    # The search tries cp where each sequence splits into chunks of 2048 tokens or more; at
    # tp 2 without pipelining only those with cp > 1 fit.
    results, _ = planner.search(model, H100, 64, {"tp": 2, "pp": 1, "recompute": "selective",
                                                  "micro_batch_size": 1})
    assert {r["cp"] for r in results} == {2, 4, 8}
    fixed, _ = planner.search(model, H100, 64, {"tp": 2, "pp": 1, "cp": 4})
    assert fixed and {r["cp"] for r in fixed} == {4}
    # A run's own --context-parallel-size.
    out = _plan(*CLUSTER, "--json", "--", *TRAINING, "--context-parallel-size", "2")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)[0]
    assert (row["tp"], row["cp"], row["pp"], row["dp"]) == (8, 2, 4, 1)
    cluster = planner.Cluster(planner.GPUS["h100-80g"], 8, 64, 450e9, 50e9)
    lay = planner.Layout(8, 4, 1, 1, 2, "selective", True, True, overlap_grad_reduce=True,
                         overlap_param_gather=False, cp=2)
    want = planner.predict(planner.ModelShape(80, 8192, 64, 8, 28672, 32000, 4096), cluster,
                           lay, 64)
    assert row["step_time_s"] == pytest.approx(want["step_time_s"], rel=1e-12)


def test_sliding_window_attention_costs_and_counts_the_window():
    # Model FLOPs: a windowed layer's attention over min(s, W + 1) keys per query (as
    # Megatron-Bridge counts it), the rest unchanged; from a TransformerConfig and a ModelShape
    # alike. Executed keys (the planner's time): min(i + 1, W + 1) for the query at position i.
    import braid
    from braid import flops

    s, w = 32, 7
    cfg = braid.TransformerConfig.preset("llama-tiny")  # 2 layers, hidden 64, 4 heads of 16
    base = flops.forward_flops_per_token(cfg, s)
    cfg.window_size, cfg.window_layers = w, [1, 0]
    assert flops.forward_flops_per_token(cfg, s) == base - 4 * 64 * (s - (w + 1))
    cfg.window_layers = []
    assert flops.forward_flops_per_token(cfg, s) == base - 2 * 4 * 64 * (s - (w + 1))
    cfg.window_size = 100  # longer than the sequence: no change
    assert flops.forward_flops_per_token(cfg, s) == base
    shape = planner.ModelShape(2, 64, 4, 2, 192, 256, s, window_size=w, window_layers=(1, 0))
    cfg.window_size, cfg.window_layers = w, [1, 0]
    assert flops.forward_flops_per_token(shape, s) == flops.forward_flops_per_token(cfg, s)
    windowed = sum(min(i + 1, w + 1) for i in range(s)) / s
    assert shape.executed_keys() == pytest.approx((s / 2 + windowed) / 2)
    # Mistral 7B v0.1 at 32K tokens: every layer's window of 4096 leaves attention about a
    # quarter of its causal work (3.8K keys a query against 16K), and the step a fifth shorter.
    mistral = planner.ModelShape(32, 4096, 32, 8, 14336, 32000, 32768)
    cluster = planner.Cluster(planner.GPUS["h100-80g"], 8, 8, 450e9, 50e9)
    lay = planner.Layout(8, 1, 1, 1, 1, "selective", True, False)
    full = planner.predict(mistral, cluster, lay, 8)
    swa = planner.predict(dataclasses.replace(mistral, window_size=4095), cluster, lay, 8)
    assert mistral.executed_keys() / dataclasses.replace(
        mistral, window_size=4095).executed_keys() == pytest.approx(4.27, rel=0.01)
    assert swa["step_time_s"] < 0.85 * full["step_time_s"]
    assert swa["mfu"] < full["mfu"]  # fewer model FLOPs, counted as such
    # Per layer: Qwen2's pattern (full layers first, windowed after) loads the first pipeline
    # stage more than an alternating one with as many windowed layers does; the simulated step
    # shows it. Full recomputation reruns each layer at its own cost (HFU: the layers' forward
    # once more).
    lay = planner.Layout(4, 2, 1, 1, 1, "full", True, False)
    first_full = dataclasses.replace(mistral, window_size=4095, window_layers=(0,) * 16 + (1,) * 16)
    alternating = dataclasses.replace(first_full, window_layers=(0, 1) * 16)
    assert first_full.executed_keys() == alternating.executed_keys()
    uneven, even = (planner.predict(x, cluster, lay, 8) for x in (first_full, alternating))
    assert uneven["step_time_s"] > 1.05 * even["step_time_s"]
    assert uneven["mfu"] * uneven["step_time_s"] == pytest.approx(  # the same model FLOPs
        even["mfu"] * even["step_time_s"], rel=1e-12)
    layers_only = flops.forward_flops_per_token(dataclasses.replace(first_full, vocab_size=0),
                                                first_full.seq_length)
    whole = flops.forward_flops_per_token(first_full, first_full.seq_length)
    assert uneven["hfu"] / uneven["mfu"] - 1 == pytest.approx(layers_only / (3 * whole),
                                                              rel=1e-9)
    # tools/plan.py takes the window as pretrain_gpt.py does, directly or from a run's flags.
    args = ["--gpu", "h100-80g", "--num-gpus", "8", "--nvlink-bw", "450GB/s", "--net-bw",
            "400Gb/s", "--json", "--tp", "8", "--pp", "1", "--micro-batch-size", "1",
            "--recompute", "selective", "--sequence-parallel", "true", "--zero", "false",
            "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
            "--num-query-groups", "8", "--ffn-hidden-size", "14336", "--vocab-size", "32000",
            "--seq-length", "32768", "--global-batch", "8"]
    out = _plan(*args, "--window-size", "4095,0")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[0]["step_time_s"] == pytest.approx(swa["step_time_s"], rel=0.02)
    out = _plan(*args, "--window-attn-skip-freq", "2")
    assert out.returncode == 2 and "--window-attn-skip-freq needs --window-size" in out.stderr
    out = _plan(*CLUSTER, "--json", "--", *TRAINING, "--window-size", "1023,0",
                "--window-attn-skip-freq", "2")
    assert out.returncode == 0, out.stderr
    model = planner.ModelShape(80, 8192, 64, 8, 28672, 32000, 4096, window_size=1023,
                               window_layers=(1, 0) * 40)
    lay = planner.Layout(8, 4, 2, 1, 2, "selective", True, True, overlap_grad_reduce=True,
                         overlap_param_gather=False)
    want = planner.predict(model, planner.Cluster(planner.GPUS["h100-80g"], 8, 64, 450e9, 50e9),
                           lay, 64)
    assert json.loads(out.stdout)[0]["step_time_s"] == pytest.approx(want["step_time_s"],
                                                                      rel=1e-12)
    out = _plan(*CLUSTER, "--window-size", "1023,0", "--", *TRAINING)
    assert out.returncode == 2 and "--window-size: with training arguments after --" in out.stderr
    out = _plan(*args, "--window-size", "4095,0", "--window-attn-skip-freq", "[1,0]")
    assert out.returncode == 2 and "gives 2 layers; the model has --num-layers 32" in out.stderr
