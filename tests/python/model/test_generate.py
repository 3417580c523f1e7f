"""Generation with a KV cache: GPTModel.kv_cache / decode and python/braid/generate.py.

- decode's logits equal logits() of the whole sequence (f32, 1e-5) at every step: a prefill of
  a [B, P] prompt, then one token at a time, or a few at a time; gpt2-tiny (learned positions)
  and llama-tiny (rope, GQA: 2 kv heads for 4 query heads); B = 3
- greedy generation is the argmax of a full recompute at every step; top-k = 1 and temperature
  -> 0 are greedy; prompts of different lengths give what each gives alone
- top-k and top-p never sample outside the set they allow (thousands of seeded draws), and
  sample it in proportion to the renormalised probabilities
- past max_position_embeddings, a cache made for another batch, bad sampling: ValueError
- load_model: a checkpoint saved by a Trainer loads back with the same logits, bit for bit

BRAID_TEST_DEVICE=cuda runs the model tests on the GPU (f32 parameters there too).
"""

import os

import numpy as np
import pytest

import braid
from braid import generate as gen

DEVICE = os.environ.get("BRAID_TEST_DEVICE", "cpu")
PRESETS = ["gpt2-tiny", "llama-tiny", "qwen3-tiny"]  # qwen3: llama with qk_layernorm
ATOL = 1e-5


def tiny(preset, seed=3, max_positions=None):
    qk_norm = preset == "qwen3-tiny"
    cfg = braid.TransformerConfig.preset("llama-tiny" if qk_norm else preset)
    cfg.qk_layernorm = qk_norm
    if max_positions is not None:
        cfg.max_position_embeddings = max_positions
    return braid.GPTModel(cfg, device=DEVICE, seed=seed)


def full_logits(model, ids):
    return np.from_dlpack(model.logits(np.ascontiguousarray(ids, dtype=np.int32)))


def random_ids(model, shape, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, model.config.vocab_size, size=shape).astype(np.int32)


@pytest.mark.parametrize("preset", PRESETS)
def test_prefill_then_single_tokens_match_full_logits(preset):
    model = tiny(preset)
    if preset == "llama-tiny":
        assert model.config.kv_heads < model.config.num_attention_heads  # GQA
    b, p, n = 3, 5, 9
    ids = random_ids(model, (b, p + n))
    cache = model.kv_cache(b)
    assert (cache.batch, cache.length) == (b, 0)
    assert cache.capacity == model.config.max_position_embeddings
    got = np.from_dlpack(model.decode(ids[:, :p], cache))
    assert got.shape == (b, p, model.config.vocab_size) and got.dtype == np.float32
    np.testing.assert_allclose(got, full_logits(model, ids[:, :p]), rtol=0, atol=ATOL)
    for i in range(p, p + n):
        step = np.from_dlpack(model.decode(ids[:, i:i + 1], cache))
        assert cache.length == i + 1
        want = full_logits(model, ids[:, :i + 1])[:, -1:]
        np.testing.assert_allclose(step, want, rtol=0, atol=ATOL, err_msg=f"position {i}")
        assert np.abs(want).max() > 0.05  # the comparison is not one of zeros


@pytest.mark.parametrize("preset", PRESETS)
def test_a_few_tokens_at_a_time_and_last_only(preset):
    model = tiny(preset, seed=11)
    ids = random_ids(model, (2, 17), seed=1)
    full = full_logits(model, ids)
    cache = model.kv_cache(2, 20)
    pieces = [np.from_dlpack(model.decode(ids[:, :4], cache))]
    for start, stop in ((4, 7), (7, 8), (8, 12), (12, 17)):
        pieces.append(np.from_dlpack(model.decode(ids[:, start:stop], cache)))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=0, atol=ATOL)
    cache.reset()
    last = np.from_dlpack(model.decode(ids[:, :6], cache, last_only=True))
    assert last.shape == (2, 1, model.config.vocab_size)
    np.testing.assert_allclose(last[:, 0], full[:, 5], rtol=0, atol=ATOL)
    step = np.from_dlpack(model.decode(ids[:, 6:9], cache, last_only=True))
    np.testing.assert_allclose(step[:, 0], full[:, 8], rtol=0, atol=ATOL)


def test_cache_holds_keys_after_rope_for_every_layer():
    model = tiny("llama-tiny")
    cache = model.kv_cache(2, 8)
    model.decode(random_ids(model, (2, 3)), cache)
    c = model.config
    assert cache.num_layers == c.num_layers
    for layer in range(c.num_layers):
        k = np.from_dlpack(cache.keys(layer).to("cpu") if DEVICE != "cpu" else cache.keys(layer))
        assert k.shape == (2, 8, c.kv_heads, c.head_dim)
        assert np.abs(k[:, :3]).max() > 0 and not k[:, 3:].any()


