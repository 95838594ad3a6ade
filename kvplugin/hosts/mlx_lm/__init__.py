"""mlx-lm adapter: the seams of ``mlx_lm.server`` and ``mlx_lm.models.cache``.

Installed by the bootstrap right after ``mlx_lm.server`` is imported (the
``mlx_lm.server`` console script and ``python -m mlx_lm server`` both import it).
Everything mlx-lm-specific lives here; every decision (trim, quantize, bound, spill)
is made by :class:`kvplugin.cache.service.service.KVService` and the hooks behind it.

One job per module:

* :mod:`.adapter` - the adapter: every seam checked, then patched (all or none); the
  server's options, start-up and the per-request cache;
* :mod:`.prompt_cache` - :class:`KVPluginPromptCache`, mlx-lm's ``LRUPromptCache`` over
  the service;
* :mod:`.routes` - ``GET /kvplugin/stats`` and ``GET /metrics``;
* :mod:`.batch` - the batched path without whole-cache copies for a batch of one;
* :mod:`.admission` - ``--max-memory`` refusals as mlx-lm answers errors;
* :mod:`.guard` - the generation thread survives an error in its loop;
* :mod:`.salt` - a request's ``cache_salt``, from its body to the prompt cache's calls.

Seams (identical in mlx-lm 0.31.3 and 0.32.x unless noted):

``mlx_lm.server.main``
    Wrapped. While it runs, the first ``ArgumentParser.parse_args`` call (patched on the
    class for that moment only) adds kvplugin's options to the server's parser before
    parsing and resolves the settings after it (a bad value -> ``parser.error``: exit 2
    with a message naming the flag and the env variable).
``mlx_lm.server.run``
    Wrapped. Builds the process's :class:`KVService` from the settings and the host's
    ``--prompt-cache-bytes`` (stock never passes it to its cache) / ``--prompt-cache-size``,
    says one ``kvplugin: active (...)`` line, then calls the original ``run``; when it
    returns (shut-down) the service is closed (``kvplugin_unconfigure``).
``mlx_lm.server.LRUPromptCache``
    Rebound (a by-name copy that ``run`` instantiates) to :class:`KVPluginPromptCache`,
    which keeps the host's interface and is backed by the service's store.
``make_prompt_cache``
    Rebound in ``mlx_lm.models.cache``, ``mlx_lm.server`` and (0.32) ``mlx_lm.generate``:
    the original, then ``service.make_cache`` (``--max-kv-size``, ``--kv-cache-step``).
``BatchKVCache.step`` / ``BatchRotatingKVCache.step``
    The batched path re-merges every cache into these classes, which grow by their class
    ``step``; set to the steps of ``KVService.batch_plan`` when the service starts.
``BatchKVCache.merge``
    Replaced by :func:`kvplugin.hosts.mlx_lm.batch.adopting_merge`: a batch of one plain
    ``KVCache`` adopts its arrays instead of copying them (the copy was a whole entry of extra
    memory on every reuse); anything else goes to mlx-lm's own ``merge``.
``mlx_lm.models.cache.PreallocatedRotatingKVCache``
    Added (not replaced), so ``load_prompt_cache`` can read entries saved with kvplugin's
    bounded cache class.
``ModelProvider._load`` / ``ModelProvider.load_default``
    Wrapped: the quantization group size is checked against the loaded model's head
    dimension; at start-up (the default model, loaded by the generation thread) a bad
    value ends the process with exit code 2 and a message naming flag and env variable.
``ResponseGenerator._generate`` / ``ResponseGenerator._next_request``
    Wrapped (:mod:`.guard`): an exception that escapes the generation loop fails the
    requests in flight and the loop starts again, instead of the thread dying and the
    server answering 503 until restarted.
``APIHandler.do_GET``
    Wrapped (:mod:`.routes`): ``GET /kvplugin/stats`` answers the service's counters and the
    stored entries as JSON, ``GET /metrics`` kvplugin's Prometheus series (mlx-lm has no
    ``/metrics`` of its own); every other path goes to the host.
``ResponseGenerator._tokenize`` / ``generate``, ``APIHandler._set_completion_headers`` /
``handle_completion``
    Wrapped (:mod:`.admission`): ``--max-memory`` admits each request or refuses it.
``APIHandler.handle_completion``, ``ResponseGenerator._tokenize`` / ``_serve_single``,
``BatchGenerator.insert_segments`` / ``extract_cache`` / ``next``
    Wrapped (:mod:`.salt`): a request's ``cache_salt`` reaches the prompt cache's calls,
    which key by it (400 for a bad one).

Importing this package imports neither mlx-lm nor mlx. ``kvplugin.hosts.mlx_lm:ADAPTER`` is
the adapter named by the ``kvplugin.hosts`` entry point; the bootstrap calls
:func:`on_import` with ``mlx_lm.server``.
"""

from __future__ import annotations

from kvplugin.hosts.base import STATS_PATH, SeamError
from kvplugin.hosts.mlx_lm.adapter import ADAPTER, MlxLmAdapter, on_import
from kvplugin.hosts.mlx_lm.prompt_cache import KVPluginPromptCache

__all__ = ["ADAPTER", "STATS_PATH", "KVPluginPromptCache", "MlxLmAdapter", "SeamError",
           "on_import"]

KVPluginPromptCache.adapter = ADAPTER  # the one adapter, before a script builds its own cache
