"""A llama whose memory its KV cache dominates: 32 layers x 1 KV head x 64, float32.

16 KiB of KV per token against ~6 MB of weights, so a server's memory across cache reuse
is almost only KV: the setting in which a reuse transient decides whether a 16 GB Mac
survives. Random weights (answers are gibberish but deterministic); the tokenizer is the
tiny model's. Built offline, reproducibly, once per cache directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

LAYERS, HEAD_DIM, HIDDEN, INTERMEDIATE = 32, 64, 64, 128
VERSION = 1
_MARKER = ".kvplugin-kv-heavy"


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
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs
    from mlx_lm.utils import save_config, save_model

    from kvplugin.tools.models.tiny import build_lock, build_tiny_model, kvplugin_home

    directory = Path(directory or kvplugin_home() / f"kv-heavy-v{VERSION}").expanduser().resolve()
    marker = directory / _MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("seed") == seed:
        return directory
    with build_lock(directory):
        if marker.is_file() and json.loads(marker.read_text()).get("seed") == seed:
            return directory
        tiny = build_tiny_model(directory.parent / f".{directory.name}-tokenizer")
        directory.mkdir(parents=True, exist_ok=True)
        for f in tiny.iterdir():
            if f.suffix == ".json" and f.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy(f, directory / f.name)
        cfg = config(json.loads((tiny / "config.json").read_text()))
        model = Model(ModelArgs.from_dict(cfg))
        rng = np.random.default_rng(seed)
        weights = []
        for name, value in sorted(tree_flatten(model.parameters())):
            if name.endswith("norm.weight"):
                w = np.ones(value.shape, np.float32)
            else:
                w = rng.standard_normal(value.shape).astype(np.float32) * (2.0 / np.sqrt(value.shape[-1]))
            weights.append((name, mx.array(w)))
        model.load_weights(weights)
        mx.eval(model.parameters())
        save_model(directory, model)
        save_config(cfg, config_path=directory / "config.json")
        marker.write_text(json.dumps({"version": VERSION, "seed": seed}))
    return directory
