"""rapid-mlx, a vllm-mlx fork kvplugin recognizes and does not back, on its real server.

rapid-mlx ships its own ``vllm-mlx`` console script (``rapid_mlx.cli``; it never imports
``vllm_mlx.cli``). Started from this environment, where kvplugin is installed and active,
that real ``vllm-mlx serve`` must say exactly one line,
``kvplugin: rapid-mlx X is not supported; the server runs stock``, and serve as stock:

* kvplugin adds no flag to it and reads no setting (a ``KVPLUGIN_*`` value that stops a
  backed host at start-up leaves this one serving);
* nothing of kvplugin is served (no ``/kvplugin/stats``, no ``kvplugin_`` metric);
* its greedy answers are those of the same server with ``KVPLUGIN_DISABLE=1``.
"""

from __future__ import annotations

import importlib.metadata

import harness
import pytest
from harness import SERVED_MODEL_NAME, host_cmd, run_command

from kvplugin.hostspecs import RAPID_MLX

# A value kvplugin refuses (a backed host exits 2 at start-up, naming flag and variable).
BAD_SETTING = {"KVPLUGIN_KV_CACHE_QUANTIZATION_BITS": "9"}
# Flags kvplugin adds to a host it backs; rapid-mlx has none of them.
KVPLUGIN_ONLY_FLAGS = ("--hot-cache-only", "--kv-cache-step", "--kv-cache-codec",
                       "--kv-cache-remote", "--max-memory")
CONVERSATION = ["Tell me about the river.", "And the mountain beyond it?"]


def rapid_serve_cmd(model_dir, port, *extra):
    """The declared launch of rapid-mlx's own ``vllm-mlx serve`` (it has no --offline)."""
    return host_cmd(RAPID_MLX, model_dir, port, *extra)


def expected_line() -> str:
    version = importlib.metadata.version(RAPID_MLX.distribution)
    return f"kvplugin: {RAPID_MLX.distribution} {version} is not supported; the server runs stock"


def kvplugin_lines(text: str) -> list[str]:
    """kvplugin's own lines (paths in the log may contain "kvplugin", never "kvplugin:")."""
    return [line for line in text.splitlines() if "kvplugin:" in line]


@pytest.fixture(scope="module")
def rapid(start_server):
    """rapid-mlx serving the tiny model, kvplugin installed, a bad kvplugin value set."""
    return start_server(rapid_serve_cmd, env={**RAPID_MLX.launch_env, **BAD_SETTING},
                        model=SERVED_MODEL_NAME)


@pytest.fixture(scope="module")
def rapid_disabled(start_server):
    return start_server(rapid_serve_cmd, env={**RAPID_MLX.launch_env, "KVPLUGIN_DISABLE": "1"},
                        model=SERVED_MODEL_NAME)


def conversation(srv) -> list[str]:
    messages, answers = [], []
    for turn in CONVERSATION:
        messages.append({"role": "user", "content": turn})
        answer = harness.answer_text(srv.chat(messages, max_tokens=12))
        messages.append({"role": "assistant", "content": answer})
        answers.append(answer)
    return answers


def test_the_vllm_mlx_script_here_is_rapid_mlx():
    scripts = {ep.name: ep for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts[RAPID_MLX.console_script].value == "rapid_mlx.cli:main"
    assert scripts[RAPID_MLX.console_script].dist.metadata["Name"] == RAPID_MLX.distribution
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm-mlx")
    assert importlib.metadata.version(RAPID_MLX.distribution) in RAPID_MLX.tested


def test_start_up_says_the_one_line_exactly_once(rapid):
    assert kvplugin_lines(rapid.log_text()) == [expected_line()]


def test_serves_stock(rapid, rapid_disabled):
    answers = conversation(rapid)
    assert all(answers), answers
    assert answers == conversation(rapid_disabled)
    status, _ = rapid.request("GET", "/kvplugin/stats", timeout=10)
    assert status == 404
    status, metrics = rapid.request("GET", "/metrics", timeout=10)
    assert status == 200 and "rapid_mlx" in str(metrics) and "kvplugin" not in str(metrics)
    assert kvplugin_lines(rapid.log_text()) == [expected_line()]  # still once, after requests
    assert kvplugin_lines(rapid_disabled.log_text()) == [
        "kvplugin: disabled by KVPLUGIN_DISABLE; rapid_mlx.server runs stock"]


def test_no_kvplugin_flag_is_added():
    script = str(harness.venv_script(RAPID_MLX.console_script))
    env = {**RAPID_MLX.launch_env, **BAD_SETTING}
    out = run_command([script, "serve", "--help"], env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--kv-cache-quantization" in out.stdout  # rapid-mlx's own flag, as stock
    assert [f for f in KVPLUGIN_ONLY_FLAGS if f in out.stdout] == []
    out = run_command([script, "serve", "/nonexistent", "--kv-cache-step", "64"], env=env,
                      timeout=120)
    assert out.returncode == 2
    assert "unrecognized arguments: --kv-cache-step 64" in out.stderr
    assert kvplugin_lines(out.stderr + out.stdout) == []  # refused before any server code
