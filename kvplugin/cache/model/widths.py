"""What a model's attention layers put in their caches: head and cache widths from its config.

Why a module of its own: the codec checks its group size against these widths before a
server starts (:mod:`kvplugin.cache.service.startup_checks`), and admission control sizes a prompt's cache
from the same config fields (:mod:`kvplugin.cache.memory.footprint`); neither needs the codec.
"""

from __future__ import annotations

from typing import Any

__all__ = ["head_dim_of", "cache_widths", "validate_group_size_for_model"]

ALLOWED_GROUP_SIZES = (32, 64, 128)  # what mx.quantize groups by


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _field(obj: Any, name: str) -> Any:
    """An attribute, else a dict item: ``mlx.nn.Module`` *is* a dict (of its children), so
    attributes such as ``model.args`` must be looked up first."""
    value = getattr(obj, name, None)
    if value is None and isinstance(obj, dict):
        value = obj.get(name)
    return value


def _pos_int(x: Any) -> int | None:
    return x if _is_int(x) and x > 0 else None


def _configs(model: Any) -> list[Any]:
    """The model's ``args`` (or its language model's), then their ``text_config``."""
    args = _field(model, "args")
    if args is None:
        lm = _field(model, "language_model")
        args = _field(lm, "args") if lm is not None else None
    if args is None:
        return []
    text = _field(args, "text_config")
    return [args] if text is None else [args, text]


def head_dim_of(model: Any) -> int | None:
    """The attention head dimension from ``model.args`` (or a nested ``text_config``).

    ``head_dim`` when given, else ``hidden_size // num_attention_heads``; None when unknown
    (then callers skip the check and :func:`quantize_entry` still checks each layer's arrays).
    """
    for cfg in _configs(model):
        head_dim = _pos_int(_field(cfg, "head_dim"))
        if head_dim:
            return head_dim
        hidden, heads = (
            _pos_int(_field(cfg, "hidden_size")),
            _pos_int(_field(cfg, "num_attention_heads")),
        )
        if hidden and heads and hidden % heads == 0:
            return hidden // heads
    return None


def cache_widths(model: Any) -> dict[str, int] | None:
    """Last-axis widths of what the model's attention layers put in their caches, by role.

    Why not the head dimension: MLA models (DeepSeek-V2/V3, Kimi-K2) cache the compressed KV
    latent (``kv_lora_rank`` wide) in the keys slot and the rope key (``qk_rope_head_dim``)
    in the values slot, while ``hidden_size / num_attention_heads`` (56 for DeepSeek-V3) is
    not a cache width at all. None when unknown (then :func:`quantize_entry` still checks
    each layer's arrays, and skips what it cannot quantize).
    """
    for cfg in _configs(model):
        latent, rope = _pos_int(_field(cfg, "kv_lora_rank")), _pos_int(_field(cfg, "qk_rope_head_dim"))
        if latent and rope:
            return {"keys (kv latent)": latent, "values (rope key)": rope}
        head_dim = head_dim_of({"args": cfg})
        if head_dim:
            return {"keys": head_dim, "values": _pos_int(_field(cfg, "v_head_dim")) or head_dim}
    return None


def validate_group_size_for_model(model: Any, group_size: int) -> list[str]:
    """Check ``group_size`` against the widths the model's cache really holds.

    ``mx.quantize`` needs the group size to divide the last dimension. Raises ``ValueError``
    only when it divides *none* of them (nothing could be stored quantized: a silent no-op
    otherwise); returns the widths it does not divide, which stay full precision (the caller
    says so once). Does nothing when the widths are unknown.
    """
    widths = cache_widths(model)
    if not widths:
        return []
    left = [f"{role} {w}" for role, w in widths.items() if w % group_size]
    if len(left) < len(widths):
        return left
    dims = sorted(set(widths.values()))
    fits = [g for g in ALLOWED_GROUP_SIZES if any(d % g == 0 for d in dims)]
    advice = (
        "use one of: " + ", ".join(map(str, fits))
        if fits
        else f"none of the supported group sizes {ALLOWED_GROUP_SIZES} does, so KV cache "
        "quantization cannot be used with this model"
    )
    what = "head dimension" if set(widths) == {"keys", "values"} else "cache widths"
    raise ValueError(
        f"group size {group_size} does not divide the model's {what} "
        f"{'/'.join(map(str, dims))}; {advice}"
    )
