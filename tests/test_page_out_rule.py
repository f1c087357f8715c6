"""The page-out rule (issue 35): a cache in device memory pages an evicted prefix out only while
paging out and restoring a token costs less than evaluating it again, as measured in the context
(``Context.eval_cost``: a line through its decodes' sizes and times; the tiers' own page-out and
restore seconds). A cache in host memory always pages out."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import pyllama_kv as pk
from conftest import DEVICE_RUN, toks
from pyllama_kv.core.cost import MIN_DECODES, EvalCost
from pyllama_kv.prefixcache.tiers import PAGE_OUT_EVIDENCE, PAGE_OUT_PROBE, Tiers, TierStats


def test_eval_cost_is_the_slope_of_a_decodes_time_against_its_tokens():
    c = EvalCost()
    for i in range(MIN_DECODES - 1):
        c.observe(8 + 40 * (i % 4), 0.010 + 0.0002 * (8 + 40 * (i % 4)))
    assert c.per_token() is None, "too few decodes for an estimate"
    c.observe(8, 0.010 + 0.0002 * 8)
    assert c.per_token() == pytest.approx(0.0002, rel=1e-6)


def test_eval_cost_says_nothing_from_batches_of_one_size():
    c = EvalCost()
    for _ in range(4 * MIN_DECODES):
        c.observe(32, 0.02)
    assert c.per_token() is None
    for i in range(4 * MIN_DECODES):   # sizes that grow while the time falls: noise, not a cost
        c.observe(1 + i, 1.0 / (1 + i))
    assert c.per_token() is None


class CostClock:
    """A clock for ``EvalCost.clock`` that advances by a known cost: a decode of n tokens takes
    ``fixed + per_token * n`` seconds by it. The test says n before each decode (``next``); the
    context reads the clock once before its decode (the time stays) and once after it (the time moves
    on by the decode's cost)."""

    def __init__(self, fixed: float, per_token: float):
        self.fixed, self.per_token = fixed, per_token
        self.now, self.reads, self.next = 1000.0, 0, None

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:   # the read after a decode
            assert self.next is not None, "a decode the test did not announce"
            self.now += self.fixed + self.per_token * self.next
            self.next = None
        return self.now


def test_a_context_measures_its_decodes(tiny_model, patched_lib):
    """The context times each decode with its EvalCost's clock and counts the batch's tokens (every
    sequence's): with a clock that charges 2 ms a call and 50 us a token, the measured slope is 50 us
    exactly, whatever the machine's load (the real clock's slope on a busy machine was noise)."""
    with pk.Model(tiny_model, lib=patched_lib) as m, m.context(n_ctx=2048, n_seq_max=2) as ctx:
        assert ctx.cache_on_device == DEVICE_RUN, "a CPU run's cache is in host memory, a GPU run's on the GPU"
        assert ctx.eval_cost.decodes == 0 and ctx.eval_cost.per_token() is None
        clock = ctx.eval_cost.clock = CostClock(fixed=0.002, per_token=50e-6)
        seqs = [ctx.new_sequence() for _ in range(2)]
        n = 0
        for r in range(6):
            for size in (1, 16, 64):
                clock.next = 2 * size   # both sequences' tokens, in one decode
                ctx.decode({s: toks(size, seed=r * 10 + size + i) for i, s in enumerate(seqs)})
                n += 1
                assert clock.reads == 2 * n, "the decode read the clock once before and once after"
                if n < MIN_DECODES:
                    assert ctx.eval_cost.per_token() is None, "too few decodes for an estimate"
        assert ctx.eval_cost.decodes == n >= MIN_DECODES
        assert ctx.eval_cost.per_token() == pytest.approx(50e-6, rel=1e-6)
        # a decode that fails is not counted (its time says nothing of an evaluation)
        with pytest.raises(pk.LlamaError):
            ctx.decode({seqs[0]: [m.n_vocab + 5]})
        assert ctx.eval_cost.decodes == n


class FixedCost:
    """An evaluation that costs ``per_token`` seconds a token (the rule's input, fixed for the test)."""

    def __init__(self, per_token):
        self.value = per_token

    def per_token(self):
        return self.value


def page_out_many(seqs, *, on_device: bool, eval_seconds: float) -> tuple[TierStats, list[int]]:
    stats = TierStats(enabled=True)
    tiers = Tiers(SimpleNamespace(cache_on_device=on_device, eval_cost=FixedCost(eval_seconds)), 64 << 20, stats)
    stored = [tiers.page_out(s) for s in seqs]
    return stats, stored


@pytest.fixture(scope="module")
def sequences(tiny_model, patched_lib):
    with pk.Model(tiny_model, lib=patched_lib) as m, m.context(n_ctx=1024, n_seq_max=24) as ctx:
        seqs = []
        for i in range(24):
            s = ctx.new_sequence()
            s.extend(toks(20, seed=100 + i))
            seqs.append(s)
        yield seqs


def test_a_device_cache_drops_what_is_cheaper_to_evaluate_again(sequences):
    stats, stored = page_out_many(sequences, on_device=True, eval_seconds=1e-12)
    # the first PAGE_OUT_EVIDENCE are paged out (the cost is measured), then only every PAGE_OUT_PROBE-th
    assert all(n == 20 for n in stored[:PAGE_OUT_EVIDENCE])
    later = stored[PAGE_OUT_EVIDENCE:]
    probes = [i for i, n in enumerate(later, 1) if n]
    assert probes == [i for i in range(1, len(later) + 1) if i % PAGE_OUT_PROBE == 0]
    assert stats.page_outs_skipped == len(later) - len(probes) > 0
    assert stats.page_outs == PAGE_OUT_EVIDENCE + len(probes)
    assert stats.eval_token_seconds == 1e-12


def test_a_device_cache_pages_out_while_evaluating_costs_more(sequences):
    stats, stored = page_out_many(sequences, on_device=True, eval_seconds=10.0)
    assert all(n == 20 for n in stored) and stats.page_outs_skipped == 0


@pytest.mark.parametrize("eval_seconds", [None, 1e-12])
def test_a_host_cache_always_pages_out(sequences, eval_seconds):
    stats, stored = page_out_many(sequences, on_device=False, eval_seconds=eval_seconds)
    assert all(n == 20 for n in stored) and stats.page_outs_skipped == 0 and stats.eval_token_seconds == 0


def test_no_estimate_no_rule(sequences):
    stats, stored = page_out_many(sequences, on_device=True, eval_seconds=None)
    assert all(n == 20 for n in stored) and stats.page_outs_skipped == 0


def test_a_slow_restore_counts_against_a_page_out(sequences):
    """What a page-out saves is paid again by its restore: with copies out cheaper than an evaluation
    but restores far dearer, the rule drops."""
    stats = TierStats(enabled=True)
    tiers = Tiers(SimpleNamespace(cache_on_device=True, eval_cost=FixedCost(1.0)), 64 << 20, stats)
    stored = [tiers.page_out(s) for s in sequences[:PAGE_OUT_EVIDENCE + 2]]
    assert all(n == 20 for n in stored) and stats.page_outs_skipped == 0, "copies out cost less than 1 s a token"
    tiers._restored.add(1, 10.0)   # a restore measured at 10 s a token
    assert tiers.page_out(sequences[PAGE_OUT_EVIDENCE + 2]) == 0 and stats.page_outs_skipped == 1
