"""Training metrics on disk: TensorBoard event files and a JSONL file, pure stdlib.

    with MetricsWriter(tensorboard_dir="runs/gpt", jsonl_path="runs/gpt/metrics.jsonl",
                       enabled=(job.rank == 0)) as metrics:
        metrics.scalars(step, {"lm loss": loss, "learning-rate": lr, "tokens-per-sec": tps})

The event file is TensorBoard's own format, written here without TensorFlow or tensorboard:
TFRecord framing (uint64 length, masked CRC-32C of the length, the data, masked CRC-32C of
the data) around hand-encoded ``Event`` protobufs: the first one carries
``file_version = "brain.Event:2"``, every ``scalars`` call after it one Event with a
``Summary.Value{tag, simple_value}`` per name (values are stored as float32). The JSONL file
holds one object per call, ``{"step": s, "time": t, name: value, ...}``, written as one line
and flushed, so a crash loses at most the line being written.

``read_event_file``, ``read_jsonl`` and ``read_metrics`` read both back (tools/plot_metrics.py
draws them). A truncated tail, the record or line a writer was in the middle of, is skipped:
files of a running or crashed job read up to their last complete record. A record whose CRC
does not match, or a line in the middle that is not JSON, is an error naming the file.

With ``wandb_run`` (a Weights & Biases run, braid.wandb_log), every ``scalars`` call is also
logged to it (the same names and values as the JSON line, at ``step``), and ``close`` finishes
the run.

This module imports nothing from braid's C++ extension, nor wandb; only the caller decides
which rank writes (``enabled=False`` makes every method a no-op that creates no file).
"""

import glob
import json
import os
import socket
import struct
import sys
import time

__all__ = ["MetricsWriter", "read_event_file", "read_jsonl", "read_metrics", "crc32c"]

FILE_VERSION = "brain.Event:2"

# ---------------------------------------------------------------------------------------------
# CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), table-driven, and TFRecord's mask.

_CRC32C_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _CRC32C_TABLE.append(_c)
del _n, _c


def crc32c(data: bytes) -> int:
    """CRC-32C of ``data`` (crc32c(b"123456789") == 0xE3069283)."""
    crc = 0xFFFFFFFF
    table = _CRC32C_TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _record(data: bytes) -> bytes:
    """One TFRecord: length, masked CRC of the length, data, masked CRC of the data."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", _masked_crc(length)) + data
            + struct.pack("<I", _masked_crc(data)))


# ---------------------------------------------------------------------------------------------
# Protobuf encoding of Event{wall_time=1 double, step=2 int64, file_version=3 string,
# summary=5 Summary}, Summary{value=1 repeated Value}, Value{tag=1 string, simple_value=2 float}.

def _varint(n: int) -> bytes:
    n &= 0xFFFFFFFFFFFFFFFF  # int64: negatives are ten bytes of two's complement
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, *, file_version=None, values=None) -> bytes:
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3 | 0) + _varint(step)
    if file_version is not None:
        out += _field_bytes(3, file_version.encode())
    if values is not None:
        summary = b"".join(
            _field_bytes(1, _field_bytes(1, tag.encode()) + _varint(2 << 3 | 5)
                         + struct.pack("<f", value))
            for tag, value in values)
        out += _field_bytes(5, summary)
    return out


# ---------------------------------------------------------------------------------------------
# Protobuf decoding: just enough for the fields above; unknown fields are skipped.

def _read_varint(buf: bytes, pos: int):
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _fields(buf: bytes):
    """Yields (field number, wire type, value): int for varints, bytes for the others."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            size, pos = _read_varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > len(buf):
            raise ValueError("truncated protobuf field")
        yield number, wire, value


def _decode_event(buf: bytes) -> dict:
    event = {"wall_time": 0.0, "step": 0, "scalars": {}}
    for number, wire, value in _fields(buf):
        if number == 1 and wire == 1:
            event["wall_time"] = struct.unpack("<d", value)[0]
        elif number == 2 and wire == 0:
            event["step"] = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 3 and wire == 2:
            event["file_version"] = value.decode()
        elif number == 5 and wire == 2:
            for vn, vw, v in _fields(value):
                if vn != 1 or vw != 2:
                    continue
                tag, simple = None, None
                for fn, fw, f in _fields(v):
                    if fn == 1 and fw == 2:
                        tag = f.decode()
                    elif fn == 2 and fw == 5:
                        simple = struct.unpack("<f", f)[0]
                if tag is not None and simple is not None:  # tensor summaries are skipped
                    event["scalars"][tag] = simple
    return event


def read_event_file(path) -> list:
    """The events of one TensorBoard event file, in order: dicts with ``wall_time``, ``step``,
    ``scalars`` ({tag: float}) and, on the first, ``file_version``. A truncated last record is
    skipped; a CRC mismatch or an undecodable record raises ValueError naming the file."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    events, pos = [], 0
    while pos < len(data):
        if len(data) - pos < 12:
            break  # truncated length header
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        if _masked_crc(header) != length_crc:
            raise ValueError(f"{path}: not a TensorBoard event file "
                             f"(bad length checksum at byte {pos})")
        end = pos + 12 + length + 4
        if end > len(data):
            break  # truncated record: the writer was in the middle of it
        payload = data[pos + 12:pos + 12 + length]
        (data_crc,) = struct.unpack("<I", data[end - 4:end])
        if _masked_crc(payload) != data_crc:
            raise ValueError(f"{path}: corrupt record at byte {pos} (data checksum mismatch)")
        try:
            events.append(_decode_event(payload))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: undecodable event at byte {pos}: {e}") from None
        pos = end
    return events


def read_jsonl(path) -> list:
    """The records of a metrics JSONL file, in order. An incomplete last line (no newline and
    not JSON) is skipped; any other line that is not a JSON object raises ValueError."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                break  # the line a crashed writer left half-written
            raise ValueError(f"{path}:{number}: not JSON: {e}") from None
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}:{number}: not a metrics record (an object with 'step')")
        records.append(record)
    return records


