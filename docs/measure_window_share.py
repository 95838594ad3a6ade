"""Four conversations on a real mlx_lm.server, stock first, then kvplugin under each flag set:
answers and prompt tokens reused per turn against stock's (docs/benchmarks.md, "A shared
system prompt inside a window").

    python docs/measure_window_share.py MODEL_DIR {batched,seq} stock fp16 \\
        "q4=--kv-cache-quantization --kv-cache-quantization-bits 4" ...

A (3 turns) on a ~420-token system prompt, B (3 turns) on the same, C on another, A2 as A
again; 24 greedy tokens per answer. ``seq`` sends seeded requests (mlx-lm's sequential path).
The first label is the baseline; one starting with ``stock`` runs with KVPLUGIN_DISABLE=1;
``{wd}`` in the flags is the run's scratch directory. Preload OpenBLAS for real models.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from kvplugin.tools.hostcmd import free_port, mlx_lm_server_cmd
from kvplugin.tools.hostproc import ServerProcess, answer_text, cached_tokens
from kvplugin.tools.prompts import TextMaker

TURNS = 3


def run(model: Path, flags: list[str], env: dict[str, str], seeded: bool) -> dict:
    """Every conversation's answers and cached tokens, in order, on one fresh server."""
    texts = TextMaker(model)
    system, other = texts.text(420, seed=1), texts.text(300, seed=2)
    work = Path(tempfile.mkdtemp(prefix="window-share-"))
    flags = [f.replace("{wd}", str(work)) for f in flags]
    port = free_port()
    out: dict = {"answers": [], "cached": []}
    with ServerProcess(mlx_lm_server_cmd(model, port, *flags), port=port, env=env,
                       workdir=work, startup_timeout=300) as srv:
        for name, prompt in (("A", system), ("B", system), ("C", other), ("A2", system)):
            messages = [{"role": "system", "content": prompt}]
            for t in range(TURNS):
                messages.append({"role": "user", "content": f"{name} question {t + 1}: "
                                 f"summarize part {t + 1} in one sentence."})
                r = srv.chat(messages, max_tokens=24, seed=7 if seeded else None)
                messages.append({"role": "assistant", "content": answer_text(r)})
                out["answers"].append(answer_text(r))
                out["cached"].append(cached_tokens(r) or 0)
    return out


def main(argv: list[str]) -> None:
    model, seeded = Path(argv[0]), argv[1] == "seq"
    base = None
    for config in argv[2:]:
        label, _, rest = config.partition("=")
        env = {"KVPLUGIN_DISABLE": "1"} if label.startswith("stock") else {}
        got = run(model, rest.split(), env, seeded)
        base = base or got
        same = sum(a == b for a, b in zip(got["answers"], base["answers"]))
        print(f"{label:12} answers = {argv[2].partition('=')[0]}'s: {same}/{len(got['answers'])}"
              f"  reused {sum(got['cached'])} (mlx_lm.server's cached_tokens per turn: "
              f"{got['cached']})")


if __name__ == "__main__":
    main(sys.argv[1:])
