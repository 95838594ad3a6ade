"""What the SSD tier's digest costs: per MiB on write and on read, and on warm TTFT.

``python -m kvplugin.tools.bench.tier_digest [--sizes 1k,2k,4k] [--repeat 5]``

1. In process: ``tensor_digest`` over fp16 entries of 1/4/16/64 MiB, and the whole
   ``SSDTier.put`` / ``fetch`` of the same entries, so the digest's share is visible.
2. Real ``mlx_lm.server`` processes on the tiny model, ``--ssd-cache-dir`` and a
   ``--prompt-cache-bytes`` that holds one entry: two conversations of N prompt tokens
   alternate, so every measured request is a warm hit *from the SSD tier* (checked: the
   server's ``store_cold_hits`` moves and the cached tokens cover the prompt). The same run
   with the digest switched off (a plugin, this script's only, replaces ``tensor_digest``
   with a constant in the server process, for writing and reading) gives the difference.

Every printed figure says what produced it. Needs the bench extras (the tiny model build).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

__all__ = ["main"]

_PLUGIN = (
    "from kvplugin.hookspecs import hookimpl\n\n"
    "@hookimpl\n"
    "def kvplugin_configure(settings, host):\n"
    "    from kvplugin.cache.tiers import ssd\n"
    "    ssd.tensor_digest = lambda arrays: 'blake2b:off'\n"
)


def _digest_off_env(where: Path) -> dict[str, str]:
    (where / "kvp_nodigest.py").write_text(_PLUGIN)
    dist = where / "kvp_nodigest-1.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvp-nodigest\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvplugin]\nnodigest = kvp_nodigest\n")
    return {"PYTHONPATH": str(where)}


def in_process(sizes_mib=(1, 4, 16, 64), repeat: int = 5) -> list[str]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvplugin.cache.tiers import ssd

    lines = []
    for mib in sizes_mib:
        tokens = mib * 1024 * 1024 // (2 * 2 * 8 * 64)  # keys + values, 8 heads x 64, fp16
        layer = KVCache()
        k = mx.random.normal((1, 8, tokens, 64)).astype(mx.float16)
        layer.update_and_fetch(k, k)
        mx.eval(layer.keys, layer.values)
        arrays = {"keys": layer.keys[..., :tokens, :], "values": layer.values[..., :tokens, :]}
        mx.eval(list(arrays.values()))
        t_digest, t_put, t_fetch = [], [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            ssd.tensor_digest(arrays)
            t_digest.append(time.perf_counter() - t0)
            with tempfile.TemporaryDirectory() as d:
                tier = ssd.SSDTier(d, 1 << 40)
                key = list(range(tokens))
                t0 = time.perf_counter()
                assert tier.put("bench", key, [layer])
                t_put.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = tier.fetch("bench", key + [0])
                t_fetch.append(time.perf_counter() - t0)
                assert got is not None
        d, p, f = (statistics.median(x) * 1e3 for x in (t_digest, t_put, t_fetch))
        lines.append(f"  {mib:3d} MiB entry: digest {d:7.1f} ms ({d / mib:5.2f} ms/MiB, "
                     f"{mib / d * 1e3:6.0f} MiB/s); whole put {p:7.1f} ms (digest "
                     f"{100 * d / p:4.1f}%), whole fetch {f:7.1f} ms (digest {100 * d / f:4.1f}%)")
    return lines


def _prompt(tokenizer, n: int, salt: str) -> str:
    from kvplugin.tools.models.corpus import CORPUS

    text = (salt + " " + CORPUS) * (1 + 4 * n // max(1, len(tokenizer.encode(CORPUS))))
    ids = tokenizer.encode(text)[:n]
    return tokenizer.decode(ids)


def server_ttft(model: Path, n_tokens: int, repeat: int, digest: bool, work: Path) -> dict:
    from kvplugin.tools import hostproc
    from kvplugin.tools.client import get_stats, stream_chat

    ssd = work / f"kv-{n_tokens}-{digest}"
    env = None if digest else _digest_off_env(Path(tempfile.mkdtemp(dir=work)))
    port = hostproc.free_port()
    entry = n_tokens * 1024  # the tiny model: 1 KiB per token at fp16
    srv = hostproc.ServerProcess(
        hostproc.mlx_lm_server_cmd(model, port, "--ssd-cache-dir", str(ssd),
                                   "--prompt-cache-bytes", str(int(entry * 1.6))),
        port=port, env=env, workdir=Path(tempfile.mkdtemp(dir=work))).start()
    try:
        from mlx_lm.utils import load_tokenizer

        tok = load_tokenizer(Path(model))
        convs = [[{"role": "user", "content": _prompt(tok, n_tokens, s)}] for s in ("A", "B")]
        for _ in range(2):  # write both, then each is read back from the SSD tier
            for c in convs:
                stream_chat(srv, c, max_tokens=2)
        times = []
        for i in range(2 * repeat):
            before = get_stats(srv)["store_cold_hits"]
            r = stream_chat(srv, convs[i % 2], max_tokens=2)
            time.sleep(0.2)  # the evicted entry spills after the answer
            assert get_stats(srv)["store_cold_hits"] == before + 1, "not a hit from the SSD tier"
            assert (r.cached_tokens or 0) >= 0.9 * (r.prompt_tokens or 0), r
            times.append(r.ttft_s)
        return {"ttft_ms": statistics.median(times) * 1e3, "prompt_tokens": r.prompt_tokens}
    finally:
        srv.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1k,2k,4k", help="prompt sizes in tokens (k = 1024)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    where = f"{platform.machine()} {platform.processor() or ''}".strip()
    print(f"kvplugin.tools.bench.tier_digest on {where} (CPU; medians of {args.repeat})")
    print("1. in process, fp16 entries, SSDTier on", tempfile.gettempdir())
    for line in in_process(repeat=args.repeat):
        print(line)
    from kvplugin.tools.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        model = build_tiny_model(work / "tiny")
        print("2. warm TTFT from the SSD tier, real mlx_lm.server, tiny model (fp16), "
              "streamed, 2 tokens generated")
        for size in args.sizes.split(","):
            n = int(size[:-1]) * 1024 if size.endswith("k") else int(size)
            on = server_ttft(model, n, args.repeat, True, work)
            off = server_ttft(model, n, args.repeat, False, work)
            print(f"  {on['prompt_tokens']:5d} prompt tokens: TTFT {on['ttft_ms']:7.1f} ms with "
                  f"digest verification, {off['ttft_ms']:7.1f} ms without "
                  f"({on['ttft_ms'] - off['ttft_ms']:+.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