def test_past_max_position_embeddings_is_a_clear_error():
    model = tiny("gpt2-tiny", max_positions=8)
    cache = model.kv_cache(1)
    model.decode(random_ids(model, (1, 6)), cache)
    model.decode(random_ids(model, (1, 2)), cache)  # positions 6 and 7: the last ones
    with pytest.raises(ValueError, match="exceed max_position_embeddings 8"):
        model.decode(random_ids(model, (1, 1)), cache)
    with pytest.raises(ValueError, match="max_position_embeddings 8"):
        model.kv_cache(1, 9)
    with pytest.raises(ValueError, match="capacity 4"):
        small = model.kv_cache(1, 4)
        model.decode(random_ids(model, (1, 5)), small)
    with pytest.raises(ValueError, match="the cache holds 1 sequences"):
        model.decode(random_ids(model, (2, 1)), model.kv_cache(1))
    for layer in (-1, 2):  # gpt2-tiny's 2 layers
        with pytest.raises(ValueError, match=rf"layer {layer} is outside the cache's layers "
                                             r"\[0, 2\)"):
            cache.keys(layer)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.decode(np.array([[model.config.vocab_size]], dtype=np.int32), model.kv_cache(1))
    with pytest.raises(ValueError, match="max_position_embeddings 8"):
        gen.generate(model, [[1, 2, 3]], max_new_tokens=6)


def greedy_by_recompute(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(full_logits(model, np.array([ids]))[0, -1])))
    return ids[len(prompt):]


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_is_the_argmax_of_a_full_recompute(preset):
    model = tiny(preset, seed=5)
    prompts = [list(random_ids(model, (7,), seed=s)) for s in range(3)]
    got = gen.generate(model, prompts, 12, gen.Sampling(greedy=True))
    for prompt, new in zip(prompts, got):
        assert new == greedy_by_recompute(model, prompt, 12)


def test_prompts_of_different_lengths_give_what_each_gives_alone():
    model = tiny("llama-tiny", seed=9)
    prompts = [list(random_ids(model, (n,), seed=n)) for n in (3, 7, 3, 5)]
    sampling = gen.Sampling(greedy=True)
    together = gen.generate(model, prompts, 6, sampling)
    assert together == [gen.generate(model, [p], 6, sampling)[0] for p in prompts]


def test_top_k_1_and_temperature_to_zero_are_greedy():
    model = tiny("gpt2-tiny", seed=2)
    prompts = [list(random_ids(model, (5,), seed=s)) for s in range(4)]
    greedy = gen.generate(model, prompts, 10, gen.Sampling(greedy=True))
    for seed in range(3):
        assert gen.generate(model, prompts, 10, gen.Sampling(top_k=1), seed=seed) == greedy
        assert gen.generate(model, prompts, 10, gen.Sampling(temperature=1e-6), seed=seed) == greedy
        assert gen.generate(model, prompts, 10, gen.Sampling(temperature=0.0), seed=seed) == greedy
    # ... and plain sampling at temperature 1 is not (the test above could not fail otherwise).
    sampled = [gen.generate(model, prompts, 10, gen.Sampling(), seed=s) for s in range(3)]
    assert any(s != greedy for s in sampled)
    assert sampled[0] == gen.generate(model, prompts, 10, gen.Sampling(), seed=0)  # seeded


def test_stop_token_ends_a_sequence():
    model = tiny("gpt2-tiny", seed=2)
    prompt = list(random_ids(model, (5,), seed=0))
    free = gen.generate(model, [prompt], 10, gen.Sampling(greedy=True))[0]
    stop = free[3]
    cut = gen.generate(model, [prompt, prompt], 10, gen.Sampling(greedy=True), stop_token=stop)
    assert cut == [free[:free.index(stop) + 1]] * 2


# ---- the sampler on fixed distributions ---------------------------------------------------

LOGITS = np.log(np.array([[0.30, 0.05, 0.20, 0.02, 0.15, 0.08, 0.12, 0.08]]))


def draws(sampling, n=4000, seed=0):
    rng = np.random.default_rng(seed)
    return np.array([gen.sample_next(LOGITS, sampling, rng)[0] for _ in range(n)])


def assert_frequencies(tokens, allowed, probs):
    counts = np.bincount(tokens, minlength=LOGITS.shape[1])
    assert set(np.nonzero(counts)[0]) <= set(allowed)
    want = np.zeros(LOGITS.shape[1])
    want[allowed] = probs[allowed] / probs[allowed].sum()
    np.testing.assert_allclose(counts / len(tokens), want, atol=0.03)


def test_top_k_samples_the_k_most_likely_only():
    probs = np.exp(LOGITS[0])
    tokens = draws(gen.Sampling(top_k=3))
    assert_frequencies(tokens, [0, 2, 4], probs)
    assert set(tokens) == {0, 2, 4}


