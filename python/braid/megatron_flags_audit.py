"""The Megatron-LM arguments an audit of megatron/training/arguments.py found that GPT launch
scripts pass and braid did not know: logging and telemetry switches, resilience checkers,
NCCL and overlap knobs, checkpoint-format knobs and deprecated spellings (accepted, with no
effect), and the ones that would change the model, the numbers or the schedule (refused, with
what braid does instead). braid.megatron_flags merges both into its NO_EFFECT and UNSUPPORTED;
docs/arguments.md lists them."""

from __future__ import annotations

_ONE_LOGGER = "NVIDIA's one-logger telemetry; braid sends no telemetry"
_STRAGGLER = ("Megatron's straggler detector times each GPU and logs the slowest ranks; braid "
              "has none (--timing-log-level compares the ranks' step times)")
_RERUN = ("Megatron's rerun engine reruns an iteration whose loss or gradients a check "
          "flags, to tell a transient fault from a reproducible result; braid has no rerun "
          "engine (it skips a step whose loss or gradient norm is not finite, and logs it)")
_OWN_CKPT = ("a knob of Megatron's torch_dist checkpoint writer; braid writes its own "
             "checkpoints, which load under any layout (docs/checkpoints.md)")
_TP_OVERLAP = "see --tp-comm-overlap"
_CUDA_GRAPH = ("CUDA graphs replay Megatron's captured PyTorch launches; braid launches its "
               "own kernels from C++ and captures no graphs")
_P2P_OVERLAP = ("it overlaps the interleaved schedule's pipeline sends and receives with the "
                "next forward or backward; braid posts each exchange's sends and receives "
                "together and waits on them (Megatron's batched p2p): the same tensors")
_FP8 = "braid has no FP8 kernels"
_FP4 = "braid has no FP4 kernels"
_MUON = "braid's optimizer is AdamW (--optimizer adam); no Muon"
_OFFLOAD = ("braid keeps the optimizer state on the device; --use-distributed-optimizer "
            "shards it over the data-parallel ranks instead")
_NON_PERSISTENT = ("braid's checkpoints are all persistent (--save-interval, "
                   "--save-retain-interval); it has no non-persistent or node-local ones")

