"""Megatron-LM's legacy `torch` checkpoints (--ckpt-format torch, the only format of older
Megatron-LM versions) read as the global tensors a torch_dist checkpoint holds, for
tools/convert_megatron.py's import (docs/convert_megatron.md).

An iteration folder holds one torch.save per model-parallel rank (Megatron-LM's
get_checkpoint_name): mp_rank_TT/model_optim_rng.pt with one pipeline stage, mp_rank_TT_PPP/...
with more, and _EEE after either with expert parallelism (a distributed optimizer's state beside
it in distrib_optim.pt). Each is a dict (generate_state_dict): args, checkpoint_version 3.0,
iteration, model (model0, model1, ... with virtual pipeline stages: the rank's megatron-core
GPTModel state_dict_for_save_checkpoint(), its local shards under local names), optimizer,
opt_param_scheduler, rng_state, rerun_state_machine, num_floating_point_operations_so_far.

Merging: a stage's layers are numbered from 0 (decoder.layers.{i}); megatron-core's split of
args.num_layers over the pipeline ranks and virtual stages (stage_layers) gives each its first
global layer. An expert-parallel rank holds num_experts / EP experts numbered from 0
(local_experts.{j}, TEGroupedMLP's weight{j}): rank e's expert j is expert e * (E / EP) + j. The
tensor-parallel shards join on each parameter's partition axis (tp_rule): the vocabulary rows,
column-parallel rows (linear_qkv's per rank whole query groups, in order), row-parallel columns;
SwiGLU's fc1 holds [gate shard; up shard] per rank, so the gates join first, then the ups; the
rest is whole on every rank (checked equal). A tensor several files hold (dense tensors on every
expert-parallel rank, the embedding on the MTP stage) is checked equal. The distributed
optimizer's Adam state (distrib_optim.pt) is placed in each rank's own parameters by value
(distrib_optim_state) and joins as those parameters do, under torch_dist's per-parameter names
(optimizer.state.<exp_avg|exp_avg_sq|param>.<name>).

Reading never runs code from the files: data.pkl is read by megatron_torch_dist's unpickler
(plain containers, argparse.Namespace, an inert Opaque for any other class), which here stands
in for torch's tensor rebuilders too: a tensor is its storage's record, offset, shape and
strides, and only the model's and the distributed optimizer's are read, with numpy, from the
file's records (no torch needed).
"""

import io
import os
import pickle
import re
import zipfile

import numpy as np

from hf_configs import ConvertError, check
from megatron_mla import mla_value
from megatron_mlp import arg
from megatron_torch_dist import FormatError, Opaque, _Unpickler, load_pickle, load_torch_save
from safetensors_numpy import STORAGE, Tensor

RANK_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM = "distrib_optim.pt"  # the distributed optimizer's state, beside a rank file
CHECKPOINT_VERSION = 3.0  # Megatron-LM's since its megatron-core models; 2.0 and 0, 1.0 before
# torch's legacy storage classes (how torch.save names a tensor's storage) -> safetensors dtype
STORAGE_DTYPES = {"FloatStorage": "F32", "BFloat16Storage": "BF16", "HalfStorage": "F16",
                  "DoubleStorage": "F64", "LongStorage": "I64", "IntStorage": "I32",
                  "ShortStorage": "I16", "CharStorage": "I8", "ByteStorage": "U8",
                  "BoolStorage": "BOOL"}
# Column-parallel linear layers (rows split over TP); row-parallel ones split their weight's
# columns; the down projections of multi-latent attention are column-parallel in the local spec
# and whole on every rank in Transformer Engine's (TELinear, duplicated).
COLUMN_PARALLEL = ("word_embeddings", "output_layer", "linear_qkv", "linear_q_proj",
                   "linear_q_up_proj", "linear_kv_up_proj", "eh_proj")
ROW_PARALLEL = ("linear_proj", "linear_fc2")
LATENT_DOWN = ("linear_q_down_proj", "linear_kv_down_proj")


# ---- torch.save files, their tensors unread --------------------------------------------------

class _StorageType:
    """torch.FloatStorage and the like, as the unpickler meets them: a dtype."""

    def __init__(self, dtype):
        self.dtype = dtype


class _Storage:
    """A storage of the file: its record's key, dtype and elements."""

    def __init__(self, key, dtype, numel):
        self.key, self.dtype, self.numel = key, dtype, numel


