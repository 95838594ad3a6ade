"""A llama whose memory its KV cache dominates: 32 layers x 1 KV head x 64, float32.

16 KiB of KV per token against ~6 MB of weights, so a server's memory across cache reuse
is almost only KV: the setting in which a reuse transient decides whether a 16 GB Mac
survives. Random weights (answers are gibberish but deterministic); the tokenizer is the
tiny model's. Built offline, reproducibly, once per cache directory.
"""

from __future__ import annotations

from pathlib import Path

LAYERS, HEAD_DIM, HIDDEN, INTERMEDIATE = 32, 64, 64, 128
VERSION = 1


def config(tiny_config: dict) -> dict:
    cfg = dict(tiny_config)
    cfg.update(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=1,
        num_key_value_heads=1, head_dim=HEAD_DIM, intermediate_size=INTERMEDIATE,
        torch_dtype="float32", max_position_embeddings=32768,
    )
    return cfg


def build_kv_heavy_model(directory: Path | None = None, *, seed: int = 0) -> Path:
    """Build (or reuse) the model in ``directory`` (default: under kvplugin's home)."""
    from kvplugin.home import kvplugin_home
    from kvplugin.tools.models.tiny import build_derived_model

    def make(target: Path, tiny_cfg: dict) -> None:
        import mlx.core as mx
        import numpy as np
        from mlx.utils import tree_flatten
        from mlx_lm.models.llama import Model, ModelArgs
        from mlx_lm.utils import save_config, save_model

        cfg = config(tiny_cfg)
        model = Model(ModelArgs.from_dict(cfg))
        rng = np.random.default_rng(seed)
        weights = []
        for name, value in sorted(tree_flatten(model.parameters())):
            if name.endswith("norm.weight"):
                w = np.ones(value.shape, np.float32)
            else:
                scale = 2.0 / np.sqrt(value.shape[-1])
                w = rng.standard_normal(value.shape).astype(np.float32) * scale
            weights.append((name, mx.array(w)))
        model.load_weights(weights)
        mx.eval(model.parameters())
        save_model(target, model)
        save_config(cfg, config_path=target / "config.json")

    target = directory or kvplugin_home() / f"kv-heavy-v{VERSION}"
    return build_derived_model(Path(target), seed, make, label=f"kv-heavy-v{VERSION}")