# flag -> (takes a value: False, True, or "+" for one or more; why it changes nothing in braid)
AUDIT_NO_EFFECT = {
    # Logging and telemetry.
    "--log-straggler": (False, _STRAGGLER),
    "--disable-straggler-on-startup": (False, _STRAGGLER),
    "--straggler-minmax-count": (True, _STRAGGLER),
    "--straggler-ctrlr-port": (True, _STRAGGLER),
    "--enable-one-logger": (False, _ONE_LOGGER + " (Megatron's older switch, now on by default)"),
    "--no-one-logger": (False, _ONE_LOGGER),
    "--one-logger-async": (False, _ONE_LOGGER),
    "--one-logger-project": (True, _ONE_LOGGER),
    "--one-logger-run-name": (True, _ONE_LOGGER),
    "--app-tag-run-name": (True, "a run tag for " + _ONE_LOGGER),
    "--app-tag-run-version": (True, "a run tag for " + _ONE_LOGGER),
    "--log-progress": (False, "Megatron appends its progress (tokens, FLOPs, throughput) to "
                              "progress.txt in the checkpoint directory; braid writes no "
                              "progress.txt (its log line and metrics carry the same)"),
    "--log-energy": (False, "braid reads no GPU energy counters"),
    "--no-log-loss-scale-to-tensorboard": (False, "braid always writes loss-scale with the "
                                                  "other metrics"),
    "--no-log-learnig-rate-to-tensorboard": (False, "removed from Megatron, which now always "
                                                    "writes learning-rate; braid always "
                                                    "writes it too"),
    "--logging-level": (True, "the level of Megatron's Python loggers; braid's log level is "
                              "BRAID_LOG_LEVEL's (debug, info, warn, error)"),
    "--no-barrier-with-level-1-timing": (False, "Megatron's level-1 timers start with a "
                                                "barrier unless this is given; braid's timers "
                                                "add none"),
    "--config-logger-dir": (True, "Megatron writes its modules' configurations there for "
                                  "debugging; braid writes none (its log prints the arguments "
                                  "and the model)"),
    "--record-memory-history": (False, "PyTorch's CUDA allocator history for its memory "
                                       "viewer; braid's allocator is its own "
                                       "(--log-memory-to-tensorboard logs its use)"),
    "--memory-snapshot-path": (True, "see --record-memory-history"),
    # Resilience: checks that report, fault injection, restarts driven by a cluster.
    "--rerun-mode": (True, _RERUN),
    "--check-for-large-grads": (False, _RERUN),
    "--check-for-spiky-loss": (False, _RERUN),
    "--error-injection-rate": (True, "it injects faults to test Megatron's rerun engine "
                                     "(--rerun-mode); braid has none, so nothing is injected"),
    "--error-injection-type": (True, "see --error-injection-rate"),
    "--check-weight-hash-across-dp-replicas-interval": (True, "Megatron checks that the "
                                                              "data-parallel replicas' weights "
                                                              "hash alike; braid has no such "
                                                              "check"),
    "--deterministic-mode": (False, "braid's kernels are deterministic already: no atomics, "
                                    "fixed summation orders (cuDNN's attention backward too, "
                                    "except for shapes where cuDNN has no deterministic one, "
                                    "which the log names)"),
    "--adlr-autoresume": (False, "Megatron polls the ADLR cluster's termination request, "
                                 "saves and exits; braid saves and exits on SIGTERM when "
                                 "--save is given"),
    "--adlr-autoresume-interval": (True, "see --adlr-autoresume"),
    "--enable-ft-package": (False, "heartbeats to NVIDIA's fault-tolerance launcher; braid "
                                   "sends none (a collective waiting past "
                                   "--distributed-timeout-minutes aborts the job)"),
    "--calc-ft-timeouts": (False, "see --enable-ft-package"),
    # Checkpoint format and I/O.
    "--use-dist-ckpt": (False, "deprecated in Megatron, which ignores it; see --ckpt-format"),
    "--dist-ckpt-format": (True, "deprecated in Megatron, which ignores it; see --ckpt-format"),
    "--ckpt-fully-parallel-save": (False, "deprecated in Megatron, which ignores it (saving in "
                                          "parallel is its default)"),
    "--no-ckpt-fully-parallel-save": (False, _OWN_CKPT),
    "--ckpt-fully-parallel-load": (False, _OWN_CKPT),
    "--ckpt-assume-constant-structure": (False, _OWN_CKPT),
    "--dist-ckpt-save-pre-mcore-014": (False, _OWN_CKPT),
    "--dist-ckpt-optim-fully-reshardable": (False, _OWN_CKPT),
    "--distrib-optim-fully-reshardable-mem-efficient": (False, _OWN_CKPT),
    "--use-persistent-ckpt-worker": (False, "a worker process for Megatron's --async-save; "
                                            "braid's --async-save writes from a thread"),
    "--use-mp-args-from-checkpoint-args": (False, "Megatron takes the tensor- and "
                                                  "pipeline-parallel sizes from the checkpoint, "
                                                  "which loads only under them; braid's load "
                                                  "under any layout, so it runs the command "
                                                  "line's"),
    "--no-initialization": (False, "it skips initialising weights a checkpoint overwrites "
                                   "(startup time only); braid initialises them"),
    # Recomputation.
    "--distribute-saved-activations": (False, "it splits the input full recomputation keeps "
                                              "over the tensor-parallel ranks (a memory "
                                              "saving); braid keeps it whole on each rank "
                                              "(--sequence-parallel shards it; "
                                              "docs/memory.md)"),
    # Pipeline and data-parallel communication.
    "--overlap-p2p-communication": (False, _P2P_OVERLAP + " (Megatron's older switch)"),
    "--no-overlap-p2p-communication": (False, "it makes Megatron post each exchange's sends "
                                              "and receives together and wait on them, as "
                                              "braid always does"),
    "--overlap-p2p-communication-warmup-flush": (False, _P2P_OVERLAP),
    "--use-ring-exchange-p2p": (False, "a custom PyTorch build's ring exchange for the "
                                       "pipeline's sends and receives; braid's are NCCL's "
                                       "(MPI's on the CPU)"),
    "--pipeline-model-parallel-comm-backend": (True, "braid's pipeline sends and receives are "
                                                     "NCCL's (MPI's on the CPU)"),
    "--defer-embedding-wgrad-compute": (False, "it moves the output layer's weight-gradient "
                                               "GEMMs to the pipeline flush, the same "
                                               "gradients; braid computes them in each "
                                               "backward"),
    "--wgrad-deferral-limit": (True, "see --defer-embedding-wgrad-compute"),
    "--no-align-grad-reduce": (False, "when each pipeline stage launches its data-parallel "
                                      "reductions: the same reductions"),
    "--no-align-param-gather": (False, "when each pipeline stage launches its parameter "
                                       "all-gathers: the same gathers"),
    "--overlap-param-gather-with-optimizer-step": (False, "it starts the first bucket's "
                                                          "parameter all-gather in the "
                                                          "optimizer step; braid's "
                                                          "--overlap-param-gather gathers "
                                                          "in the next forward"),
    "--ddp-num-buckets": (True, "braid sizes its gradient buckets by --ddp-bucket-size"),
    "--ddp-pad-buckets-for-high-nccl-busbw": (False, "it pads the gradient buckets for NCCL's "
                                                     "bandwidth: the same reductions"),
    "--num-distributed-optimizer-instances": (True, "it shards Megatron's distributed "
                                                    "optimizer over dp / N ranks and keeps N "
                                                    "copies; braid's shards it over every "
                                                    "data-parallel rank: the same updates"),
    "--hierarchical-context-parallel-sizes": ("+", "the groups of --cp-comm-type a2a+p2p; see "
                                                   "--cp-comm-type"),
    "--use-tp-pp-dp-mapping": (False, "it orders the ranks tp-cp-ep-pp-dp, which changes "
                                      "which processes share a node, not what a rank "
                                      "computes; braid keeps megatron-core's tp-cp-ep-dp-pp "
                                      "(docs/parallel.md)"),
    "--local-rank": (True, "the local rank torch.distributed.launch passes; braid takes it "
                           "from the launcher's environment or MPI (docs/launching.md)"),
    # NCCL tuning.
    "--nccl-communicator-config-path": (True, "per-communicator NCCL settings (CTAs, CGA "
                                              "cluster size); braid's communicators take "
                                              "NCCL's defaults and environment variables"),
    "--use-sharp": (False, "IB SHARP (NCCL CollNet) on the data-parallel communicator; "
                           "braid's communicators take NCCL's environment variables "
                           "(NCCL_COLLNET_ENABLE)"),
    "--sharp-enabled-group": (True, "see --use-sharp"),
    "--high-priority-stream-groups": ("+", "high-priority CUDA streams for these groups' "
                                           "collectives; braid's communication streams have "
                                           "the default priority"),
    "--use-nccl-ub": (False, "it registers Megatron's data-parallel buffers with NCCL (user "
                             "buffers); braid registers none"),
    "--disable-symmetric-registration": (False, "see --use-nccl-ub"),
    # Transformer Engine's tensor-parallel overlap, kernel and CUDA graph choices.
    "--tp-comm-overlap-cfg": (True, _TP_OVERLAP),
    "--tp-comm-bootstrap-backend": (True, _TP_OVERLAP),
    "--disable-tp-comm-overlap-ag": (False, _TP_OVERLAP),
    "--disable-tp-comm-overlap-rs": (False, _TP_OVERLAP),
    "--tp-comm-overlap-rs-dgrad": (False, _TP_OVERLAP),
    "--disable-tp-comm-bulk-dgrad": (False, _TP_OVERLAP),
    "--disable-tp-comm-bulk-wgrad": (False, _TP_OVERLAP),
    "--disable-tp-comm-split-ag": (False, _TP_OVERLAP),
    "--disable-tp-comm-split-rs": (False, _TP_OVERLAP),
    "--use-te-activation-func": (False, "a kernel choice; braid has its own kernels"),
    "--delay-wgrad-compute": (False, "it delays weight-gradient GEMMs to overlap them with "
                                     "the expert-parallel all-to-all; braid's all-to-all does "
                                     "not overlap"),
    "--no-clone-scatter-output-in-embedding": (False, "a PyTorch memory detail of Megatron's "
                                                      "embedding under sequence parallelism; "
                                                      "braid manages its own buffers"),
    "--no-manual-gc-eval": (False, "see --manual-gc"),
    "--enable-cuda-graph": (False, _CUDA_GRAPH),
    "--external-cuda-graph": (False, _CUDA_GRAPH),
    "--cuda-graph-impl": (True, _CUDA_GRAPH),
    "--cuda-graph-scope": (True, _CUDA_GRAPH),
    "--cuda-graph-warmup-steps": (True, _CUDA_GRAPH),
}

