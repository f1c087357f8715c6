"""pyllama_kv.chat.conversation (the token-stable multi-turn conversation) on pyllama_kv.engine.oneshot's
EngineSession, on the tiny model with a small template of our own (the tiny model has none)."""
from __future__ import annotations

import pytest

import pyllama_kv as pk
from pyllama_kv.chat.conversation import ChatTemplate, Conversation
from pyllama_kv.config import GREEDY, EngineConfig
from pyllama_kv.engine.oneshot import EngineSession

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def model(tiny_model):
    m = pk.Model(tiny_model)
    yield m
    m.close()


def _config(**kw) -> EngineConfig:
    return EngineConfig(**{"n_ctx": 512, "parallel": 1, "prefix_cache": 2, "max_tokens": 16, "keep_finished": True,
                           **kw})


def test_a_model_without_a_template_is_refused(model):
    with pytest.raises(pk.InvalidInputError, match="has no chat template"):
        ChatTemplate(model)
    with pytest.raises(pk.InvalidInputError, match="the template t.jinja"):
        ChatTemplate(model, "{{ raise_exception('no') }}", "the template t.jinja")


def test_each_turn_starts_with_the_tokens_the_cache_holds(model):
    conv = Conversation(ChatTemplate(model, TEMPLATE), system="be brief")
    with EngineSession(model, _config()) as s:
        held: list[int] = []
        for i, user in enumerate(("hello there", "and the cache", "one more")):
            turn = conv.next_prompt(user)
            assert turn.tokens[:len(held)] == held   # the contract: the kept tokens, then the new text's
            assert conv.n_keep is not None and 0 < conv.n_keep < len(turn.tokens)
            events: list = []
            h = s.generate(turn.tokens, GREEDY, max_tokens=8, keep=True, n_keep=conv.n_keep,
                           boundaries=conv.next_boundaries, on_events=events.extend)
            c = h.completions[0]
            assert c.finish_reason in ("eos", "length") and "".join(e.text for e in events) == c.text
            if i:   # everything the cache held was reused but the last token of the previous answer
                assert h.usage.reused_tokens >= len(held) - 1, (h.usage, len(held))
            conv.answered(*turn, c, cells_kept=True)
            held = conv.tokens
            assert held[:len(turn.tokens)] == turn.tokens and len(held) > len(turn.tokens)
        assert [m["role"] for m in conv.messages] == ["system"] + ["user", "assistant"] * 3
        s.forget()   # /reset: the cached turns are freed
        assert s.ctx.kv_stats().used_cells == 0
    conv.reset()
    assert conv.tokens == [] and conv.messages == [{"role": "system", "content": "be brief"}]


def test_a_session_holds_the_cells_until_closed(model):
    s = EngineSession(model, _config(parallel=3, prefix_cache=0, keep_finished=False), hold=True)
    try:
        h = s.generate(model.tokenize("the cache of the model"), GREEDY, max_tokens=4, n=3, keep=False)
        assert h.done and len(h.completions) == 3
        assert s.ctx.kv_stats().used_cells > 0   # held for the caller's stats
    finally:
        s.close()
    s.close()   # twice is fine
    with pytest.raises(pk.InvalidInputError):
        s.engine.submit([1, 2, 3])


def test_submit_collects_the_events_for_run(model):
    with EngineSession(model, _config()) as s:
        with pytest.raises(TypeError, match="on_event"):
            s.submit([1, 2, 3], GREEDY, on_event=print)
