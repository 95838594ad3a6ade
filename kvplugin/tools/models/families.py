"""Tiny random-weight models of other architectures, built offline from mlx-lm's own classes.

Why: kvplugin must store, reuse, quantize and bound the caches of every family mlx-lm serves,
not only llama's ``KVCache``. These models are a few layers and a few hundred KiB each, use
the tiny model's tokenizer, and are built reproducibly (``mx.random.seed``) into kvplugin's
home. ``FAMILIES`` says which mlx-lm versions have each architecture.

``mamba`` (state-space: ``ArraysCache`` only, no token count); ``deepseek_v3`` (MLA: the
cache holds the kv latent and the rope key; ``hidden_size / num_attention_heads`` is 56, not
a multiple of 64, as in the real DeepSeek-V3); ``gemma3_text`` and ``gpt_oss`` (sliding
window ``RotatingKVCache`` + full attention); ``qwen3_next`` (GatedDeltaNet ``ArraysCache`` +
attention); ``falcon_h1`` (``CacheList`` of a Mamba-2 state and attention per layer);
``llama4`` (``ChunkedKVCache`` + full attention; the multimodal ``llama4`` wrapper, whose text
model makes the chunked caches). Windows and chunks are 128
tokens, so a ~1k-token conversation wraps them. Weights are fp32 (``gpt_oss``'s attention
sinks need it; fp32 everywhere keeps the families alike).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from packaging.version import Version

VERSION = 1

FAMILIES: dict[str, dict[str, Any]] = {
    "mamba": {
        "since": "0.31.3",
        "config": dict(model_type="mamba", hidden_size=64, intermediate_size=128,
                       state_size=16, num_hidden_layers=2, conv_kernel=4, use_bias=False,
                       use_conv_bias=True, time_step_rank=8, tie_word_embeddings=True),
    },
    "deepseek_v3": {
        "since": "0.31.3",
        "config": dict(model_type="deepseek_v3", hidden_size=112, intermediate_size=128,
                       moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, n_shared_experts=1, n_routed_experts=2,
                       num_experts_per_tok=1, kv_lora_rank=64, q_lora_rank=None,
                       qk_rope_head_dim=64, v_head_dim=32, qk_nope_head_dim=32,
                       first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1,
                       max_position_embeddings=4096, rope_scaling=None),
    },
    # Sliding window (RotatingKVCache, 128) on layers 0-1 and full attention on layer 2:
    # a ~1k-token prompt wraps the window.
    "gemma3_text": {
        "since": "0.31.3",
        "config": dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=64, query_pre_attn_scalar=64, sliding_window=128,
                       sliding_window_pattern=3, max_position_embeddings=4096),
    },
    # Alternating sliding (128) / full attention, mixture of experts, attention sinks.
    "gpt_oss": {
        "since": "0.31.3",
        "config": dict(model_type="gpt_oss", hidden_size=64, intermediate_size=64,
                       num_hidden_layers=2, num_local_experts=2, num_experts_per_tok=1,
                       head_dim=64, num_attention_heads=2, num_key_value_heads=1,
                       sliding_window=128,
                       layer_types=["sliding_attention", "full_attention"]),
    },
    # GatedDeltaNet (ArraysCache, recurrent) on layers 0-2, attention (KVCache) on layer 3.
    "qwen3_next": {
        "since": "0.31.3",
        "config": dict(model_type="qwen3_next", hidden_size=64, num_hidden_layers=4,
                       intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=64, linear_num_value_heads=2, linear_num_key_heads=1,
                       linear_key_head_dim=32, linear_value_head_dim=32,
                       linear_conv_kernel_dim=4, num_experts=2, num_experts_per_tok=1,
                       decoder_sparse_step=1, shared_expert_intermediate_size=64,
                       mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6,
                       rope_theta=10000.0, partial_rotary_factor=0.25,
                       max_position_embeddings=4096, full_attention_interval=4,
                       tie_word_embeddings=False),
    },
    # Every layer a CacheList(ArraysCache (Mamba-2 state), KVCache (attention)).
    "falcon_h1": {
        "since": "0.31.3",
        "config": dict(model_type="falcon_h1", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=64, mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32,
                       mamba_d_state=16, mamba_chunk_size=64, mamba_n_groups=1,
                       max_position_embeddings=4096),
    },
    # Chunked attention (ChunkedKVCache, chunk 128) on layers 0-2, full attention on layer 3.
    # mlx-lm 0.31.3's own server fails on it once a prompt passes a chunk (a stock mask of
    # shape (1, 0) in the chunked layer's attention): served from 0.32.0 on.
    "llama4": {
        "since": "0.32.0",
        "config": dict(model_type="llama4", text_config=dict(
            model_type="llama4_text", attention_bias=False, attention_chunk_size=128,
            head_dim=64, hidden_size=64, interleave_moe_layer_step=2, intermediate_size=64,
            intermediate_size_mlp=128, max_position_embeddings=4096, num_attention_heads=2,
            num_experts_per_tok=1, num_hidden_layers=4, num_key_value_heads=1,
            num_local_experts=2, rms_norm_eps=1e-5, rope_scaling=None, rope_theta=500000.0,
            use_qk_norm=True, vocab_size=None)),
    },
}


def available(family: str, mlx_lm_version: str) -> bool:
    """Whether the installed mlx-lm has this architecture."""
    return Version(mlx_lm_version) >= Version(FAMILIES[family]["since"])


def build_family_model(family: str, directory: Path | None = None, *, seed: int = 0,
                       config: dict | None = None) -> Path:
    """Build (or reuse) the tiny ``family`` model; returns its directory. ``config``: fields
    that replace the family's (e.g. a real model's head width); then ``directory`` is needed."""
    if config and directory is None:
        raise ValueError("a family model with its own config needs its own directory")
    from kvplugin.home import kvplugin_home
    from kvplugin.tools.models.tiny import build_derived_model

    def make(target: Path, tiny_cfg: dict) -> None:
        import mlx.core as mx
        import mlx_lm.utils as mlx_utils

        cfg = dict(FAMILIES[family]["config"], **(config or {}),
                   vocab_size=tiny_cfg["vocab_size"], torch_dtype="float32")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            cfg[key] = tiny_cfg[key]
        if "text_config" in cfg:  # multimodal wrappers (llama4): the text model's own config
            cfg["text_config"] = dict(cfg["text_config"], vocab_size=tiny_cfg["vocab_size"])
        mx.random.seed(seed)
        model_cls, args_cls = mlx_utils._get_classes(cfg)
        model = model_cls(args_cls.from_dict(cfg))
        mx.eval(model.parameters())
        mlx_utils.save_model(target, model)
        mlx_utils.save_config(cfg, config_path=target / "config.json")

    target = directory or kvplugin_home() / f"family-{family}-v{VERSION}"
    return build_derived_model(Path(target), seed, make, label=f"family-{family}-v{VERSION}")
