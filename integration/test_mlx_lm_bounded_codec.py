"""4- and 8-bit entries of a bounded real model keep its answers: SmolLM2-135M-Instruct (float32,
OpenBLAS) behind a real ``mlx_lm.server`` with ``KVPLUGIN_MAX_KV_SIZE=512``, so every layer
is a rotating one and the ring wraps within the system prompt.

Two greedy multi-turn chats of 4 questions each, behind ~900-token real-text system prompts,
run once with full-precision entries (what the bounded server answers; stock mlx-lm's server
cannot bound its cache, and kvplugin's fp16 entries answer as mlx-lm's own bounded
generation does, ``test_mlx_lm_max_kv_smollm2``) and once each with the default 4- and 8-bit
entries, which store every ring with keys per channel over the slots (at 4 bits the ``keep``
and the newest tokens at full precision). At least 7 of the 8 answers must be identical, the
later turns must be served from stored quantized entries, and each turn must reuse as many
prompt tokens as the full-precision server did.
"""

from __future__ import annotations

import re

import harness
import pytest
from harness import answer_text, cached_tokens

from kvplugin.tools import blas
from kvplugin.tools.models import realtext
from kvplugin.tools.models.smollm2 import build_smollm2

pytestmark = pytest.mark.real_model

N = 512
MAX_TOKENS = 24
WORDS = realtext.text("declaration-of-independence").split()
CHATS = [
    ("You are a careful assistant. Answer questions about this document briefly.\n\n"
     + " ".join(WORDS[:650]),
     ["In one sentence, what does this document declare?",
      "Which rights does it call unalienable?",
      "Whom does it accuse of repeated injuries?",
      "What does it say governments derive their powers from?"]),
    ("You answer in plain words, one sentence at a time.\n\n" + " ".join(WORDS[650:1300]),
     ["What is this passage about?",
      "Name one grievance it lists.",
      "Who is said to have refused assent to laws?",
      "What did the colonists do about it?"]),
]


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    return build_smollm2(tmp_path_factory.mktemp("smollm2") / "float32")


def ask_chats(srv) -> list[dict]:
    """Both chats, greedy, each answer fed back as the next turn's history (also
    ``docs/measure_chat.py``'s)."""
    out = []
    for system, questions in CHATS:
        messages = [{"role": "system", "content": system}]
        for question in questions:
            messages.append({"role": "user", "content": question})
            r = srv.chat(messages, max_tokens=MAX_TOKENS, temperature=0.0)
            out.append(r)
            messages.append({"role": "assistant", "content": answer_text(r)})
    return out


def _run(start_server, model_dir, *flags: str) -> tuple[list[dict], dict]:
    srv = start_server(harness.mlx_lm_server_cmd, *flags, model_dir=model_dir,
                       env={**blas.preload_env(), "KVPLUGIN_MAX_KV_SIZE": str(N)})
    out = ask_chats(srv)
    stats = srv.get("/kvplugin/stats")
    srv.stop()  # one server at a time: they share the CPU
    return out, stats


@pytest.fixture(scope="module")
def full_precision(start_server, smollm2_dir) -> list[dict]:
    """The bounded server's own answers: kvplugin's full-precision entries."""
    full, _ = _run(start_server, smollm2_dir)
    assert all(r["usage"]["prompt_tokens"] > N + 200 for r in full), [r["usage"] for r in full]
    return full


# per width: the codecs the stored rings name, and the bytes stored at most x fp16's.
# 8 bits: ``affine`` on plain entries, ``rotated-channel`` on entries with a window (these);
# 4 bits: the worst-quantized layer in ten with 6-bit keys, paid for by 3-bit keys on others
EXPECTED = {4: ({"rotated-channel-k4v4-s4r16+prerope", "rotated-channel-k6v4-s4r16+prerope",
                 "rotated-channel-k3v4-s4r16+prerope"}, 0.35),
            8: ({"rotated-channel-k8v8"}, 0.56)}


@pytest.mark.parametrize("bits", sorted(EXPECTED))
def test_default_entries_keep_7_of_8_bounded_answers(start_server, smollm2_dir,
                                                    full_precision, bits):
    quantized, stats = _run(start_server, smollm2_dir, "--kv-cache-quantization-bits", str(bits))
    same = [answer_text(a) == answer_text(b) for a, b in zip(quantized, full_precision)]
    assert sum(same) >= 7, [(answer_text(a), answer_text(b))
                            for a, b in zip(quantized, full_precision)]
    for mine, theirs in zip(quantized, full_precision):
        assert cached_tokens(mine) >= cached_tokens(theirs), (mine["usage"], theirs["usage"])
    assert stats["entries_quantized"] >= 6 and stats["store_hits"] >= 6, stats
    layers = {k for e in stats["entries"] for k in e["layers"]}
    assert layers == {"QuantizedRotatingKVCache"}, layers
    # 4 bits: the keep tokens (4) and the newest 16 per ring, keys stored pre-RoPE (SmolLM2's
    # rope is known); 8 bits: keys per channel, post-RoPE, nothing protected
    named, share = EXPECTED[bits]
    for joined in stats["bytes_stored_by_codec"]:  # an entry's layers' codecs, "+"-joined
        names = set(re.findall(r"[a-z-]+-k\dv\d(?:-s\d+r\d+)?(?:\+prerope)?", joined))
        assert names and names <= named and "+".join(sorted(names)) == joined, stats
    if bits == 4:  # ranked: the entries hold layers with 6-bit keys
        assert any("k6v4" in joined for joined in stats["bytes_stored_by_codec"]), stats
    assert stats["bytes_stored"] < share * stats["bytes_before"], stats
