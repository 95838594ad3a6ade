"""Which RoPE each of a model's layers applies to its keys before they enter the cache.

Why a module of its own: keys quantized per channel lose least when the position's rotation
is taken out first (pre-RoPE keys, :mod:`kvplugin.cache.codec.prerope`): after RoPE, a
channel pair swings with the position, so one group's range covers the swing rather than the
channel's own spread. The engine learns the ropes once from the loaded model the host hands
it (:meth:`kvplugin.cache.service.service.KVService.learn_model`), reading the model's own
rope modules; it never imports a host.

Only model families whose attention is known to apply ``self_attn.rope`` to the whole key
head at the cache's offset, right before the cache update, are read: elsewhere a rope module
may cover part of another tensor (MLA's rope key), be skipped on some layers (NoPE), or
scale the keys besides, and storing such keys "pre-RoPE" would be wrong. Those layers are
stored as before (post-RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["KeyRope", "KNOWN_MODEL_TYPES", "key_ropes", "parse_record"]

#: ``model_type`` of the families whose layers apply ``self_attn.rope`` (an ``nn.RoPE``) to
#: every key head at ``cache.offset`` just before ``cache.update_and_fetch``
KNOWN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")
#: What a layer's record of its keys' rope starts with
_PREFIX = "rope"


@dataclass(frozen=True)
class KeyRope:
    """``mx.fast.rope``'s parameters of one layer's keys (``nn.RoPE``'s fields)."""

    dims: int
    traditional: bool
    base: float
    scale: float

    @property
    def record(self) -> str:
        """How a stored layer records it (a scalar the SSD and remote formats carry)."""
        return f"{_PREFIX}:{self.dims}:{int(self.traditional)}:{self.base!r}:{self.scale!r}"


def parse_record(text: Any) -> KeyRope | None:
    """The :class:`KeyRope` a stored layer's record names, or None for one this version
    cannot read."""
    if not isinstance(text, str):
        return None
    parts = text.split(":")
    if len(parts) != 5 or parts[0] != _PREFIX or parts[2] not in ("0", "1"):
        return None
    try:
        rope = KeyRope(int(parts[1]), parts[2] == "1", float(parts[3]), float(parts[4]))
    except ValueError:
        return None
    if rope.dims <= 0 or rope.dims % 2 or not rope.base > 0 or rope.scale == 0:
        return None
    return rope if rope.record == text else None


def _model_type(model: Any) -> str | None:
    for owner in (model, getattr(model, "language_model", None)):
        args = getattr(owner, "args", None)
        kind = getattr(args, "model_type", None)
        if isinstance(kind, str):
            return kind
    return None


def _one(layer: Any, width: int | None) -> KeyRope | None:
    import mlx.nn as nn

    rope = getattr(getattr(layer, "self_attn", None), "rope", None)
    if type(rope) is not nn.RoPE:  # scaled variants (Llama 3, YaRN, ...) stay post-RoPE
        return None
    dims, base, scale = rope.dims, rope.base, rope.scale
    if (not isinstance(dims, int) or dims <= 0 or dims % 2 or (width and dims > width)
            or not isinstance(base, (int, float)) or not isinstance(scale, (int, float))
            or not base > 0 or scale == 0):
        return None
    return KeyRope(dims, bool(rope.traditional), float(base), float(scale))


def key_ropes(model: Any, cache: list) -> tuple[KeyRope | None, ...] | None:
    """Each cache layer's key rope (None where unknown), for a fresh ``cache`` of ``model``
    (``make_prompt_cache``'s: one per layer); None when nothing is known (a family outside
    :data:`KNOWN_MODEL_TYPES`, a cache not one per layer)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from kvplugin.cache.model.widths import head_dim_of

    if _model_type(model) not in KNOWN_MODEL_TYPES:
        return None
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (list, tuple)) or len(layers) != len(cache):
        return None
    width = head_dim_of(model)
    ropes = tuple(_one(layer, width) if type(c) in (KVCache, RotatingKVCache) else None
                  for layer, c in zip(layers, cache))
    return ropes if any(ropes) else None
