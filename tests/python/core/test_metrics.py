"""braid.metrics: TensorBoard event files checked with tensorboard's own reader, the JSONL file,
truncated and corrupt files, and tools/plot_metrics.py on both."""

import glob
import json
import math
import os
import struct
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow

from braid import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PLOT = os.path.join(ROOT, "tools", "plot_metrics.py")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = 50
TAGS = ["lm loss", "learning-rate", "grad-norm", "loss-scale", "tokens-per-sec", "mfu"]


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def values_at(step):
    """Megatron-like scalars, none of them exact in float32."""
    return {
        "lm loss": 10.0 * math.exp(-step / 17.0) + 0.1,
        "learning-rate": 3e-4 * min(1.0, (step + 1) / 10.0) * math.cos(step / 80.0),
        "grad-norm": 1.0 / (step + 3) + 0.123456789,
        "loss-scale": 65536.0 / (1 << (step // 20)),
        "tokens-per-sec": 12345.678 + 7.1 * step,
        "mfu": 0.31 + step * 1e-3,
    }


def write_run(tmp_path, **kwargs):
    tb_dir, jsonl = tmp_path / "tb", tmp_path / "metrics.jsonl"
    with metrics.MetricsWriter(tb_dir, jsonl, **kwargs) as writer:
        for step in range(1, STEPS + 1):
            writer.scalars(step, values_at(step))
    return tb_dir, jsonl


def test_crc32c_matches_tensorboard():
    assert metrics.crc32c(b"123456789") == 0xE3069283
    for data in [b"", b"a", bytes(range(256)), b"brain.Event:2" * 7]:
        assert metrics.crc32c(data) == pywrap_tensorflow.crc32c(data)
        assert metrics._masked_crc(data) == pywrap_tensorflow.masked_crc32c(data)


def test_tensorboard_reads_the_event_file(tmp_path):
    tb_dir, _ = write_run(tmp_path)
    files = glob.glob(str(tb_dir / "events.out.tfevents.*"))
    assert len(files) == 1
    name = os.path.basename(files[0])
    assert name.startswith("events.out.tfevents.")
    stamp, rest = name[len("events.out.tfevents."):].split(".", 1)
    host, pid, n = rest.rsplit(".", 2)  # the host name may hold dots
    assert stamp.isdigit() and pid == str(os.getpid()) and n.isdigit() and host

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted(TAGS)
    for tag in TAGS:
        events = acc.Scalars(tag)
        assert [e.step for e in events] == list(range(1, STEPS + 1))
        assert [e.value for e in events] == [f32(values_at(s)[tag]) for s in range(1, STEPS + 1)]
        assert all(e.wall_time > 1e9 for e in events)
    assert acc.FirstEventTimestamp() > 1e9  # the file_version event


def test_own_reader_reads_the_event_file(tmp_path):
    tb_dir, _ = write_run(tmp_path)
    (path,) = glob.glob(str(tb_dir / "events.out.tfevents.*"))
    events = metrics.read_event_file(path)
    assert events[0]["file_version"] == "brain.Event:2" and events[0]["scalars"] == {}
    assert len(events) == STEPS + 1
    for step, event in enumerate(events[1:], 1):
        assert event["step"] == step
        assert event["scalars"] == {k: f32(v) for k, v in values_at(step).items()}
    series = metrics.read_metrics(tb_dir)
    assert series["lm loss"] == [(s, f32(values_at(s)["lm loss"])) for s in range(1, STEPS + 1)]


def test_jsonl_round_trip(tmp_path):
    _, jsonl = write_run(tmp_path)
    lines = jsonl.read_text().splitlines()
    assert len(lines) == STEPS
    for step, line in enumerate(lines, 1):
        record = json.loads(line)
        assert record.pop("step") == step
        assert record.pop("time") > 1e9
        assert record == values_at(step)  # exact: JSON keeps Python's doubles
    series = metrics.read_metrics(jsonl)
    assert series["mfu"] == [(s, values_at(s)["mfu"]) for s in range(1, STEPS + 1)]


def test_jsonl_appends_and_the_last_write_of_a_step_wins(tmp_path):
    jsonl = tmp_path / "m.jsonl"
    with metrics.MetricsWriter(jsonl_path=jsonl) as w:
        for step in range(1, 6):
            w.scalars(step, {"lm loss": float(step)})
    with metrics.MetricsWriter(jsonl_path=jsonl) as w:  # resumed from the step-3 checkpoint
        for step in range(4, 8):
            w.scalars(step, {"lm loss": 10.0 * step})
    assert len(metrics.read_jsonl(jsonl)) == 9
    assert metrics.read_metrics(jsonl)["lm loss"] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0), (7, 70.0)]


