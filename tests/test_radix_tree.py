"""The prefix cache's radix tree (terminus.kernels.radix) over a real KV allocator:
matching, deduplicating inserts, locks along the path, LRU eviction of unlocked leaves.
Every test ends with the pool full and the tree empty."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from terminus.kernels import TokenKVAllocator
from terminus.kernels.radix import LockUnderflow, RadixTree, StaleNode


def _drain(tree: RadixTree, kv: TokenKVAllocator) -> None:
    kv.free(tree.evict(tree.total_size()))
    assert tree.total_size() == 0
    kv.assert_full()


def _alloc(kv: TokenKVAllocator, n: int) -> torch.Tensor:
    out = kv.alloc(n)
    assert out is not None
    return out


@pytest.mark.parametrize("page", [1, 4])
def test_a_second_request_matches_the_first_ones_prefix_in_whole_pages(page: int):
    kv = TokenKVAllocator(256, page_size=page)
    tree = RadixTree(page)
    a = list(range(10))
    a_kv = _alloc(kv, len(a))
    ins = tree.insert(a, a_kv)
    aligned = len(a) - len(a) % page
    assert ins.prefix_len == 0 and ins.taken.tolist() == a_kv[:aligned].tolist()
    assert ins.duplicates.numel() == 0 and ins.leftover.tolist() == a_kv[aligned:].tolist()
    kv.free(ins.leftover)

    m = tree.match_prefix([*a[:7], 99, 98, 97])
    assert m.length == 7 - 7 % page
    assert m.indices.tolist() == a_kv[:m.length].tolist()
    tree.check()
    _drain(tree, kv)


@pytest.mark.parametrize("as_tuple", [False, True])
def test_a_match_with_a_limit_matches_only_that_head_in_whole_pages(as_tuple: bool):
    kv = TokenKVAllocator(256, page_size=4)
    tree = RadixTree(4)
    a = list(range(1, 21))
    a_kv = _alloc(kv, len(a))
    tree.insert(a, a_kv)
    query = tuple(a) if as_tuple else list(a)
    for limit, matched in ((None, 20), (30, 20), (20, 20), (19, 16), (9, 8), (3, 0),
                           (0, 0), (-5, 0)):
        m = tree.match_prefix(query, limit=limit)
        assert m.length == matched, limit
        assert m.indices.tolist() == a_kv[:matched].tolist()
    assert list(query) == a  # the caller's tokens are not touched
    tree.check()
    _drain(tree, kv)


def test_an_insert_returns_what_is_already_cached_as_duplicates_for_the_caller_to_free():
    kv = TokenKVAllocator(64)
    tree = RadixTree()
    first = _alloc(kv, 6)
    kv.free(tree.insert([1, 2, 3, 4, 5, 6], first).leftover)
    # A second request computed the same first four tokens itself (no match taken).
    second = _alloc(kv, 8)
    ins = tree.insert([1, 2, 3, 4, 9, 9, 9, 9], second)
    assert ins.prefix_len == 4
    assert ins.duplicates.tolist() == second[:4].tolist()
    assert ins.taken.tolist() == second[4:].tolist()
    kv.free(ins.duplicates)
    assert tree.total_size() == 10
    tree.check()
    _drain(tree, kv)


def test_the_callers_matched_prefix_is_neither_a_duplicate_nor_taken():
    kv = TokenKVAllocator(64)
    tree = RadixTree()
    base = _alloc(kv, 4)
    tree.insert([1, 2, 3, 4], base)
    m = tree.match_prefix([1, 2, 3, 4, 5, 6])
    tree.inc_lock_ref(m.node)
    own = _alloc(kv, 2)
    row = torch.cat([m.indices, own])
    ins = tree.insert([1, 2, 3, 4, 5, 6], row, owned_from=m.length)
    assert ins.duplicates.numel() == 0 and ins.taken.tolist() == own.tolist()
    tree.dec_lock_ref(m.node)
    tree.check()
    _drain(tree, kv)


def test_a_locked_prefix_is_never_evicted_and_unlocking_makes_it_evictable():
    kv = TokenKVAllocator(64)
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], _alloc(kv, 4))
    tree.insert([7, 8], _alloc(kv, 2))
    m = tree.match_prefix([1, 2, 3])
    assert tree.inc_lock_ref(m.node) == 3
    assert (tree.protected_size(), tree.evictable_size()) == (3, 3)
    dropped = tree.evict(100)
    # [7, 8] and the unlocked tail [4] go; the locked [1, 2, 3] stays.
    assert sorted(dropped.tolist()) == sorted(set(dropped.tolist())) and dropped.numel() == 3
    kv.free(dropped)
    assert tree.match_prefix([1, 2, 3, 4]).length == 3
    assert tree.dec_lock_ref(m.node) == 3
    tree.check()
    _drain(tree, kv)


def test_eviction_takes_the_least_recently_used_leaf_first():
    kv = TokenKVAllocator(64)
    tree = RadixTree()
    old, new = _alloc(kv, 2), _alloc(kv, 2)
    tree.insert([1, 1], old)
    tree.insert([2, 2], new)
    tree.match_prefix([1, 1])  # touch: [2, 2] is now the older one
    dropped = tree.evict(1)
    assert dropped.tolist() == new.tolist()
    kv.free(dropped)
    _drain(tree, kv)


def test_an_unlock_without_its_lock_raises_and_changes_nothing():
    kv = TokenKVAllocator(64)
    tree = RadixTree()
    tree.insert([1, 2, 3], _alloc(kv, 3))
    m = tree.match_prefix([1, 2, 3])
    with pytest.raises(LockUnderflow, match=r"is not locked; every dec_lock_ref must follow"):
        tree.dec_lock_ref(m.node)
    assert (tree.evictable_size(), tree.protected_size()) == (3, 0)
    tree.check()
    _drain(tree, kv)


def test_unlocking_an_ancestor_locked_only_through_its_descendant_is_refused():
    kv = TokenKVAllocator(64)
    tree = RadixTree()
    tree.insert([1, 2], _alloc(kv, 2))
    kv.free(tree.insert([1, 2, 3, 4], _alloc(kv, 4)).duplicates)
    leaf = tree.match_prefix([1, 2, 3, 4]).node
    mid = tree.match_prefix([1, 2]).node
    assert mid is not leaf and leaf.parent is mid
    tree.inc_lock_ref(leaf)  # mid is locked only through leaf
    with pytest.raises(LockUnderflow, match=r"all held through its descendants \(1\), none "
                       r"taken at this node"):
        tree.dec_lock_ref(mid)
    tree.check()  # nothing changed: the leaf's owner unlocks it as it should
    assert (tree.evictable_size(), tree.protected_size()) == (0, 4)
    tree.inc_lock_ref(mid)
    assert tree.dec_lock_ref(mid) == 0  # a lock taken at mid is mid's to return
    assert tree.dec_lock_ref(leaf) == 4
    tree.check()
    _drain(tree, kv)


def test_locking_an_evicted_node_raises():
    kv = TokenKVAllocator(64)
    tree = RadixTree()
    tree.insert([1, 2], _alloc(kv, 2))
    m = tree.match_prefix([1, 2])
    kv.free(tree.evict(2))
    with pytest.raises(StaleNode, match="is not in this tree"):
        tree.inc_lock_ref(m.node)
    _drain(tree, kv)


def test_an_insert_whose_matched_prefix_was_evicted_is_refused_and_changes_nothing():
    kv = TokenKVAllocator(64)
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], _alloc(kv, 4))
    m = tree.match_prefix([1, 2, 3, 4, 5])
    # No lock taken: eviction is free to drop the matched prefix.
    kv.free(tree.evict(4))
    own = _alloc(kv, 1)
    with pytest.raises(ValueError, match=r"matched prefix \(4 tokens\) is no longer cached"):
        tree.insert([1, 2, 3, 4, 5], torch.cat([m.indices, own]), owned_from=4)
    assert tree.total_size() == 0
    kv.free(own)
    _drain(tree, kv)


def test_a_refused_insert_does_not_split_the_node_its_key_ends_inside():
    kv = TokenKVAllocator(64)
    tree = RadixTree()
    tree.insert([1, 2, 9, 9, 9, 9], _alloc(kv, 6))
    before = tree.evictable_size()
    mine = _alloc(kv, 5)
    # The caller claims 5 matched tokens; the tree holds 4 of them, inside one node.
    with pytest.raises(ValueError, match=r"matched prefix \(5 tokens\) is no longer cached "
                                         r"\(the tree holds 4 of them\)"):
        tree.insert([1, 2, 9, 9, 5], mine, owned_from=5)
    (only,) = tree.root.children.values()
    assert len(only.key) == 6 and not only.children  # not split at the 4th token
    assert tree.evictable_size() == before
    tree.check()
    kv.free(mine)
    _drain(tree, kv)


@pytest.mark.parametrize(("tokens", "indices", "kw", "message"), [
    ([1, 2], torch.tensor([3]), {}, r"2 tokens but kv_indices of shape \(1,\)"),
    ([1, 2], torch.tensor([3.0, 4.0]), {}, r"must be an integer tensor, got torch.float32"),
    ([1, 2], torch.tensor([3, 4]), {"owned_from": 3}, r"owned_from=3 is outside 0..2"),
])
def test_bad_insert_input_names_what_was_wrong(tokens, indices, kw, message):
    tree = RadixTree()
    with pytest.raises(ValueError, match=message):
        tree.insert(tokens, indices, **kw)
    assert tree.total_size() == 0


_PROMPTS = ((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9), (5, 5, 5, 5, 5, 5, 5, 5, 5))


class RadixWithRequests(RuleBasedStateMachine):
    """Many requests over one tree and one KV pool. After every step each KV page has
    exactly one holder (the pool's free list, the tree, or one live request), every live
    request's matched prefix is still cached, and the tree's counts agree with its nodes."""

    page = 1
    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.kv = TokenKVAllocator(512, page_size=self.page)
        self.tree = RadixTree(self.page)
        self.reqs: dict[int, tuple[list[int], object, torch.Tensor, torch.Tensor]] = {}
        self.next_id = 0

    @rule(target=live, prompt=st.sampled_from(_PROMPTS),
          suffix=st.lists(st.integers(0, 3), max_size=6))
    def start(self, prompt, suffix):
        tokens = list(prompt) + suffix
        m = self.tree.match_prefix(tokens)
        self.tree.inc_lock_ref(m.node)
        own = self.kv.alloc(len(tokens) - m.length)
        if own is None:  # pool dry: evict, as a scheduler would, then retry once
            self.kv.free(self.tree.evict(len(tokens)))
            own = self.kv.alloc(len(tokens) - m.length)
        if own is None:
            self.tree.dec_lock_ref(m.node)
            return multiple()
        rid = self.next_id
        self.next_id += 1
        self.reqs[rid] = (tokens, m.node, m.indices, own)
        return rid

    @rule(rid=consumes(live))
    def finish(self, rid):
        tokens, node, matched, own = self.reqs.pop(rid)
        ins = self.tree.insert(tokens, torch.cat([matched, own]), owned_from=matched.numel())
        self.kv.free(torch.cat([ins.duplicates, ins.leftover]))
        self.tree.dec_lock_ref(node)

    @rule(rid=consumes(live))
    def abort(self, rid):
        _, node, _, own = self.reqs.pop(rid)
        self.kv.free(own)  # never inserted
        self.tree.dec_lock_ref(node)

    @rule(n=st.integers(0, 40))
    def evict(self, n):
        self.kv.free(self.tree.evict(n))

    @precondition(lambda self: self.tree.total_size() > 0)
    @rule(prompt=st.sampled_from(_PROMPTS))
    def lookup(self, prompt):
        self.tree.match_prefix(prompt)  # may split a node; holds nothing

    @invariant()
    def every_page_has_exactly_one_holder(self):
        held = [self.tree.cached_indices()] + [own for *_, own in self.reqs.values()]
        # A page is held by one holder (whose indices on it may be several); no index
        # is held twice.
        owners: dict[int, int] = {}
        for h, t in enumerate(held):
            assert t.unique().numel() == t.numel(), f"holder {h} holds an index twice"
            for p in torch.div(t, self.page, rounding_mode="floor").unique().tolist():
                assert owners.setdefault(p, h) == h, f"page {p} held twice"
        assert len(owners) * self.page == self.kv.capacity - self.kv.available

    @invariant()
    def every_live_match_is_still_cached(self):
        cached = set(self.tree.cached_indices(locked=True).tolist())
        for _, _, matched, _ in self.reqs.values():
            assert set(matched.tolist()) <= cached

    @invariant()
    def the_tree_is_consistent(self):
        self.tree.check()

    def teardown(self):
        for rid in list(self.reqs):
            self.abort(rid)
        assert self.tree.protected_size() == 0
        _drain(self.tree, self.kv)


class RadixWithRequestsPaged(RadixWithRequests):
    page = 4


TestRadixWithRequests = RadixWithRequests.TestCase
TestRadixWithRequests.settings = settings(max_examples=60, stateful_step_count=30,
                                          deadline=None)
TestRadixWithRequestsPaged = RadixWithRequestsPaged.TestCase
TestRadixWithRequestsPaged.settings = settings(max_examples=60, stateful_step_count=30,
                                               deadline=None)


def test_the_radix_benchmark_reports_every_figure_beside_its_baseline():
    from terminus.kernels import bench_radix

    r = bench_radix.run(quick=True)
    assert r["cached_tokens"] >= 1 << 16
    assert r["matched_tokens"] == 3000 - 3000 % r["page_size"]
    for k in ("match_us", "insert_us", "evict_ms"):
        assert r[k] > 0 and r[f"baseline_{k}"] > 0
        assert r["speedup_vs_dict"][k.rsplit("_", 1)[0]] > 0
    assert len(bench_radix.rows(r)) == 3


def test_eviction_pops_the_least_recent_unlocked_leaf_under_random_operations():
    # The queue of unlocked leaves is kept as the tree changes; each single-leaf
    # eviction must drop what a full walk of the tree would pick.
    rng = random.Random(3)
    tree = RadixTree(page_size=2)
    locked: list = []
    nxt = 0
    for _ in range(600):
        op = rng.random()
        tokens = [rng.randrange(3) for _ in range(2 * rng.randrange(1, 5))]
        if op < 0.4:
            tree.insert(tokens, torch.arange(nxt, nxt + len(tokens)))
            nxt += len(tokens)
        elif op < 0.6:
            m = tree.match_prefix(tokens)
            tree.inc_lock_ref(m.node)
            locked.append(m.node)
        elif op < 0.75 and locked:
            tree.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            leaves = [n for n in tree._nodes() if not n.children and n.lock_ref == 0]
            dropped = tree.evict(1)
            if leaves:
                want = min(leaves, key=lambda n: n.last_access)
                assert torch.equal(dropped, want.value)
            else:
                assert dropped.numel() == 0
        tree.check()
    for node in locked:
        tree.dec_lock_ref(node)
    tree.evict(tree.evictable_size())
    tree.check()
    assert tree.total_size() == 0


def _shape(tree: RadixTree) -> list[tuple]:
    """Every node as (key, value, lock_ref, last_access), in a canonical order."""
    out = []
    stack = [((), tree.root)]
    while stack:
        at, n = stack.pop()
        for ck in sorted(n.children):
            c = n.children[ck]
            out.append((at, c.key, c.value.tolist(), c.lock_ref, c.last_access))
            stack.append((at + c.key, c))
    return out


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_lookups_read_lists_tensors_and_tuples_alike(page_size, seed):
    # The lookups read the caller's tokens where they are (a tuple's slices as they are,
    # a list's made tuples): three trees fed the same operations, one with tuples, one
    # with lists and one with tensors, match, insert, split, lock and evict alike.
    rng = random.Random(seed)
    trees = [RadixTree(page_size) for _ in range(3)]
    kinds = (tuple, list, lambda t: torch.tensor(t, dtype=torch.int64))
    seqs: list[list[int]] = []
    locked: list[list] = []
    nxt = 0
    for _ in range(120):
        op = rng.random()
        if op < 0.45 or not seqs:
            base = list(rng.choice(seqs)) if seqs and rng.random() < 0.7 else []
            seq = base[: rng.randrange(len(base) + 1)] + [rng.randrange(6)
                                                          for _ in range(rng.randrange(1, 14))]
            seqs.append(seq)
            kv = torch.arange(nxt, nxt + len(seq))
            nxt += len(seq)
            got = [t.insert(k(seq), kv.clone()) for t, k in zip(trees, kinds, strict=True)]
            assert len({(g.prefix_len, tuple(g.taken.tolist()), g.duplicate_count, g.node.key)
                        for g in got}) == 1
        elif op < 0.8:
            seq = rng.choice(seqs)
            limit = rng.choice([None, rng.randrange(len(seq) + 2)])
            got = [t.match_prefix(k(seq), limit=limit)
                   for t, k in zip(trees, kinds, strict=True)]
            assert len({(m.length, tuple(m.indices.tolist()), m.node.key) for m in got}) == 1
            if rng.random() < 0.5 and got[0].length:
                for t, m in zip(trees, got, strict=True):
                    t.inc_lock_ref(m.node)
                locked.append([m.node for m in got])
        elif op < 0.9 and locked:
            for t, n in zip(trees, locked.pop(rng.randrange(len(locked))), strict=True):
                t.dec_lock_ref(n)
        else:
            k = rng.randrange(1, 12)
            assert len({tuple(t.evict(k).tolist()) for t in trees}) == 1
        shapes = [_shape(t) for t in trees]
        assert shapes[0] == shapes[1] == shapes[2]
        for t in trees:
            t.check()
    for nodes in locked:
        for t, n in zip(trees, nodes, strict=True):
            t.dec_lock_ref(n)
    for t in trees:
        t.evict(t.evictable_size())
        assert t.total_size() == 0
