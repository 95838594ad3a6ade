"""What kvplugin adds to a host process before it stores anything (docs/benchmarks.md, "A fixed
cost"): resident memory after the host's own imports, after each import kvplugin brings, and
after the codec warm-up kvplugin runs at start-up, each as VmRSS and its anonymous and
file-backed parts (code pages of the libraries loaded). With ``--after-model-ops`` the host
first runs what a model's forward pass runs (attention, a matmul, RoPE, in float32), so the
warm-up's line shows only what a serving process had not touched yet.

Not part of the package and imported by nothing. Run it with the preload the servers use:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python docs/measure_fixed_cost.py [BITS] [--after-model-ops]
"""

from __future__ import annotations

import importlib
import sys

KVPLUGIN_IMPORTS = ("pluggy", "pydantic", "pydantic_settings", "packaging.version",
                    "prometheus_client", "safetensors", "kvplugin.settings", "kvplugin.plugins",
                    "kvplugin.cache.service.service", "kvplugin.cache.codec.quantize")


def resident() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process, KiB."""
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) for line in f
                if line.startswith(("VmRSS", "RssAnon", "RssFile"))}


def model_ops() -> None:
    """What a stock server's first request runs anyway (its kernels' code pages)."""
    import mlx.core as mx

    x = mx.random.normal((1, 4, 64, 64))
    mx.eval(mx.fast.scaled_dot_product_attention(x, x, x, scale=0.125), x @ x,
            mx.fast.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=0))


def main(bits: int, after_model_ops: bool) -> None:
    import mlx_lm.server  # noqa: F401  the host, as stock has it

    if after_model_ops:
        model_ops()

    base = prev = resident()
    print(f"{'after':42s} {'VmRSS':>9s} {'anon':>9s} {'file':>9s}   (KiB added)")
    print(f"{'mlx_lm.server (stock)':42s} {base['VmRSS']:9d} {base['RssAnon']:9d} "
          f"{base['RssFile']:9d}   (absolute)")

    def step(label: str) -> None:
        nonlocal prev
        now = resident()
        print(f"{label:42s} " + " ".join(f"{now[k] - prev[k]:+9d}"
                                         for k in ("VmRSS", "RssAnon", "RssFile")))
        prev = now

    for name in KVPLUGIN_IMPORTS:
        importlib.import_module(name)
        step(f"import {name}")
    from kvplugin.cache.codec.quantize import warm_up
    from kvplugin.codecs import codec_plan
    from kvplugin.settings import resolve_settings

    plan = codec_plan(resolve_settings({"kv_cache_quantization": True,
                                        "kv_cache_quantization_bits": bits}))
    warm_up(plan)
    step(f"codec warm-up, {bits}-bit")
    total = resident()
    print(f"{'kvplugin in all':42s} {total['VmRSS'] - base['VmRSS']:+9d} "
          f"{total['RssAnon'] - base['RssAnon']:+9d} {total['RssFile'] - base['RssFile']:+9d}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--after-model-ops"]
    main(int(args[0]) if args else 8, "--after-model-ops" in sys.argv)