class LazyTensor:
    """A tensor of a torch.save file, unread: its storage, offset, shape and strides
    (elements)."""

    def __init__(self, storage, offset, size, stride):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride

    @property
    def numel(self):
        return int(np.prod(self.size)) if self.size else 1


def _ints(x):
    if isinstance(x, Opaque) and x.args:  # torch.Size where torch is not installed
        x = x.args[0]
    values = tuple(x)
    if not all(isinstance(v, int) and v >= 0 for v in values):
        raise ValueError(f"not a shape: {values!r}")
    return values


def _rebuild_tensor(storage, offset, size, stride, *rest):
    """torch._utils._rebuild_tensor_v2's arguments -> a LazyTensor (an Opaque for a storage this
    module does not read)."""
    if not isinstance(storage, _Storage) or not isinstance(offset, int) or offset < 0:
        return Opaque("tensor of an unread storage")
    return LazyTensor(storage, offset, _ints(size), _ints(stride))


def _rebuild_parameter(data, *rest):  # torch._utils._rebuild_parameter: the tensor it wraps
    return data


def _rebuild_from_type(func, new_type, args, state=None):  # torch._tensor._rebuild_from_type_v2
    if func is _rebuild_tensor:
        return _rebuild_tensor(*args)
    return Opaque("tensor subclass")


class _TensorUnpickler(_Unpickler):
    """megatron_torch_dist's unpickler, taking torch's tensor rebuilders as this module's."""

    REBUILDERS = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
                  ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
                  ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
                  ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type}

    def __init__(self, file):
        super().__init__(file)
        self.storages = {}

    def find_class(self, module, name):
        if (module, name) in self.REBUILDERS:
            return self.REBUILDERS[(module, name)]
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        return super().find_class(module, name)

    def persistent_load(self, pid):
        # torch.save's ("storage", storage type, record key, location, elements)
        if (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[4], int)):
            key = str(pid[2])
            return self.storages.setdefault(key, _Storage(key, pid[1].dtype, pid[4]))
        return Opaque("storage")


class RankFile:
    """One model_optim_rng.pt (or another torch.save file holding a `holds`): its dict (`state`,
    tensors as LazyTensor) and its tensors' bytes on request (`tensor`)."""

    def __init__(self, path, holds=dict):
        self.path, self.cache, self.holds = path, {}, holds
        try:
            self.zip = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError) as e:
            raise FormatError(f"{path}: not a readable torch.save file ({e}; PyTorch before 1.6 "
                              "wrote another format: load and save it with a newer PyTorch)")
        try:
            self.state = self._load()
        except BaseException:
            self.zip.close()
            raise

    def _load(self):
        pickles = [n for n in self.zip.namelist() if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise FormatError(f"{self.path}: not a torch.save file (no data.pkl)")
        self.prefix = pickles[0][:-len("data.pkl")]
        if self.prefix + "byteorder" in self.zip.namelist():
            order = self.zip.read(self.prefix + "byteorder").decode(errors="replace")
            if order != "little":
                raise FormatError(f"{self.path}: saved {order}-endian; this tool reads "
                                  "little-endian files")
        try:
            state = _TensorUnpickler(self.zip.open(pickles[0])).load()
        except (zipfile.BadZipFile, OSError, pickle.UnpicklingError, EOFError, ValueError,
                TypeError, AttributeError, KeyError, IndexError) as e:
            raise FormatError(f"{self.path}: not a readable torch.save file ({e})")
        if not isinstance(state, self.holds):
            raise FormatError(f"{self.path}: holds a {type(state).__name__}, not Megatron-LM's "
                              f"{'checkpoint dict' if self.holds is dict else 'state'}")
        return state

    def tensor(self, t, what):
        """The Tensor a LazyTensor stands for (copied out of the file)."""
        if not isinstance(t, LazyTensor):
            raise FormatError(f"{self.path}: {what} is a {type(t).__name__}, not a tensor")
        s = t.storage
        data = self.cache.get(s.key)
        if data is None:
            try:
                raw = self.zip.read(f"{self.prefix}data/{s.key}")
            except (KeyError, OSError, zipfile.BadZipFile) as e:
                raise FormatError(f"{self.path}: {what}: its storage {s.key} is unreadable ({e})")
            dtype = np.dtype(STORAGE[s.dtype])
            if len(raw) != s.numel * dtype.itemsize:
                raise FormatError(f"{self.path}: {what}: its storage {s.key} holds {len(raw)} "
                                  f"bytes, not {s.numel} {s.dtype} elements")
            data = self.cache[s.key] = np.frombuffer(raw, dtype=dtype)
        if len(t.size) != len(t.stride):
            raise FormatError(f"{self.path}: {what} has shape {list(t.size)} and strides "
                              f"{list(t.stride)}")
        end = t.offset + sum((n - 1) * st for n, st in zip(t.size, t.stride)) + 1
        if t.numel and end > data.size:
            raise FormatError(f"{self.path}: {what} runs past the end of its storage {s.key}")
        view = np.lib.stride_tricks.as_strided(
            data[t.offset:] if t.numel else data[:0], shape=t.size,
            strides=[st * data.itemsize for st in t.stride], writeable=False)
        return Tensor(s.dtype, np.array(view))

    def forget(self):
        """Drops the storages read so far (the next file's turn)."""
        self.cache = {}

    def close(self):
        self.cache = {}
        self.zip.close()


# ---- the saving run's layout -----------------------------------------------------------------

def positive(args, name, default, where):
    value = arg(args, name, default)
    check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
          f"{where}: args.{name} should be a positive integer, is {value!r}")
    return value


