"""Turn a llama-architecture GGUF file into the pieces of an mlx-lm model directory.

Three pure conversions, each from what ``mx.load(path, return_metadata=True)`` returns:

- :func:`llama_config` — ``config.json`` from the ``llama.*`` metadata;
- :func:`llama_weights` — mlx-lm llama parameter names, dequantized to float32/float16,
  with llama.cpp's Q/K row permutation undone;
- :func:`build_tokenizer` / :func:`tokenizer_files` — a Hugging Face fast tokenizer rebuilt
  from the GGUF vocabulary, merges and special-token ids, with the chat template.

WHY dequantize: MLX reads GGUF Q4_0/Q4_1/Q8_0 tensors as its own affine-quantized arrays
(weight, scales, biases; group 32). On a CPU, MLX's quantized and float16 matmuls are slow,
while float32 goes through BLAS; so the builder stores dense weights. The dequantization is
done in float32 from the float16 scales and biases, exactly like llama.cpp's reference
dequantization (``x = q * d + m``), so the float32 weights are the GGUF's values bit for bit.

WHY un-permute: llama.cpp's converter reorders the rows of every head of ``attn_q`` and
``attn_k`` so that its rope rotates adjacent pairs (0,1), (2,3), ...; Hugging Face and
mlx-lm's llama (``rope_traditional=False``) rotate the two halves of a head (i, i + d/2).
:func:`unpermute_rope` is the inverse of ``convert_hf_to_gguf.LlamaModel.permute``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

__all__ = [
    "GGUFError",
    "llama_config",
    "unpermute_rope",
    "llama_weights",
    "build_tokenizer",
    "tokenizer_files",
]

# GGUF tensor name (after "blk.N.") -> mlx-lm llama name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)$")

# GGUF token types (llama.cpp's llama_token_type): 3 = control, 4 = user-defined.
_SPECIAL_TOKEN_TYPES = (3, 4)
_DTYPES = ("float32", "float16")


class GGUFError(ValueError):
    """The GGUF file lacks something the conversion needs, or holds something it cannot map."""


def _scalar(meta: Mapping[str, Any], key: str) -> Any:
    try:
        value = meta[key]
    except KeyError:
        raise GGUFError(f"GGUF metadata has no {key!r}") from None
    return value.item() if hasattr(value, "item") else value


def _optional(meta: Mapping[str, Any], key: str) -> Any:
    return _scalar(meta, key) if key in meta else None


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not
    9.999999747378752e-06): 7 significant digits read back as the same float32."""
    return float(f"{float(value):.7g}")


