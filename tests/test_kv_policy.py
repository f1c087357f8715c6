"""The KV policy (engine/kv.py's PrefixPolicy) and the scheduler's use of it, on a KV cache in pure
Python: no model, no context, the whole file in well under a second.

The fake implements PrefixPolicy's primitives the way ContextKV does over a context: cells are ids
with reference counts (a fork shares its parent's), idle cached prefixes are kept least recently used
first, and an evicted one is paged out to a host tier of ``host_tokens`` tokens (or dropped when it
does not fit there); a later prompt restores what the host tier holds instead of evaluating it.
reserve(), make_room() and the scheduler above them are the real ones."""
from __future__ import annotations

from collections import Counter, OrderedDict

import numpy as np
import pytest

from pyllama_kv.engine import GREEDY, Engine, EngineConfig
from pyllama_kv.engine.kv import PrefixPolicy
from pyllama_kv.engine.scheduler import _MAX_OVERTAKES, _MIN_SHARED
from pyllama_kv.errors import KVCacheFullError, LlamaError
from pyllama_kv.prefixcache.cache import shared_prefix

TOKEN = 5        # what the fake model always answers (never end-of-generation)
N_VOCAB = 8


class FakeModel:
    n_vocab = N_VOCAB

    def check_tokens(self, t):
        return np.asarray(list(t), dtype=np.int32)

    def token_to_piece(self, t):
        return b"x"

    def is_eog(self, t):
        return False


