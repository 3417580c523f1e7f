"""pretrain_gpt.py's pipeline arguments: Megatron's virtual stages, uneven first and last stages,
--account-for-embedding/loss-in-pipeline-split and --pipeline-model-parallel-layout, checked
against each other and turned into what engine::ParallelConfig takes: the virtual stages per
rank and, where the split is not Megatron's even one, every model chunk's layer count."""

from __future__ import annotations

import argparse
import re
from typing import Callable

LAYOUT_HELP = ("every pipeline stage's layers, Megatron's syntax: stages separated by '|', "
               "E the embedding (first stage), t a transformer layer, m an MTP depth (last "
               "stage), L the loss (last stage), 'x*n' and '(...)*n' repeat, commas are "
               "ignored; pp × virtual stages stages, model chunk by model chunk: "
               "\"Et*3|(tt|)*6ttmL\"")


def add_arguments(g, pos_int):
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=pos_int, default=None)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=pos_int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=pos_int, default=None,
                   help="layers of the first pipeline stage (uneven stages; the other stages "
                        "split the rest evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=pos_int, default=None,
                   help="layers of the last pipeline stage, which also runs the LM head and loss")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as a layer when splitting: the first model chunk "
                        "holds one layer fewer")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the LM head and loss as a layer when splitting: the last model "
                        "chunk holds one layer fewer")
    g.add_argument("--pipeline-model-parallel-layout", default=None, help=LAYOUT_HELP)


