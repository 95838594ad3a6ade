"""Which codec a quantized entry is stored with: the names and ``auto``'s choice.

Why a module of its own: the settings (no MLX imported), the default quantize hook, the
remote tier's namespace and ``/kvplugin/stats`` all need the same resolved answer to "what
does ``--kv-cache-codec auto`` with these bits mean", so it is decided once, here.

``auto`` (the default) is what ``kvplugin bench --quality --real-model`` measured best
(docs/benchmarks.md, SmolLM2-135M, 10 real-text windows x 200 tokens): keys rotated and
quantized per channel (``rotated-channel``) at every width. At 8 bits plain ``affine`` is
close (mean KL 2.2e-5) but flips 0.15% of greedy tokens, which ended a quarter of the
200-token greedy continuations early; ``rotated-channel`` flipped none (7.9e-6) at the same
bytes, for about twice the restore time on a CPU. Below 6 bits the first 4 tokens (attention
sinks) and the last 16 are kept at full precision besides; at 6 bits and more they are not
needed (the 8-bit figures are without them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CODECS", "CHOICES", "CODEC_ATTR", "SEED_ATTR", "CodecPlan", "UnknownCodec",
           "codec_plan"]

CODECS = ("affine", "rotated", "rotated-channel")  # what kvplugin.cache.quantize can read
CHOICES = ("auto",) + CODECS
#: What a stored layer records its codec and rotation seed under (scalar attributes, which
#: the SSD and remote formats carry); a layer without the codec attribute is ``affine``.
CODEC_ATTR = "kvplugin_codec"
SEED_ATTR = "kvplugin_codec_seed"
#: what ``auto`` resolves to
AUTO_CODEC = "rotated-channel"
#: Sink and recent tokens kept at full precision when not given, for the rotated codecs
#: below :data:`PROTECT_BELOW_BITS` (of the narrower of keys and values): they need the
#: sinks (whose huge keys otherwise set the range of a whole group). ``affine``: none.
PROTECTED_DEFAULT = (4, 16)
PROTECT_BELOW_BITS = 6


class UnknownCodec(ValueError):
    """A stored layer names a codec (or parameters) this kvplugin cannot decode: a miss."""


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
    value_bits = settings.kv_cache_value_bits or bits
    codec = AUTO_CODEC if settings.kv_cache_codec == "auto" else settings.kv_cache_codec
    protect = codec != "affine" and min(key_bits, value_bits) < PROTECT_BELOW_BITS
    sink, recent = PROTECTED_DEFAULT if protect else (0, 0)
    if settings.kv_cache_sink_tokens is not None:
        sink = settings.kv_cache_sink_tokens
    if settings.kv_cache_recent_tokens is not None:
        recent = settings.kv_cache_recent_tokens
    return CodecPlan(codec, key_bits, value_bits,
                     settings.kv_cache_quantization_group_size, sink, recent)
