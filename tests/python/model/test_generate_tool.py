"""tools/generate.py as a user runs it.

- a checkpoint saved by a real 4-rank mpirun job of the demo at tp 2, pp 2 loads in one process
  and greedy-generates exactly the completions that the job's gathered model printed (the demo
  decodes those by full recompute, generate.py over its KV cache)
- sampling flags: top-k 1 prints the greedy completions; a seed repeats itself
- --prompt-ids, and --tokenizer with a local Hugging Face tokenizer directory
- bad flags, and a metadata.json or shard that cannot be read: one "braid: error: ..." line
  naming the flag (and the file), exit code 2
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

from mpi_job import mpi_env

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TOOL = os.path.join(REPO, "tools", "generate.py")

# Trained far enough that its answers differ from problem to problem (none is right yet).
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--lr-warmup-iters", "10", "--eval-problems", "24", "--distributed-timeout-minutes", "1",
        "--micro-batch-size", "16", "--global-batch-size", "32", "--log-interval", "50",
        "--train-iters", "200", "--lr", "1e-2"]


def env():
    return mpi_env(HF_HUB_OFFLINE="1")


def generate(*args, timeout=120):
    return subprocess.run([sys.executable, TOOL, *map(str, args)], env=env(), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo trained at tp 2, pp 2 (4 ranks) with --save: its checkpoint and the completions
    its gathered model printed, {prompt: answer}."""
    if shutil.which("mpirun") is None:
        pytest.skip("needs mpirun")
    tmp = tmp_path_factory.mktemp("generate_demo")
    ckpt = tmp / "ckpt"
    cmd = ["mpirun", "-np", "4", "--oversubscribe", sys.executable, "-m", "braid.demo", *TINY,
           "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
           "--save", str(ckpt), "--data-cache-path", str(tmp / "data")]
    r = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    printed = dict(re.findall(r"^  (\d+\+\d+=)(\d*) *(?:ok|wrong)", r.stdout, re.MULTILINE))
    assert len(printed) == 6 and len(set(printed.values())) > 3, r.stdout
    return ckpt, printed


def test_tp2_pp2_checkpoint_greedy_matches_the_gathered_model(demo):
    ckpt, printed = demo
    with open(ckpt / "latest_checkpointed_iteration.txt") as f:
        assert f.read().strip() == "200"
    assert len(os.listdir(ckpt / "iter_0000200")) == 5  # metadata + 4 (tp, pp) files
    prompts = list(printed)
    r = generate("--load", ckpt, "--greedy", "--max-new-tokens", "5", "--prompt", *prompts)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [p + printed[p] for p in prompts]
    # top-k 1 samples the argmax: the same lines, whatever the seed and temperature.
    r = generate("--load", ckpt, "--top-k", "1", "--temperature", "1.5", "--seed", "9",
                 "--max-new-tokens", "5", "--prompt", *prompts)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [p + printed[p] for p in prompts]


def test_sampling_is_seeded(demo):
    ckpt, printed = demo
    args = ["--load", ckpt, "--temperature", "2.0", "--max-new-tokens", "5", "--prompt",
            *list(printed) * 3]
    first = generate(*args, "--seed", "1")
    assert first.returncode == 0, first.stderr
    assert generate(*args, "--seed", "1").stdout == first.stdout
    others = [generate(*args, "--seed", str(s)).stdout for s in (2, 3)]
    assert any(o != first.stdout for o in others)


def test_prompt_ids_print_the_new_ids(demo):
    ckpt, printed = demo
    prompt = next(iter(printed))
    ids = ",".join(str(b) for b in prompt.encode())
    r = generate("--load", ckpt, "--greedy", "--max-new-tokens", "5", "--stop-token", "10",
                 "--prompt-ids", ids)
    assert r.returncode == 0, r.stderr
    want = [str(b) for b in printed[prompt].encode()]
    got = r.stdout.split()
    assert got[:len(want)] == want and (len(got) == len(want) or got[len(want)] == "10")


def test_tokenizer_directory(demo, tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    ckpt, printed = demo
    # A character-level tokenizer over the addition bytes: token id = byte value.
    vocab = {chr(i): i for i in range(32, 127)}
    vocab["\n"] = 10
    model = tokenizers.models.WordLevel(vocab, unk_token="?")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="\n",
                                                unk_token="?")
    fast.save_pretrained(tmp_path / "tok")
    prompt = next(iter(printed))
    assert fast.encode(prompt) == list(prompt.encode())
    r = generate("--load", ckpt, "--tokenizer", tmp_path / "tok", "--greedy", "--max-new-tokens",
                 "5", "--prompt", prompt)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [prompt + printed[prompt]]


