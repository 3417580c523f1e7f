"""The flags an audit of Megatron-LM's megatron/training/arguments.py added
(braid.megatron_flags_audit): each no-effect flag parses and the run's notes name it with its
reason, each refused flag is an error with its reason, both are in docs/arguments.md's right
table, the flags braid takes at its own value only are noted at it and refused at another, and
--recompute-activations is Megatron's --recompute-granularity selective (and
--persistent-save-interval its other spelling of --save-interval). The lists
come from braid.megatron_flags; a hand-written sample keeps the test from passing on empty
lists."""

import os
import re
import sys

import pytest

REPO = os.path.join(os.path.dirname(__file__), "..", "..", "..")
sys.path.insert(0, os.path.join(REPO, "python"))

from braid.arguments import ArgumentError, parse_args  # noqa: E402
from braid.megatron_flags import NO_EFFECT, UNSUPPORTED, no_effect_given  # noqa: E402
from braid.megatron_flags_audit import (AUDIT_NO_EFFECT, AUDIT_ONLY_VALUE,  # noqa: E402
                                        AUDIT_UNSUPPORTED)

BASE = ["--vocab-size", "300", "--mock-data", "--seq-length", "32", "--num-layers", "2",
        "--hidden-size", "64", "--num-attention-heads", "4"]

# Written out by hand: (flag, what it takes, a phrase of its reason).
NO_EFFECT_SAMPLE = [("--use-dist-ckpt", False, "see --ckpt-format"),
                    ("--dist-ckpt-format", True, "deprecated in Megatron"),
                    ("--rerun-mode", True, "rerun engine"),
                    ("--log-straggler", False, "straggler detector"),
                    ("--no-overlap-p2p-communication", False, "as braid always does"),
                    ("--high-priority-stream-groups", "+", "default priority"),
                    ("--distribute-saved-activations", False, "tensor-parallel ranks"),
                    ("--deterministic-mode", False, "deterministic already")]
UNSUPPORTED_SAMPLE = [("--apply-residual-connection-post-layernorm", "pre-norm"),
                      ("--fp32-residual-connection", "activations' dtype"),
                      ("--init-method-xavier-uniform", "--init-method-std"),
                      ("--result-rejected-tracker-filename", "give the iterations to --iterations-to-skip"),
                      ("--checkpoint-activations", "--recompute-activations")]


CHECKED = {"--hierarchical-context-parallel-sizes": ["1", "1"]}  # (their product: cp 1)


def argv_of(flag, takes_value):
    return [flag] + CHECKED.get(flag, {False: [], True: ["7"], "+": ["dp", "tp"]}[takes_value])


def test_the_audit_is_merged_into_megatron_flags_and_holds_the_sample():
    assert len(AUDIT_NO_EFFECT) >= 60 and len(AUDIT_UNSUPPORTED) >= 40
    assert set(AUDIT_NO_EFFECT) <= set(NO_EFFECT) and set(AUDIT_UNSUPPORTED) <= set(UNSUPPORTED)
    assert not set(NO_EFFECT) & set(UNSUPPORTED)
    for flag, takes_value, why in NO_EFFECT_SAMPLE:
        assert NO_EFFECT[flag][0] == takes_value and why in NO_EFFECT[flag][1], flag
    for flag, why in UNSUPPORTED_SAMPLE:
        assert why in UNSUPPORTED[flag], flag


def test_every_no_effect_flag_parses_and_the_notes_say_why():
    argv = [arg for flag, (takes, _) in AUDIT_NO_EFFECT.items() for arg in argv_of(flag, takes)]
    notes = no_effect_given(parse_args([*BASE, *argv], 1))
    expected = []
    for flag, (takes, why) in AUDIT_NO_EFFECT.items():
        given = " ".join(argv_of(flag, takes))
        expected.append(f"braid: {given} has no effect: {why}")
    assert notes == expected
    # The hand-written sample, each alone: only its own note.
    for flag, takes, why in NO_EFFECT_SAMPLE:
        notes = no_effect_given(parse_args([*BASE, *argv_of(flag, takes)], 1))
        assert len(notes) == 1 and notes[0].startswith(f"braid: {flag}") and why in notes[0]
    assert no_effect_given(parse_args(BASE, 1)) == []


