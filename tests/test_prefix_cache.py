"""The prefix cache's ownership in the engine: locks released by terminal plans exactly
once, inserts only on success (duplicates and tails freed by the KV releaser), eviction
of unlocked pages only, and an audit that finds every page's one holder."""

from __future__ import annotations

import pytest
import torch

from terminus.effects.disagg import DisaggPools, DisaggPrefill
from terminus.effects.prefix_cache import PREFIX_LOCK, PrefixCache, audit_pages
from terminus.effects.sequence import RunningBatch, SchedulerPools
from terminus.effects.sim.transport import FakeTransport
from terminus.fsm import ReleaseFailed, TransitionNotAllowed
from terminus.fsm.paths import complete, transition_paths
from terminus.kernels import RadixTree
from terminus.states.sequence import (
    SEQUENCE,
    Admit,
    ChunkLaunched,
    Fail,
    Finish,
    LastChunkDone,
    SequenceAbort,
    Token,
)

SHARED = list(range(1000, 1040))  # a 40-token prompt whose first 32 tokens others share


@pytest.fixture(params=[1, 16], ids=["page1", "page16"])
def pools(request):
    p = SchedulerPools(rows=8, max_context_len=64, kv_tokens=256, mamba_slots=8, strict=True,
                       page_size=request.param)
    yield p
    p.assert_full()


def cached_batch(pools, log=None):
    cache = PrefixCache(pools.kv)

    def on_retired(rows, state):
        if log is not None:
            log.extend((int(r), state) for r in rows)

    return RunningBatch(pools, on_retired, cache=cache), cache


def run_to_finish(rb, prompt):
    """Admit `prompt`, prefill what was not matched in one chunk, decode one token,
    finish: its KV is inserted into the cache."""
    rows = rb.admit(1, mamba=False, prompts=[prompt])
    r = int(rows[0])
    rest = len(prompt) - rb.matched(r)
    assert rb.append_kv(rows, torch.tensor([rest]))
    rb.fire(rows, ChunkLaunched)
    rb.fire(rows, LastChunkDone)
    prompt.append(7)
    assert rb.append_kv(rows, torch.tensor([1]))
    rb.fire(rows, Token)
    rb.fire(rows, Finish)
    return r


def end_clean(rb, cache, pools):
    """Every test's end: no lock left, the cache evicted, every pool full."""
    assert cache.locked_tokens == 0
    rb.audit()
    cache.evict_all()
    assert cache.held_tokens == 0
    pools.assert_full()


def test_a_finished_request_is_cached_and_the_next_one_matches_and_locks_it(pools):
    rb, cache = cached_batch(pools)
    run_to_finish(rb, list(SHARED))
    assert cache.held_tokens == 32 if pools.page_size == 16 else 41
    rows = rb.admit(1, mamba=True, prompts=[SHARED[:32] + [5] * 8])
    r = int(rows[0])
    assert rb.matched(r) == 32 and int(pools.table.lengths[r]) == 32
    assert cache.locked_tokens == 32
    audit = rb.audit()
    assert audit["cache_locked"] == 32 and audit["requests"] == 0
    # Only the rest is allocated, on the row's own pages.
    free_before = pools.kv.available
    assert rb.append_kv(rows, torch.tensor([8]))
    assert free_before - pools.kv.available == (8 if pools.page_size == 1 else 16)
    assert rb.audit()["requests"] == free_before - pools.kv.available
    rb.fire(rows, ChunkLaunched)
    rb.fire(rows, LastChunkDone)
    rb.fire(rows, Finish)
    assert cache.locked_tokens == 0
    end_clean(rb, cache, pools)


def test_a_limited_lookup_counts_only_the_tokens_it_looked_up(pools):
    rb, cache = cached_batch(pools)
    run_to_finish(rb, list(SHARED))
    page = cache.page_size
    for limit, looked in ((None, 40), (60, 40), (39, 39), (5, 5), (0, 0), (-3, 0)):
        before, hits = cache.lookup_tokens, cache.hit_tokens
        m = cache.match(list(SHARED), limit=limit)
        assert cache.lookup_tokens - before == looked
        assert m.length == looked - looked % page and cache.hit_tokens - hits == m.length
    cache.evict_all()