# Megatron arguments braid refuses, with what braid does instead.
AUDIT_UNSUPPORTED = {
    # The model.
    "--apply-residual-connection-post-layernorm": "braid's layers add each sublayer's output "
                                                  "to its input, before the norm (pre-norm, "
                                                  "megatron-core's GPT)",
    "--fp32-residual-connection": "braid's residual stream is in the activations' dtype "
                                  "(bf16 with --bf16)",
    "--no-rope-freq": "braid applies RoPE in every layer",
    "--qk-l2-norm": "braid's --qk-layernorm norms queries and keys with --normalization's "
                    "norm and its weights",
    "--init-method-xavier-uniform": "braid initialises weights from a normal of "
                                    "--init-method-std (output projections std / sqrt(2 x "
                                    "layers))",
    "--data-parallel-random-init": "braid initialises every data-parallel replica alike, "
                                   "from --seed",
    "--encoder-num-layers": "Megatron reads it as --num-layers when that is not given; use "
                            "--num-layers",
    "--encoder-seq-length": "Megatron reads it as --seq-length when that is not given; use "
                            "--seq-length",
    "--decoder-num-layers": "T5's decoder; braid's GPT has --num-layers layers",
    "--vocab-extra-ids": "Megatron adds this many <extra_id_i> tokens to SentencePieceTokenizer's "
                         "(and BERT's) vocabulary for T5's span masking; braid's tokenizers "
                         "add none",
    # The schedule and the data.
    "--decrease-batch-size-if-needed": "braid refuses a --global-batch-size that "
                                       "--micro-batch-size x dp does not divide; it never "
                                       "shrinks the batch",
    "--result-rejected-tracker-filename": "Megatron's rerun engine records the iterations "
                                          "whose results it rejected in this file and adds "
                                          "them to --iterations-to-skip; braid has no rerun "
                                          "engine: give the iterations to "
                                          "--iterations-to-skip",
    # Checkpoints.
    "--pretrained-checkpoint": "braid starts from --load's checkpoint (--finetune: its "
                               "parameters only)",
    "--non-persistent-save-interval": _NON_PERSISTENT,
    "--non-persistent-ckpt-type": _NON_PERSISTENT,
    "--non-persistent-global-ckpt-dir": _NON_PERSISTENT,
    "--non-persistent-local-ckpt-dir": _NON_PERSISTENT,
    "--non-persistent-local-ckpt-algo": _NON_PERSISTENT,
    # Removed from Megatron, which refuses them itself.
    "--checkpoint-activations": "removed from Megatron, which exits on it; use "
                                "--recompute-activations or --recompute-granularity",
    "--batch-size": "removed from Megatron, which refuses it; use --micro-batch-size",
    "--warmup": "removed from Megatron, which refuses it; use --lr-warmup-iters, "
                "--lr-warmup-fraction or --lr-warmup-samples",
    "--model-parallel-size": "removed from Megatron, which refuses it; use "
                             "--tensor-model-parallel-size",
    # Neighbours of flags braid refuses already.
    "--fp8-interval": _FP8,
    "--fp8-quantizer-factory": _FP8,
    "--no-fp8-wgrad": _FP8,
    "--num-layers-at-start-in-bf16": _FP8 + " (see --first-last-layers-bf16)",
    "--num-layers-at-end-in-bf16": _FP8 + " (see --first-last-layers-bf16)",
    "--reuse-grad-buf-for-mxfp8-param-ag": _FP8,
    "--fp4-param-gather": _FP4,
    "--fp4-quantizer-factory": _FP4,
    "--muon-momentum": _MUON,
    "--muon-no-split-qkv": _MUON,
    "--muon-use-nesterov": _MUON,
    "--muon-scale-mode": _MUON,
    "--muon-fp32-matmul-prec": _MUON,
    "--muon-num-ns-steps": _MUON,
    "--muon-tp-mode": _MUON,
    "--muon-extra-scale-factor": _MUON,
    "--optimizer-cpu-offload": _OFFLOAD,
    "--optimizer-offload-fraction": _OFFLOAD,
    "--overlap-cpu-optimizer-d2h-h2d": _OFFLOAD,
    "--use-torch-optimizer-for-cpu-offload": _OFFLOAD,
    "--no-pin-cpu-grads": _OFFLOAD,
    "--no-pin-cpu-params": _OFFLOAD,
    "--moe-upcycling-granularity": "see --moe-use-upcycling",
}


# Accepted at the value that asks for what braid does (the log notes that it changes nothing),
# refused at any other: flag -> (braid's value, from the arguments; why another is refused).
AUDIT_ONLY_VALUE = {
    "--dataloader-type": (lambda a: "single",
                          "braid reads the samples in order from the consumed-samples position, "
                          "as Megatron's default single does (docs/data.md); cyclic reshuffles "
                          "each epoch, external is the script's own loader"),
    "--mid-level-dataset-surplus": (lambda a: 0.005,
                                    "braid builds each blend member with Megatron's default "
                                    "surplus, 0.005; another changes the members' samples"),
    "--microbatch-group-size-per-virtual-pipeline-stage": (
        lambda a: a.pipeline_model_parallel_size,
        "braid's interleaved schedule runs each model chunk on groups of "
        "--pipeline-model-parallel-size microbatches (Megatron's default)"),
}
