"""Megatron-LM arguments braid does not take as Megatron means them: those it refuses, with the
reason (UNSUPPORTED), and those it accepts with no effect because they choose an
implementation where braid has its own, or ask for what braid always does (NO_EFFECT; the
run's log names each one given). docs/arguments.md lists both. The entries an audit of
Megatron-LM's arguments.py added live in braid.megatron_flags_audit and are merged in here."""

from __future__ import annotations

import argparse

from braid.megatron_flags_audit import AUDIT_NO_EFFECT, AUDIT_ONLY_VALUE, AUDIT_UNSUPPORTED


# Megatron arguments braid refuses, with the reason. Anything else unknown is refused as well
# ("not a braid argument"); these only get a better message.
UNSUPPORTED = {
    "--fp16": "braid has no float16 kernels; use --bf16 (CUDA) or the default float32",
    "--fp8-format": "braid has no FP8 kernels",
    "--fp8-recipe": "braid has no FP8 kernels",
    "--fp8-amax-history-len": "braid has no FP8 kernels",
    "--fp8-amax-compute-algo": "braid has no FP8 kernels",
    "--fp8-param-gather": "braid has no FP8 kernels",
    "--moe-input-jitter-eps": "the router's input jitter is not implemented",
    "--moe-layer-recompute": "braid recomputes whole layers or their cheap parts: "
                             "--recompute-granularity selective keeps the routing and the "
                             "experts' fc1 rows and outputs, full recomputes every layer",
    "--moe-router-force-load-balancing": "braid always routes by the router's scores",
    "--moe-apply-probs-on-input": "braid weights the experts' outputs by the probabilities, "
                                  "not their inputs",
    "--moe-use-upcycling": "upcycling a dense checkpoint into experts is not implemented",
    "--moe-router-topk-limited-devices": "use --moe-router-num-groups and "
                                         "--moe-router-group-topk (Megatron's replacement)",
    "--fp8-margin": "braid has no FP8 kernels",
    "--first-last-layers-bf16": "braid has no FP8 kernels (this keeps some layers out of FP8)",
    "--moe-router-padding-for-fp8": "braid has no FP8 kernels",
    "--fp4-format": "braid has no FP4 kernels",
    "--fp4-recipe": "braid has no FP4 kernels",
    "--fp16-lm-cross-entropy": "braid has no float16 kernels",
    "--sgd-momentum": "braid's optimizer is AdamW (--optimizer adam); no SGD",
    "--use-megatron-fsdp": "braid's data parallelism is DDP with an optional ZeRO-1 optimizer "
                           "(--use-distributed-optimizer)",
    "--cpu-offloading-num-layers": "braid keeps activations on the device; "
                                   "--recompute-granularity trades compute for memory instead",
    "--use-torch-fsdp2": "braid's data parallelism is DDP with an optional ZeRO-1 optimizer "
                         "(--use-distributed-optimizer)",
    "--use-pytorch-profiler": "braid is not PyTorch: --profile writes braid's own traces (Chrome "
                              "trace format) to --tensorboard-dir/traces",
}