def test_every_terminal_path_of_the_sequence_with_a_matched_prefix(pools):
    """Each transition path to a terminal state, driven on a row that matched a cached
    prefix: the lock is released exactly once whichever terminal state it reaches, the
    KV is inserted only when it finished, and every page keeps one holder throughout."""
    paths = [complete(SEQUENCE, p) for p in transition_paths(SEQUENCE)]
    assert {p.final for p in paths} == {"finished", "aborted", "failed"}
    for path in paths:
        log = []
        rb, cache = cached_batch(pools, log)
        run_to_finish(rb, list(SHARED))
        log.clear()
        inserted = cache.inserted_tokens
        rows = None
        prompt = SHARED[:32] + list(range(1, 9))
        for step in path.steps:
            if step.source == "vacant":
                assert step.event is Admit
                rows = rb.admit(1, mamba=True, prompts=[prompt])
                assert rows is not None and rb.matched(int(rows[0])) == 32
                assert cache.locked_tokens == 32
                continue
            assert rows is not None
            if step.event is ChunkLaunched:
                assert rb.append_kv(rows, torch.tensor([4]))
            if step.event is Token:
                prompt.append(3)
                assert rb.append_kv(rows, torch.tensor([1]))
            rb.fire(rows, step.event)
            rb.audit()
        assert [s for _, s in log] == [path.final], str(path)
        assert cache.locked_tokens == 0, str(path)
        assert rb.locks[int(rows[0])] is None
        if path.final == "finished":
            assert cache.inserted_tokens >= inserted
        else:
            assert cache.inserted_tokens == inserted, f"{path}: an aborted row was cached"
        end_clean(rb, cache, pools)


def test_growth_evicts_only_unlocked_pages_and_never_a_locked_one(pools):
    rb, cache = cached_batch(pools)
    run_to_finish(rb, list(SHARED))
    run_to_finish(rb, list(range(2000, 2040)))  # a second, unrelated cached prompt
    rows = rb.admit(1, mamba=False, prompts=[SHARED[:32] + [9] * 8])
    locked = set(cache.tree.cached_indices(locked=True).tolist())
    assert len(locked) == 32
    # Fill the pool so the next growth must evict.
    hogs = []

    def fill():
        while pools.kv.available:
            hog = rb.admit(1, mamba=False)
            assert rb.append_kv(hog, torch.tensor([min(64, pools.kv.available)]))
            hogs.append(hog)

    while pools.kv.available:
        hog = rb.admit(1, mamba=False)
        assert rb.append_kv(hog, torch.tensor([min(64, pools.kv.available)]))
        hogs.append(hog)

    assert rb.append_kv(rows, torch.tensor([8]))  # room made by eviction
    assert cache.evicted_tokens > 0
    assert set(cache.tree.cached_indices(locked=True).tolist()) == locked
    rb.audit()
    # Nothing evictable left beyond what is locked: growth is refused, nothing taken.
    cache.evict_all()
    fill()
    before = (pools.kv.available, int(pools.table.lengths[int(rows[0])]))
    assert not rb.append_kv(rows, torch.tensor([pools.page_size]))
    assert cache.locked_tokens == 32
    assert (pools.kv.available, int(pools.table.lengths[int(rows[0])])) == before
    rb.fire(torch.cat([rows, *hogs]), Fail)
    end_clean(rb, cache, pools)


def test_the_audit_names_a_page_with_two_holders_or_none(pools):
    rb, cache = cached_batch(pools)
    run_to_finish(rb, list(SHARED))
    rb.audit()
    page = cache.tree.cached_indices()[:1]
    pools.kv.free(page)  # by hand: the pool and the cache both hold it now
    with pytest.raises(AssertionError, match="counted free and held"):
        rb.audit()
    pools.kv.alloc(pools.page_size)  # take it back (the stack hands out the last freed)
    rb.audit()
    lost = pools.kv.alloc(pools.page_size)  # allocated with no holder: a leak
    with pytest.raises(AssertionError, match="nobody holds"):
        rb.audit()
    pools.kv.free(lost)
    with pytest.raises(AssertionError, match="two holders"):
        audit_pages(pools.kv, cache, [cache.tree.cached_indices()[:1]])
    end_clean(rb, cache, pools)


def test_admission_refuses_prompts_without_a_cache_or_of_the_wrong_count(pools):
    rb = RunningBatch(pools)
    with pytest.raises(ValueError, match="no prefix cache"):
        rb.admit(1, mamba=False, prompts=[[1, 2]])
    rb2, cache = cached_batch(pools)
    with pytest.raises(ValueError, match="2 prompts for 1 rows"):
        rb2.admit(1, mamba=False, prompts=[[1], [2]])
    with pytest.raises(ValueError, match="built over the batch's own KV pool"):
        RunningBatch(pools, cache=PrefixCache(SchedulerPools(
            rows=1, max_context_len=8, kv_tokens=64, mamba_slots=1,
            page_size=pools.page_size).kv))
    assert pools.table.available == pools.table.capacity
    end_clean(rb2, cache, pools)


