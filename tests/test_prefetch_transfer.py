"""`PrefetchSite.transfer` reads the host pages `start` acquired through their ledger
handle while the prefetch still owns it, and through the ledger's query otherwise; the
state checks of `start`, `complete` and `forget` compare state ids (effects.prefetch);
`queue` locks its anchor before the prefetch is known."""

from __future__ import annotations

import pytest
import torch

from terminus.effects.prefetch import PrefetchSite
from terminus.kernels.host import HostPagePool


def _site() -> tuple[PrefetchSite, list[torch.Tensor]]:
    taken: list[torch.Tensor] = []
    return PrefetchSite(HostPagePool(16), insert=lambda rid, p: taken.append(p)), taken


def _end(site: PrefetchSite, taken: list[torch.Tensor]) -> None:
    for p in taken:
        site.host.free(p)  # the cache's pages back to the pool
    site.assert_released()
    site.host.assert_full()
    assert site.ledger.count() == 0


def test_transfer_through_the_handle_counts_as_the_ledger_query_does():
    site, taken = _site()
    site.queue("a")
    p = site.start("a", 4)
    inst = site.requests["a"]
    assert inst.handle is not None and inst.handle.value is p
    seen = [site.transfer("a", 1) for _ in range(3)]
    # The general path: the same prefetch found by asking the ledger what it owns.
    (held,) = site.ledger.owned(inst, "host_pages")
    assert held is inst.handle and seen == [1, 2, 3] and p.completed == 3
    site.transfer("a", 1)
    site.complete("a")
    assert inst.state == "completed" and inst.handle.released
    _end(site, taken)


def test_a_transfer_without_pages_owned_is_refused_and_changes_nothing():
    site, taken = _site()
    with pytest.raises(ValueError, match="request 'x' has no running transfer"):
        site.transfer("x", 1)  # never queued
    site.queue("a")
    with pytest.raises(ValueError, match="request 'a' has no running transfer"):
        site.transfer("a", 1)  # queued, not started: no handle yet
    assert site.requests["a"].state == "pending"
    site.start("a", 2)
    site.transfer("a", 2)
    site.complete("a")
    occupied = site.host.occupied
    with pytest.raises(ValueError, match="request 'a' has no running transfer"):
        site.transfer("a", 1)  # its handle was released with the completion
    assert site.host.occupied == occupied
    assert site.complete("a") is None  # a late completion: absorbed, nothing released
    _end(site, taken)


def test_a_handle_moved_to_another_owner_is_not_written_through_the_old_one():
    site, taken = _site()
    site.queue("a")
    site.queue("b")
    site.start("a", 2)
    a, b = site.requests["a"], site.requests["b"]
    h = a.handle
    site.ledger.transfer(h, b)  # `b` owns those pages now (the ledger says so)
    with pytest.raises(ValueError, match="request 'a' has no running transfer"):
        site.transfer("a", 1)
    assert h.value.completed == 0
    site.ledger.transfer(h, a)  # back to `a`, as `start` left it
    assert site.transfer("a", 2) == 2
    site.complete("a")
    site.start("b", 1)
    site.transfer("b", 1)
    site.complete("b")
    _end(site, taken)


def test_a_queue_whose_anchor_lock_raises_is_refused_and_registers_nothing(monkeypatch):
    """`queue` locks the anchor (the cached pages the prefetch extends) before the
    prefetch is known: a lock that raises, a failing pool or an anchor outside it, is a
    refused queue. Locked after registering, it left a pending prefetch without its lock
    (its start then read cached pages nothing protected) and refused the retry."""
    site, taken = _site()
    anchor = site.host.alloc(2)  # cached pages (the cache owns them)
    assert anchor is not None

    def refuse(pages):
        raise RuntimeError("host pool failed")

    monkeypatch.setattr(site.host, "lock", refuse)
    with pytest.raises(RuntimeError, match="host pool failed"):
        site.queue("r", anchor=anchor)
    monkeypatch.undo()
    with pytest.raises(IndexError, match="outside the pool"):
        site.queue("s", anchor=torch.tensor([99]))
    assert site.requests == {} and site.ledger.count() == 0
    assert site.host.locked_pages() == 0
    inst = site.queue("r", anchor=anchor)  # the retry
    assert inst.state == "pending" and site.host.locked_pages() == 2
    assert [h.kind for h in site.ledger.owned(inst)] == ["host_lock"]
    site.start("r", 2)
    site.transfer("r", 2)
    site.complete("r")
    assert site.host.locked_pages() == 0
    site.host.free(anchor)
    _end(site, taken)