class FakeKV(PrefixPolicy):
    """A KVCache in pure Python (see the module docstring). ``starts`` records the first token of
    every started sequence (admission order); ``page_outs`` / ``drops`` the tokens of every idle
    prefix evicted, by how."""

    context = None

    def __init__(self, n_cells: int, parallel: int, prefix_cache: int = 0, host_tokens: int = 0):
        self.n_cells, self.parallel, self.prefix_cache = n_cells, parallel, prefix_cache
        self.host_tokens = host_tokens
        self.refs: Counter = Counter()                 # cell -> sequences holding it
        self.cells: dict[int, list[int]] = {}          # sequence -> its cells, by position
        self.toks: dict[int, list[int]] = {}           # sequence -> its tokens
        self.idle: OrderedDict[int, None] = OrderedDict()
        self.live: set[int] = set()
        self.host: list[tuple[int, ...]] = []
        self.page_outs: list[tuple[int, ...]] = []
        self.drops: list[tuple[int, ...]] = []
        self.starts: list[int] = []
        self.restored = 0
        self._ids = iter(range(10**6))
        self._cell_ids = iter(range(10**9))

    # -- storage ---------------------------------------------------------------------------------

    def _new(self, cells: list[int], toks: list[int]) -> int:
        if len(self.cells) >= self.parallel + self.prefix_cache:
            raise LlamaError("no free sequence id")
        sid = next(self._ids)
        self.refs.update(cells)
        self.cells[sid], self.toks[sid] = list(cells), list(toks)
        return sid

    def _grow(self, sid: int, toks) -> None:
        new = [next(self._cell_ids) for _ in toks]
        self.refs.update(new)
        self.cells[sid] += new
        self.toks[sid] += list(toks)

    def _close(self, sid: int) -> None:
        self.refs.subtract(self.cells.pop(sid))
        self.refs += Counter()   # (drops the cells no sequence holds)
        del self.toks[sid]
        self.idle.pop(sid, None)

    def _best(self, tokens) -> tuple[int | None, int]:
        best, n = None, 0
        for sid in self.idle:
            k = shared_prefix(self.toks[sid], tokens)
            if k > n:
                best, n = sid, k
        return best, n

    # -- PrefixPolicy's primitives -----------------------------------------------------------------

    def free_cells(self) -> int:
        return self.n_cells - len(self.refs)

    def free_ids(self) -> int:
        return min(self.parallel - len(self.live), self.parallel + self.prefix_cache - len(self.cells))

    @property
    def n_live(self) -> int:
        return len(self.live)

    def _resident_match(self, tokens) -> int:
        return self._best(tokens)[1]

    def _evict_idle(self, keep_for) -> bool:
        keep = self._best(keep_for)[0] if keep_for is not None else None
        victim = next((s for s in self.idle if s != keep), None)
        if victim is None:
            return False
        toks = tuple(self.toks[victim])
        if sum(map(len, self.host)) + len(toks) <= self.host_tokens:
            self.host.append(toks)
            self.page_outs.append(toks)
        else:
            self.drops.append(toks)
        self._close(victim)
        return True

    # -- the rest of KVCache -----------------------------------------------------------------------

    def match(self, tokens) -> int:
        return max([self._resident_match(tokens)] + [shared_prefix(h, tokens) for h in self.host])

    def start(self, tokens):
        best, n = self._best(tokens)
        n = min(n, len(tokens) - 1)
        sid = self._new(self.cells[best][:n] if best is not None else [], list(tokens[:n]))
        self.live.add(sid)
        self.starts.append(tokens[0])
        # what the host tier holds beyond that is restored (cells, no evaluation)
        paged = max((shared_prefix(h, tokens) for h in self.host), default=0)
        upto = min(paged, len(tokens) - 1)
        if upto > n and upto - n <= self.free_cells():
            self._grow(sid, tokens[n:upto])
            self.restored += upto - n
            n = upto
        return sid, n

    def fork(self, seq):
        while len(self.cells) >= self.parallel + self.prefix_cache and self._evict_idle(None):
            pass
        sid = self._new(self.cells[seq], self.toks[seq])
        self.live.add(sid)
        return sid

    def decode(self, batch):
        if sum(len(t) for t in batch.values()) > self.free_cells():
            raise KVCacheFullError("full")
        out = {}
        for s, t in batch.items():
            self._grow(s, t)
            logits = np.zeros(N_VOCAB, np.float32)
            logits[TOKEN] = 1.0
            out[s] = logits
        return out

    def shift(self, seq, n_keep, n_discard):
        return False

    def truncate(self, seq, n):
        self.refs.subtract(self.cells[seq][n:])
        self.refs += Counter()
        del self.cells[seq][n:], self.toks[seq][n:]

    def _keep_idle(self, sid: int) -> None:
        for o in [o for o in self.idle if self.toks[sid][:len(self.toks[o])] == self.toks[o]]:
            self._close(o)   # (a prefix of the new one: redundant)
        self.idle[sid] = None
        while len(self.idle) > self.prefix_cache and self._evict_idle(None):
            pass

    def finish(self, seq, keep):
        self.live.discard(seq)
        if keep and self.toks[seq] and self.prefix_cache:
            self._keep_idle(seq)
        else:
            self._close(seq)

    def remember(self, seq):
        if self.prefix_cache and len(self.cells) < self.parallel + self.prefix_cache:
            self._keep_idle(self._new(self.cells[seq], self.toks[seq]))

    def checkpoints_at(self, tokens, boundaries, held):
        return []

    def checkpoint(self, seq):
        pass

    def kv_stats(self):
        return {}


def engine(kv: FakeKV, **cfg) -> Engine:
    config = EngineConfig(n_ctx=kv.n_cells, parallel=kv.parallel, prefix_cache=kv.prefix_cache, **cfg)
    return Engine(FakeModel(), config, kv=kv)


def prompt(first: int, n: int) -> list[int]:
    """``n`` tokens starting with ``first`` (admission order is read from the first tokens)."""
    return [first] + [1 + (first + i) % 7 for i in range(n - 1)]


def finished(h) -> str:
    return h.result()[0].finish_reason


# -- the policy alone ------------------------------------------------------------------------------


def idle_kv(n_cells=100, host_tokens=0) -> FakeKV:
    """Three idle prefixes of 20 tokens (first tokens 1, 2, 3; 1 the least recently used)."""
    kv = FakeKV(n_cells, parallel=2, prefix_cache=3, host_tokens=host_tokens)
    for first in (1, 2, 3):
        s, _ = kv.start(prompt(first, 20))
        kv.decode({s: prompt(first, 20)})
        kv.finish(s, keep=True)
    assert kv.free_cells() == n_cells - 60 and len(kv.idle) == 3
    return kv


def test_reserve_evicts_only_what_it_needs_least_recently_used_first():
    kv = idle_kv()
    assert kv.reserve(prompt(9, 30), 10, 1) and kv.drops == []       # 40 fit in the 40 free cells
    assert kv.reserve(prompt(9, 30), 25, 1)                          # 55: one prefix has to go
    assert [t[0] for t in kv.drops] == [1]
    assert kv.reserve(prompt(9, 30), 45, 1) and [t[0] for t in kv.drops] == [1, 2]