@pytest.mark.parametrize("flag", sorted(AUDIT_UNSUPPORTED))
def test_every_refused_flag_is_refused_with_its_reason(flag):
    message = f"{flag} is not supported by braid: {AUDIT_UNSUPPORTED[flag]}"
    with pytest.raises(ArgumentError, match=f"^{re.escape(message)}$"):
        parse_args([*BASE, flag, "1"], 1)


def test_refused_sample():
    for flag, why in UNSUPPORTED_SAMPLE:
        with pytest.raises(ArgumentError, match=rf"{flag} is not supported by braid: .*{why}"):
            parse_args([*BASE, flag, "single"], 1)


def test_docs_list_each_flag_in_its_table():
    with open(os.path.join(REPO, "docs", "arguments.md"), encoding="utf-8") as f:
        text = f.read()
    no_effect = text.split("## Accepted from Megatron scripts, with no effect")[1]
    no_effect, refused = no_effect.split("## Megatron arguments braid refuses")

    def rows(section):
        return set(re.findall(r"^\| `(--[a-z0-9_-]+)` \|", section, re.MULTILINE))

    assert set(AUDIT_NO_EFFECT) | set(AUDIT_ONLY_VALUE) <= rows(no_effect)
    assert set(AUDIT_UNSUPPORTED) <= rows(refused)
    assert "--recompute-activations" in rows(text.split("## Tokenizer")[0])
    assert {f for f, _, _ in NO_EFFECT_SAMPLE} <= rows(no_effect)


@pytest.mark.parametrize("flag, braids, other", [
    ("--dataloader-type", "single", "cyclic"),
    ("--mid-level-dataset-surplus", "0.0050", "0.01"),
    ("--microbatch-group-size-per-virtual-pipeline-stage", "2", "4")])
def test_flags_at_braids_value_only(flag, braids, other):
    assert set(AUDIT_ONLY_VALUE) == {"--dataloader-type", "--mid-level-dataset-surplus",
                                     "--microbatch-group-size-per-virtual-pipeline-stage"}
    pipeline = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                "1"]
    notes = no_effect_given(parse_args([*BASE, *pipeline, flag, braids], 2))
    assert notes == [f"braid: {flag} {braids} has no effect: it asks for what braid does: "
                     f"{AUDIT_ONLY_VALUE[flag][1]}"]
    with pytest.raises(ArgumentError, match=rf"^{re.escape(flag)} {other} is not supported by "
                       r"braid: .* \(give .*, or drop the flag\)$"):
        parse_args([*BASE, *pipeline, flag, other], 2)


def test_persistent_save_interval_is_save_interval(tmp_path):
    a = parse_args([*BASE, "--save", str(tmp_path), "--persistent-save-interval", "7"], 1)
    assert a.save_interval == 7


def test_recompute_activations_is_selective_granularity():
    assert parse_args(BASE, 1).recompute_granularity is None
    a = parse_args([*BASE, "--recompute-activations"], 1)
    assert a.recompute_granularity == "selective"
    a = parse_args([*BASE, "--recompute-activations", "--recompute-granularity", "selective",
                    "--recompute-modules", "core_attn", "layernorm"], 1)
    assert a.recompute_granularity == "selective"
    # Megatron would silently drop full for selective; braid refuses the pair.
    with pytest.raises(ArgumentError, match="--recompute-activations is Megatron's shorthand "
                       "for --recompute-granularity selective"):
        parse_args([*BASE, "--recompute-activations", "--recompute-granularity", "full"], 1)
    # Selective takes no --recompute-method, as in Megatron.
    with pytest.raises(ArgumentError, match="--recompute-method uniform needs "
                       "--recompute-granularity full"):
        parse_args([*BASE, "--recompute-activations", "--recompute-method", "uniform"], 1)
