"""kvplugin's own strategies: ordinary plugins, one module per concern.

Each module is registered under its own name (:data:`DEFAULT_PLUGINS`), so
``KVPLUGIN_BLOCK_PLUGINS=quantize`` replaces the quantizer and leaves trimming, bounding and
storage alone. Every implementation is ``trylast``: an installed plugin runs first and
overrides it by returning a non-``None`` value. Engine modules are imported inside the hooks:
registering the defaults must not load mlx.
"""

from __future__ import annotations

#: plugin name -> module; the names ``KVPLUGIN_BLOCK_PLUGINS`` and ``kvplugin info`` use.
DEFAULT_PLUGINS: dict[str, str] = {
    "trim": "kvplugin.default_plugins.trim",
    "quantize": "kvplugin.default_plugins.quantize",
    "bound": "kvplugin.default_plugins.bound",
    "storage": "kvplugin.default_plugins.storage",
}
