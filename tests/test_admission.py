"""Admission control (``--max-memory``): the limit's syntax, the estimate against what a real
prefill and decode really take, the ledger's verdicts, and the ``kvplugin_admit`` hook fired
through the session as hosts fire it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from kvplugin import plugins
from kvplugin.cache.memory.footprint import (
    GROWTH_SLACK,
    AdmissionRefused,
    Ledger,
    probe_footprint,
)
from kvplugin.cache.service.service import KVService
from kvplugin.resources import parse_memory_limit, physical_memory
from kvplugin.hookspecs import hookimpl
from kvplugin.settings import SettingsError, resolve_settings

LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 32


@pytest.fixture(scope="module")
def model():
    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=LAYERS,
                           intermediate_size=256, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=512, num_key_value_heads=KV_HEADS)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize("text, expected", [
    ("12GiB", 12 * 2**30), ("800MB", 800 * 10**6), ("1e9", 10**9), ("64 mib", 64 * 2**20),
    ("off", None),
])
def test_limit_syntax(text, expected):
    assert parse_memory_limit(text) == expected


def test_fractions_and_auto_are_of_physical_memory():
    ram = physical_memory()
    assert parse_memory_limit("auto") == ram
    assert parse_memory_limit("0.5") == int(ram * 0.5)
    assert parse_memory_limit("25%") == int(ram * 0.25)


@pytest.mark.parametrize("bad", ["lots", "12XB", "0", "150%", "100"])
def test_a_bad_limit_names_flag_and_variable(bad, monkeypatch):
    monkeypatch.setenv("KVPLUGIN_MAX_MEMORY", bad)
    with pytest.raises(SettingsError) as err:
        resolve_settings()
    assert "--max-memory" in str(err.value) and "KVPLUGIN_MAX_MEMORY" in str(err.value)


def test_probe_reads_the_kv_bytes_per_token_of_each_layer(model):
    fp = probe_footprint(model, make_prompt_cache(model), [1, 2, 3, 4])
    assert len(fp.layers) == LAYERS
    per_token = 2 * KV_HEADS * HEAD_DIM * 4  # keys + values, float32
    assert {layer.per_slot for layer in fp.layers} == {per_token}
    assert fp.kv_bytes(1000) == LAYERS * per_token * (1000 + GROWTH_SLACK)


def test_a_bounded_layer_is_priced_at_its_window(model):
    bounded = [RotatingKVCache(max_size=64, keep=4) for _ in range(LAYERS)]
    fp = probe_footprint(model, bounded, [1, 2, 3, 4])
    assert {layer.cap for layer in fp.layers} == {64}
    assert fp.kv_bytes(10_000) == fp.kv_bytes(64)


@pytest.fixture(scope="module")
def kv_heavy_model():
    """KV-dominated, like the memory benchmark's model: 32 layers x 1 KV head x 64."""
    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=32,
                           intermediate_size=128, num_attention_heads=1, rms_norm_eps=1e-5,
                           vocab_size=512, num_key_value_heads=1, head_dim=64)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize("which", ["model", "kv_heavy_model"])
@pytest.mark.parametrize("prompt_len, max_tokens", [(300, 20), (1500, 40)])
def test_the_estimate_covers_what_a_request_really_takes(request, which, prompt_len,
                                                         max_tokens):
    """Never refuse what fits: the estimate is at least the measured peak growth of a real
    prefill + decode through mlx-lm's own generate_step; and not absurdly above it."""
    model = request.getfixturevalue(which)
    fp = probe_footprint(model, make_prompt_cache(model), [1, 2, 3, 4])
    chunk = 512
    need = fp.need(prompt_len, max_tokens, chunk, dequantize=False)
    prompt = mx.array([(7 * i) % 500 + 1 for i in range(prompt_len)])
    mx.clear_cache()
    mx.eval(prompt)
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    cache = make_prompt_cache(model)
    for _, _ in zip(range(max_tokens),
                    generate_step(prompt, model, prompt_cache=cache, prefill_step_size=chunk)):
        pass
    took = mx.get_peak_memory() - before
    assert need >= took, (need, took)
    assert need <= 6 * took, (need, took)


def test_ledger_verdicts():
    ledger = Ledger(limit=100)
    ledger.observe_idle(active=30, stored=0)  # the model holds 30
    verdict, excess = ledger.judge(1, 80, stored=0, active=30)
    assert verdict.status == 413 and "--max-memory" in verdict.reason  # 30 + 80 > 100 alone
    verdict, excess = ledger.judge(1, 50, stored=40, active=70)
    assert verdict.admitted and excess == 20  # fits once 20 stored bytes go
    verdict, _ = ledger.judge(2, 30, stored=0, active=80)
    assert verdict.status == 503 and verdict.retry_after_s  # request 1 holds 50
    assert ledger.release(1) and not ledger.release(1)
    verdict, _ = ledger.judge(2, 30, stored=0, active=30)
    assert verdict.admitted
    assert ledger.release(2)