@pytest.mark.parametrize("refusal", ["bad_prompt", "lock_raises", "mamba_raises"])
def test_an_admission_refused_after_its_first_prompt_matched_takes_nothing(pools, refusal,
                                                                           monkeypatch):
    """Prompts are matched and locked before any row is taken: a prompt the cache cannot
    read, a lock that raises (on the second row, the first's lock already made) or a
    Mamba pool that raises leaves no row admitted and no lock held. Read after the
    rows were admitted, they left admitted rows the caller never got (admit raised)
    and the first row's lock."""
    rb, cache = cached_batch(pools)
    run_to_finish(rb, list(SHARED[:20]))  # cached: the prompts below match it
    prompts: list = [[*SHARED[:20], 1], [*SHARED[:20], 2]]
    if refusal == "bad_prompt":
        prompts[1] = None
    elif refusal == "lock_raises":
        real, calls = cache.lock, []

        def lock(m):
            calls.append(m)
            if len(calls) == 2:
                raise RuntimeError("cache lock failed")
            return real(m)

        monkeypatch.setattr(cache, "lock", lock)
    else:
        def refuse(n):
            raise RuntimeError("mamba pool failed")

        monkeypatch.setattr(pools.mamba, "alloc", refuse)
    free = (pools.table.available, pools.mamba.available_size(), pools.kv.available)
    with pytest.raises((TypeError, RuntimeError)):
        rb.admit(2, mamba=True, prompts=prompts)
    monkeypatch.undo()
    assert (pools.table.available, pools.mamba.available_size(), pools.kv.available) == free
    assert cache.locked_tokens == 0 and rb.rows_in("prefill").tolist() == []
    assert rb.locks == [None] * pools.table.capacity
    rows = rb.admit(2, mamba=True, prompts=[[*SHARED[:20], 1], [*SHARED[:20], 2]])
    hit = 20 - 20 % pools.page_size  # whole pages
    assert [rb.matched(int(r)) for r in rows] == [hit, hit] and cache.locked_tokens == hit
    rb.fire(rows, SequenceAbort)
    end_clean(rb, cache, pools)


def test_a_lock_released_twice_raises_and_changes_nothing(pools):
    cache = PrefixCache(pools.kv)
    kv = pools.kv.alloc(32)
    cache.insert("a", SHARED[:32], kv)
    lock = cache.lock(cache.match(SHARED))
    lock.release()
    with pytest.raises(RuntimeError, match="released twice"):
        lock.release()
    assert cache.locked_tokens == 0
    assert cache.evict_all() == 32
    pools.assert_full()


# -- disaggregated prefill ----------------------------------------------------------------


@pytest.fixture(params=[1, 16], ids=["page1", "page16"])
def disagg(request):
    pools = DisaggPools.make(kv_tokens=512, page_size=request.param)
    e = DisaggPrefill(pools, transport=FakeTransport(auto_complete=True))
    yield e
    e.finish()


def prefill(e, rid, tokens, chunk=16, abort_at=None):
    e.add(rid, len(tokens), chunk_size=chunk, tokens=tuple(tokens))
    e.bootstrap(rid)
    k = 0
    while e.req(rid).state in ("waiting", "prefilling"):
        if abort_at == k:
            e.abort(rid)
        c = e.schedule(rid)
        if c is not None:
            e.result(rid, c.index)
            e.audit()
        k += 1
    e.poll_transfer(rid)
    e.audit()
    return e.req(rid)


def test_disagg_success_inserts_once_and_frees_duplicates_and_tail_through_the_releaser(
        disagg):
    e = disagg
    ps = e.pools.page_size
    # Two requests with the same prompt prefill at once: neither finds it cached.
    for rid in ("a", "b"):
        e.add(rid, 40, chunk_size=16, tokens=tuple(SHARED))
        e.bootstrap(rid)
        assert e.req(rid).cached == 0
    for k in range(3):
        for rid in ("a", "b"):
            e.schedule(rid)
            e.result(rid, k)
            e.audit()
    e.poll_transfer("a")
    assert e.req("a").state == "succeeded" and e.cache.inserts["a"] == 1
    assert e.cache.held_tokens == (32 if ps == 16 else 40)
    # b's pages duplicate a's: its KV releaser frees them (and the unaligned tail).
    e.poll_transfer("b")
    assert e.req("b").state == "succeeded" and e.cache.inserts["b"] == 1
    assert e.cache.duplicate_tokens == (32 if ps == 16 else 40)
    assert e.cache.held_tokens == (32 if ps == 16 else 40)
    audit = e.audit()
    assert audit["requests"] == 0 and audit["cache_evictable"] == e.cache.held_tokens
    assert audit["free"] + audit["cache_evictable"] == audit["capacity"]
    assert e.ledger.count() == 0


