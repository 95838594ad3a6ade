"""Codecs of stored entries on the real model: ``kvplugin bench --quality --real-model``.

Why a second quality bench: the tiny trained model of :mod:`kvplugin.tools.bench.quality`
has no attention sinks nor outlier key channels, which is what breaks 4-bit entries of real
models (issue 15). This one prefills windows of real text (:mod:`kvplugin.tools.models.realtext`)
with SmolLM2-135M-Instruct (float32, :mod:`kvplugin.tools.models.smollm2`; run it with
OpenBLAS preloaded on Linux), rounds the entry to fp16 (the reference: "the fp16 entry"),
passes it through each codec the way a hit does (``quantize_entry`` -> ``dequantize_entry``),
and compares with the fp16 entry over the fp16 greedy continuation:

* bytes of the stored entry / fp16 bytes (protected tokens and scales included);
* KL(p_fp16 || p_codec) of next-token distributions, mean and max over positions (nats);
* teacher-forced top-1 agreement with the fp16 greedy tokens;
* free-running greedy agreement: the fraction of the continuation generated identically
  before the first divergence;
* perplexity delta on the real text that follows each window (teacher-forced);
* prefix-served KL: the entry of the window *and* its real continuation, reused only up to
  the window's end (what a repeated, regenerated or edited turn does with a later entry),
  over the same fp16 greedy continuation; with the rows before that prompt boundary kept
  at full precision as a server keeps them (``prompt_boundaries``) and without;
* quantize + dequantize time per MiB of fp16 entry (this machine's CPU, wall clock).

``--model DIR`` runs it on another mlx-lm model (plain attention caches). Codecs are named
``CODEC-kKvV-gG-sSrR`` (keys K bits, values V bits, group G, S sink and R
recent tokens at full precision). Output: a table, ``codecs.json`` and ``codecs-pareto.png``.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import time
from pathlib import Path
from typing import Any

from kvplugin.tools.bench.report import environment, format_table, save_results

__all__ = ["DEFAULT_CODECS", "parse_codec", "main"]

DEFAULT_CODECS = (
    "affine-k8v8-g64-s0r0", "rotated-channel-k8v8-g64-s0r0", "affine-k4v4-g64-s0r0",
    "rotated-k4v4-g64-s4r32", "rotated-channel-k4v4-g64-s4r0",
    "rotated-channel-k4v4-g64-s4r16", "rotated-channel-k4v4-g64-s4r32",
    "rotated-channel-k4v3-g64-s4r16", "rotated-channel-k3v3-g64-s4r16",
    "rotated-channel-sym-k3v3-g64-s4r6",
)
_SPEC = re.compile(r"(affine|rotated|rotated-channel|rotated-channel-sym)"
                   r"-k(\d)v(\d)-g(\d+)-s(\d+)r(\d+)")


def parse_codec(spec: str) -> dict[str, Any]:
    """``rotated-k4v4-g64-s4r32`` -> quantize_entry keyword arguments."""
    m = _SPEC.fullmatch(spec)
    if not m:
        raise ValueError(f"codec spec {spec!r} is not CODEC-kKvV-gG-sSrR")
    return dict(codec=m[1], bits=int(m[2]), value_bits=int(m[3]), group_size=int(m[4]),
                sink_tokens=int(m[5]), recent_tokens=int(m[6]))


def _cast(cache: list, dtype) -> list:
    for layer in cache:
        layer.keys, layer.values = layer.keys.astype(dtype), layer.values.astype(dtype)
    return cache


def _one_prompt(model, ids: list[int], plen: int, cont: int, specs, acc) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kvplugin.cache.layers import entry_nbytes
    from kvplugin.cache.quantize import dequantize_entry, quantize_entry
    from kvplugin.cache.layers.trim import trim_entry

    prompt = mx.array(ids[:plen])[None]
    truth = mx.array(ids[plen : plen + cont])[None]  # the real text that follows
    cache = make_prompt_cache(model)
    model(prompt[:, :-1], cache=cache)
    mx.eval([c.state for c in cache])
    fp16 = _cast(trim_entry(copy.deepcopy(cache)), mx.float16)

    def restored(entry):
        return _cast(copy.deepcopy(entry), mx.float32)

    def logprobs(entry, tokens):
        logits = model(tokens, cache=entry).astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def greedy(entry):
        tok, out = prompt[:, -1:], []
        for _ in range(cont):
            tok = mx.argmax(model(tok, cache=entry)[:, -1, :], axis=-1, keepdims=True)
            mx.eval(tok)
            out.append(tok)
        return mx.concatenate(out, axis=1)[0]

    longer = make_prompt_cache(model)  # the window and the real text after it, one entry
    model(mx.concatenate([prompt, truth], axis=1), cache=longer)
    longer = _cast(trim_entry(longer), mx.float16)

    def cut(entry, m):  # reused up to the window's end, as the store cuts a longer entry
        entry = restored(entry)
        for layer in entry:
            layer.trim(layer.offset - m)
        return entry

    ref_greedy = greedy(restored(fp16))
    feed = mx.concatenate([prompt[:, -1:], ref_greedy[None, :-1]], axis=1)
    feed_truth = mx.concatenate([prompt[:, -1:], truth[:, :-1]], axis=1)
    ref_lp = logprobs(restored(fp16), feed)
    ref_nll = -mx.mean(mx.take_along_axis(logprobs(restored(fp16), feed_truth), truth[..., None], -1))
    ref_prefix_lp = logprobs(cut(longer, plen - 1), feed)
    mib = entry_nbytes(fp16) / 2**20
    for spec in specs:
        t0 = time.perf_counter()
        q = quantize_entry(copy.deepcopy(fp16), **parse_codec(spec))
        back = dequantize_entry(copy.deepcopy(q.cache))
        mx.eval([c.keys for c in back])
        dt = time.perf_counter() - t0
        lp = logprobs(restored(back), feed)
        kl = mx.sum(mx.exp(ref_lp) * (ref_lp - lp), axis=-1)[0]
        agree = mx.mean((mx.argmax(lp, axis=-1)[0] == ref_greedy).astype(mx.float32))
        nll = -mx.mean(mx.take_along_axis(logprobs(restored(back), feed_truth), truth[..., None], -1))
        free = greedy(restored(back))
        diff = [i for i, (a, b) in enumerate(zip(free.tolist(), ref_greedy.tolist())) if a != b]
        prefix_kl = []
        for boundaries in ((plen,), ()):
            q_longer = quantize_entry(copy.deepcopy(longer), **parse_codec(spec),
                                      prompt_boundaries=boundaries)
            lp_prefix = logprobs(cut(dequantize_entry(q_longer.cache), plen - 1), feed)
            prefix_kl.append(float(mx.sum(mx.exp(ref_prefix_lp)
                                          * (ref_prefix_lp - lp_prefix), axis=-1).mean()))
        a = acc.setdefault(spec, dict(kl=[], agree=[], free=[], dppl=[], maxkl=0.0,
                                      bytes=0, fp16=0, s_per_mib=[], prefix_kl=[],
                                      prefix_kl_unprotected=[]))
        a["prefix_kl"].append(prefix_kl[0])
        a["prefix_kl_unprotected"].append(prefix_kl[1])
        a["kl"].append(float(kl.mean()))
        a["maxkl"] = max(a["maxkl"], float(kl.max()))
        a["agree"].append(float(agree))
        a["free"].append((diff[0] if diff else cont) / cont)
        a["dppl"].append(float(mx.exp(nll) - mx.exp(ref_nll)))
        a["bytes"] += entry_nbytes(q.cache)
        a["fp16"] += entry_nbytes(fp16)
        a["s_per_mib"].append(dt / mib)


def _rows(acc: dict) -> list[dict]:
    rows = []
    for spec, a in acc.items():
        n = len(a["kl"])
        rows.append(dict(codec=spec, bytes_vs_fp16=a["bytes"] / a["fp16"],
                         mean_kl=sum(a["kl"]) / n, max_kl=a["maxkl"],
                         top1_agreement=sum(a["agree"]) / n, free_running=sum(a["free"]) / n,
                         ppl_delta=sum(a["dppl"]) / n,
                         prefix_kl=sum(a["prefix_kl"]) / n,
                         prefix_kl_unprotected=sum(a["prefix_kl_unprotected"]) / n,
                         ms_per_mib=1000 * sum(a["s_per_mib"]) / n, prompts=n))
    return rows


def _plot(rows: list[dict], path: Path, title: str) -> Path | None:
    from kvplugin.tools.bench import plots

    plt = plots._pyplot()
    if plt is None:
        print(plots.MISSING_MESSAGE, file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        colour = ("tab:purple" if r["codec"].startswith("rotated-channel-sym") else
                  "tab:green" if r["codec"].startswith("rotated-channel") else
                  "tab:blue" if r["codec"].startswith("rotated") else "tab:grey")
        ax.scatter(r["bytes_vs_fp16"], max(r["mean_kl"], 1e-7), color=colour)
        ax.annotate(r["codec"], (r["bytes_vs_fp16"], max(r["mean_kl"], 1e-7)), fontsize=7)
    ax.set_yscale("log")
    ax.axhline(1e-3, ls="--", color="tab:red", lw=0.8)
    ax.axvline(0.30, ls=":", color="tab:red", lw=0.8)
    ax.axvline(0.22, ls=":", color="tab:red", lw=0.8)
    ax.set_xlabel("stored bytes / fp16 bytes")
    ax.set_ylabel("mean KL vs fp16 entry (nats)")
    ax.set_title(title, fontsize=9)
    return plots._save(fig, plt, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvplugin bench --quality --real-model",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--real-model", action="store_true", help="(selects this bench)")
    p.add_argument("--codecs", default=",".join(DEFAULT_CODECS),
                   help="comma-separated CODEC-kKvV-gG-sSrR specs")
    p.add_argument("--prompts", type=int, default=10, help="text windows (default 10)")
    p.add_argument("--prompt-tokens", type=int, default=1200, help="default 1200")
    p.add_argument("--continuation-tokens", type=int, default=200, help="default 200")
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default: SmolLM2-135M-Instruct, fp32), kv-heavy, or an "
                        "mlx-lm model directory whose layers are plain attention caches")
    p.add_argument("--out", type=Path, default=Path("kvplugin-bench"))
    return p


def load_model(name: str) -> tuple[Any, Any, str]:
    """``(model, tokenizer, label)``; SystemExit naming the layers this bench cannot compare.

    Why plain attention only: the bench rounds the entry to fp16, cuts it back to a prompt
    boundary and feeds it again; a window that wrapped or recurrent state cannot be cut back,
    so their figures would not mean what the table says."""
    from mlx_lm import load
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from kvplugin.tools.bench.memory import resolve_model

    directory = resolve_model(name)  # the memory bench's names (smollm2, kv-heavy) or a path
    if not (directory / "config.json").is_file():
        raise SystemExit(f"kvplugin bench --quality --real-model: --model {name}: not "
                         "'smollm2' nor an mlx-lm model directory (no config.json)")
    model, tok = load(str(directory))
    if name == "smollm2":
        return model, tok, "SmolLM2-135M-Instruct fp32"
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache})
    if kinds:
        raise SystemExit(f"kvplugin bench --quality --real-model: --model {name} has "
                         f"{', '.join(kinds)} layers; this bench compares plain attention "
                         "caches (KVCache) only")
    from mlx.utils import tree_flatten

    dtypes = sorted({str(a.dtype).removeprefix("mlx.core.") for _, a in
                     tree_flatten(model.parameters())})
    return model, tok, f"{directory.name} ({'/'.join(dtypes)} weights)"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    specs = args.codecs.split(",")
    for s in specs:
        parse_codec(s)
    from kvplugin.tools.models import realtext

    model, tok, label = load_model(args.model)
    ids = tok.encode(realtext.text())
    span = args.prompt_tokens + args.continuation_tokens
    if len(ids) < span:
        raise SystemExit(f"the real text has {len(ids)} tokens, fewer than {span}")
    step = (len(ids) - span) // max(1, args.prompts - 1)
    acc: dict = {}
    for i in range(args.prompts):
        _one_prompt(model, ids[i * step :], args.prompt_tokens, args.continuation_tokens,
                    specs, acc)
        print(f"prompt {i + 1}/{args.prompts} done: "
              + ", ".join(f"{r['codec']} KL {r['mean_kl']:.2e} top1 {r['top1_agreement']:.4f}"
                          for r in _rows(acc)), file=sys.stderr, flush=True)
    rows = _rows(acc)
    title = (f"{label}, {args.prompts} real-text windows of "
             f"{args.prompt_tokens} tokens, {args.continuation_tokens}-token continuations "
             "(kvplugin bench --quality --real-model)")
    cols = ["codec", "bytes_vs_fp16", "mean_kl", "max_kl", "top1_agreement", "free_running",
            "ppl_delta", "prefix_kl", "prefix_kl_unprotected", "ms_per_mib"]
    fmt = dict(bytes_vs_fp16="{:.3f}", mean_kl="{:.2e}", max_kl="{:.3f}", top1_agreement="{:.4f}",
               free_running="{:.3f}", ppl_delta="{:+.4f}", prefix_kl="{:.2e}",
               prefix_kl_unprotected="{:.2e}", ms_per_mib="{:.1f}")
    table = [[fmt[c].format(r[c]) if c in fmt else r[c] for c in cols] for r in rows]
    print(format_table(cols, table, title=title))
    args.out.mkdir(parents=True, exist_ok=True)
    save_results(args.out / "codecs.json", {"title": title, "rows": rows, "env": environment()})
    _plot(rows, args.out / "codecs-pareto.png", title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