def test_reserve_keeps_the_best_match_while_something_runs_and_says_no():
    kv = FakeKV(100, parallel=2, prefix_cache=3)
    for p in (prompt(1, 20), prompt(2, 60)):   # idle: 1 (least recently used), then a long one
        s, _ = kv.start(p)
        kv.decode({s: p})
        kv.finish(s, keep=True)
    live, _ = kv.start(prompt(8, 5))
    # 40 tokens sharing 5 with the long prefix, and 10 cells more: 45 of 20 free
    want = prompt(2, 5) + [6] * 35
    assert not kv.reserve(want, 10, 1)
    assert [t[0] for t in kv.drops] == [1] and [kv.toks[s][0] for s in kv.idle] == [2]
    # with nothing live the best match goes too (nothing else would ever make room)
    kv.finish(live, keep=False)
    assert kv.reserve(want, 10, 1) and [t[0] for t in kv.drops] == [1, 2] and kv.free_cells() == 100


def test_reserve_counts_ids_and_the_shared_prefix():
    kv = idle_kv()
    # 30 tokens of which 20 are shared with prefix 3, plus 30: 40 fit without evicting
    assert kv.reserve(prompt(3, 20) + [4] * 10, 30, 1) and kv.drops == []
    assert not kv.reserve(prompt(9, 2), 0, 3)   # 3 ids: only parallel=2 can be live
    assert kv.reserve(prompt(9, 2), 0, 2)


def test_make_room_pages_out_before_it_says_no():
    kv = idle_kv(host_tokens=40)
    assert kv.make_room(70)
    assert [t[0] for t in kv.page_outs] == [1, 2] and kv.drops == []   # 40 tokens: what the host holds
    assert not kv.make_room(101)
    assert [t[0] for t in kv.drops] == [3] and kv.free_cells() == 100


# -- the scheduler over it -------------------------------------------------------------------------


def test_admission_in_arrival_order():
    kv = FakeKV(200, parallel=2)
    eng = engine(kv, output_reserve=8)
    hs = [eng.submit(prompt(first, 10), GREEDY, max_tokens=4) for first in (3, 1, 4, 2, 6)]
    eng.step()
    assert kv.starts == [3, 1] and eng.waiting == 3   # two ids: the first two, in order
    eng.run_until_idle(max_steps=100)
    assert kv.starts == [3, 1, 4, 2, 6] and all(finished(h) == "length" for h in hs)


def test_a_head_that_does_not_fit_is_overtaken_a_bounded_number_of_times():
    kv = FakeKV(64, parallel=4)
    eng = engine(kv, output_reserve=4)
    long_run = eng.submit(prompt(1, 10), GREEDY, max_tokens=40)
    eng.step()
    # 52 + 4 never fit beside the running request; the small ones (2 + 1) always do
    head = eng.submit(prompt(2, 52), GREEDY, max_tokens=4)
    small = [eng.submit(prompt(3, 2), GREEDY, max_tokens=1) for _ in range(_MAX_OVERTAKES + 4)]
    eng.run_until_idle(max_steps=500)
    assert kv.starts == [1] + [3] * _MAX_OVERTAKES + [2] + [3] * 4
    assert all(finished(h) == "length" for h in [long_run, head, *small])
    assert eng.stats.preempted == 0


def test_preemption_when_the_kv_has_no_room_the_latest_admitted_goes():
    kv = FakeKV(60, parallel=2)
    eng = engine(kv, output_reserve=4)   # both fit with reserves of 4, then grow to 35 cells each
    a = eng.submit(prompt(1, 10), GREEDY, max_tokens=25)
    b = eng.submit(prompt(2, 10), GREEDY, max_tokens=25)
    eng.run_until_idle(max_steps=500)
    assert eng.stats.preempted >= 1
    assert kv.starts[:3] == [1, 2, 2], "b (admitted last) is preempted and started again"
    assert [len(h.result()[0].tokens) for h in (a, b)] == [25, 25]
    assert kv.cells == {} and kv.free_cells() == 60