def test_a_batched_request_is_priced_alone_when_nothing_else_runs():
    ledger = Ledger(limit=100)
    ledger.observe_idle(active=30, stored=0)
    # batched it would need 80 (its cache copied into the batch), alone 40: it runs alone
    verdict, _ = ledger.judge(1, 80, stored=0, active=30, alone=40)
    assert verdict.admitted and ledger.held == 40
    # beside it, the next one is priced batched: 30 + 40 + 80 > 100
    verdict, _ = ledger.judge(2, 80, stored=0, active=70, alone=40)
    assert verdict.status == 503
    # and 413 only when it cannot fit even alone
    verdict, _ = ledger.judge(3, 200, stored=0, active=70, alone=60)
    assert verdict.status == 503
    verdict, _ = ledger.judge(3, 200, stored=0, active=70, alone=80)
    assert verdict.status == 413


class Policy:
    def __init__(self, status):
        self.status, self.calls = status, []

    @hookimpl
    def kvplugin_admit(self, need, limit, in_use, stored, settings):
        self.calls.append((need, limit, in_use, stored))
        return self.status


def _session(pm, limit: str) -> KVService:
    return KVService(resolve_settings({"max_memory": limit}), host="test", hook=pm.hook,
                     max_bytes=1 << 40)


def test_admit_hook_fires_through_the_session_and_can_refuse(model):
    pm = plugins.create_plugin_manager(load_entry_points=False)
    policy = Policy(503)
    pm.register(policy)
    service = _session(pm, "64GiB")
    service.admission.learn_model(model, make_prompt_cache(model))
    with pytest.raises(AdmissionRefused) as err:
        service.admission.admit(1, model, prompt_tokens=100, max_tokens=10, prefill_chunk=512)
    assert err.value.verdict.status == 503 and err.value.verdict.retry_after_s
    need, limit, in_use, stored = policy.calls[0]
    assert limit == 64 * 2**30 and in_use == 0 and need > 0
    assert service.stats()["refused_busy"] == 1
    # called directly, as the contract says
    assert pm.hook.kvplugin_admit(need=1, limit=2, in_use=0, stored=0,
                                  settings=service.settings) == 503


def test_kvplugin_policy_refuses_what_can_never_fit_and_evicts_for_what_can(model):
    pm = plugins.create_plugin_manager(load_entry_points=False)
    service = _session(pm, "64GiB")
    admission = service.admission
    admission.learn_model(model, make_prompt_cache(model))
    fp = admission._footprints[id(model)]
    base = admission.ledger.base
    # a limit just big enough for one 1k-token request
    need = fp.need(1000, 0, 512, dequantize=False)
    admission.ledger.limit = base + need + 10
    with pytest.raises(AdmissionRefused) as err:
        admission.admit(1, model, prompt_tokens=5000, max_tokens=0, prefill_chunk=512)
    assert err.value.verdict.status == 413 and "KVPLUGIN_MAX_MEMORY" in str(err.value)
    assert admission.admit(2, model, prompt_tokens=1000, max_tokens=0, prefill_chunk=512)
    with pytest.raises(AdmissionRefused) as err:
        admission.admit(3, model, prompt_tokens=1000, max_tokens=0, prefill_chunk=512)
    assert err.value.verdict.status == 503
    admission.finish(2)
    assert admission.admit(3, model, prompt_tokens=1000, max_tokens=0, prefill_chunk=512)
    stats = service.stats()
    assert (stats["admitted"], stats["refused_too_large"], stats["refused_busy"]) == (2, 1, 1)
    assert stats["max_memory"] == admission.ledger.limit


def test_off_admits_everything_and_never_calls_the_hook(model):
    pm = plugins.create_plugin_manager(load_entry_points=False)
    policy = Policy(413)
    pm.register(policy)
    service = _session(pm, "off")
    service.admission.learn_model(model, make_prompt_cache(model))
    assert service.admission.admit(1, model, prompt_tokens=10**7, max_tokens=0,
                                   prefill_chunk=512) is None
    assert policy.calls == [] and service.stats()["max_memory"] is None


@pytest.mark.parametrize("family", ["mamba", "falcon_h1"])
def test_recurrent_state_is_priced_at_its_fixed_size(family, tmp_path):
    """State-space layers (ArraysCache, alone or in a CacheList) do not grow with the prompt;
    attention layers beside them do (Falcon-H1)."""
    from mlx_lm import load

    from kvplugin.tools.models.families import build_family_model

    model, _ = load(str(build_family_model(family, tmp_path / family)))
    fp = probe_footprint(model, make_prompt_cache(model), [1, 2, 3, 4])
    fixed = sum(layer.fixed for layer in fp.layers)
    assert fixed > 0
    growing = sum(layer.per_slot for layer in fp.layers)
    assert fp.kv_bytes(10_000) - fp.kv_bytes(10) == growing * 9_990
    assert (growing == 0) == (family == "mamba")