def _is_event_file(path: str) -> bool:
    if "tfevents" in os.path.basename(path):
        return True
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    return not head.startswith(b"{")


def read_metrics(path) -> dict:
    """{name: [(step, value), ...]} sorted by step, from a JSONL file, an event file or a
    directory of event files (``events.out.tfevents.*``, oldest name first). A step written
    twice (a job resumed from an earlier checkpoint) keeps the value written last. Raises
    FileNotFoundError, or ValueError for a file without metrics or one that cannot be read."""
    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*tfevents*")))
        if not files:
            raise ValueError(f"{path}: no TensorBoard event files (events.out.tfevents.*)")
    elif not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or directory")
    elif os.path.getsize(path) == 0:
        raise ValueError(f"{path}: empty file")
    else:
        files = [path]
    series = {}
    for file in files:
        if _is_event_file(file):
            rows = [(e["step"], e["scalars"]) for e in read_event_file(file)]
        else:
            rows = [(r["step"], {k: v for k, v in r.items() if k not in ("step", "time")})
                    for r in read_jsonl(file)]
        for step, scalars in rows:
            for name, value in scalars.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    series.setdefault(name, {})[int(step)] = float(value)
    if not series:
        raise ValueError(f"{path}: no scalar metrics")
    return {name: sorted(steps.items()) for name, steps in series.items()}


# ---------------------------------------------------------------------------------------------

_file_counter = 0  # the <n> of events.out.tfevents.<time>.<host>.<pid>.<n>, per process


class MetricsWriter:
    """Writes scalars to a TensorBoard event file in ``tensorboard_dir`` and/or one JSON line
    per call to ``jsonl_path`` (appended to, so a resumed job continues its file) and/or the
    W&B run ``wandb_run`` (``wandb.init``'s, which ``close`` finishes). All are optional; with
    ``enabled=False`` (every rank but the one that logs) nothing is created. ``keep_going``: a
    write that fails (a full disk) stops the files with one warning on stderr instead of
    raising, so that a training run goes on to its next checkpoint."""

    def __init__(self, tensorboard_dir=None, jsonl_path=None, *, enabled=True, wandb_run=None,
                 keep_going=False):
        global _file_counter
        self.keep_going = keep_going
        self._events = self._jsonl = None
        self._wandb = wandb_run
        self.event_path = None
        self.closed = False
        if not enabled:
            if wandb_run is not None:
                raise ValueError("MetricsWriter: a disabled writer takes no wandb_run")
            return
        if tensorboard_dir is not None:
            tensorboard_dir = os.fspath(tensorboard_dir)
            os.makedirs(tensorboard_dir, exist_ok=True)
            now = time.time()
            name = (f"events.out.tfevents.{int(now)}.{socket.gethostname()}."
                    f"{os.getpid()}.{_file_counter}")
            _file_counter += 1
            self.event_path = os.path.join(tensorboard_dir, name)
            self._events = open(self.event_path, "wb")
            self._events.write(_record(_event(now, 0, file_version=FILE_VERSION)))
            self._events.flush()
        if jsonl_path is not None:
            jsonl_path = os.fspath(jsonl_path)
            parent = os.path.dirname(jsonl_path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            self._jsonl = open(jsonl_path, "a", encoding="utf-8", buffering=1)

    def scalars(self, step: int, values: dict) -> None:
        """Records ``values`` ({name: number}) at ``step``: one Event (float32 values), one
        JSON line (values as given; NaN and infinities as Python's json writes them) and one
        W&B log call (the same values; W&B's steps must not go back)."""
        if self.closed:
            raise ValueError("MetricsWriter.scalars: the writer is closed")
        if not values or (self._events is None and self._jsonl is None and self._wandb is None):
            return
        now = time.time()
        scalars = {str(name): value if isinstance(value, int) else float(value)
                   for name, value in values.items()}
        try:
            if self._events is not None:
                items = [(str(name), float(value)) for name, value in values.items()]
                self._events.write(_record(_event(now, int(step), values=items)))
                self._events.flush()
            if self._jsonl is not None:
                self._jsonl.write(json.dumps({"step": int(step), "time": now, **scalars}) + "\n")
                self._jsonl.flush()
        except OSError as e:
            if not self.keep_going:
                raise
            sys.stderr.write(f"braid: warning: writing the metrics at step {step} failed ({e}); "
                             "no more TensorBoard or metrics.jsonl records in this job, "
                             "training goes on\n")
            sys.stderr.flush()
            self._drop_files()
        if self._wandb is not None:
            self._wandb.log(scalars, step=int(step))

    def flush(self) -> None:
        """Pushes what was written to the operating system (``scalars`` already does)."""
        for f in (self._events, self._jsonl):
            if f is not None:
                f.flush()

    def _drop_files(self) -> None:
        """Closes the files, whatever their last buffered bytes do (a full disk)."""
        for f in (self._events, self._jsonl):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self._events = self._jsonl = None

    def close(self) -> None:
        """Closes the files and finishes the W&B run (W&B writes out the run's last step)."""
        for f in (self._events, self._jsonl):  # each write is flushed: nothing left to fail
            if f is not None:
                f.close()
        self._events = self._jsonl = None
        self.closed = True
        if self._wandb is not None:
            run, self._wandb = self._wandb, None
            run.finish()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