def layout_of(args, where):
    """(TP, PP, EP, virtual stages) of the run that saved, from its args."""
    tp = positive(args, "tensor_model_parallel_size", 1, where)
    pp = positive(args, "pipeline_model_parallel_size", 1, where)
    ep = positive(args, "expert_model_parallel_size", 1, where)
    vp = arg(args, "virtual_pipeline_model_parallel_size")
    per_virtual = arg(args, "num_layers_per_virtual_pipeline_stage")
    if vp is None and per_virtual and pp > 1:  # (Megatron-LM's validate_args derives vp from it)
        vp = args.num_layers // pp // per_virtual
    vp = vp if pp > 1 and vp is not None else 1
    check(isinstance(vp, int) and vp >= 1, f"{where}: args.virtual_pipeline_model_parallel_size "
          f"should be a positive integer, is {vp!r}")
    for name, why in (("pipeline_model_parallel_layout", "a custom pipeline layout"),
                      ("standalone_embedding_stage", "a pipeline stage holding only the "
                                                     "embedding")):
        if arg(args, name):
            raise ConvertError(f"{where}: args.{name} = {getattr(args, name)!r} is not supported "
                               f"in the legacy format ({why}); have Megatron-LM convert the "
                               "checkpoint to torch_dist (--ckpt-convert-format torch_dist)")
    etp = arg(args, "expert_tensor_parallel_size")
    if arg(args, "num_experts") and etp not in (None, tp):
        raise ConvertError(f"{where}: args.expert_tensor_parallel_size = {etp} differs from the "
                           f"tensor-parallel size {tp}: the legacy format then names its files by "
                           "the dense layers' TP rank alone; have Megatron-LM convert the "
                           "checkpoint to torch_dist (--ckpt-convert-format torch_dist)")
    return tp, pp, ep, vp