def test_disagg_matches_a_cached_prefix_prefills_only_the_rest_and_sends_it_all(disagg):
    e = disagg
    ps = e.pools.page_size
    prefill(e, "a", SHARED)
    prompt = SHARED[:32] + list(range(1, 20))  # 51 tokens, the first 32 cached
    r = prefill(e, "b", prompt, chunk=16, abort_at=None)
    assert r.state == "succeeded" and r.cached == 32 and r.n_chunks == 2
    assert e.transport.sent_tokens["b"] == 51  # the matched pages are sent too
    assert e.cache.locked_tokens == 0 and e.ledger.count(PREFIX_LOCK) == 0
    assert e.cache.held_tokens == (32 + 16 if ps == 16 else 40 + 19)


@pytest.mark.parametrize("ending", ["aborted", "failed", "bootstrap_failed",
                                    "aborted_transfer"])
def test_disagg_every_terminal_path_with_a_matched_prefix_unlocks_once(disagg, ending):
    e = disagg
    prefill(e, "a", SHARED)
    inserted = e.cache.inserted_tokens
    prompt = SHARED[:32] + [3] * 20
    if ending == "bootstrap_failed":
        e.transport.fail("bootstrap", "r", times=1)
    if ending == "failed":
        e.transport.fail("send", "r", times=1)
    e.add("r", len(prompt), chunk_size=16, tokens=tuple(prompt))
    assert e.cache.locked_tokens == 32 and e.ledger.count(PREFIX_LOCK) == 1
    e.bootstrap("r")
    e.audit()
    if ending == "aborted":
        e.schedule("r")
        e.abort("r")
        e.result("r", 0)
    elif ending == "aborted_transfer":
        e.transport.auto_complete = False
        for k in range(2):
            e.schedule("r")
            e.result("r", k)
        assert e.req("r").state == "transferring"
        e.abort("r")
        e.transport.abort("r")
        e.poll_transfer("r")
    elif ending == "failed":
        for k in range(2):
            e.schedule("r")
            e.result("r", k)
    e.audit()
    want = "aborted" if ending == "aborted_transfer" else ending
    assert e.req("r").state == want
    assert e.cache.locked_tokens == 0 and e.ledger.count(PREFIX_LOCK) == 0
    assert e.cache.inserted_tokens == inserted and e.cache.inserts["r"] == 0
    assert e.ledger.count() == 0


def test_disagg_abort_and_failure_never_insert(disagg):
    e = disagg
    r = prefill(e, "x", SHARED, abort_at=1)
    assert r.state == "aborted" and e.cache.inserts["x"] == 0
    e.transport.fail("send", "y", times=1)
    r = prefill(e, "y", SHARED)
    assert r.state == "failed" and e.cache.inserts["y"] == 0
    assert e.cache.held_tokens == 0 and e.ledger.count(PREFIX_LOCK) == 0


def test_disagg_insert_refused_frees_every_page_through_the_releaser(disagg):
    e = disagg

    class Refusing(PrefixCache):
        def insert(self, *a, **k):
            raise RuntimeError("cache unavailable")

    e.cache = e.resources.cache = Refusing(e.pools.kv)
    e.add("r", 40, chunk_size=16, tokens=tuple(SHARED))
    e.bootstrap("r")
    for _ in range(3):
        c = e.schedule("r")
        e.result("r", c.index)
    with pytest.raises(ReleaseFailed, match="release_succeeded"):
        e.poll_transfer("r")
    assert e.req("r").state == "succeeded"
    assert e.audit()["requests"] == 0 and e.pools.in_use()["kv"] == 0


def test_tree_export_and_cache_refuse_a_lock_on_an_evicted_node(pools):
    assert RadixTree is not None
    cache = PrefixCache(pools.kv)
    cache.insert("a", SHARED[:32], pools.kv.alloc(32))
    m = cache.match(SHARED)
    cache.evict_all()
    with pytest.raises(Exception, match="not in this tree"):
        cache.lock(m)
    pools.assert_full()
    with pytest.raises(TransitionNotAllowed):
        RunningBatch(pools, cache=PrefixCache(pools.kv)).fire(torch.tensor([0]), Finish)


def test_the_readme_example_runs():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S)
               if "PrefixCache(pools.kv)" in b]
    exec(compile(code, "README.md", "exec"), {})
