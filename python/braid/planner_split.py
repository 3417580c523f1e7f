"""The pipeline splits the planner (braid.planner) tries for pp stages of v model chunks each, as
braid's engine splits the layers (engine::stage_layers, docs/pipeline.md "Layer split"): the even
split, uneven first and last stages (planner_inputs.stage_splits, Megatron's
--decoder-first/last-pipeline-num-layers), Megatron's --account-for-embedding/loss-in-pipeline-
split and a --pipeline-model-parallel-layout's model chunks (braid.pipeline_args). A split is
(first, last, model chunk layers), as planner_inputs.Layout takes them. And the schedule the
planner simulates a layout's pipeline with, and the activations it keeps in flight."""

from __future__ import annotations

import functools

from braid import _C
from braid import pipeline_args
from braid.planner_inputs import stage_splits


def chunk_layers(num_layers: int, pp: int, v: int, first=None, last=None, chunks=()) -> tuple:
    """Every model chunk's layers, model chunk c·pp + r being chunk c of rank r, of a split as
    braid's engine makes it (ValueError naming the rule where it cannot)."""
    ranges = _C.stage_layers(num_layers, pp, v, first, last, list(chunks))
    return tuple(ranges[r][c][1] - ranges[r][c][0] for c in range(v) for r in range(pp))


def accounted(num_layers: int, pp: int, v: int, embedding: bool, loss: bool) -> tuple:
    """The --account-for-embedding/loss-in-pipeline-split split's model chunk layers
    (pipeline_args.accounted_chunk_layers; ValueError with its message where it does not
    divide, or at pp 1)."""
    if pp == 1:
        raise ValueError("--account-for-embedding/loss-in-pipeline-split needs "
                         "--pipeline-model-parallel-size > 1")
    return tuple(pipeline_args.accounted_chunk_layers(num_layers, pp, v, embedding, loss))


@functools.cache
def searched(num_layers: int, pp: int, v: int) -> tuple:
    """The splits the search tries: stage_splits' (even, lighter first and last stages), then
    the accounted split - the embedding and the loss a layer each - where it divides and is
    none of those (at v 1 it is one of them unless its first or last stage holds no layer)."""
    out = [(first, last, ()) for first, last in stage_splits(num_layers, pp, v)]
    try:
        chunks = accounted(num_layers, pp, v, True, True)
    except ValueError:
        return tuple(out)
    if all(chunk_layers(num_layers, pp, v, f, l) != chunks for f, l, _ in out):
        out.append((None, None, chunks))
    return tuple(out)


def splits(model, pp: int, v: int, fixed: dict) -> tuple[list, str]:
    """The splits to try, and why there is none when the list is empty: a fixed layout's model
    chunks (fixed["model_chunk_layers"]); the accounted split of fixed["account_for_embedding"]
    / ["account_for_loss"]; the fixed first / last stage sizes; the even split alone with
    fixed["even_stages"] (a run's own arguments); else searched()."""
    n = model.num_layers
    if fixed.get("model_chunk_layers"):
        chunks = tuple(fixed["model_chunk_layers"])
        if len(chunks) != pp * v:
            return [], (f"the layout's {len(chunks)} model chunks are not pp {pp} x "
                        f"v {v}")
        return [(None, None, chunks)], ""
    if fixed.get("account_for_embedding") or fixed.get("account_for_loss"):
        try:
            return [(None, None, accounted(n, pp, v, bool(fixed.get("account_for_embedding")),
                                           bool(fixed.get("account_for_loss"))))], ""
        except ValueError as e:
            return [], str(e)
    if "first_stage_layers" in fixed or "last_stage_layers" in fixed:
        return [(fixed.get("first_stage_layers"), fixed.get("last_stage_layers"), ())], ""
    if fixed.get("even_stages"):
        return [(None, None, ())], ""
    return list(searched(n, pp, v)), (f"{n} layers do not split over pp {pp} x v {v}, evenly "
                                      "or with lighter first/last stages")


@functools.lru_cache(maxsize=256)
def schedule(pp: int, microbatches: int, virtual_stages: int):
    """braid's schedule for the layout (shared: the search times thousands of layouts on a few
    schedules, and a schedule is never modified)."""
    if pp == 1:
        return _C.make_1f1b(1, microbatches)
    return _C.make_interleaved_1f1b(pp, microbatches, virtual_stages)


def in_flight(lay, microbatches: int):
    """(chunk, microbatch) activations each rank keeps at most under braid's schedule."""
    if lay.pp == 1:
        return [1]
    if lay.virtual_stages == 1:
        return [min(lay.pp - r, microbatches) for r in range(lay.pp)]
    return [min(_C.interleaved_warmup_steps(lay.pp, microbatches, lay.virtual_stages, r) + 1,
                lay.virtual_stages * microbatches) for r in range(lay.pp)]


def peak_kept(schedule, rank: int, kept: list) -> float:
    """The most bytes rank `rank` keeps at once under `schedule`, each forward of chunk c
    keeping kept[c] until its backward."""
    now = peak = 0.0
    for action in schedule.ranks[rank]:
        if action.kind == _C.ActionKind.forward:
            now += kept[action.chunk]
            peak = max(peak, now)
        elif action.kind == _C.ActionKind.backward:
            now -= kept[action.chunk]
    return peak