def test_an_idle_prefix_is_paged_out_before_anything_is_preempted():
    kv = FakeKV(60, parallel=2, prefix_cache=2, host_tokens=100)   # (2: no page-out for the bound)
    eng = engine(kv, output_reserve=1)
    old = eng.submit(prompt(7, 20), GREEDY, max_tokens=2)
    eng.run_until_idle(max_steps=50)
    assert [kv.toks[s][0] for s in kv.idle] == [7]
    # 10 + 40 tokens beside the idle 21 cells: a decode finds no room, and make_room pages it out
    a = eng.submit(prompt(1, 10), GREEDY, max_tokens=40)
    eng.run_until_idle(max_steps=200)
    assert eng.stats.preempted == 0 and finished(old) == finished(a) == "length"
    assert [t[0] for t in kv.page_outs] == [7] and kv.drops == []


@pytest.mark.parametrize("host_tokens", [0, 200])
def test_evicted_conversations_are_paged_out_and_come_back_restored(host_tokens):
    kv = FakeKV(64, parallel=1, prefix_cache=1, host_tokens=host_tokens)
    eng = engine(kv, output_reserve=4)
    first = prompt(1, 30)
    h1 = eng.submit(first, GREEDY, max_tokens=4)
    eng.run_until_idle(max_steps=50)
    other = eng.submit(prompt(2, 50), GREEDY, max_tokens=4)   # needs the first conversation's cells
    eng.run_until_idle(max_steps=100)
    evicted = [t[0] for t in (kv.page_outs if host_tokens else kv.drops)]
    assert 1 in evicted and (kv.drops if host_tokens else kv.page_outs) == []
    again = eng.submit(first + h1.result()[0].tokens + [3, 3], GREEDY, max_tokens=2)
    eng.run_until_idle(max_steps=100)
    assert finished(other) == finished(again) == "length"
    reused = again.usage.reused_tokens
    if host_tokens:
        assert reused >= 33 and kv.restored >= 33, "the paged-out conversation is restored, not evaluated"
    else:
        assert reused == 0 and kv.restored == 0


def test_a_prompt_sharing_one_in_evaluation_waits_for_it_then_forks_it():
    kv = FakeKV(400, parallel=2, prefix_cache=2)
    eng = engine(kv, output_reserve=4, n_batch=16, n_ubatch=16)
    system = prompt(1, 3 * _MIN_SHARED)
    a = eng.submit(system + [2, 2], GREEDY, max_tokens=2)
    eng.step()
    b = eng.submit(system + [4, 4], GREEDY, max_tokens=2)
    steps = 1
    while a.usage.completion_tokens == 0:   # a's prompt is not in yet
        eng.step()
        steps += 1
        assert kv.starts == [1], "b is held back while a's prompt is evaluated"
    eng.run_until_idle(max_steps=100)
    assert kv.starts == [1, 1] and steps >= 3
    assert b.usage.reused_tokens >= len(system), "b forks a's prompt instead of evaluating it again"
    assert finished(a) == finished(b) == "length"


def test_a_request_that_never_meets_its_reserve_is_admitted_when_nothing_runs():
    kv = FakeKV(32, parallel=2)
    eng = engine(kv, output_reserve=64, context_shift=False)
    h = eng.submit(prompt(1, 20), GREEDY, max_tokens=40)   # 20 + 40 > 32, for ever
    eng.step()
    assert eng.running == 1
    eng.run_until_idle(max_steps=100)
    c = h.result()[0]
    assert c.finish_reason == "length" and len(c.tokens) == 32 - 20 and eng.stats.preempted == 0


def test_a_request_that_does_not_meet_its_reserve_waits_while_something_runs():
    kv = FakeKV(40, parallel=2)
    eng = engine(kv, output_reserve=16)
    a = eng.submit(prompt(1, 10), GREEDY, max_tokens=10)
    b = eng.submit(prompt(2, 12), GREEDY, max_tokens=16)   # 10 + 16 held/promised, 12 + 16 more: no
    eng.step()
    assert kv.starts == [1] and eng.running == 1 and eng.waiting == 1
    eng.run_until_idle(max_steps=100)
    assert kv.starts == [1, 2] and finished(a) == finished(b) == "length" and eng.stats.preempted == 0