BAD = [
    (["--prompt", "1+2="], "--load"),  # required
    (["--load", "{ckpt}"], "give exactly one of --prompt and --prompt-ids"),
    (["--load", "{ckpt}", "--prompt", "1+2=", "--prompt-ids", "1,2"], "exactly one of --prompt"),
    (["--load", "{ckpt}", "--prompt", "1+2=", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--load", "{ckpt}", "--prompt", "1+2=", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--load", "{ckpt}", "--prompt", "1+2=", "--top-k", "-2"], "--top-k must be >= 0"),
    (["--load", "{ckpt}", "--prompt", "1+2=", "--top-k", "two"], "argument --top-k: invalid int"),
    (["--load", "{ckpt}", "--prompt", "1+2=", "--temperature", "-1"], "--temperature must be"),
    (["--load", "{ckpt}", "--prompt", "1+2=", "--temperature", "nan"],
     "--temperature must be a finite number >= 0, got nan"),
    (["--load", "{ckpt}", "--prompt", "1+2=", "--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--load", "{ckpt}", "--prompt-ids", "1,2", "--stop-token", "256"],
     "--stop-token 256 is outside the checkpoint's vocabulary [0, 256) (-1: none)"),
    (["--load", "{ckpt}", "--prompt", "1+2=", "--max-new-tokens", "0"], "--max-new-tokens must"),
    (["--load", "{ckpt}", "--prompt", "123+456=", "--max-new-tokens", "9"],
     "--max-new-tokens 9: a prompt of 8 tokens + 9 new tokens exceed the model's "
     "max_position_embeddings 16"),
    (["--load", "{ckpt}", "--prompt-ids", "1,x"], "--prompt-ids: '1,x' is not"),
    (["--load", "{ckpt}", "--prompt-ids", "1,,2"], "--prompt-ids: '1,,2' is not"),
    (["--load", "{ckpt}", "--prompt-ids", " "], "--prompt-ids: ' ' holds no token id"),
    (["--load", "{ckpt}", "--prompt-ids", "1,256"], "--prompt-ids: token id 256 is outside"),
    (["--load", "{ckpt}", "--prompt", "1+2=", "--ckpt-step", "3"], "--ckpt-step: "),
    (["--load", "{ckpt}/nowhere", "--prompt", "1+2="], "--load {ckpt}/nowhere: not a directory"),
    (["--load", "{ckpt}", "--prompt", "1+2=", "--tokenizer", "{ckpt}/nowhere"], "--tokenizer"),
    (["--load", "{ckpt}", "--prompt", "1+2=", "--device", "tpu"], "--device must be"),
    (["--load", "{ckpt}", "--prompt", "π="], "--prompt: 'π=' is not ASCII"),
    (["--load", "{ckpt}", "--prompt", ""], "--prompt: an empty prompt"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_flags_are_one_error_line(demo, args, message):
    ckpt, _ = demo
    r = generate(*[a.format(ckpt=ckpt) for a in args])
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("braid: error: "), r.stderr
    assert message.format(ckpt=ckpt) in lines[0], lines[0]
    assert r.stdout == ""


def test_text_prompt_needs_the_addition_vocabulary_or_a_tokenizer(tmp_path):
    import braid  # this process writes the checkpoint

    cfg = braid.TransformerConfig.preset("gpt2-tiny")
    cfg.vocab_size = 300
    model = braid.GPTModel(cfg, device="cpu", seed=1)
    trainer = braid.Trainer(model, braid.AdamWConfig(),
                            braid.LRSchedule(lr=1e-3, style="constant"))
    braid.save_checkpoint(str(tmp_path), trainer)
    r = generate("--load", tmp_path, "--prompt", "hello")
    assert r.returncode == 2
    assert r.stderr.strip() == ("braid: error: --prompt: the checkpoint's vocabulary (300 tokens) "
                                "is not the addition demo's (256); give --tokenizer PATH or "
                                "--prompt-ids")
    r = generate("--load", tmp_path, "--prompt-ids", "299,3", "--greedy", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 4


@pytest.mark.parametrize("name,content,message", [
    ("metadata.json", "[]", "metadata.json: not a JSON object (braid's metadata.json)"),
    ("metadata.json", None, "metadata.json: Is a directory, expected braid's metadata.json"),
    ("mp_rank_00_000.safetensors", None,
     "mp_rank_00_000.safetensors is not a file, expected a .safetensors shard"),
])
def test_unreadable_checkpoint_files_are_one_error_line(tmp_path, name, content, message):
    import braid  # this process writes the checkpoint

    model = braid.GPTModel(braid.TransformerConfig.preset("gpt2-tiny"), device="cpu", seed=1)
    trainer = braid.Trainer(model, braid.AdamWConfig(),
                            braid.LRSchedule(lr=1e-3, style="constant"))
    braid.save_checkpoint(str(tmp_path), trainer, save_optim=False)
    path = tmp_path / "iter_0000000" / name
    os.remove(path)
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    r = generate("--load", tmp_path, "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == f"braid: error: --load: {path}{message[len(name):]}", r.stderr
