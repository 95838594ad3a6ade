"""mlx-openai-server adapter: the seams of ``mlx-openai-server launch`` (``--model-type lm``).

The host runs in two processes: the server (FastAPI, the ``launch`` command) and a *spawned*
child per model that loads the model and generates. kvplugin's ``.pth`` bootstrap runs in
both; the trigger ``app.server`` is imported by both, ``app.cli`` by the server only.
Everything host-specific lives here; every decision is
:class:`kvplugin.cache.service.service.KVService`'s, in the child, where the caches live.

One job per module:

* :mod:`.adapter` - the adapter: the server's seams checked and patched (all or none), the
  child's on its first language-model handler;
* :mod:`.options` - kvplugin's options on the click ``launch`` command, checked before the
  server listens and handed to the child through ``KVPLUGIN_*`` variables;
* :mod:`.prompt_cache` - :class:`KVPluginOaiPromptCache`, the host's ``LRUPromptCache``
  over the service;
* :mod:`.handler` - the child's seams: the prompt cache, ``make_prompt_cache``, mlx-lm's
  batch caches, admission and the report methods the server calls;
* :mod:`.salt` - a request's ``cache_salt`` carried to the prompt cache on both paths;
* :mod:`.routes` - ``GET /kvplugin/stats`` and ``GET /metrics`` on the server's FastAPI app.

Seams (mlx-openai-server 1.8.x):

``app.cli.launch`` (server)
    A click command: kvplugin's options are appended to its ``params`` and its callback
    wrapped: the settings are resolved (flag > env > file) and checked with the host's
    ``--prompt-cache-dir`` as the SSD tier, ``--kv-bits`` and ``--draft-model-path``, and the
    model's ``config.json``; a bad value is click's usage error (exit 2) naming flag and
    variable, before anything starts. Given flags are exported as ``KVPLUGIN_*`` variables,
    which the spawned child inherits.
``app.server.setup_server`` (server)
    Wrapped: ``/kvplugin/stats`` and ``/metrics`` are added to the app it builds; they ask
    the model's child through ``HandlerProcessProxy._call``.
``app.server.create_handler_from_config`` (child)
    Wrapped: before the first ``lm`` handler is built, the child's seams are checked and
    patched (:func:`kvplugin.hosts.mlx_openai_server.handler.install_child`).
``app.utils.prompt_cache.LRUPromptCache``
    Replaced (``MLXLMHandler.__init__`` imports it by name) by :class:`KVPluginOaiPromptCache`:
    ``--prompt-cache-size`` and ``--max-bytes`` are the store's bounds, ``--prompt-cache-dir``
    its SSD tier (checked safetensors files, never pickles).
``make_prompt_cache``
    Rebound in ``mlx_lm.models.cache`` (what ``BatchGenerator`` calls) and
    ``app.models.mlx_lm`` (a by-name copy): the original, then ``service.make_cache``.
``BatchKVCache.merge`` / ``filter`` / ``extract`` and the batch caches' ``step``
    As for mlx-lm's own batched path (:mod:`kvplugin.hosts.mlx_lm.batch`).
``MLXLMHandler.__init__`` / ``_build_inference_context`` / ``generate_text_response`` /
``generate_text_stream``
    Wrapped: the model is bound to the prompt cache; ``--max-memory`` admits each request
    once its prompt is tokenized and releases it when its answer ends; before that, the
    request's ``cache_salt`` (kept by its request model) is checked and carried
    (:mod:`.salt`: ``_PendingRequest``, ``BatchScheduler.__init__`` and ``BatchGenerator``'s
    ``insert_segments`` / ``extract_cache`` / ``next`` too).

Importing this package imports neither the host nor mlx.
"""

from __future__ import annotations

from kvplugin.hosts.mlx_openai_server.adapter import ADAPTER, MlxOpenaiServerAdapter, on_import

__all__ = ["ADAPTER", "MlxOpenaiServerAdapter", "on_import"]
