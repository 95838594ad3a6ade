"""The 4- and 3-bit defaults on wide heads, behind a real ``mlx_lm.server``: a Gemma-3-shaped
tiny model (sliding windows and a global layer, one KV head of 256, as Gemma 3 270M) stores its
entries with 5-bit keys (3 bits: 4-bit keys, 2-bit values) in groups of 128 on every layer,
serves the next turn from them, and says so at start-up; a group size the user gives keeps
4-bit keys. At 8 bits the same entries take ``rotated-channel`` keys where plain ones take
``affine``."""

from __future__ import annotations

import re

import harness
import pytest
from harness import answer_text, cached_tokens

from kvplugin.tools.models.families import build_family_model

Q4 = ("--kv-cache-quantization-bits", "4", "--kv-cache-min-quantize-tokens", "0")
SYSTEM = "You answer about rivers. " * 40


@pytest.fixture(scope="module")
def wide_gemma(tmp_path_factory):
    return build_family_model("gemma3_text", tmp_path_factory.mktemp("wide") / "model",
                              config={"head_dim": 256, "query_pre_attn_scalar": 256})


def _chat(srv) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where?"}]
    first = srv.chat(messages, max_tokens=6, temperature=0.0)
    messages += [{"role": "assistant", "content": answer_text(first)},
                 {"role": "user", "content": "And then?"}]
    return [first, srv.chat(messages, max_tokens=6, temperature=0.0)]


def _layer_codecs(stats: dict) -> set[str]:
    """Each stored layer's codec name, without its protected tokens' suffix."""
    names = "+".join(stats["bytes_stored_by_codec"]).replace("+prerope", "").split("+")
    return {re.sub(r"-s\d+r\d+.*", "", name) for name in names}


# per width: the layer codecs an entry may hold, the one it must, and what start-up says; at
# 4 bits the worst-quantized layer's keys take 6 bits, paid for by a key bit fewer elsewhere
@pytest.mark.parametrize("bits, codecs, codec, said", [
    ("4", {"rotated-channel-k4v4", "rotated-channel-k5v4", "rotated-channel-k6v4"},
     "rotated-channel-k6v4", "k5v4 in groups of 128 on heads it divides"),
    ("3", {"rotated-channel-sym-k4v2"}, "rotated-channel-sym-k4v2",
     "k4v2 in groups of 128 on heads it divides"),
    ("8", {"rotated-channel-k8v8"}, "rotated-channel-k8v8",
     "affine-k8v8 (rotated-channel in entries with a window or recurrent state)")])
def test_default_entries_of_a_windowed_model_on_heads_of_256(start_server, wide_gemma, bits,
                                                             codecs, codec, said):
    full = start_server(harness.mlx_lm_server_cmd, model_dir=wide_gemma)
    reference = _chat(full)
    full.stop()
    srv = start_server(harness.mlx_lm_server_cmd, "--kv-cache-quantization-bits", bits,
                       *Q4[2:], model_dir=wide_gemma)
    turns = _chat(srv)
    stats = srv.get("/kvplugin/stats")
    assert codec in _layer_codecs(stats) <= codecs, stats["bytes_stored_by_codec"]
    kinds = {k for e in stats["entries"] for k in e["layers"]}
    assert {"QuantizedRotatingKVCache", "QuantizedKVCache"} <= kinds, kinds
    assert stats["store_hits"] >= 1 and stats["entries_quantized"] >= 1, stats
    assert cached_tokens(turns[1]) >= cached_tokens(reference[1]) > 0
    assert said in srv.log_text()
    srv.stop()


def test_a_group_size_the_user_gives_keeps_4bit_keys(start_server, wide_gemma):
    """... on heads of 256 (in groups of 64); the ranking of layers' keys still applies."""
    srv = start_server(harness.mlx_lm_server_cmd, *Q4, model_dir=wide_gemma,
                       env={"KVPLUGIN_KV_CACHE_QUANTIZATION_GROUP_SIZE": "64"})
    _chat(srv)
    stats = srv.get("/kvplugin/stats")
    assert "rotated-channel-k4v4" in _layer_codecs(stats) <= {
        "rotated-channel-k3v4", "rotated-channel-k4v4", "rotated-channel-k6v4"}, stats[
        "bytes_stored_by_codec"]
    assert "on heads it divides" not in srv.log_text()
    srv.stop()
