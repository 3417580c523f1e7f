"""benchmarks/mfu.py (the GPU MFU figure of scripts/gpu_check.sh) runs end to end on the CPU at
a tiny shape: a child process trains the stack, the parent reports step time, tokens/s and MFU,
and those agree with each other and with braid.flops' count for that model."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "python"))

SHAPE = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "256", "--vocab-size", "512",
         "--seq-length", "64", "--micro-batch-size", "2", "--steps", "3", "--warmup", "1"]


def test_mfu_reports_consistent_figures():
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "mfu.py"),
                        "--device", "cpu", "--peak-tflops", "0.5", *SHAPE],
                       env=dict(os.environ, PYTHONPATH=os.path.join(REPO, "python")),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "Llama-style 2 layers, hidden 128, 4 heads / 2 kv, ffn 256" in out, out
    step_ms, tokens_per_s = re.search(r"step ([0-9.]+) ms \(median of 3\), ([0-9,]+) tokens/s",
                                      out).groups()
    step = float(step_ms) / 1e3
    rounding = 0.05e-3 / step  # the step is printed to 0.1 ms, tokens/s to the unit
    assert float(tokens_per_s.replace(",", "")) == pytest.approx(2 * 64 / step, rel=rounding,
                                                                 abs=0.5)
    tflops, mfu = map(float, re.search(r"([0-9.e-]+) TFLOP/s of model FLOPs = MFU ([0-9.]+)% "
                                       r"of 0.5", out).groups())
    assert mfu == pytest.approx(100 * tflops / 0.5, abs=0.06)
    # The FLOPs are braid.flops' count of the model mfu.py built.
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import mfu as bench
    from braid import flops
    cfg = bench.config(bench.parse_args(["--device", "cpu", *SHAPE]), 2)
    want = flops.flops_per_iteration(cfg, 64, 2) / step / 1e12
    assert tflops == pytest.approx(want, rel=0.001 + rounding)


def test_mfu_runs_multi_latent_attention():
    mla = ["--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16",
           "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12"]
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "mfu.py"),
                        "--device", "cpu", "--peak-tflops", "0.5", *SHAPE, *mla],
                       env=dict(os.environ, PYTHONPATH=os.path.join(REPO, "python")),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("4 heads, multi-latent attention (latents 24/16, heads 16+8, values 12)"
            in r.stdout), r.stdout
    step_ms, = re.search(r"step ([0-9.]+) ms", r.stdout).groups()
    tflops, = re.search(r"([0-9.e-]+) TFLOP/s of model FLOPs", r.stdout).groups()
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import mfu as bench
    from braid import flops
    cfg = bench.config(bench.parse_args(["--device", "cpu", *SHAPE, *mla]), 2)
    assert cfg.multi_latent_attention and cfg.q_lora_rank == 24
    # braid.flops counts MLA's projections: the model FLOPs differ from the Llama stack's.
    llama = bench.config(bench.parse_args(["--device", "cpu", *SHAPE]), 2)
    assert flops.flops_per_iteration(cfg, 64, 2) != flops.flops_per_iteration(llama, 64, 2)
    step = float(step_ms) / 1e3
    want = flops.flops_per_iteration(cfg, 64, 2) / step / 1e12
    assert float(tflops) == pytest.approx(want, rel=0.001 + 0.05e-3 / step)
