"""The layer vocabulary: the one module that knows mlx-lm's cache classes.

Why one module: trimming, pricing, quantizing, prefix copies and the cold tier each need to
know, per cache class, how many tokens a layer holds, where its arrays are, whether it can be
cut to a prefix, trimmed exactly or quantized. Written once here, a new class (a chunked,
recurrent, MLA or batch variant) is taught to kvplugin in one place.

Two ways of naming a layer, on purpose:

* its **kind** (:class:`LayerKind`, looked up by *exact* class in :data:`KINDS`): what kvplugin
  may do that depends on the meaning of ``offset`` and the buffer layout: exact trim, growth
  headroom, quantization. A subclass (a host's own) may give ``offset`` another meaning, so it
  gets nothing until registered with :func:`register_kind`.
* its **layout** (:func:`layout_of`, by ``isinstance`` against mlx-lm's base classes): which
  array fields it has, for prefix copies and (de)serialisation (``kvplugin.cache.tiers.serialize``),
  where a subclass with only extra *scalar* attributes is as portable as its base.

Everything here works on one entry (a list of layers) or one layer and never mutates its input
unless the docstring says so. This package's face gathers its modules: accounting (bytes, tokens), kinds (exact class:
trim, quantizable), prefix (layouts, prefix copies), lend (what a moved entry leaves behind).
"""

from kvplugin.cache.layers.accounting import (dense_nbytes, entry_arrays, entry_nbytes,
                                              entry_tokens, layer_bits)
from kvplugin.cache.layers.kinds import (KINDS, LayerKind, is_exact, is_quantizable,
                                         register_kind, trim_layer, with_children)
from kvplugin.cache.layers.lend import copy_lent, lend_view, snapshot
from kvplugin.cache.layers.prefix import (KNOWN_FIELDS, can_copy_prefix, copy_floor, copy_prefix,
                                          extra_scalars, growth_of, is_trimmable, layout_of,
                                          prefix_views)

__all__ = [
    "KINDS", "KNOWN_FIELDS", "LayerKind", "can_copy_prefix", "copy_floor", "copy_lent",
    "copy_prefix", "dense_nbytes", "entry_arrays", "entry_nbytes", "entry_tokens",
    "extra_scalars", "growth_of", "is_exact", "is_quantizable", "is_trimmable", "layer_bits",
    "layout_of", "lend_view", "prefix_views", "register_kind", "snapshot", "trim_layer",
    "with_children",
]
