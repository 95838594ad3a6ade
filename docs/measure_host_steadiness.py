"""Whether a host answers one request the same way in every process (docs/benchmarks.md,
"A host fault on the tiny Qwen3-Next").

Not part of the package and imported by nothing. Starts ``N`` fresh stock servers
(``KVPLUGIN_DISABLE=1``) one after another on ``MODEL_DIR``, sends each the combination
matrix's first request (its system prompt and first question, 16 tokens, temperature 0) and
prints how many processes gave each answer.

    python docs/measure_host_steadiness.py vllm-mlx /path/to/qwen3_next 60 --continuous-batching
    python docs/measure_host_steadiness.py mlx-lm /path/to/qwen3_next 80
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

import harness  # noqa: E402
import matrix  # noqa: E402

from kvplugin.tools.hostproc import ServerProcess  # noqa: E402

COMMANDS = {"vllm-mlx": harness.vllm_mlx_serve_cmd, "mlx-lm": harness.mlx_lm_server_cmd}


def main(host: str, model_dir: str, runs: str, *flags: str) -> None:
    cmd = COMMANDS[host]
    model = harness.SERVED_MODEL_NAME if host == "vllm-mlx" else None
    request = [matrix.SYSTEM, {"role": "user", "content": matrix.QUESTIONS["A"][0]}]
    answers: collections.Counter = collections.Counter()
    for i in range(int(runs)):
        port = harness.free_port()
        srv = ServerProcess(cmd(model_dir, port, *flags), port=port, model=model,
                            env={"KVPLUGIN_DISABLE": "1"}).start()
        try:
            answers[harness.answer_text(srv.chat(request, max_tokens=matrix.MAX_TOKENS))] += 1
        finally:
            srv.stop()
            srv.close()
        print(f"process {i + 1}: {len(answers)} distinct answer(s) so far", flush=True)
    print(f"{host} {' '.join(flags)}: {runs} stock processes, answers by count:")
    for answer, count in answers.most_common():
        print(f"  {count:4d}  {answer!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