def test_top_p_samples_the_nucleus_only():
    probs = np.exp(LOGITS[0])
    # sorted: 0.30, 0.20, 0.15, 0.12, ...: 0.30 + 0.20 + 0.15 = 0.65 reaches 0.6.
    tokens = draws(gen.Sampling(top_p=0.6))
    assert_frequencies(tokens, [0, 2, 4], probs)
    assert set(tokens) == {0, 2, 4}
    # 0.45 is reached by 0.30 + 0.20: the nucleus is those two.
    assert set(draws(gen.Sampling(top_p=0.45), n=2000)) == {0, 2}
    # The most likely token always stays.
    assert set(draws(gen.Sampling(top_p=0.01), n=200)) == {0}


def test_top_k_then_top_p_and_temperature():
    # top-k 4 keeps {0, 2, 4, 6} (0.77 of the mass); top-p 0.7 of that renormalised keeps
    # 0.30, 0.20 (0.65 of 0.77) and 0.15: {0, 2, 4}.
    probs = np.exp(LOGITS[0])
    tokens = draws(gen.Sampling(top_k=4, top_p=0.7))
    assert_frequencies(tokens, [0, 2, 4], probs)
    # temperature 2 flattens: p ~ sqrt(p).
    flat = np.sqrt(probs)
    assert_frequencies(draws(gen.Sampling(temperature=2.0)), list(range(8)), flat)


def test_bad_sampling_is_a_value_error():
    model = tiny("gpt2-tiny")
    for sampling, match in ((gen.Sampling(top_p=0.0), "top_p"), (gen.Sampling(top_k=-1), "top_k"),
                            (gen.Sampling(temperature=-1.0), "temperature"),
                            (gen.Sampling(temperature=float("nan")), "finite"),
                            (gen.Sampling(temperature=float("inf")), "finite")):
        with pytest.raises(ValueError, match=match):
            gen.generate(model, [[1, 2]], 2, sampling)
    with pytest.raises(ValueError, match="empty prompt"):
        gen.generate(model, [[]], 2)


# ---- loading a checkpoint -------------------------------------------------------------------

def test_load_model_gives_the_saved_models_logits(tmp_path):
    cfg = braid.TransformerConfig.preset("llama-tiny")
    model = braid.GPTModel(cfg, device="cpu", seed=21)
    trainer = braid.Trainer(model, braid.AdamWConfig(),
                            braid.LRSchedule(lr=1e-3, style="constant"))
    ids = random_ids(model, (2, 9))
    braid.save_checkpoint(str(tmp_path), trainer)
    loaded, meta = gen.load_model(str(tmp_path))
    assert meta["config"]["num_query_groups"] == cfg.kv_heads
    np.testing.assert_array_equal(full_logits(loaded, ids), full_logits(model, ids))
    other = braid.GPTModel(cfg, device="cpu", seed=22)  # a different init is a different model
    assert not np.array_equal(full_logits(other, ids), full_logits(model, ids))
    with pytest.raises(ValueError, match="no such checkpoint"):
        gen.load_model(str(tmp_path), iteration=7)
    with pytest.raises(ValueError, match="no checkpoint"):
        gen.load_model(str(tmp_path / "empty"))


def test_load_parameters_allocates_no_optimizer_state(tmp_path):
    # A trained step, so the checkpoint holds optimizer state too.
    cfg = braid.TransformerConfig.preset("llama-tiny")
    model = braid.GPTModel(cfg, device="cpu", seed=21)
    trainer = braid.Trainer(model, braid.AdamWConfig(), braid.LRSchedule(lr=1e-3, style="constant"))
    ids = random_ids(model, (2, 9))
    trainer.train_step(ids, ids)
    braid.save_checkpoint(str(tmp_path), trainer)

    def allocated():
        return braid.memory_stats("cpu")["current_bytes"]

    start = allocated()
    params_only = braid.GPTModel(cfg, device="cpu", seed=0)
    braid.load_parameters(str(tmp_path), params_only)
    one_model = allocated() - start
    with_trainer = braid.GPTModel(cfg, device="cpu", seed=0)
    t = braid.Trainer(with_trainer, braid.AdamWConfig(), braid.LRSchedule(lr=0.0, style="constant"))
    braid.load_checkpoint(str(tmp_path), t, finetune=True)
    # The trainer's path holds Adam's two f32 moments besides the same model.
    assert allocated() - start - 2 * one_model >= 8 * model.num_parameters()
    np.testing.assert_array_equal(full_logits(params_only, ids), full_logits(model, ids))
    np.testing.assert_array_equal(full_logits(with_trainer, ids), full_logits(model, ids))