def parse_layout(text: str) -> list[str]:
    """A --pipeline-model-parallel-layout string -> its stages, each a string of E, t, m and L
    (Megatron's grammar: '|' between stages, 'x*n' and '(...)*n' repeated, commas ignored).
    ValueError naming what is wrong."""
    s = text.replace(",", "").replace(" ", "")
    while True:  # innermost groups first
        expanded = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
        if expanded == s:
            break
        s = expanded
    s = re.sub(r"([EtmL])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    bad = sorted(set(re.sub(r"[EtmL|]", "", s)))
    if bad:
        raise ValueError(f"{text!r}: unexpected {' '.join(repr(c) for c in bad)} (a stage holds "
                         "E, t, m and L; '|' separates stages; 'x*n' and '(...)*n' repeat)")
    return s.split("|")


def layout_chunk_layers(text: str, pp: int, num_layers: int,
                        mtp_num_layers: int) -> tuple[list[int], int]:
    """--pipeline-model-parallel-layout -> (every model chunk's transformer layers, virtual
    stages per rank). ValueError as Megatron checks the layout, and where braid places a part
    differently: its MTP depths run in the last stage, beside the loss."""
    stages = parse_layout(text)
    where = f"--pipeline-model-parallel-layout {text!r}"
    if len(stages) % pp:
        raise ValueError(f"{where} has {len(stages)} stages, not a multiple of "
                         f"--pipeline-model-parallel-size {pp}")
    flat = "".join(stages)
    if not stages[0].startswith("E") or flat.count("E") != 1:
        raise ValueError(f"{where}: the embedding (E) must come first, once, in the first stage")
    if not stages[-1].endswith("L") or flat.count("L") != 1:
        raise ValueError(f"{where}: the loss (L) must come last, once, in the last stage")
    if flat.count("t") != num_layers:
        raise ValueError(f"{where} places {flat.count('t')} transformer layers (t); --num-layers "
                         f"is {num_layers}")
    if flat.count("m") != mtp_num_layers:
        raise ValueError(f"{where} places {flat.count('m')} MTP depths (m); --mtp-num-layers is "
                         f"{mtp_num_layers}")
    if "m" in "".join(stages[:-1]) or "t" in stages[-1].partition("m")[2]:
        raise ValueError(f"{where}: braid runs the MTP depths (m) in the last stage, after its "
                         "transformer layers and beside the loss (L), not in a stage of their own "
                         "(Megatron's standalone MTP)")
    return [stage.count("t") for stage in stages], len(stages) // pp


def accounted_chunk_layers(num_layers: int, pp: int, virtual_stages: int, embedding: bool,
                           loss: bool) -> list[int]:
    """Megatron's --account-for-embedding/loss-in-pipeline-split: the embedding and the loss
    count as one layer each, the layers split evenly over the pp × virtual stages model chunks,
    the first chunk holding one layer fewer for the embedding and the last for the loss.
    ValueError where they do not divide."""
    chunks = pp * virtual_stages
    total = num_layers + embedding + loss
    if total % chunks:
        parts = " + 1 (the embedding)" * embedding + " + 1 (the loss)" * loss
        raise ValueError(f"--num-layers {num_layers}{parts} = {total} is not divisible by the "
                         f"{chunks} model chunks (--pipeline-model-parallel-size {pp} × "
                         f"{virtual_stages} virtual stages)")
    counts = [total // chunks] * chunks
    counts[0] -= embedding
    counts[-1] -= loss
    return counts


def validate(a: argparse.Namespace, check: Callable[[bool, str], None], pp: int):
    """Sets a.virtual_stages and a.model_chunk_layers (every model chunk's layers; [] for
    Megatron's even split or its uneven first and last stages) after checking the pipeline
    arguments against each other. check(ok, message) raises the argument error."""
    first, last = a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers
    uneven = first is not None or last is not None
    accounted = a.account_for_embedding_in_pipeline_split or a.account_for_loss_in_pipeline_split
    layout = a.pipeline_model_parallel_layout
    a.model_chunk_layers = []
    a.virtual_stages = 1
    for flag, given in (("--pipeline-model-parallel-layout", layout is not None),
                        ("--account-for-embedding/loss-in-pipeline-split", accounted)):
        check(not given or not uneven, f"{flag} excludes --decoder-first-pipeline-num-layers / "
              "--decoder-last-pipeline-num-layers")
    check(layout is None or not accounted, "--pipeline-model-parallel-layout places the "
          "embedding and the loss itself: no --account-for-embedding/loss-in-pipeline-split")
    if a.num_layers_per_virtual_pipeline_stage and a.num_virtual_stages_per_pipeline_rank:
        check(False, "give --num-layers-per-virtual-pipeline-stage or "
                     "--num-virtual-stages-per-pipeline-rank, not both")
    if layout is not None:
        check(not a.num_layers_per_virtual_pipeline_stage
              and not a.num_virtual_stages_per_pipeline_rank,
              "--pipeline-model-parallel-layout gives the virtual stages (its stages / "
              "--pipeline-model-parallel-size): no --num-layers-per-virtual-pipeline-stage or "
              "--num-virtual-stages-per-pipeline-rank")
        try:
            a.model_chunk_layers, a.virtual_stages = layout_chunk_layers(
                layout, pp, a.num_layers, a.mtp_num_layers or 0)
        except ValueError as e:
            check(False, str(e))
        return
    check(uneven or accounted or a.num_layers % pp == 0,
          f"--num-layers {a.num_layers} is not divisible by --pipeline-model-parallel-size {pp} "
          "(uneven stages: --decoder-first-pipeline-num-layers / "
          "--decoder-last-pipeline-num-layers)")
    if a.num_layers_per_virtual_pipeline_stage:
        check(not uneven and not accounted,
              "--num-layers-per-virtual-pipeline-stage assumes stages of equal size; with "
              "--decoder-first/last-pipeline-num-layers or --account-for-embedding/loss-in-"
              "pipeline-split give --num-virtual-stages-per-pipeline-rank")
        per_rank = a.num_layers // pp
        check(per_rank % a.num_layers_per_virtual_pipeline_stage == 0,
              f"--num-layers-per-virtual-pipeline-stage {a.num_layers_per_virtual_pipeline_stage}"
              f" does not divide the {per_rank} layers of each pipeline rank")
        a.virtual_stages = per_rank // a.num_layers_per_virtual_pipeline_stage
    elif a.num_virtual_stages_per_pipeline_rank:
        a.virtual_stages = a.num_virtual_stages_per_pipeline_rank
        check(uneven or accounted or (a.num_layers // pp) % a.virtual_stages == 0,
              f"--num-virtual-stages-per-pipeline-rank {a.virtual_stages} does not divide the "
              f"{a.num_layers // pp} layers of each pipeline rank")
    if accounted:
        check(pp > 1, "--account-for-embedding/loss-in-pipeline-split needs "
                      "--pipeline-model-parallel-size > 1")
        try:
            a.model_chunk_layers = accounted_chunk_layers(
                a.num_layers, pp, a.virtual_stages, a.account_for_embedding_in_pipeline_split,
                a.account_for_loss_in_pipeline_split)
        except ValueError as e:
            check(False, str(e))
