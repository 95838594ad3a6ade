"""Start-up reading and saying: the model's ``config.json`` and the start-up lines.

Modes kvplugin does not back (paged cache, ``--no-memory-aware-cache``,
``--disable-prefix-cache``; in default mode ``--enable-mtp`` and ``--specprefill``) are
announced in one ``kvplugin: not applied`` line; otherwise the one ``active`` line (and its
notices) comes from the shared :meth:`HostAdapter.say_active`. These lines name vllm-mlx's
own modes and flags, which is why they are the adapter's and not the session's.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvplugin.log import say


def unbacked_batching_mode(args: argparse.Namespace) -> str | None:
    """The flag that puts ``--continuous-batching`` on a prefix cache that is not kvplugin's."""
    if getattr(args, "use_paged_cache", False):
        return "--use-paged-cache"
    if getattr(args, "no_memory_aware_cache", False):
        return "--no-memory-aware-cache"
    if getattr(args, "disable_prefix_cache", False) or not getattr(
        args, "enable_prefix_cache", True
    ):
        return "--disable-prefix-cache"
    return None


def simple_not_applied(args: argparse.Namespace) -> list[str]:
    """Default-mode flags whose requests do not go through kvplugin's cache."""
    out = []
    for flag, dest in (("--enable-mtp", "enable_mtp"), ("--specprefill", "specprefill")):
        if getattr(args, dest, False):
            out.append(f"{flag}: requests on that path use vllm-mlx's own cache handling")
    if getattr(args, "prefix_trie_cache", False):
        out.append(
            "--prefix-trie-cache: replaced by kvplugin's prompt store (same role, "
            "kvplugin's budget and flags)"
        )
    return out


def announce(adapter: Any, args: argparse.Namespace) -> None:
    """The start-up lines once the serving seams are patched."""
    rt = adapter.runtime
    where = unbacked_batching_mode(args) if rt.mode == "batching" else None
    if where is not None:
        hot = (
            "; --hot-cache-only still keeps vllm-mlx from saving its cache to disk"
            if rt.service is not None and not rt.service.may_persist()
            else ""
        )
        say(
            f"not applied: {where}: vllm-mlx's prefix cache in this mode is not kvplugin's, "
            "so --kv-cache-quantization*, --kv-cache-min-quantize-tokens, --ssd-cache-dir and "
            f"kvplugin's store are not used (--max-kv-size is applied by vllm-mlx){hot}",
            key="vllm-mlx:not-applied",
        )
        return
    not_applied = simple_not_applied(args) if rt.mode == "simple" else []
    if not_applied:
        say("not applied: " + "; ".join(not_applied), key="vllm-mlx:not-applied")
    if rt.service is not None:
        mode = "--continuous-batching" if rt.mode == "batching" else "default (simple) mode"
        adapter.say_active(rt.service, mode=mode)
