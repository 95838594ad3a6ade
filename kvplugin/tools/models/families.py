"""Tiny random-weight models of other architectures, built offline from mlx-lm's own classes.

Why: kvplugin must store, reuse, quantize and bound the caches of every family mlx-lm serves,
not only llama's ``KVCache``. These models are a few layers and a few hundred KiB each, use
the tiny model's tokenizer, and are built reproducibly (``mx.random.seed``) into kvplugin's
home. ``FAMILIES`` says which mlx-lm versions have each architecture.

So far: ``mamba`` (state-space: ``ArraysCache`` only, no token count) and ``deepseek_v3``
(MLA: the cache holds the kv latent and the rope key; ``hidden_size / num_attention_heads``
is 56, not a multiple of 64, as in the real DeepSeek-V3).
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
}


def available(family: str, mlx_lm_version: str) -> bool:
    """Whether the installed mlx-lm has this architecture."""
    return Version(mlx_lm_version) >= Version(FAMILIES[family]["since"])


def build_family_model(family: str, directory: Path | None = None, *, seed: int = 0) -> Path:
    """Build (or reuse) the tiny ``family`` model; returns its directory."""
    from kvplugin.tools.models.tiny import build_derived_model, kvplugin_home

    def make(target: Path, tiny_cfg: dict) -> None:
        import mlx.core as mx
        import mlx_lm.utils as mlx_utils

        cfg = dict(FAMILIES[family]["config"], vocab_size=tiny_cfg["vocab_size"],
                   torch_dtype="float32")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            cfg[key] = tiny_cfg[key]
        mx.random.seed(seed)
        model_cls, args_cls = mlx_utils._get_classes(cfg)
        model = model_cls(args_cls.from_dict(cfg))
        mx.eval(model.parameters())
        mlx_utils.save_model(target, model)
        mlx_utils.save_config(cfg, config_path=target / "config.json")

    target = directory or kvplugin_home() / f"family-{family}-v{VERSION}"
    return build_derived_model(Path(target), seed, make, label=f"family-{family}-v{VERSION}")
