"""Which codec a quantized entry is stored with: the names and ``auto``'s choice.

Why a module of its own: the settings (no MLX imported), the default quantize hook, the
remote tier's namespace and ``/kvplugin/stats`` all need the same resolved answer to "what
does ``--kv-cache-codec auto`` with these bits mean", so it is decided once, here.

``auto`` (the default) is what ``kvplugin bench --quality --real-model`` measured best
(docs/benchmarks.md, SmolLM2-135M): at 6 or more key bits plain ``affine`` is already
within 1e-4 nats of the fp16 entry and the rotation only costs time; below, keys rotated and
quantized per channel (``rotated-channel``) with the first 4 tokens (attention sinks) and
the last 16 kept at full precision lose several times less than ``affine`` at the same size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CODECS", "CHOICES", "CodecPlan", "codec_plan"]

CODECS = ("affine", "rotated", "rotated-channel")  # what kvplugin.cache.quantize can read
CHOICES = ("auto",) + CODECS
#: ``auto`` keeps ``affine`` from this many key bits on.
AUTO_AFFINE_FROM_BITS = 6
#: Sink and recent tokens kept at full precision when not given: the rotated codecs need
#: the sinks (their huge keys otherwise set the range of a whole group).
PROTECTED_DEFAULT = {"affine": (0, 0), "rotated": (4, 16), "rotated-channel": (4, 16)}


@dataclass(frozen=True)
class CodecPlan:
    """A resolved codec: what :func:`kvplugin.cache.quantize.quantize_entry` is called with."""

    codec: str
    key_bits: int | None
    value_bits: int | None
    group_size: int
    sink_tokens: int
    recent_tokens: int

    @property
    def name(self) -> str:
        """As stored layers name it (``codec_name``), e.g. ``rotated-channel-k4v4-s4r16``."""
        extra = (f"-s{self.sink_tokens}r{self.recent_tokens}"
                 if self.sink_tokens or self.recent_tokens else "")
        return f"{self.codec}-k{self.key_bits}v{self.value_bits}{extra}"


def codec_plan(settings: Any) -> CodecPlan:
    """The codec ``settings`` ask for, ``auto`` and unset protections resolved."""
    bits = settings.kv_cache_quantization_bits
    key_bits = settings.kv_cache_key_bits or bits
    codec = settings.kv_cache_codec
    if codec == "auto":
        codec = "affine" if key_bits >= AUTO_AFFINE_FROM_BITS else "rotated-channel"
    sink, recent = PROTECTED_DEFAULT[codec]
    if settings.kv_cache_sink_tokens is not None:
        sink = settings.kv_cache_sink_tokens
    if settings.kv_cache_recent_tokens is not None:
        recent = settings.kv_cache_recent_tokens
    return CodecPlan(codec, key_bits, settings.kv_cache_value_bits or bits,
                     settings.kv_cache_quantization_group_size, sink, recent)
