"""Per-family server benchmark: stock vs kvplugin on every tiny model family mlx-lm serves.

``kvplugin bench --server --families`` / ``python -m kvplugin.tools.bench.families``. For each
family of :mod:`kvplugin.tools.models.families` that the installed mlx-lm has, a stock
``mlx_lm.server`` (``KVPLUGIN_DISABLE=1``) and a kvplugin one on the same tiny model run the
same workload (:func:`workload`, also what ``integration/test_mlx_lm_families.py`` checks): a
3-turn conversation on a ~1k-token system prompt, two concurrent conversations on it, then a
fourth. Reported per family: prompt tokens reused (the servers' own
``usage.prompt_tokens_details.cached_tokens``), kvplugin's stored bytes per conversation
(``/kvplugin/stats`` ``store_bytes`` over the 4 conversations; stock reports no byte count
of its own), and warm time to first token (the median first streamed token of the turns
that follow a turn of the same conversation, client clock).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from kvplugin.tools import hostcmd, hostproc
from kvplugin.tools.client import at_once, stream_chat
from kvplugin.tools.models.corpus import CORPUS

SYSTEM = " ".join(CORPUS.split()[:500])  # ~800 tokens: past the 128-token windows
QUESTIONS = ["Where is the river?", "And the hills?", "Who lives there?"]
CONVERSATIONS = 4


def conversation(srv: Any, who: int, turns: int, out: dict, barrier: Any = None) -> None:
    """Conversation ``who``: ``turns`` user turns on the shared system prompt; its answers,
    cached tokens and first-token times go to ``out[who]``."""
    messages = [{"role": "system", "content": SYSTEM}]
    answers, reused, ttft = [], [], []
    for t in range(turns):
        messages.append({"role": "user", "content": f"{QUESTIONS[(who + t) % 3]} (visitor {who})"})
        if barrier is not None:
            barrier.wait(timeout=120)  # in lock-step: both want the shared prefix at once
        r = stream_chat(srv, messages, max_tokens=8)
        answers.append(r.text)
        reused.append(r.cached_tokens or 0)
        ttft.append(r.ttft_s)
        messages.append({"role": "assistant", "content": r.text})
    out[who] = (answers, reused, ttft)


def workload(srv: Any) -> dict:
    """Conversation 0 (3 turns), then 1 and 2 concurrently (2 turns each), then 3 (2 turns)."""
    out: dict = {}
    conversation(srv, 0, 3, out)
    at_once(*(lambda barrier, w=w: conversation(srv, w, 2, out, barrier) for w in (1, 2)))
    conversation(srv, 3, 2, out)
    return out


def answers(out: dict) -> list[list[str]]:
    return [out[w][0] for w in sorted(out)]


def reused(out: dict) -> int:
    return sum(sum(out[w][1]) for w in out)


def warm_ttft(out: dict) -> float | None:
    """Median first-token time of the turns after a conversation's first (seconds)."""
    times = [t for w in out for t in out[w][2][1:] if t is not None]
    return statistics.median(times) if times else None


def bench_family(family: str, work: Path, extra: Sequence[str] = ()) -> dict:
    """Run the workload on stock and on kvplugin for one family; the numbers."""
    from kvplugin.tools.models.families import build_family_model

    model = build_family_model(family, work / family / "model")
    row: dict[str, Any] = {"family": family}
    for name, env in (("stock", {"KVPLUGIN_DISABLE": "1"}), ("kvplugin", None)):
        port = hostcmd.free_port()
        srv = hostproc.ServerProcess(hostcmd.mlx_lm_server_cmd(model, port, *extra), port=port,
                                     env=env, workdir=work / family / name)
        srv.start()
        try:
            out = workload(srv)
            row[f"{name}_answers"] = answers(out)
            row[f"{name}_reused"] = reused(out)
            row[f"{name}_warm_ttft_s"] = warm_ttft(out)
            if env is None:
                stats = srv.get("/kvplugin/stats")
                row["kvplugin_bytes_per_conversation"] = stats["store_bytes"] / CONVERSATIONS
                row["kvplugin_lent_copies"] = stats["store_lent_copies"]
        finally:
            srv.stop()
    row["same_answers"] = row["stock_answers"] == row["kvplugin_answers"]
    return row


def table(rows: list[dict]) -> str:
    head = (f"{'family':<12} {'reused stock':>12} {'reused kvplugin':>15} "
            f"{'KiB/conv kvplugin':>17} {'warm TTFT stock':>15} {'warm TTFT kvplugin':>18} "
            f"{'lent copies':>11} {'same answers':>12}")
    lines = [head]
    for r in rows:
        ms = [f"{1000 * r[k]:.0f} ms" if r[k] is not None else "-"
              for k in ("stock_warm_ttft_s", "kvplugin_warm_ttft_s")]
        lines.append(f"{r['family']:<12} {r['stock_reused']:>12} {r['kvplugin_reused']:>15} "
                     f"{r['kvplugin_bytes_per_conversation'] / 1024:>17.1f} {ms[0]:>15} "
                     f"{ms[1]:>18} {r['kvplugin_lent_copies']:>11} {str(r['same_answers']):>12}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvplugin bench --server --families",
        description="Per model family (tiny offline models of mlx-lm's own classes): stock vs "
                    "kvplugin mlx_lm.server on one workload (3-turn chat on a long system "
                    "prompt, two concurrent conversations, a fourth): prompt tokens reused, "
                    "stored bytes per conversation, warm time to first token.")
    p.add_argument("--family", action="append", default=None,
                   help="only this family (repeatable; default: all the installed mlx-lm has)")
    p.add_argument("host_args", nargs="*", metavar="-- HOST_ARGS",
                   help="extra arguments for both servers, after `--`")
    args = p.parse_args(argv)
    import mlx_lm

    from kvplugin.tools.models.families import FAMILIES, available

    here = [f for f in FAMILIES if available(f, mlx_lm.__version__)]
    chosen = args.family or here
    unknown = [f for f in chosen if f not in here]
    if unknown:
        p.error(f"not a family of mlx-lm {mlx_lm.__version__}: {', '.join(unknown)} "
                f"(available: {', '.join(here)})")
    with tempfile.TemporaryDirectory(prefix="kvplugin-families-") as tmp:
        rows = [bench_family(f, Path(tmp), args.host_args) for f in chosen]
    print(f"kvplugin bench --server --families: mlx_lm.server {mlx_lm.__version__}, stock "
          f"(KVPLUGIN_DISABLE=1) vs kvplugin, tiny offline models; reused = sum of the "
          f"servers' usage.prompt_tokens_details.cached_tokens over 9 requests; KiB/conv = "
          f"/kvplugin/stats store_bytes / {CONVERSATIONS}; warm TTFT = median first streamed "
          f"token of later turns (client clock)\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