def llama_config(meta: Mapping[str, Any], *, dtype: str = "float32") -> dict[str, Any]:
    """``config.json`` for mlx-lm's llama from GGUF metadata (architecture ``llama`` only).

    The embedding is tied (``tie_word_embeddings``) exactly when the GGUF has no
    ``output.weight``; callers pass that in through :func:`llama_weights`, which checks it.
    """
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"GGUF architecture {arch!r} is not 'llama'")
    hidden = int(_scalar(meta, "llama.embedding_length"))
    heads = int(_scalar(meta, "llama.attention.head_count"))
    kv_heads = int(_optional(meta, "llama.attention.head_count_kv") or heads)
    head_dim = int(_optional(meta, "llama.rope.dimension_count") or hidden // heads)
    if head_dim * heads != hidden:
        raise GGUFError(f"rope dimension {head_dim} x {heads} heads != hidden size {hidden}")
    vocab = _optional(meta, "llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(_optional(meta, "llama.rope.freq_base") or 10000.0),
        "rope_traditional": False,
        "vocab_size": int(vocab),
        "max_position_embeddings": int(_scalar(meta, "llama.context_length")),
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": dtype,
    }
    for key in ("bos", "eos", "padding"):
        value = _optional(meta, f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            cfg[f"{'pad' if key == 'padding' else key}_token_id"] = int(value)
    return cfg


def unpermute_rope(w: Any, n_heads: int) -> Any:
    """Undo llama.cpp's Q/K row order: per head, rows ``(d/2, 2)`` back to ``(2, d/2)``.

    llama.cpp stores ``w.reshape(h, 2, d/2, in).swapaxes(1, 2)``; this is its inverse.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise GGUFError(f"{rows} rows do not split into {n_heads} heads of even size")
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _dense(weights: Mapping[str, Any], stem: str):
    """The float32 tensor ``stem`` (``stem.weight`` plus, if quantized, scales/biases)."""
    import mlx.core as mx

    w = weights[f"{stem}.weight"]
    scales = weights.get(f"{stem}.scales")
    if scales is None:
        if not mx.issubdtype(w.dtype, mx.floating):
            raise GGUFError(f"{stem}.weight is {w.dtype} without scales (unsupported GGUF type)")
        return w.astype(mx.float32)
    biases = weights.get(f"{stem}.biases")
    # GGUF Q4_0/Q4_1/Q8_0 use 32-value groups; a uint32 word packs 32 / bits values.
    group_size = 32
    bits = w.shape[-1] * 32 // (scales.shape[-1] * group_size)
    if bits not in (4, 8) or w.shape[-1] * 32 != scales.shape[-1] * group_size * bits:
        raise GGUFError(f"{stem}: unexpected quantized layout {w.shape} / {scales.shape}")
    return mx.dequantize(w, scales.astype(mx.float32),
                         None if biases is None else biases.astype(mx.float32),
                         group_size=group_size, bits=bits)


def llama_weights(weights: Mapping[str, Any], cfg: Mapping[str, Any], *,
                  dtype: str = "float32") -> dict[str, Any]:
    """mlx-lm llama parameters (names sorted, arrays evaluated) from GGUF tensors."""
    import mlx.core as mx

    if dtype not in _DTYPES:
        raise GGUFError(f"dtype must be one of {_DTYPES}, not {dtype!r}")
    target = getattr(mx, dtype)
    stems = sorted({k.rsplit(".", 1)[0] for k in weights})
    out: dict[str, Any] = {}
    for stem in stems:
        block = _BLOCK.match(stem)
        if block:
            layer, part = block.groups()
            if part not in _LAYER_NAMES:
                raise GGUFError(f"unknown GGUF tensor {stem!r}")
            name = f"model.layers.{layer}.{_LAYER_NAMES[part]}.weight"
        elif stem in _TOP_NAMES:
            part, name = stem, f"{_TOP_NAMES[stem]}.weight"
        else:
            raise GGUFError(f"unknown GGUF tensor {stem!r}")
        w = _dense(weights, stem)
        if part == "attn_q":
            w = unpermute_rope(w, cfg["num_attention_heads"])
        elif part == "attn_k":
            w = unpermute_rope(w, cfg["num_key_value_heads"])
        out[name] = w.astype(target)
        mx.eval(out[name])
    if ("lm_head.weight" in out) == cfg["tie_word_embeddings"]:
        raise GGUFError("tie_word_embeddings does not match the presence of output.weight")
    expected = 2 + cfg["num_hidden_layers"] * len(_LAYER_NAMES) + (not cfg["tie_word_embeddings"])
    if len(out) != expected:
        raise GGUFError(f"{len(out)} tensors mapped, expected {expected}")
    return out


# --------------------------------------------------------------------------- #
# tokenizer


def _special_ids(meta: Mapping[str, Any]) -> list[int]:
    types = meta["tokenizer.ggml.token_type"].tolist()
    return [i for i, t in enumerate(types) if t in _SPECIAL_TOKEN_TYPES]


def build_tokenizer(meta: Mapping[str, Any]):
    """A ``tokenizers.Tokenizer``: byte-level BPE from ``tokenizer.ggml.tokens``/``merges``.

    The pre-tokenizer follows ``tokenizer.ggml.pre``: ``smollm`` (like ``starcoder``) splits
    every digit on its own before GPT-2's regex, as SmolLM2's own tokenizer.json does.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if _scalar(meta, "tokenizer.ggml.model") != "gpt2":
        raise GGUFError("only byte-level BPE ('gpt2') GGUF tokenizers are supported")
    tokens = list(meta["tokenizer.ggml.tokens"])
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError("GGUF vocabulary has duplicate tokens")
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    if any(len(m) != 2 for m in merges):
        raise GGUFError("a GGUF merge is not two space-separated tokens")
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = _optional(meta, "tokenizer.ggml.pre") or "default"
    if pre in ("smollm", "starcoder"):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("default", "gpt-2"):
        tok.pre_tokenizer = byte_level
    else:
        raise GGUFError(f"unsupported GGUF pre-tokenizer {pre!r}")
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in _special_ids(meta)])
    for i in _special_ids(meta):
        if tok.token_to_id(tokens[i]) != i:
            raise GGUFError(f"special token {tokens[i]!r} did not keep id {i}")
    return tok


def tokenizer_files(meta: Mapping[str, Any], tok) -> dict[str, str]:
    """``tokenizer.json``, ``tokenizer_config.json`` (with the GGUF chat template) and
    ``special_tokens_map.json``, as text."""
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        value = _optional(meta, f"tokenizer.ggml.{key}_token_id")
        return None if value is None else tokens[int(value)]

    special = _special_ids(meta)
    named = {k: token(k) for k in ("bos", "eos", "unknown", "padding")}
    extra = [t for t in (named["bos"], named["eos"]) if t is not None]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": named["bos"],
        "eos_token": named["eos"],
        "unk_token": named["unknown"],
        "pad_token": named["padding"],
        "additional_special_tokens": list(dict.fromkeys(extra)),
        "added_tokens_decoder": {
            str(i): {"content": tokens[i], "lstrip": False, "normalized": False,
                     "rstrip": False, "single_word": False, "special": True}
            for i in special
        },
        "add_bos_token": bool(_optional(meta, "tokenizer.ggml.add_bos_token") or False),
        "add_eos_token": bool(_optional(meta, "tokenizer.ggml.add_eos_token") or False),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length")),
        "chat_template": _scalar(meta, "tokenizer.chat_template"),
    }
    special_map = {k: v for k, v in (("bos_token", named["bos"]), ("eos_token", named["eos"]),
                                      ("unk_token", named["unknown"]),
                                      ("pad_token", named["padding"])) if v is not None}
    special_map["additional_special_tokens"] = config["additional_special_tokens"]
    return {
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
        "special_tokens_map.json": json.dumps(special_map, indent=2) + "\n",
    }
