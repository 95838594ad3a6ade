"""vllm-mlx adapter: ``vllm-mlx serve`` backed by kvplugin's engine in every mode.

One job per module:

* :mod:`.adapter` - identity (vllm-mlx's, not a fork's), the CLI (stage 1, on
  ``import vllm_mlx.cli``), start-up and the stage-2 wiring (all or none);
* :mod:`.startup` - the model's ``config.json`` and the start-up lines;
* :mod:`.runtime` - the state of one serving process, owned by the adapter instance;
* :mod:`.simple` - default mode: mlx-lm's ``stream_generate`` on kvplugin's caches;
* :mod:`.batching` - ``--continuous-batching``: the scheduler's prefix cache and the
  host's persistence;
* :mod:`.metrics` - kvplugin's counters on ``/metrics`` and ``GET /kvplugin/stats``;
* :mod:`.salt` - a request's ``cache_salt``, from its body to the prompt cache's calls;

Importing this package imports neither vllm-mlx nor mlx. The bootstrap calls
:func:`on_import` with ``vllm_mlx.cli``; ``kvplugin.hosts.vllm_mlx:ADAPTER`` is the adapter
named by the ``kvplugin.hosts`` entry point.
"""

from __future__ import annotations

from kvplugin.hosts.vllm_mlx.adapter import ADAPTER, VllmMlxAdapter, on_import

__all__ = ["ADAPTER", "VllmMlxAdapter", "on_import"]