# Megatron arguments that choose an implementation (a kernel fusion, an attention backend, a
# communication library) where braid has one, or that ask for what braid always does: accepted
# so Megatron launch scripts run unchanged, with no effect; the run's log names each one given.
# flag -> (takes a value: False, True, "+" for one or more, or a list of Megatron's choices;
#          why it changes nothing in braid)
NO_EFFECT = {
    "--use-mcore-models": (False, "braid has one GPT model (megatron-core's layout and names)"),
    "--transformer-impl": (True, "braid runs its own kernels"),
    "--use-flash-attn": (False, "braid's attention is always flash-style"),
    "--attention-backend": (True, "braid's attention is always flash-style"),
    "--attention-softmax-in-fp32": (False, "braid's attention keeps its softmax statistics in f32"),
    "--accumulate-allreduce-grads-in-fp32": (False, "braid's gradients and their reductions are "
                                                    "always f32"),
    "--cp-comm-type": ("+", "braid's context parallelism all-gathers the keys and values "
                             "(Llama 3's scheme); Megatron's p2p, a2a and allgather compute the "
                             "same attention"),
    "--calculate-per-token-loss": (False, "it asks for what braid always does: the loss is "
                                          "the mean over the global batch's counted tokens "
                                          "(Megatron's default, the mean of the microbatches' "
                                          "means, differs only where tokens are masked, as by "
                                          "--eod-mask-loss)"),
    "--use-cpu-initialization": (False, "every rank initialises its shard from the same seeded "
                                        "streams on any device"),
    "--distributed-backend": (True, "braid chooses NCCL for CUDA tensors and MPI on the CPU"),
    "--moe-grouped-gemm": (False, "braid runs each expert's GEMMs on its contiguous rows of "
                                  "tokens"),
    "--moe-token-dispatcher-type": (True, "braid exchanges tokens over the expert-parallel "
                                          "group all-to-all (Megatron's alltoall); allgather "
                                          "and flex compute the same outputs"),
    "--moe-permute-fusion": (False, "a kernel fusion choice; braid has its own kernels"),
    "--moe-router-fusion": (False, "a kernel fusion choice; braid has its own kernels"),
    "--moe-shared-expert-overlap": (False, "it overlaps the shared expert with expert-parallel "
                                           "dispatch; braid's all-to-all does not overlap"),
    "--overlap-moe-expert-parallel-comm": (False, "it overlaps the expert-parallel all-to-all "
                                                  "with another microbatch's computation; "
                                                  "braid's all-to-all does not overlap"),
    "--moe-enable-deepep": (False, "DeepEP's kernels dispatch over expert-parallel ranks; "
                                   "braid's all-to-all moves the same rows"),
    "--moe-deepep-num-sms": (True, "see --moe-enable-deepep"),
    "--moe-use-legacy-grouped-gemm": (False, "braid runs each expert's GEMMs on its contiguous "
                                             "rows of tokens"),
    # Refused with --moe-router-enable-expert-bias (moe_args), whose counts the padding changes.
    "--moe-pad-expert-input-to-capacity": (False, "Megatron pads each expert's input to its "
                                                  "capacity with zero-probability tokens: the "
                                                  "same outputs and gradients (only its "
                                                  "expert-bias token counts would include the "
                                                  "padding)"),
    "--moe-router-dtype": (True, "braid's router logits and probabilities are always f32 (its "
                                 "GEMMs take the activations' dtype with f32 accumulation)"),
    "--num-workers": (True, "braid's data loader prefetches on a thread of its own"),
    "--manual-gc": (False, "braid's step runs in C++; Python's garbage collector is not in it"),
    "--manual-gc-interval": (True, "see --manual-gc"),
    "--log-validation-ppl-to-tensorboard": (False, "braid always writes the perplexity with "
                                                   "the loss: lm loss validation ppl (and lm "
                                                   "loss test ppl)"),
    "--log-batch-size-to-tensorboard": (False, "removed from Megatron, which now writes "
                                               "batch-size always; braid always writes it too"),
    "--tensorboard-queue-size": (True, "braid's metrics writer queues nothing: every record is "
                                       "written and flushed to the event file as it is made"),
    "--no-masked-softmax-fusion": (False, "a kernel fusion choice; braid has its own kernels"),

    "--no-bias-swiglu-fusion": (False, "a kernel fusion choice; braid has its own kernels"),
    "--no-bias-dropout-fusion": (False, "a kernel fusion choice; braid has its own kernels"),
    "--no-rope-fusion": (False, "a kernel fusion choice; braid has its own kernels"),
    "--no-persist-layer-norm": (False, "a kernel fusion choice; braid has its own kernels"),
    "--no-gradient-accumulation-fusion": (False, "braid's GEMMs always accumulate weight "
                                                 "gradients into the f32 buffer"),
    "--cross-entropy-loss-fusion": (False, "braid's vocab-parallel cross-entropy is one kernel "
                                           "chain already"),
    "--cross-entropy-fusion-impl": (True, "braid's vocab-parallel cross-entropy is one kernel "
                                          "chain already"),
    "--no-create-attention-mask-in-dataloader": (False, "braid's data loader never builds "
                                                        "attention masks: its attention "
                                                        "kernels apply the causal mask, and "
                                                        "--reset-attention-mask's documents "
                                                        "(which Megatron drops with this "
                                                        "flag)"),
    "--no-mmap-bin-files": (False, "braid always maps the .bin files read-only; Megatron's "
                                   "option reads each sample with file reads instead, for "
                                   "file systems where mapping is slow"),
    "--tp-comm-overlap": (False, "it overlaps Transformer Engine's tensor-parallel "
                                 "communication with its GEMMs; braid's tensor-parallel "
                                 "collectives do not overlap"),
    "--use-precision-aware-optimizer": (False, "with f32 gradients, master weights and "
                                               "moments (braid's, and --main-grads-dtype's, "
                                               "--exp-avg-dtype's ... defaults) it changes only "
                                               "which kernel casts them"),
    "--ckpt-format": (["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"],
                      "braid writes its own checkpoints, safetensors shards that load under "
                      "any layout (docs/checkpoints.md); tools/convert_megatron.py converts them "
                      "to and from Megatron's torch_dist"),
    "--te-rng-tracker": (False, "Transformer Engine's RNG tracker: braid's dropout masks are "
                                "its own, drawn from the seed and the global positions "
                                "(docs/parallel.md#randomness)"),
    "--no-check-for-nan-in-loss-and-grad": (False, "Megatron's check stops the run at a "
                                                   "non-finite loss or gradient norm; braid "
                                                   "never stops there: it skips the step (no "
                                                   "update) and logs it"),
    "--ddp-average-in-collective": (False, "it divides by the DP size inside the reduction "
                                           "instead of after it; braid weights each "
                                           "microbatch's loss by its share of the global "
                                           "batch, so its reductions sum"),
    "--disable-gloo-process-groups": (False, "braid creates no Gloo groups (MPI on the CPU, "
                                             "NCCL on GPUs)"),
    "--num-dataset-builder-threads": (True, "Megatron's threads for its dataset index "
                                            "builders; braid builds its indices on its own "
                                            "(docs/data.md)"),
    "--auto-detect-ckpt-format": (False, "braid loads its own checkpoint format; "
                                         "tools/convert_megatron.py converts Megatron's"),
    "--dist-ckpt-strictness": (True, "braid's loader matches every tensor of the model "
                                     "against the checkpoint's index and refuses any "
                                     "mismatch"),
    "--no-async-tensor-model-parallel-allreduce": (False, "deprecated in Megatron, which "
                                                          "ignores it"),
    "--no-query-key-layer-scaling": (False, "removed from Megatron; braid never scales the "
                                            "attention scores by the layer number"),
    "--data-impl": (True, "removed from Megatron, whose .bin files are always mapped; braid "
                          "maps them too"),
    "--no-position-embedding": (False, "Megatron's older switch-off of learned absolute "
                                       "positions: braid's positions are "
                                       "--position-embedding-type's"),
    # Megatron divides QK^T by the layer number and has the softmax multiply it back: the same
    # attention, its scores kept in float16's range.
    "--apply-query-key-layer-scaling": (False, "it rescales the attention scores only to keep "
                                               "them in float16's range; braid's scores and "
                                               "softmax are f32"),
}

