"""kvplugin hands back the C heap its own start-up freed (:func:`kvplugin.cache.memory.release.trim_heap`).

Why it matters: kvplugin's imports and start-up work sit under every later peak of the host
process, so what they freed must not stay resident (docs/benchmarks.md, "kvplugin's own
start-up memory")."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvplugin.cache.memory import release

linux_glibc = pytest.mark.skipif(release._malloc_trim() is None, reason="glibc's malloc_trim")


@linux_glibc
def test_trim_heap_gives_freed_heap_pages_back():
    """Freed blocks below the heap's top stay resident until trimmed (a fresh process, so
    nothing else moves the figures)."""
    script = textwrap.dedent("""
        import ctypes
        from kvplugin.cache.memory.release import trim_heap
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        blocks = []
        for _ in range(1600):  # 1600 x 64 KiB = 100 MiB, under the mmap threshold: the heap
            p = libc.malloc(65536)
            ctypes.memset(p, 1, 65536)
            blocks.append(p)
        for p in blocks[:-1]:  # the last one pins the top, so free() alone gives nothing back
            libc.free(p)
        before = rss()
        trim_heap()
        print(before - rss())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    assert int(out.stdout.split()[-1]) > 80 << 20


@pytest.mark.parametrize("max_memory", ["auto", "off"])
def test_service_start_up_and_model_probe_trim_the_heap(monkeypatch, max_memory, tiny_llama):
    """Both ends of kvplugin's own start-up work trim: the service (settings, codec warm-up)
    before the host loads its model, and the model probe before the first request (with or
    without admission control, which runs the probe)."""
    from mlx_lm.models.cache import make_prompt_cache

    from kvplugin import plugins
    from kvplugin.cache.service import service as service_mod
    from kvplugin.settings import resolve_settings

    calls: list[str] = []
    monkeypatch.setattr(service_mod, "trim_heap", lambda: calls.append("trim"))
    svc = service_mod.KVService(resolve_settings({"max_memory": max_memory,
                                                  "kv_cache_quantization": True}),
                                host="test",
                                hook=plugins.create_plugin_manager(load_entry_points=False).hook)
    assert calls == ["trim"]
    svc.learn_model(tiny_llama, make_prompt_cache(tiny_llama))
    assert calls == ["trim", "trim"]
    svc.close()
