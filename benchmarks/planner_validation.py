#!/usr/bin/env python3
"""The planner (python/braid/planner.py) against published large training runs.

Reads ../shared/published_runs.csv (relative to the repository; --csv to override), predicts
each row at its published layout (tp, pp, dp, GPUs, global batch; the micro batch size,
virtual stages, sequence parallelism and ZeRO the paper did not fix are searched, and the best
taken, as Megatron's authors tuned theirs) and prints predicted vs published TFLOP/s per GPU
with the relative error. Target: every row within ±10%.

FLOPs are compared like with like: rows whose flops_accounting is "eq3_factor96_with_full_recompute"
(Narayanan et al. 2021) count the recomputed forward too (96 instead of 72 in their eq. 3,
the LM head at 3x), and were measured with full recomputation, so the prediction is made with
recompute=full and counted the same way; "model_flops_as_published" rows are model FLOPs
(braid.flops, 3x the forward).

    python benchmarks/planner_validation.py [--csv PATH] [--json] [--fit]

--fit grid-searches the fitted constants (the A100 and H100 GEMM efficiency e_max and the
A100 GEMM half-efficiency size) against the rows and prints the best; the GPUS table of
python/braid/planner_inputs.py holds the result.
"""

import argparse
import csv
import dataclasses
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "python"))

from braid import flops as bflops  # noqa: E402
from braid import planner  # noqa: E402

TOLERANCE = 0.10


def row_model(row) -> planner.ModelShape:
    h, ffn = int(row["hidden"]), int(row["ffn_hidden"])
    gelu = ffn == 4 * h and row["heads"] == row["kv_heads"]
    return planner.ModelShape(int(row["layers"]), h, int(row["heads"]), int(row["kv_heads"]),
                              ffn, int(row["vocab"]), int(row["seq"]),
                              "gelu" if gelu else "swiglu",
                              tied_embeddings=row["source"].startswith("narayanan"))


def row_cluster(row) -> planner.Cluster:
    # Selene / Eos: DGX nodes of 8 GPUs, NVLink 300 GB/s (A100) / 450 GB/s (H100) per direction,
    # one 200 Gb/s (A100) / 400 Gb/s (H100) InfiniBand NIC per GPU.
    gpu = planner.GPUS[row["gpu"]]
    h100 = row["gpu"].startswith("h")
    return planner.Cluster(gpu, 8, int(row["gpus"]), (450e9 if h100 else 300e9),
                           (400e9 if h100 else 200e9) / 8)


def published_count(row, model, result) -> float:
    """Predicted TFLOP/s per GPU, counted as the row's paper counted."""
    gb, s = int(row["global_batch"]), model.seq_length
    if row["flops_accounting"].startswith("eq3_factor96"):
        fwd_layers = bflops.forward_flops_per_token(
            dataclasses.replace(model, vocab_size=0), s)
        head = 2 * model.hidden_size * model.vocab_size
        flops = (4 * fwd_layers + 3 * head) * s * gb
    else:
        flops = bflops.flops_per_iteration(model, s, gb)
    return flops / result["step_time_s"] / int(row["gpus"]) / 1e12


def predict_row(row):
    model, cluster = row_model(row), row_cluster(row)
    fixed = dict(tp=int(row["tp"]), pp=int(row["pp"]), dp=int(row["dp"]))
    if row["flops_accounting"].startswith("eq3_factor96"):  # every layer recomputed
        fixed.update(recompute="full", recompute_method="uniform", recompute_num_layers=1)
    results, rejected = planner.search(model, cluster, int(row["global_batch"]), fixed)
    if not results:
        raise RuntimeError(f"{row['source']} {row['params_b']}B: nothing fits ({rejected})")
    best = results[0]
    return best, published_count(row, model, best)


def validate(path):
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            best, predicted = predict_row(row)
            published = float(row["tflops_per_gpu"])
            rows.append(dict(source=row["source"], gpu=row["gpu"], params_b=float(row["params_b"]),
                             tp=best["tp"], pp=best["pp"], dp=best["dp"], gpus=int(row["gpus"]),
                             micro_batch_size=best["micro_batch_size"],
                             virtual_stages=best["virtual_stages"], recompute=best["recompute"],
                             accounting=row["flops_accounting"], published=published,
                             predicted=predicted, error=predicted / published - 1.0))
    return rows


def _rows(path, gpu_prefix):
    with open(path, newline="", encoding="utf-8") as f:
        return [r for r in csv.DictReader(f) if r["gpu"].startswith(gpu_prefix)]


def _worst(rows):
    return max(abs(predict_row(r)[1] / float(r["tflops_per_gpu"]) - 1) for r in rows)


def fit(path):
    """A100: (e_max, n_half) on the A100 rows; H100: e_max on the H100 rows, n_half = A100's
    (assumed). Both grids; prints the constants for planner.GPUS."""
    a100_rows, h100_rows = _rows(path, "a100"), _rows(path, "h100")
    best = None
    # A wider scan (n_half 0..3072, e_max 0.60..0.99) found the optimum here.
    for nh in [1536, 2048, 2560]:
        for e in [x / 100 for x in range(84, 97, 2)]:
            planner.GPUS["a100-80g"] = dataclasses.replace(
                planner.GPUS["a100-80g"], gemm_eff_max=e, gemm_n_half=nh)
            w = _worst(a100_rows)
            if best is None or w < best[0]:
                best = (w, e, nh)
    print("A100: worst |error| %.3f at gemm_eff_max %.2f gemm_n_half %d" % best)
    nh = best[2]  # one H100 row cannot fit two numbers: the curve's shape is A100's
    best = None
    for e in [x / 100 for x in range(60, 100, 1)]:
        planner.GPUS["h100-80g"] = dataclasses.replace(
            planner.GPUS["h100-80g"], gemm_eff_max=e, gemm_n_half=nh)
        w = _worst(h100_rows)
        if best is None or w < best[0]:
            best = (w, e, nh)
    print("H100: worst |error| %.3f at gemm_eff_max %.2f gemm_n_half %d" % best)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", default=os.path.join(REPO, "..", "shared", "published_runs.csv"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--fit", action="store_true")
    a = ap.parse_args(argv)
    if not os.path.exists(a.csv):
        ap.error(f"--csv {a.csv}: no such file")
    if a.fit:
        fit(a.csv)
        return 0
    rows = validate(a.csv)
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'source':<22} {'gpu':<9} {'params':>7} {'tp':>3} {'pp':>3} {'dp':>3} "
              f"{'mbs':>3} {'v':>2} {'published':>9} {'predicted':>9} {'error':>7}")
        for r in rows:
            print(f"{r['source']:<22} {r['gpu']:<9} {r['params_b']:>6.1f}B {r['tp']:>3} "
                  f"{r['pp']:>3} {r['dp']:>3} {r['micro_batch_size']:>3} "
                  f"{r['virtual_stages']:>2} {r['published']:>9.1f} {r['predicted']:>9.1f} "
                  f"{100 * r['error']:>+6.1f}%")
        inside = sum(abs(r["error"]) <= TOLERANCE for r in rows)
        print(f"{inside}/{len(rows)} rows within ±{100 * TOLERANCE:.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
