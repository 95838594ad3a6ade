"""What stage 2 decided for one serving process, held by the adapter instance.

Why one object: the simple-mode wrappers, the batching prefix cache, the metrics collector
and the stats route all need the same few facts (the session, the served model, the mode).
Each gets this object (never a module global), so two adapters never share state and
``uninstall`` drops all of it by replacing one attribute.
"""

from __future__ import annotations

import threading
from typing import Any



class Runtime:
    """The state of one ``vllm-mlx serve`` (one per process; replaced on uninstall)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.settings: Any = None  # resolved by the wrapped serve_command
        self.service: Any = None  # the process's KVService (None: kvplugin not serving)
        self.model_id: str | None = None  # args.model (path or repo id)
        self.mode = "simple"  # or "batching" (--continuous-batching)
        self.simple_models: dict[int, str] = {}  # id(nn.Module) -> store model key
        self.group_size_checked = False
        self.collectors: list[tuple[Any, Any]] = []  # (prometheus registry, our collector)
        self._model_fp: str | None = None

    def model_key(self, model: Any = None) -> str:
        """The store's model key: the served checkpoint's fingerprint (shared with the mlx-lm
        adapter: path + config/tokenizer contents + weight sizes/mtimes + mlx-lm minor), so
        entries persisted on disk are never served to another checkpoint."""
        if self.model_id:
            if self._model_fp is None:
                from kvplugin.cache.model.fingerprint import model_fingerprint

                self._model_fp = model_fingerprint(str(self.model_id))
            base = self._model_fp
        else:  # --models-config: several models, identified by their architecture
            base = _host_fingerprint(model)
        from kvplugin.cache.service.service import store_key  # lazy: mlx loads with the engine

        return store_key("vllm-mlx", base, self.settings)

    @property
    def mode_label(self) -> str:
        """The mode as the report (``mode``) names it."""
        return "continuous-batching" if self.mode == "batching" else "simple"


def _host_fingerprint(model: Any) -> str:
    """vllm-mlx's own architecture fingerprint of a loaded model (``--models-config``)."""
    try:
        from vllm_mlx import memory_cache

        return str(memory_cache._compute_model_fingerprint(model))
    except Exception:
        return f"model-{id(model)}"