def test_disabled_writer_creates_nothing(tmp_path):
    with metrics.MetricsWriter(tmp_path / "tb", tmp_path / "m.jsonl", enabled=False) as w:
        w.scalars(1, {"lm loss": 1.0})
        w.flush()
    assert os.listdir(tmp_path) == []


def test_closed_writer_refuses_scalars(tmp_path):
    w = metrics.MetricsWriter(jsonl_path=tmp_path / "m.jsonl")
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.scalars(1, {"x": 1.0})


def test_negative_step_and_non_finite_values(tmp_path):
    with metrics.MetricsWriter(tmp_path) as w:
        w.scalars(-3, {"lm loss": float("nan"), "grad-norm": float("inf")})
    (path,) = glob.glob(str(tmp_path / "events.out.tfevents.*"))
    (event,) = metrics.read_event_file(path)[1:]
    assert event["step"] == -3
    assert math.isnan(event["scalars"]["lm loss"]) and event["scalars"]["grad-norm"] == math.inf
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert acc.Scalars("grad-norm")[0].step == -3


def test_truncated_tail_is_skipped_corruption_is_an_error(tmp_path):
    """Documented behaviour: a file is read up to its last complete record (a running or
    crashed job), a checksum mismatch is an error naming the file."""
    tb_dir, jsonl = write_run(tmp_path)
    (path,) = glob.glob(str(tb_dir / "events.out.tfevents.*"))
    data = open(path, "rb").read()
    for cut in (5, 20):
        with open(path, "wb") as f:
            f.write(data[:-cut])
        events = metrics.read_event_file(path)
        assert len(events) == STEPS and events[-1]["step"] == STEPS - 1

    with open(path, "wb") as f:
        f.write(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    with pytest.raises(ValueError, match=f"{path}: corrupt record"):
        metrics.read_event_file(path)

    text = jsonl.read_text()
    jsonl.write_text(text[:-12])  # half of the last line
    assert len(metrics.read_jsonl(jsonl)) == STEPS - 1
    jsonl.write_text("not json\n" + text)
    with pytest.raises(ValueError, match=f"{jsonl}:1: not JSON"):
        metrics.read_jsonl(jsonl)


def plot(*args):
    return subprocess.run([sys.executable, PLOT, *map(str, args)], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("source", ["tb_dir", "event_file", "jsonl"])
def test_plot_metrics_writes_pngs(tmp_path, source):
    tb_dir, jsonl = write_run(tmp_path)
    path = {"tb_dir": tb_dir, "jsonl": jsonl,
            "event_file": glob.glob(str(tb_dir / "events.out.tfevents.*"))[0]}[source]
    out = tmp_path / "plots"
    proc = plot(path, "--out", out)
    assert proc.returncode == 0, proc.stderr
    written = proc.stdout.split()
    assert sorted(os.path.basename(p) for p in written) == sorted(
        t.replace(" ", "_") + ".png" for t in TAGS)
    for p in written:
        data = open(p, "rb").read()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1000


def test_plot_metrics_tag_filter_and_default_out(tmp_path):
    _, jsonl = write_run(tmp_path)
    proc = plot(jsonl, "--tag", "lm loss", "--tag", "learning-rate")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(tmp_path / "lm_loss.png"),
                                   str(tmp_path / "learning-rate.png")]
    proc = plot(jsonl, "--tag", "perplexity")
    assert proc.returncode == 1 and "no scalar 'perplexity'" in proc.stderr


def test_plot_metrics_errors(tmp_path):
    cases = {}
    cases["missing"] = (tmp_path / "missing.jsonl", "no such file or directory")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    cases["empty"] = (tmp_path / "empty.jsonl", "empty file")
    (tmp_path / "emptydir").mkdir()
    cases["empty dir"] = (tmp_path / "emptydir", "no TensorBoard event files")
    (tmp_path / "garbage.bin").write_bytes(bytes(range(1, 65)))
    cases["garbage"] = (tmp_path / "garbage.bin", "not a TensorBoard event file")
    (tmp_path / "bad.jsonl").write_text('{"step": 1, "x": 2}\n{oops\n{"step": 3, "x": 2}\n')
    cases["bad jsonl"] = (tmp_path / "bad.jsonl", "bad.jsonl:2: not JSON")
    (tmp_path / "nometrics.jsonl").write_text('{"step": 1, "time": 5.0}\n')
    cases["no scalars"] = (tmp_path / "nometrics.jsonl", "no scalar metrics")
    for name, (path, message) in cases.items():
        proc = plot(path)
        assert proc.returncode == 1, name
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("plot_metrics: error: "), (name, lines)
        assert str(path) in lines[0] and message in lines[0], (name, lines)