def stage_layers(args, pp, vp, where):
    """{(pipeline rank, virtual stage): (its first global layer, its layers)}: megatron-core's
    split of args.num_layers (get_num_layers_to_build, get_transformer_layer_offset): even, or
    --decoder-first/last-pipeline-num-layers on the first/last rank and the rest even over the
    others; the embedding (loss) counted as a layer of the first (last) stage with
    --account-for-embedding(loss)-in-pipeline-split; each rank's split evenly over its virtual
    stages, the global order virtual stage by virtual stage, rank by rank."""
    layers = args.num_layers
    if pp == 1:
        return {(0, 0): (0, layers)}
    first, last = (arg(args, f"decoder_{x}_pipeline_num_layers") for x in ("first", "last"))
    embedding = bool(arg(args, "account_for_embedding_in_pipeline_split", False))
    loss = bool(arg(args, "account_for_loss_in_pipeline_split", False))
    if first is not None or last is not None:
        check(not embedding and not loss, f"{where}: args split the layers unevenly and count the "
              "embedding or loss as a layer (megatron-core refuses both)")
        others = pp - (first is not None) - (last is not None)
        rest = layers - (first or 0) - (last or 0)
        check(rest >= 0 and (rest % others == 0 if others else rest == 0), f"{where}: "
              f"{layers} layers (args.num_layers) do not split over {pp} pipeline stages with "
              f"{first} on the first and {last} on the last")
        per_rank = [rest // others if others else 0] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
    else:
        total = layers + embedding + loss
        check(total % pp == 0, f"{where}: {total} layers do not split evenly over {pp} "
              "pipeline stages")
        per_rank = [total // pp] * pp
    counts = {}
    for p, n in enumerate(per_rank):
        check(n % vp == 0, f"{where}: pipeline stage {p}'s {n} layers do not split evenly over "
              f"{vp} virtual stages")
        counts.update({(p, v): n // vp for v in range(vp)})
    counts[(0, 0)] -= embedding
    counts[(pp - 1, vp - 1)] -= loss
    check(min(counts.values()) >= 0, f"{where}: the args leave a pipeline stage fewer than no "
          "layers")
    out, offset = {}, 0
    for v in range(vp):
        for p in range(pp):
            out[(p, v)] = (offset, counts[(p, v)])
            offset += counts[(p, v)]
    return out


def rank_folder(t, p, e, pp, ep):
    """Megatron-LM's get_checkpoint_name: mp_rank_TT, _PPP with pipeline stages, _EEE with
    expert parallelism."""
    return f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")


# ---- names: local to global ------------------------------------------------------------------

def expert_name(rest, e, local, where):
    """A layer's tensor name with an expert-parallel rank's local expert numbering made global
    (SequentialMLP's local_experts.{j}.*, TEGroupedMLP's linear_fc1.weight{j}: both as
    torch_dist's per-expert mlp.experts.experts.{j}.*)."""
    m = (re.match(r"mlp\.experts\.local_experts\.(\d+)\.(.+)$", rest)
         or re.match(r"mlp\.experts\.(linear_fc[12]\.(?:weight|bias))(\d+)$", rest))
    if not m:
        check(not re.match(r"mlp\.experts\.weight[12]$", rest), f"{where}: mlp.experts.weight1 / "
              "weight2 are megatron-core's legacy GroupedMLP (--moe-grouped-gemm without "
              "Transformer Engine), which this tool does not read")
        return rest
    j, name = (int(m.group(1)), m.group(2)) if rest.startswith("mlp.experts.local") else (
        int(m.group(2)), m.group(1))
    check(j < local, f"{where}: local expert {j}; args make {local} per expert-parallel rank")
    return f"mlp.experts.experts.{e * local + j}.{name}"


def global_name(name, offset, count, e, local, layers_seen, where):
    """The name torch_dist gives a stage's tensor: its layer made global (per-layer names),
    its experts too; the MTP depths' (all on the last stage, numbered from 0) and the rest as
    they are."""
    check(not name.startswith("language_model."), f"{where}: {name}: megatron.legacy's GPT model "
          "(language_model.*); this tool reads megatron-core GPTModels (--use-mcore-models)")
    m = re.match(r"decoder\.layers\.(\d+)\.(.+)$", name)
    if m:
        i = int(m.group(1))
        check(i < count, f"{where}: {name}: the args put {count} layers on this stage")
        layers_seen.add(i)
        return f"decoder.layers.{offset + i}.{expert_name(m.group(2), e, local, where)}"
    m = re.match(r"(mtp\.layers\.\d+\.transformer_layer\.)(.+)$", name)
    if m:
        return m.group(1) + expert_name(m.group(2), e, local, where)
    return name


# ---- tensor parallelism ----------------------------------------------------------------------

def tp_rule(name):
    """How TP splits a parameter: its axis (0 rows, 1 columns), "fc1" (rows, SwiGLU's halves per
    rank), "latent" (rows, or whole), or None (whole on every rank)."""
    module, _, param = name.rpartition(".")
    kind = re.sub(r"\d+$", "", param)
    last = module.rsplit(".", 1)[-1]
    if param == "softmax_offset":  # attention sinks, one per head: split by heads
        return 0
    if kind not in ("weight", "bias"):  # TE's fused norms (layer_norm_weight), expert_bias, ...
        return None
    if last == "linear_fc1":
        return "fc1"
    if last in COLUMN_PARALLEL:
        return 0
    if last in LATENT_DOWN:
        return "latent"
    if last in ROW_PARALLEL and kind == "weight":
        return 1
    return None


def latent_rows(name, args):
    if name.endswith("linear_q_down_proj.weight"):
        return mla_value(args, "q_lora_rank")
    return mla_value(args, "kv_lora_rank") + mla_value(args, "qk_pos_emb_head_dim")


def merge_tp(name, parts, args, where, replicas_equal=True):
    """The global tensor of `name` from its TP ranks' shards (parts[t]); one whole on every rank
    is checked equal on each (replicas_equal), else TP rank 0's."""
    first = parts[0]
    for t, part in enumerate(parts[1:], start=1):
        check(part.dtype == first.dtype and part.shape == first.shape, f"{where}: {name} is "
              f"{first.dtype} {first.shape} at TP rank 0, {part.dtype} {part.shape} at TP rank "
              f"{t} (the shards of one tensor have one shape)")
    if len(parts) == 1:
        return first
    rule = tp_rule(name)
    if rule == "latent":
        rule = None if first.shape[0] == latent_rows(name, args) else 0
    if rule is None:
        for t, part in enumerate(parts[1:] if replicas_equal else [], start=1):
            check(np.array_equal(part.array, first.array), f"{where}: TP ranks 0 and {t} hold "
                  f"different {name}, which megatron-core keeps whole on every TP rank")
        return first
    if rule == "fc1" and (arg(args, "swiglu", False) or arg(args, "quick_geglu", False)):
        check(first.shape[0] % 2 == 0, f"{where}: {name} has {first.shape[0]} rows per TP rank; "
              "a gated activation's holds a gate and an up half")
        halves = [np.split(p.array, 2) for p in parts]
        return first.like(np.concatenate([h[0] for h in halves] + [h[1] for h in halves]))
    return first.like(np.concatenate([p.array for p in parts], axis=0 if rule == "fc1" else rule))


# ---- reading ---------------------------------------------------------------------------------

def is_legacy(folder):
    """Whether `folder` is an iteration's folder in the legacy format (Megatron-LM's
    _get_checkpoint_format: an mp_rank_* entry)."""
    try:
        return any(n.startswith("mp_rank_") and os.path.isdir(os.path.join(folder, n))
                   for n in os.listdir(folder))
    except OSError:
        return False


def extra_state_empty(value, f, what):
    """Whether a module's _extra_state (of RankFile f) holds nothing: None (megatron-core's local
    layers), or Transformer Engine's without FP8: an empty byte tensor or one holding a pickle of
    None (TE 2), a BytesIO empty or holding a torch.save of None (TE 1). Read without running
    code, as the rest."""
    if value is None:
        return True
    try:
        if isinstance(value, LazyTensor):
            return value.numel == 0 or load_pickle(f.tensor(value, what).array.tobytes()) is None
        if isinstance(value, Opaque) and value.pickled_name == "_io.BytesIO":  # (bytes, pos, ..)
            data = value.state[0] if isinstance(value.state, tuple) and value.state else None
            return data == b"" or (isinstance(data, bytes)
                                   and load_torch_save(io.BytesIO(data)) is None)
    except (FormatError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            KeyError, IndexError):
        pass  # not a pickle: FP8 state of another form
    return False


def optimizer_tensors(x, path):
    """The names of the LazyTensors in `x` (the optimizer's state), for the note on what is not
    carried."""
    if isinstance(x, LazyTensor):
        yield path
    elif isinstance(x, dict):
        for k, v in x.items():
            if k != "grad_scaler":  # fp16's loss scale, not Adam's state
                yield from optimizer_tensors(v, f"{path}.{k}")
    elif isinstance(x, (list, tuple)):
        for k, v in enumerate(x):
            yield from optimizer_tensors(v, f"{path}.{k}")


def open_rank_files(folder):
    """{(t, p, e): RankFile} of every rank the first file's args make, the args' layout; refuses
    a missing or an extra rank folder."""
    present = sorted(n for n in os.listdir(folder) if n.startswith("mp_rank_"))
    first_path = os.path.join(folder, present[0], RANK_FILE)
    check(os.path.isfile(first_path), f"{folder}/{present[0]}: no {RANK_FILE}")
    first, files = RankFile(first_path), {}
    try:
        args = first.state.get("args")
        check(args is not None and hasattr(args, "num_layers"), f"{first_path}: no args "
              "(Megatron-LM's save_checkpoint stores them; this tool takes the model's shape and "
              "the TP/PP/EP layout from them)")
        tp, pp, ep, vp = layout_of(args, first_path)
        wanted = {rank_folder(t, p, e, pp, ep): (t, p, e)
                  for t in range(tp) for p in range(pp) for e in range(ep)}
        extra = sorted(set(present) - set(wanted))
        check(not extra, f"{folder}: holds {', '.join(extra)}, which TP {tp} x PP {pp} x EP {ep} "
              f"(args of {present[0]}) does not make")
        for name, rank in wanted.items():
            path = os.path.join(folder, name, RANK_FILE)
            check(os.path.isfile(path), f"{folder}: no {name}/{RANK_FILE} (TP {tp} x PP {pp} x "
                  f"EP {ep}, the args' layout, makes {len(wanted)} rank files)")
            files[rank] = first if name == present[0] else RankFile(path)
    except BaseException:
        for f in {id(f): f for f in [first, *files.values()]}.values():
            f.close()
        raise
    return files, (tp, pp, ep, vp)


def read_legacy(folder, drop_fp8_state=False):
    """(common: args, iteration, checkpoint_version and opt_param_scheduler of TP/PP/EP rank 0's
    file; name -> Tensor of every model tensor, global, under torch_dist's names (per layer,
    per expert); the names of the optimizer tensors left out)."""
    files, (tp, pp, ep, vp) = open_rank_files(folder)
    try:
        return _read_ranks(folder, files, tp, pp, ep, vp, drop_fp8_state)
    finally:
        for f in files.values():
            f.close()


def _read_ranks(folder, files, tp, pp, ep, vp, drop_fp8_state):
    head = files[(0, 0, 0)].state
    args = head["args"]
    stages = stage_layers(args, pp, vp, files[(0, 0, 0)].path)
    experts = arg(args, "num_experts") or 0
    check(experts % ep == 0, f"{folder}: {experts} experts (args.num_experts) do not split over "
          f"EP {ep}")
    chunks = ["model"] if vp == 1 else [f"model{v}" for v in range(vp)]
    shards, left_out = {}, []  # name -> {tp rank: Tensor}
    states, problem = {}, None  # Adam's, as torch_dist names it: "optimizer.state.<kind>.<name>"
    steps = set()  # the optimizer not distributed's: torch's per-parameter steps
    for (t, p, e), f in files.items():
        where, state = f.path, f.state
        version = state.get("checkpoint_version")
        check(version == CHECKPOINT_VERSION, f"{where}: checkpoint_version {version!r}; this "
              f"tool reads {CHECKPOINT_VERSION} (Megatron-LM's saves of megatron-core models; "
              "before 2.0 the fused QKV rows were ordered otherwise)")
        rank_args = state.get("args")
        check(rank_args is not None and layout_of(rank_args, where) == (tp, pp, ep, vp),
              f"{where}: its args' TP/PP/EP layout differs from {files[(0, 0, 0)].path}'s")
        check(state.get("iteration") == head.get("iteration"), f"{where}: iteration "
              f"{state.get('iteration')!r}, {files[(0, 0, 0)].path} has {head.get('iteration')!r}")
        unread = list(optimizer_tensors(state.get("optimizer"),
                                        f"{os.path.basename(os.path.dirname(where))}/optimizer"))
        local = {}  # the rank's tensors: "model.<name>" -> (the global name, Tensor)
        for v, key in enumerate(chunks):
            model = state.get(key)
            check(isinstance(model, dict), f"{where}: no {key} (the model's state dict"
                  + (f" of virtual stage {v}" if vp > 1 else "") + ")")
            offset, count = stages[(p, v)]
            seen = set()
            for name, value in model.items():
                what = f"{where}: {key}.{name}"
                if name.endswith("_extra_state"):
                    check(drop_fp8_state or extra_state_empty(value, f, f"{key}.{name}"),
                          f"{what} holds Transformer Engine state (FP8 scaling factors and amax "
                          "histories: the run used FP8); braid has no FP8. Pass --drop-fp8-state "
                          "to import the weights without it")
                    continue
                check(isinstance(value, LazyTensor), f"{what} is a {type(value).__name__}, not "
                      "a tensor this tool reads")
                gname = global_name(name, offset, count, e, max(experts // ep, 1), seen, what)
                local[f"{key}.{name}"] = gname, f.tensor(value, f"{key}.{name}")
                add_shard(shards, gname, t, local[f"{key}.{name}"][1], what)
            check(seen == set(range(count)), f"{where}: {key} holds layers {sorted(seen)}; the "
                  f"args put {count} on pipeline stage {p}"
                  + (f", virtual stage {v}" if vp > 1 else ""))
        optim = os.path.join(os.path.dirname(where), DISTRIB_OPTIM)
        rank_tensors = {n: tensor for n, (_, tensor) in local.items()}
        rank_state = {}
        try:  # Adam's state: the distributed optimizer's beside the file, or in it
            if problem is None and os.path.isfile(optim):
                rank_state = distrib_optim_state(optim, rank_tensors)
            elif problem is None and unread:
                from megatron_optimizer import indexed_state  # (which imports this module)
                rank_state, found = indexed_state(state.get("optimizer"), rank_tensors, f.tensor,
                                                  where)
                steps |= found
                unread = []
            for kind, moments in rank_state.items():
                for n, moment in moments.items():
                    add_shard(states, f"optimizer.state.{kind}.{local[n][0]}", t, moment,
                              f"{where}: {kind} of {n}")
        except (ConvertError, FormatError) as e:  # the weights import without it
            problem, states = str(e), {}
        left_out += unread
        f.forget()

    def merged(name, parts, replicas_equal=True):
        missing = [t for t in range(tp) if t not in parts]
        if missing:
            raise ConvertError(f"{folder}: {name} is in TP rank {min(parts)}'s files, not in TP "
                               f"rank {missing[0]}'s")
        return merge_tp(name, [parts[t] for t in range(tp)], args, folder, replicas_equal)
    tensors = {name: merged(name, parts) for name, parts in shards.items()}
    try:  # the weights import whatever the optimizer state holds
        # (a tensor whole on every TP rank: TP rank 0's state, as torch_dist keeps it)
        tensors.update({name: merged(name, parts, False) for name, parts in states.items()})
    except ConvertError as e:
        problem = str(e)
    if problem is None and not states and arg(args, "use_distributed_optimizer", False) and \
            not arg(args, "no_save_optim", False):
        problem = (f"args.use_distributed_optimizer, but no rank folder holds {DISTRIB_OPTIM} "
                   "(the distributed optimizer's state)")
    common = {k: head.get(k) for k in ("args", "iteration", "checkpoint_version", "optimizer")}
    if steps:  # read here: the files are closed when import takes the step
        common["optimizer"] = {"param_groups": [{"step": step} for step in sorted(steps)]}
    common["opt_param_scheduler"] = head.get("opt_param_scheduler", head.get("lr_scheduler"))
    if problem is not None:
        common["optimizer_problem"] = problem
    return common, tensors, left_out


def add_shard(shards, name, t, tensor, what):
    """Keeps TP rank t's `tensor` of `name`; a copy another file holds (another stage's or
    expert-parallel rank's) must be equal."""
    slot = shards.setdefault(name, {})
    if t in slot:
        check(slot[t].dtype == tensor.dtype and np.array_equal(slot[t].array, tensor.array),
              f"{what} differs from another rank file's {name}")
    else:
        slot[t] = tensor


def distrib_optim_state(path, local):
    """Adam's state of one rank's parameters (`local`: name -> Tensor, its rank file's) from the
    distrib_optim.pt beside that file: megatron-core's state gathered on each data-parallel
    group's first rank (save_parameter_state; a list of them for chained optimizers, None for
    those another rank saved), placed by value (megatron_optimizer.flat_state).
    {kind: {name: Tensor}} for the parameters it holds."""
    from megatron_optimizer import BUFFERS, flat_state, gathered_buckets  # (it imports this)
    f = RankFile(path, holds=(dict, list))
    try:
        saved = f.state if isinstance(f.state, list) else [f.state]
        buckets = gathered_buckets({f"{DISTRIB_OPTIM}[{i}]": s for i, s in enumerate(saved)
                                    if s is not None}, f.tensor, path)
        chunks = {n: [((0,) * len(x.shape), tuple(x.shape))] for n, x in local.items()
                  if not n.endswith(BUFFERS)}
        return flat_state(buckets, local, chunks, path)
    finally:
        f.close()
