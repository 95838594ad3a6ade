"""THE CONTRACT: every public kvplugin hook.

A plugin replaces one of kvplugin's decisions by implementing a hook, never by patching.
Rules that keep this API stable (docs/hooks.md repeats them):

* Hooks are called with keyword arguments only; a plugin may accept fewer arguments.
* Arguments are only ever *added*, never removed or renamed; a name never changes meaning.
* ``firstresult`` hooks: the first non-``None`` result wins. kvplugin's built-ins are
  registered ``trylast``, so any installed plugin runs before them and overrides them by
  returning a value; returning ``None`` defers to the next implementation.
* Strategies are called once per cache event (build, store, fetch, evict), never per token.
* ``HOOK_API_VERSION`` counts additions to this contract. A plugin written against a newer
  contract sets ``kvplugin_hook_api_version = N`` on its module or object; kvplugin refuses to
  load it (with one message naming it) when ``N`` is above the version it speaks. An older
  plugin always loads: nothing is ever removed.
* kvplugin's own strategies are ordinary plugins, one per concern, registered under the
  names ``trim``, ``quantize``, ``bound`` and ``storage``; ``KVPLUGIN_BLOCK_PLUGINS=quantize``
  replaces one of them, ``builtin`` blocks all four.

``cache`` below is always a *cache entry*: the list of per-layer cache objects that
mlx-lm's ``make_prompt_cache`` returns (``KVCache``, ``QuantizedKVCache``,
``RotatingKVCache``, ...). Hooks receive and return the host's own cache classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

from kvplugin.types import ColdTier, StoreEntry

if TYPE_CHECKING:
    from kvplugin.settings import KVPluginSettings

PROJECT = "kvplugin"
#: Version 2 added ``kvplugin_unconfigure``; version 3 ``kvplugin_cache_event``; version 4
#: ``kvplugin_admit``; version 5 the ``prompt_boundaries`` argument of
#: ``kvplugin_quantize_entry``; version 6 its ``stored_prefix`` argument; version 7 the
#: ``seconds`` argument of ``kvplugin_cache_event``; version 8 the ``key_ropes`` argument of
#: ``kvplugin_quantize_entry`` and ``kvplugin_dequantize_entry``.
HOOK_API_VERSION = 8
#: The attribute a plugin sets to the contract version it needs.
API_VERSION_ATTR = "kvplugin_hook_api_version"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec(historic=True)
def kvplugin_configure(settings: KVPluginSettings, host: str) -> None:
    """Called once per process, after the settings are resolved and before serving.

    ``host`` is the adapter name (``"mlx-lm"``, ``"vllm-mlx"``) or ``"none"`` outside a
    host (``kvplugin info``). Historic: a plugin registered later still receives it.
    Raise :class:`kvplugin.settings.SettingsError` to stop the host at start-up with a
    message (every host exits with status 2 and prints it).
    """


@hookspec
def kvplugin_unconfigure(settings: KVPluginSettings, host: str) -> None:
    """Called once at shut-down, after the store has been flushed and closed.

    The counterpart of ``kvplugin_configure``: release what it acquired (connections,
    threads, files). Nothing is stored or fetched after it. Results are ignored.
    """


@hookspec(firstresult=True)
def kvplugin_make_cache(model: Any, cache: list, settings: KVPluginSettings) -> list | None:
    """Shape the fresh per-request cache the host has just built for ``model``.

    Called each time the host makes a new cache (one call per request, not per token).
    Return a replacement list (same length, one cache per layer) or ``None`` to keep
    ``cache``. The built-in bounds plain layers with a rotating cache grown up to the bound when
    ``settings.max_kv_size`` is set and applies ``settings.kv_cache_step`` otherwise.
    """


@hookspec(firstresult=True)
def kvplugin_trim_entry(cache: list) -> list | None:
    """Cut an entry to its used length before it is stored.

    Return the trimmed list (layers already exact may be returned as they are) or
    ``None`` to defer. The built-in copies each layer's used tokens into a fresh buffer
    so the oversized one is freed.
    """


@hookspec(firstresult=True)
def kvplugin_quantize_entry(
    cache: list, num_tokens: int, settings: KVPluginSettings,
    prompt_boundaries: tuple[int, ...], stored_prefix: list | None,
    key_ropes: tuple | None,
) -> list | None:
    """Quantize an entry of ``num_tokens`` tokens before it is stored.

    Called only when ``settings.kv_cache_quantization`` is on. Return the entry to store
    (quantized layers should be mlx-lm ``QuantizedKVCache``), or ``None`` to decline and
    store it as it is (the built-in declines below ``kv_cache_min_quantize_tokens``).
    ``prompt_boundaries`` (ascending, each below ``num_tokens``): where earlier prompts that
    this entry starts with ended, i.e. where a later request (a repeated or edited turn) is
    likely to reuse a prefix of it; the built-in keeps the tokens before each at full
    precision like the entry's last ones (API version 5). ``stored_prefix`` (API version
    6): the layers of an entry the store holds for this entry's first tokens, as a codec
    stored them, or ``None``; the built-in copies the rows it wrote with the same codec
    rather than quantize them again (a turn then costs its new tokens, not its history).
    ``key_ropes`` (API version 7): each layer's key rope
    (:class:`kvplugin.cache.model.rope.KeyRope`, None where unknown) of the model the host
    loaded, or ``None``; the built-in stores per-channel keys pre-RoPE with it.
    """


@hookspec(firstresult=True)
def kvplugin_dequantize_entry(cache: list, settings: KVPluginSettings,
                              key_ropes: tuple | None) -> list | None:
    """Restore a stored entry for a host path that cannot use quantized layers.

    Return the full-precision entry, or ``None`` if there is nothing to restore.
    ``key_ropes`` (API version 7): as for ``kvplugin_quantize_entry``; the built-in puts
    each rope back on keys stored pre-RoPE, and an entry whose rope it does not give is a
    miss.
    """


@hookspec(firstresult=True)
def kvplugin_store_backend(settings: KVPluginSettings) -> ColdTier | None:
    """Provide the cold tier that evicted hot entries spill to.

    Called when a host's prompt store is created, and again when a host persists its
    prompt cache across restarts (then ``settings.ssd_cache_dir`` is the directory the host
    keeps it in). Return an object implementing :class:`kvplugin.types.ColdTier`, or
    ``None`` for no cold tier (evictions are discarded). The built-in returns an SSD tier
    when ``settings.ssd_cache_dir`` is set. Never called under ``settings.hot_cache_only``:
    kvplugin then keeps nothing outside RAM, whatever plugins are installed.
    """


@hookspec
def kvplugin_on_evict(entry: StoreEntry, settings: KVPluginSettings) -> None:
    """Observe an entry leaving the hot tier (spilled or discarded). Results are ignored."""


@hookspec
def kvplugin_cache_event(event: str, tokens: int, nbytes: int, seconds: float) -> None:
    """Observe one cache event as it happens: ``fetch`` (a hit: ``tokens`` reused),
    ``miss``, ``dequantize``, ``trim``, ``quantize``, ``store`` (``nbytes`` stored),
    ``evict``, ``spill`` (an entry the cold tier accepted: ``nbytes`` it held in memory),
    ``demote`` (the pressure policy's worker quantized a stored entry in place). ``seconds``: how long the event's codec
    work took (a demotion's; 0 where not measured). Results are ignored.

    Why: memory across a reuse is decided by what happens at these moments, so a tracer
    (``python -m kvplugin.tools.memtrace``) or a metrics plugin reads memory right here,
    from one place, instead of patching every seam a second time. Called on the thread
    doing the work; keep it cheap.
    """


@hookspec(firstresult=True)
def kvplugin_admit(need: int, limit: int, in_use: int, stored: int,
                   settings: KVPluginSettings) -> int | None:
    """Admission policy (``--max-memory``): called once per request, before its prefill.

    ``need``: kvplugin's estimate of the bytes the request adds to MLX's memory (its KV cache
    for prompt + max_tokens, one prefill chunk, the fetched entry's dequantize transient).
    ``limit``: the limit in force. ``in_use``: bytes reserved by requests in flight.
    ``stored``: bytes of stored entries (evictable). Return an HTTP status: 200 admits (the
    request still counts against the limit), 413 or 503 refuses; ``None`` leaves the
    decision to kvplugin (admit if it fits, evicting stored entries first; 413 if it can
    never fit; 503 + ``Retry-After`` while requests in flight hold the memory). Not called
    when admission control is off (``--max-memory off``).
    """
