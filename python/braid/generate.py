"""Sampling from a braid model with a KV cache.

``generate(model, prompts, ...)`` prefills each batch of prompts in one ``GPTModel.decode`` call
and then decodes one token per step over the model's KV cache (``GPTModel.kv_cache``), so a step
costs one position's work instead of the whole sequence's. Prompts of different lengths are
grouped by length, each group one batch (no padding, so no attention mask is needed).

Sampling follows Hugging Face's ``generate``: logits / temperature, then top-k, then top-p
(nucleus: the smallest set of most likely tokens whose probability reaches top_p; the most
likely token always stays), then one draw from the renormalised distribution with a seeded
numpy ``Generator``. ``greedy`` (or temperature 0) takes the argmax instead.

``load_model(dir)`` builds a one-process ``GPTModel`` from a checkpoint directory saved under any
(tp, pp, dp) layout: the model config comes from the checkpoint's metadata.json and the
parameters through ``braid.load_checkpoint``, which reshards.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

import braid

# metadata.json "config" keys, set on a TransformerConfig as they are (docs/checkpoints.md):
# what the model computes (token dropping in whole-sequence forwards: KV-cache decoding is
# dropless). The router's training losses (moe_aux_loss_coeff, moe_z_loss_coeff)
# and the expert-bias update rate change nothing in a forward; the expert biases themselves are
# state, which braid.load_parameters reads.
_CONFIG_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "ffn_hidden_size", "vocab_size", "max_position_embeddings",
                "normalization", "activation", "position_embedding", "add_bias_linear",
                "add_qkv_bias", "qk_layernorm", "zero_centered_gamma", "tie_embeddings",
                "mtp_num_layers",
                "rope_theta", "rope_scaling_factor", "rope_low_freq_factor",
                "rope_high_freq_factor", "rope_original_max_position_embeddings",
                "rope_yarn_factor", "rope_yarn_beta_fast", "rope_yarn_beta_slow",
                "rope_yarn_mscale", "rope_yarn_mscale_all_dim", "rope_linear_factor",
                "rotary_percent", "rotary_interleaved", "rope_yarn_truncate", "softmax_type",
                "glu_linear_offset", "activation_clamp", "window_size",
                "window_layers", "num_experts",
                "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax",
                "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_layers",
                "moe_router_score_function", "moe_router_num_groups", "moe_router_group_topk",
                "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
                "moe_expert_capacity_factor", "moe_token_drop_policy", "norm_eps",
                "params_dtype", "multi_latent_attention", "q_lora_rank", "kv_lora_rank",
                "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


@dataclass
class Sampling:
    """How the next token is chosen. greedy (or temperature == 0): the argmax.

    top_k = 0 and top_p = 1.0 turn those filters off."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def check(self):
        if not 0 <= self.temperature < math.inf:  # NaN too: it would turn every draw to the last id
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0


