"""braid checkpoints in a sharded layout for the converter tests: written directly from a tp-1
checkpoint as braid lays them out (reshard), or saved by braid's C++ in a 4-rank job
(resave_at_tp2_pp2)."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np

from mpi_job import mpi_env

_TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "convert_hf.py")
_spec = importlib.util.spec_from_file_location("convert_hf", _TOOL)
convert_hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_hf)


def reshard(src, dst, tp, pp, vocab_divisible=128):
    """Writes the global checkpoint `src` (tp 1) as braid saves it at (tp, pp): each (tp, pp)
    position's stored slices (vocabulary padding left out, replicated tensors and shared kv heads
    once), optimizer state beside the parameters. (Checked once by hand against a real
    save_checkpoint at tp 2, pp 2 under mpirun: the same tensor index.)"""
    meta, tensors = convert_hf.read_checkpoint(str(src))
    c = meta["config"]
    layers = c["num_layers"]
    per_stage = layers // pp
    files, index = {}, {}
    for name, shape, tp_dim in convert_hf.braid_specs(c):
        if name.startswith("model.layers."):
            stage = int(name.split(".")[2]) // per_stage
        elif name.startswith("model.embed"):
            stage = 0
        else:
            stage = pp - 1
        kv = ".k_proj." in name or ".v_proj." in name
        replicated = tp_dim < 0 or (kv and c["num_query_groups"] < tp)
        assert not kv or c["num_query_groups"] in (1,) or c["num_query_groups"] % tp == 0
        n = shape[max(tp_dim, 0)]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            step = -(-n // (vocab_divisible * tp)) * vocab_divisible
        else:
            step = n // tp
        for t in range(tp):
            if replicated:
                if t != 0:
                    continue
                dim, start, length = -1, 0, shape[0]
                piece = tensors[name].array
            else:
                dim, start = tp_dim, t * step
                length = max(0, min(n - start, step))
                if length == 0:
                    continue
                sl = [slice(None)] * len(shape)
                sl[dim] = slice(start, start + length)
                piece = tensors[name].array[tuple(sl)]
            file = f"mp_rank_{t:02d}_{stage:03d}.safetensors"
            for key in (name, "optimizer.exp_avg." + name, "optimizer.exp_avg_sq." + name):
                value = piece if key == name else np.full(piece.shape, 0.5, np.float32)
                dtype = tensors[name].dtype if key == name else "F32"
                files.setdefault(file, {})[key] = convert_hf.Tensor(dtype, np.ascontiguousarray(value))
                entry = index.setdefault(key, {"shape": shape, "split_dim": dim, "shards": []})
                entry["shards"].append({"file": file, "start": start, "length": length})
    iter_dir = dst / "iter_0000005"
    iter_dir.mkdir(parents=True)
    for file, content in files.items():
        convert_hf.write_safetensors(str(iter_dir / file), content)
    meta = dict(meta, iteration=5, optimizer=True, tensors=index,
                layout=dict(meta["layout"], tensor_model_parallel_size=tp,
                            pipeline_model_parallel_size=pp))
    meta.pop("hf_config")  # braid's own saves carry none
    (iter_dir / "metadata.json").write_text(json.dumps(meta, indent=1))
    (dst / "latest_checkpointed_iteration.txt").write_text("5\n")
    return sorted(files)


RESAVE = """
import json, sys
import braid
src, dst = sys.argv[1], sys.argv[2]
braid.init_distributed(timeout_minutes=2)
from braid.generate import config_from_metadata
cfg = config_from_metadata(json.load(open(src + "/iter_0000000/metadata.json"))["config"])
state = braid.ParallelState(tp=2, pp=2, dp=1)
model = braid.ParallelModel(cfg, device="cpu", seed=5, state=state)
trainer = braid.Trainer(model, braid.TrainerConfig(braid.AdamWConfig(), braid.LRSchedule(
    lr=1e-3, min_lr=1e-4, warmup_iters=0, decay_iters=10, style="cosine")))
braid.load_checkpoint(src, trainer, finetune=True)
braid.save_checkpoint(dst, trainer)
"""


def resave_at_tp2_pp2(ckpt, dst):
    """braid's C++ loads `ckpt` into a tp = 2, pp = 2 job (4 MPI ranks) and saves it at `dst`."""
    script = dst.parent / "resave.py"
    script.write_text(RESAVE)
    r = subprocess.run(["mpirun", "-np", "4", "--oversubscribe", sys.executable, str(script),
                        str(ckpt), str(dst)],
                       env=mpi_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
