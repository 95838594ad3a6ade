"""``python -m mlx_lm.server`` (the form many guides use) runs with kvplugin, like the
console script: runpy executes the host as ``__main__``, and kvplugin hands ``__main__`` the
patched module's ``main()``."""

from __future__ import annotations

import sys

import harness
import pytest


def runpy_cmd(model_dir, port, *extra):
    harness.host_version("mlx-lm")
    return [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir),
            "--host", harness.HOST, "--port", str(port), *map(str, extra)]


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server(runpy_cmd, "--kv-cache-quantization-bits", "4",
                        "--kv-cache-min-quantize-tokens", "0")


def test_flags_and_stats_work_under_python_dash_m(srv):
    assert "kvplugin: active on mlx-lm" in srv.log_text()
    assert "runs stock" not in srv.log_text()
    messages = [{"role": "user", "content": "Tell me about the river and the hills."}]
    first = srv.chat(messages, max_tokens=6)
    messages += [{"role": "assistant", "content": harness.answer_text(first)},
                 {"role": "user", "content": "And then?"}]
    srv.chat(messages, max_tokens=6)
    stats = srv.get("/kvplugin/stats")
    assert stats["quantization"]["bits"] == 4  # --kv-cache-quantization-bits alone turns it on
    assert stats["entries_quantized"] >= 1 and stats["store_hits"] >= 1