def checkpoint_metadata(load: str, iteration: int | None = None) -> tuple[int, dict]:
    """(iteration, metadata.json) of the latest (or the given) checkpoint under `load`."""
    if iteration is None:
        iteration = braid.latest_iteration(load)
        if iteration < 0:
            raise ValueError(f"{load}: no checkpoint (latest_checkpointed_iteration.txt is "
                             f"missing)")
    path = os.path.join(braid.iteration_directory(load, iteration), "metadata.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such checkpoint") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    except OSError as e:  # a directory, unreadable
        raise ValueError(f"{path}: {e.strerror}, expected braid's metadata.json") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: not a JSON object (braid's metadata.json)")
    if not isinstance(meta.get("config"), dict):
        raise ValueError(f"{path}: no model config")
    return iteration, meta


def config_from_metadata(config: dict, device: str = "cpu") -> braid.TransformerConfig:
    """The TransformerConfig a checkpoint's metadata.json describes. On the CPU parameters are
    f32 (the CPU computes in f32) whatever dtype the run trained in."""
    cfg = braid.TransformerConfig()
    for key in _CONFIG_KEYS:
        if key in config:
            setattr(cfg, key, config[key])
    if config.get("multi_latent_attention"):
        cfg.kv_channels = 0  # saved as the head width, qk_head_dim + qk_pos_emb_head_dim
    if device == "cpu":
        cfg.params_dtype = "f32"
    cfg.hidden_dropout = 0.0
    cfg.attention_dropout = 0.0
    cfg.validate()
    return cfg


def load_model(load: str, iteration: int | None = None, device: str = "cpu"
               ) -> tuple[braid.GPTModel, dict]:
    """(model, metadata) - a one-process GPTModel on `device` holding the parameters of the
    checkpoint (latest, or `iteration`) in directory `load`, saved under any layout."""
    iteration, meta = checkpoint_metadata(load, iteration)
    cfg = config_from_metadata(meta["config"], device)
    model = braid.GPTModel(cfg, device=device, seed=0)
    braid.load_parameters(load, model, iteration=iteration)  # no optimizer state allocated
    return model, meta


def filter_logits(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    """Rows of logits [B, V] scaled by the temperature, with -inf where top-k or top-p drop a
    token (f64)."""
    x = np.asarray(logits, dtype=np.float64) / sampling.temperature
    vocab = x.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = np.partition(x, vocab - sampling.top_k, axis=-1)[:, vocab - sampling.top_k]
        x = np.where(x < kth[:, None], -np.inf, x)  # ties with the k-th stay, as in HF
    if sampling.top_p < 1.0:
        order = np.argsort(-x, axis=-1, kind="stable")
        sorted_x = np.take_along_axis(x, order, axis=-1)
        p = np.exp(sorted_x - sorted_x[:, :1])
        p /= p.sum(axis=-1, keepdims=True)
        before = np.cumsum(p, axis=-1) - p  # probability of the more likely tokens
        drop_sorted = before >= sampling.top_p
        drop_sorted[:, 0] = False
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        x = np.where(drop, -np.inf, x)
    return x


def sample_next(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> np.ndarray:
    """One token per row of logits [B, V] (int64 [B])."""
    logits = np.asarray(logits)
    if sampling.is_greedy:
        return np.argmax(logits, axis=-1)
    x = filter_logits(logits, sampling)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(len(x)) * cdf[:, -1]
    tokens = np.array([np.searchsorted(row, ui, side="right") for row, ui in zip(cdf, u)])
    return np.minimum(tokens, x.shape[-1] - 1)  # u * total rounds to total: the last kept


def generate(model: braid.GPTModel, prompts: list[list[int]], max_new_tokens: int,
             sampling: Sampling | None = None, seed: int = 0, stop_token: int | None = None
             ) -> list[list[int]]:
    """The new tokens of each prompt (a list of token ids): up to max_new_tokens, fewer when
    the sequence produced stop_token (which ends it and is included).

    ValueError for an empty prompt or when prompt + max_new_tokens exceed the model's
    max_position_embeddings."""
    sampling = sampling or Sampling()
    sampling.check()
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    limit = model.config.max_position_embeddings
    for p in prompts:
        if len(p) == 0:
            raise ValueError("empty prompt: give at least one token")
        if len(p) + max_new_tokens > limit:
            raise ValueError(f"a prompt of {len(p)} tokens + {max_new_tokens} new tokens exceed "
                             f"the model's max_position_embeddings {limit}")
    rng = np.random.default_rng(seed)
    out: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return out
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    for length, rows in sorted(by_length.items()):
        ids = np.array([prompts[i] for i in rows], dtype=np.int32)
        cache = model.kv_cache(len(rows), length + max_new_tokens)
        logits = np.from_dlpack(model.decode(ids, cache, last_only=True))[:, -1]
        done = np.zeros(len(rows), dtype=bool)
        for step in range(max_new_tokens):
            tokens = sample_next(logits, sampling, rng)
            for r, i in enumerate(rows):
                if not done[r]:
                    out[i].append(int(tokens[r]))
                    done[r] = stop_token is not None and int(tokens[r]) == stop_token
            if done.all() or step == max_new_tokens - 1:
                break
            step_ids = tokens.astype(np.int32).reshape(-1, 1)
            logits = np.from_dlpack(model.decode(step_ids, cache))[:, -1]
    return out
