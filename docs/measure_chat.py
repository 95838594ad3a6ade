"""Greedy multi-turn chat answers of a real ``mlx_lm.server`` with quantized entries against
stock's (docs/benchmarks.md, "Five-bit keys and larger key groups").

Not part of the package and imported by nothing: the chats of
``integration/test_mlx_lm_bounded_codec.py`` (two 4-question chats behind ~900-token
real-text system prompts, 24 greedy tokens per answer) on any model directory, one server at
a time (OpenBLAS preloaded): stock (``KVPLUGIN_DISABLE=1``), then kvplugin with each set of
flags. Prints, per run, how many of the 8 answers equal stock's and the prompt tokens each
turn reused.

    python docs/measure_chat.py MODEL_DIR "--kv-cache-quantization-bits 4" ["FLAGS" ...]
    python docs/measure_chat.py --every-run "--max-kv-size 512" MODEL_DIR "FLAGS" ...

``--every-run``: kvplugin flags given to every run; the baseline is then kvplugin with them and
full-precision entries, not stock (stock ``mlx_lm.server`` has no ``--max-kv-size``), as in
the bounded integration test.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from test_mlx_lm_bounded_codec import ask_chats  # noqa: E402

from kvplugin.tools import blas  # noqa: E402
from kvplugin.tools.hostcmd import free_port, mlx_lm_server_cmd  # noqa: E402
from kvplugin.tools.hostproc import ServerProcess, answer_text, cached_tokens  # noqa: E402


def chat(model_dir: str, flags: list[str], env: dict) -> list[tuple[str, int]]:
    port = free_port()
    with ServerProcess(mlx_lm_server_cmd(model_dir, port, *flags), port=port,
                       env={**blas.preload_env(), **env}) as srv:
        return [(answer_text(r), cached_tokens(r)) for r in ask_chats(srv)]


def main(argv: list[str]) -> int:
    every: list[str] = []
    if argv[:1] == ["--every-run"]:
        every, argv = shlex.split(argv[1]), argv[2:]
    model_dir, runs = argv[0], argv[1:]
    base, name = ((chat(model_dir, every, {}), f"kvplugin {' '.join(every)}, full-precision "
                   "entries") if every else (chat(model_dir, [], {"KVPLUGIN_DISABLE": "1"}),
                                             "stock"))
    print(f"{name}: reused {[c for _, c in base]}")
    for flags in runs:
        got = chat(model_dir, every + shlex.split(flags), {})
        same = sum(a == b for (a, _), (b, _) in zip(got, base))
        print(f"kvplugin {' '.join(every + shlex.split(flags))}: {same} of {len(base)} answers "
              f"equal {name}'s, reused {[c for _, c in got]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
