"""A conversation's previous turn is superseded by its next one, never another's entry.

Why: a chat's next prompt carries the previous reply re-tokenized from text, which often
differs from the generated tokens in its last few positions; the previous turn's entry then
is not a strict prefix of the new one, and without this rule every turn of a conversation
stays stored (measured on a real server: one full entry per turn).
"""

from __future__ import annotations

from kvplugin.cache.service.service import KVService
from kvplugin.cache.store.prompt_store import PromptStore
from kvplugin.plugins import create_plugin_manager
from kvplugin.settings import resolve_settings

from test_store import extend, kv, prefix_ok, seq  # noqa: F401  (shared fixtures of the store tests)


def test_entry_whose_prompt_is_continued_is_superseded():
    s = PromptStore(max_bytes=1 << 30)
    prompt, reply = seq(0, 30), seq(100, 6)
    s.insert("m", prompt + reply, kv(prompt + reply), prompt_len=len(prompt))
    retokenized = seq(100, 4) + seq(500, 3)  # the reply as the next prompt spells it
    nxt = prompt + retokenized + seq(200, 5)
    s.insert("m", nxt, kv(nxt))
    assert len(s) == 1 and s.stats().superseded == 1
    got, n = s.fetch("m", prompt + reply + [9])  # the old prompt again: served from the new entry
    assert n == len(prompt) + 4


def test_branch_inside_the_prompt_keeps_the_other_conversation():
    s = PromptStore(max_bytes=1 << 30)
    system = seq(0, 30)
    a = system + seq(100, 5) + seq(150, 5)
    s.insert("m", a, kv(a), prompt_len=35)
    b = system + seq(300, 5) + seq(350, 5)  # B shares the system prompt only
    s.insert("m", b, kv(b), prompt_len=35)
    assert len(s) == 2 and s.stats().superseded == 0


def test_unknown_prompt_length_is_never_superseded_by_a_branch():
    s = PromptStore(max_bytes=1 << 30)
    a = seq(0, 40)
    s.insert("m", a, kv(a))
    b = seq(0, 38) + [999, 998, 997]
    s.insert("m", b, kv(b))
    assert len(s) == 2


def test_session_learns_the_prompt_length_from_the_fetch():
    pm = create_plugin_manager(load_entry_points=False)
    svc = KVService(resolve_settings(), host="test", hook=pm.hook, max_bytes=1 << 40)
    system, user1 = seq(0, 30), seq(100, 4)
    prompt1 = system + user1
    cache, n = svc.fetch("m", prompt1)
    assert cache is None
    reply = seq(200, 6)
    svc.insert("m", prompt1 + reply, kv(prompt1 + reply))
    (entry,) = svc.store.snapshot()[1]
    assert entry.prompt_len == len(prompt1)
    prompt2 = prompt1 + seq(200, 4) + seq(700, 2) + seq(300, 3)  # reply re-tokenized, user 2
    cache, n = svc.fetch("m", prompt2)
    assert n == len(prompt1) + 4  # the shared prefix, as a view of the stored entry
    assert prefix_ok(cache, prompt2[:n])
    extend(cache, prompt2[n:], n)
    svc.insert("m", prompt2, cache)
    assert len(svc.store) == 1 and svc.store.stats().superseded == 1


def test_prepare_then_store_learns_the_prompt_length_too():
    """vllm-mlx's ``--continuous-batching`` prefix cache stores through ``prepare_entry`` +
    ``store_prepared`` (not ``insert``): its conversation's previous turn must go as well."""
    pm = create_plugin_manager(load_entry_points=False)
    svc = KVService(resolve_settings(), host="test", hook=pm.hook, max_bytes=1 << 40)
    prompt1 = seq(0, 34)
    svc.fetch("m", prompt1)
    reply = seq(200, 6)
    svc.store_prepared("m", prompt1 + reply, svc.prepare_entry(kv(prompt1 + reply), 40))
    (entry,) = svc.store.snapshot()[1]
    assert entry.prompt_len == len(prompt1)
    prompt2 = prompt1 + seq(200, 4) + seq(700, 2) + seq(300, 3)
    cache, n = svc.fetch("m", prompt2)
    extend(cache, prompt2[n:], n)
    svc.store_prepared("m", prompt2, svc.prepare_entry(cache, len(prompt2)))
    assert len(svc.store) == 1 and svc.store.stats().superseded == 1