# The audit's entries, after the ones above (the log names the flags given in this order).
_twice = ((NO_EFFECT.keys() | UNSUPPORTED.keys())
          & (AUDIT_NO_EFFECT.keys() | AUDIT_UNSUPPORTED.keys() | AUDIT_ONLY_VALUE.keys()))
assert not _twice, f"listed twice: {sorted(_twice)}"
NO_EFFECT.update(AUDIT_NO_EFFECT)
UNSUPPORTED.update(AUDIT_UNSUPPORTED)
ONLY_VALUE = AUDIT_ONLY_VALUE


def _same(given: str, wanted) -> bool:
    try:
        return float(given) == float(wanted)
    except ValueError:
        return given == str(wanted)


def only_value_error(a: argparse.Namespace) -> str | None:
    """The error for an ONLY_VALUE flag given at a value other than braid's, or None."""
    for flag, (braids, why) in ONLY_VALUE.items():
        value = getattr(a, flag[2:].replace("-", "_"))
        if value is not None and not _same(value, braids(a)):
            return (f"{flag} {value} is not supported by braid: {why} (give {braids(a)}, or "
                    "drop the flag)")
    return None


def no_effect_given(a: argparse.Namespace) -> list[str]:
    """The NO_EFFECT flags this run was given, each as a log line saying why it does nothing."""
    lines = []
    for flag, (takes_value, why) in NO_EFFECT.items():
        value = getattr(a, flag[2:].replace("-", "_"))
        if value not in (None, False):
            if isinstance(value, list):
                value = " ".join(value)
            given = f"{flag} {value}" if takes_value else flag
            lines.append(f"braid: {given} has no effect: {why}")
    for flag, (braids, why) in ONLY_VALUE.items():
        value = getattr(a, flag[2:].replace("-", "_"))
        if value is not None:
            lines.append(f"braid: {flag} {value} has no effect: it asks for what braid does: {why}")
    return lines



def activation(a: argparse.Namespace) -> str:
    """The MLP's activation as Megatron computes it: --swiglu, --quick-geglu, --squared-relu,
    else GELU - its tanh form in megatron-core's fused bias-GELU (with biases and without
    --no-bias-gelu-fusion; Megatron-LM turns the fusion off without biases) or with
    --openai-gelu, the exact (erf) form otherwise."""
    for flag in ("swiglu", "quick_geglu", "squared_relu"):
        if getattr(a, flag):
            return flag
    fused = not a.no_bias_gelu_fusion and not a.disable_bias_linear
    return "gelu" if a.openai_gelu or fused else "gelu_exact"
