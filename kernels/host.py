"""Host page pool of a hierarchical (GPU → host → storage) cache, with prefetches.

A host page is free, allocated, or allocated and locked (``lock_refs > 0``: someone is
reading or writing it, so it cannot be freed or evicted). A storage prefetch allocates
its pages up front and fills them in order::

    pages      [p0 p1 p2 p3 p4 p5]
    completed   ─────────┘            I/O finished pages[:3]
    terminate()          └── frees pages[3:], which the I/O never started
    release()   frees pages[:3] only (abort) ── or take() hands them to the cache

The two halves have two owners (the I/O side and the request), so each is freed once
by its owner; freeing all of ``pages`` from the request would double-free the tail.

Host frees are rare next to KV frees, so this pool validates every free and unlock
eagerly (``strict`` free list): errors are raised at the call that caused them. A
prefetch's own release never fails on a reader's lock: a page still locked is freed by
the unlock that drops its last reference (``free_when_unlocked``).
"""

from __future__ import annotations

import torch

from terminus.kernels._stack import FreeStack, IdsLike, StackPool, as_int, long_ids
from terminus.kernels.errors import DoubleFree, KernelError, LeakError, PageLocked, _fmt

__all__ = ["HostPagePool", "Prefetch"]


class HostPagePool(StackPool):
    """``num_pages`` host pages (ids ``0 .. num_pages-1``) with lock reference counts."""

    def __init__(self, num_pages: int, device: str | torch.device = "cpu") -> None:
        self._free = FreeStack("HostPagePool", 0, num_pages, device, strict=True, unit="pages")
        self.lock_refs = torch.zeros(num_pages, dtype=torch.int32, device=self._free.device)
        # Pages whose owner released them while a reader still held a lock: freed by
        # the unlock that drops their last lock reference.
        self._doomed = torch.zeros(num_pages, dtype=torch.bool, device=self._free.device)
        self._prefetching = 0
        # Host-side counts of lock references and doomed pages: while both are 0 (the
        # common case) a free reads neither tensor back (no sync).
        self._refs = 0
        self._n_doomed = 0

    @property
    def occupied(self) -> int:
        """Pages allocated (by anyone, prefetches included)."""
        return self.capacity - self.available

    @property
    def prefetch_occupied(self) -> int:
        """Pages reserved by prefetches that have not been released or taken yet."""
        return self._prefetching

    @property
    def deferred(self) -> int:
        """Pages their owner released while a reader held a lock: the reader's last
        unlock frees them (a host-side count)."""
        return self._n_doomed

    def locked_pages(self) -> int:
        """How many pages hold at least one lock reference (one sync)."""
        return int((self.lock_refs > 0).sum())

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` pages, or None when short (never partial)."""
        return self._free.pop(n)

    def free(self, pages: IdsLike) -> None:
        """Return pages; raises ``PageLocked`` (freeing nothing) if any is locked."""
        ids = long_ids(pages, self.device, "HostPagePool")
        if not ids.numel():
            return
        self._validate(ids)
        if self._refs:
            locked = self.lock_refs.index_select(0, ids) > 0
            if bool(locked.any()):
                raise PageLocked("HostPagePool", ids[locked].tolist())
        self._free.push(ids, checked=True)  # validated above, nothing changed since

    def _validate(self, ids: torch.Tensor) -> None:
        self._free.validate(ids)
        if self._n_doomed:
            doomed = self._doomed.index_select(0, ids)
            if bool(doomed.any()):  # released already; its last unlock frees it
                raise DoubleFree("HostPagePool", ids[doomed].tolist())

    def free_when_unlocked(self, pages: IdsLike) -> int:
        """Return pages now, except locked ones, which go back at their last unlock.

        For an owner's release, which must not fail because a reader still holds a page
        (it would have no later chance to free it). Returns how many were deferred.
        """
        ids = long_ids(pages, self.device, "HostPagePool")
        if not ids.numel():
            return 0
        self._validate(ids)
        return self._return(ids)

    def _return(self, ids: torch.Tensor) -> int:
        """``free_when_unlocked`` of ``ids`` that ``_validate`` passed just now (nothing
        changed since): the free list does not validate them a second time."""
        if not self._refs:  # nothing is locked: every page goes back now
            self._free.push(ids, checked=True)
            return 0
        locked = self.lock_refs.index_select(0, ids) > 0
        later = ids[locked]
        self._doomed.index_fill_(0, later, True)
        self._n_doomed += later.numel()
        now = ids[~locked]
        if now.numel():
            self._free.push(now, checked=True)
        return later.numel()

    def lock(self, pages: IdsLike) -> None:
        """Add one lock reference to each page (a page listed twice gets two). Only a page
        someone holds (handed out by ``alloc`` or a prefetch, not freed since) can be
        locked: a free page (``KernelError``) would be handed out locked by the next
        ``alloc``, whose owner's ``free`` then raises ``PageLocked``; a page outside the
        pool is an ``IndexError``. Either is refused with nothing locked (``index_add_``
        would have counted the ids before it, unseen by ``free``); one read checks both."""
        ids = long_ids(pages, self.device, "HostPagePool")
        if not ids.numel():
            return
        outside, free = self._free.outside_or_free(ids)
        if outside:
            raise IndexError(f"HostPagePool: lock of pages {outside} outside the pool "
                             f"(0..{self.lock_refs.numel() - 1}); lock pages it gave out")
        if free:
            raise KernelError(
                f"HostPagePool: lock of pages {sorted(set(free))} that are free (never "
                "handed out, or freed already); nothing was locked. Lock only pages "
                "alloc() or a prefetch gave out that their holder has not freed")
        self.lock_refs.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self._refs += ids.numel()

    def unlock(self, pages: IdsLike) -> None:
        """Drop one lock reference per listed page; raises (changing nothing) on underflow
        or on a page outside the pool (`IndexError`)."""
        ids = long_ids(pages, self.device, "HostPagePool")
        self._unlock_commit(ids, self._unlocked(ids))

    def _unlocked(self, ids: torch.Tensor) -> torch.Tensor:
        """``lock_refs`` after unlocking ``ids``; raises on underflow, changing nothing."""
        after = self.lock_refs.clone()
        try:
            after.index_add_(0, ids, torch.full_like(ids, -1, dtype=torch.int32))
        except (IndexError, RuntimeError):
            # (on a clone: nothing changed) a page outside the pool, named
            n = self.lock_refs.numel()
            bad = [v for v in ids.tolist() if not 0 <= v < n]
            if not bad:
                raise
            raise IndexError(f"HostPagePool: unlock of pages {bad} outside the pool "
                             f"(0..{n - 1}); unlock pages it locked") from None
        under = after.index_select(0, ids) < 0
        if bool(under.any()):
            raise KernelError(
                f"HostPagePool: unlock of pages {sorted(set(ids[under].tolist()))} that are "
                "not locked that many times; each lock() has exactly one unlock()"
            )
        return after

    def _unlock_commit(self, ids: torch.Tensor, after: torch.Tensor) -> None:
        self.lock_refs.copy_(after)
        self._refs -= ids.numel()
        if not self._n_doomed:
            return
        ready = ids[self._doomed.index_select(0, ids) & (after.index_select(0, ids) == 0)]
        if ready.numel():
            ready = torch.unique(ready)
            self._doomed.index_fill_(0, ready, False)
            self._n_doomed -= ready.numel()
            self._free.push(ready)

    def prefetch(self, n: int, anchor: IdsLike | None = None) -> Prefetch | None:
        """Reserve ``n`` pages for a storage prefetch, or None when short.

        ``anchor``: pages the prefetch extends (e.g. the cached prefix it continues);
        they stay locked until the prefetch is released or taken. Locked before any
        page is taken: an anchor the pool refuses (not page ids, a page outside the
        pool) raises with nothing taken and nothing locked.
        """
        anchor_ids = (
            None if anchor is None else long_ids(anchor, self.device, "HostPagePool")
        )
        if anchor_ids is not None:
            self.lock(anchor_ids)
        try:
            pages = self._free.pop(n)
        except BaseException:
            if anchor_ids is not None:
                self.unlock(anchor_ids)
            raise
        if pages is None:
            if anchor_ids is not None:
                self.unlock(anchor_ids)
            return None
        self._prefetching += n
        return Prefetch(self, pages, anchor_ids)

    def _retire(self, p: Prefetch, free: torch.Tensor | None) -> None:
        """Retire ``p``: free ``free`` (its completed prefix, on release), unlock its anchor,
        drop its occupancy. Every check runs before anything changes, so a refusal (a
        double free, an anchor unlocked by someone else) leaves ``p`` as it was, to be
        retried once the cause is gone."""
        after = None if p.anchor is None else self._unlocked(p.anchor)
        if free is not None and free.numel():
            self._validate(free)
        # Decided: nothing below raises.
        if free is not None and free.numel():
            self._return(free)  # int64: a slice of what pop() returned
        if after is not None:
            assert p.anchor is not None
            self._unlock_commit(p.anchor, after)
        self._prefetching -= p._n_pages

    def assert_full(self) -> None:
        """Raise ``LeakError`` unless every page is free and unlocked, no prefetch live."""
        held = torch.nonzero(self._doomed).flatten()
        if held.numel():
            raise LeakError("HostPagePool", held.numel(), held.tolist(),
                            "released pages still locked by a reader")
        self._free.assert_full()
        held = torch.nonzero(self.lock_refs).flatten()
        if held.numel():
            raise LeakError("HostPagePool", held.numel(), held.tolist(), "locked pages")
        if self._prefetching:
            raise LeakError("HostPagePool", self._prefetching, [], "prefetch pages")


class Prefetch:
    """One storage → host prefetch; see the module docstring for who frees what."""

    def __init__(self, pool: HostPagePool, pages: torch.Tensor, anchor: torch.Tensor | None):
        self.pool = pool
        self.pages = pages
        self._n_pages = int(pages.numel())  # (advance runs per transfer step: no C call)
        self.anchor = anchor
        self.completed = 0
        self.stopped = False
        self.terminated = False
        self.retired = False
        self._taken = False  # retired by take(): its prefix is the caller's, not free

    def advance(self, k: int) -> int:
        """Record ``k`` more pages transferred (an int >= 0; a bool is no count);
        returns the completed count."""
        if k.__class__ is not int:
            j = as_int(k)  # (a numpy integer is one)
            if j is None:
                raise TypeError(f"Prefetch.advance({k!r}): k is the count of pages the I/O "
                                "wrote since the last call, an int")
            k = j
        if k < 0:
            raise ValueError(f"Prefetch.advance({k}): k is a count of pages written, >= 0")
        if self.stopped:
            raise KernelError("Prefetch.advance() after stop()/terminate(): the I/O was stopped")
        done = self.completed + k
        if done > self._n_pages:
            done = self._n_pages
        self.completed = done
        return done

    def stop(self) -> int:
        """Stop the I/O (a drain) without freeing anything; returns ``completed``.

        The pages it never wrote stay held until ``terminate()``: an abort that must
        wait for its peers frees nothing before the barrier.
        """
        self.stopped = True
        return self.completed

    def terminate(self) -> int:
        """Stop the I/O; free the pages it never started. Idempotent; returns ``completed``.

        A tail page someone still has locked goes back at its last unlock.
        """
        if not self.terminated:
            self.stopped = True
            if self.completed < self._n_pages:  # (all written: no tail, nothing to cut)
                self.pool.free_when_unlocked(self.pages[self.completed :])
            self.terminated = True
        return self.completed

    def _retirable(self, what: str) -> torch.Tensor:
        """The completed prefix, if this prefetch may be released or taken now."""
        if not self.terminated:
            raise KernelError(
                f"Prefetch.{what}() while its I/O may still write the pages; "
                "terminate() (drain) it first"
            )
        if self.retired:
            done = self.pages[: self.completed].tolist()
            if self._taken:
                raise DoubleFree("Prefetch", done, (
                    f"{what}() after take(): take() handed pages {_fmt(done)} to its caller, who "
                    "owns them now (they were not freed). A prefetch retires once, by one "
                    "release() or one take(): free them through their new owner (the cache "
                    "that took them, or HostPagePool.free), not through the prefetch."))
            raise DoubleFree("Prefetch", done)
        # (all of them: the tensor itself, a slice is a torch call)
        return self.pages if self.completed == self._n_pages else self.pages[: self.completed]

    def release(self) -> int:
        """Abort path: free only the completed prefix ``pages[:completed]``; returns its size.

        A page a reader still has locked goes back at the reader's last unlock, so the
        release itself never fails on a lock. A release that raises (its prefix freed
        already, or its anchor unlocked by someone else) changes nothing: the prefix is
        still held, the anchor still locked, and ``release()`` can be called again.
        """
        done = self._retirable("release")
        self.pool._retire(self, done)
        self.retired = True
        return done.numel()

    def take(self) -> torch.Tensor:
        """Success path: hand the completed prefix to the caller, who now owns it.

        Like ``release``, a take that raises changes nothing and can be retried. Once it
        has returned, a ``release()`` or ``take()`` is a ``DoubleFree`` saying the pages
        were taken (they are the caller's: freed through it, not the prefetch).
        """
        done = self._retirable("take")
        self.pool._retire(self, None)
        self.retired = self._taken = True
        return done
