"""A radix (prefix) tree over token ids whose nodes hold KV indices: the prefix cache.

Requests that share a prompt prefix share its KV pages. The tree keeps, for each cached
prefix, the KV token indices that hold it; a running request locks the path it matched
(``inc_lock_ref``) so eviction cannot free pages it attends over, and unlocks it when it
ends (``dec_lock_ref``, from its terminal plan: ownership is the effects' business, this
module only keeps the tree and the counts)::

    root ── (1 2 3 4) ── (5 6)          a node: key (token ids, whole pages),
       │              └─ (7 8 9 10)             value (the KV indices of those tokens),
       └── (11 12)                              lock_ref (requests locking this path)

Nodes are page-granular: keys and values are whole pages (``page_size`` tokens), so a
match, an insert and an eviction never split a page between two holders. A match that
ends inside a node splits the node at that page boundary (as SGLang's ``RadixCache``
does), so a lock covers exactly what was matched.

Where this differs from SGLang's ``RadixCache`` (0.5.x):

- ``insert`` accounts for every index the caller hands it: ``taken`` (now the tree's),
  ``duplicates`` (already cached: the caller frees them) and ``leftover`` (the unaligned
  tail the tree does not take); ``owned_from`` says where the caller's own indices
  start (its matched, locked prefix is the tree's, not the caller's). SGLang leaves this
  arithmetic to each caller.
- An insert whose matched prefix is no longer cached (``owned_from`` past what the tree
  holds) is refused before anything changes: the caller's indices below ``owned_from``
  were the tree's and may have been freed by an eviction, so caching them again could
  hand a freed page to two holders.
- ``evict`` returns the indices it dropped instead of freeing them, so the effects free
  them through the ledger; it never drops a locked node or the root.
- Recency is a counter, not a clock: runs are reproducible.
- The unlocked leaves are kept as the tree changes, with a heap by recency (stale
  entries skipped when popped): an eviction pops what it drops, O(k log n), instead of
  walking every node to find the leaves.
- ``dec_lock_ref`` below zero, or on a node that is no longer in the tree, raises
  (SGLang asserts, or silently corrupts its sizes).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from terminus.kernels._stack import as_int
from terminus.kernels.errors import KernelError

__all__ = ["LockUnderflow", "RadixInsert", "RadixMatch", "RadixNode", "RadixTree", "StaleNode"]


class LockUnderflow(KernelError):
    """``dec_lock_ref`` on a path one of whose nodes is not locked: an unlock without its
    lock (a release that ran twice, or a lock taken on another node)."""


class StaleNode(KernelError):
    """A node that is not (or no longer) in this tree: evicted, or from another tree."""


class RadixNode:
    """One node of the tree: ``key`` (token ids, whole pages), ``value`` (their KV indices)
    and ``host``: ``value``'s numpy array (the same memory) when the node was inserted
    from the host (`RadixTree.insert_host`), else None."""

    __slots__ = ("children", "held", "host", "key", "last_access", "lock_ref", "parent",
                 "value")

    def __init__(self, key: tuple[int, ...], value: torch.Tensor,
                 parent: RadixNode | None, host: np.ndarray | None = None) -> None:
        self.key = key
        self.value = value
        self.host = host
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        """Locks on this node: its own and every descendant's (a lock counts along its
        path to the root)."""
        self.held = 0
        """Locks taken at this node itself (`inc_lock_ref(self)`): the ones an unlock of
        this node may return."""
        self.last_access = 0

    def __repr__(self) -> str:
        head = ", ".join(map(str, self.key[:6])) + (", ..." if len(self.key) > 6 else "")
        return f"RadixNode(({head}), tokens={len(self.key)}, lock_ref={self.lock_ref})"

    # A heap of evictable leaves orders them by recency.
    def __lt__(self, other: RadixNode) -> bool:
        return self.last_access < other.last_access


class RadixMatch:
    """What ``match_prefix`` found: ``length`` cached tokens, their KV ``indices``, and
    the ``node`` the match ended at (lock it to keep the prefix from eviction).

    ``host``: the same indices as an int64 numpy array (``indices``' memory) when every
    matched node was inserted from the host, else None: a CPU caller that writes them
    into a table reads them without a ``.numpy()`` call. Read-only, as ``indices``."""

    __slots__ = ("host", "indices", "length", "node")

    def __init__(self, indices: torch.Tensor, node: RadixNode,
                 length: int | None = None, host: np.ndarray | None = None) -> None:
        self.indices = indices
        self.length = int(indices.numel()) if length is None else length
        self.node = node
        self.host = host


class RadixInsert:
    """What ``insert`` did with the caller's indices ``kv_indices[owned_from:]``.

    ``taken``: now held by the tree; ``duplicates``: the tree already held those tokens
    (the caller frees these indices); ``leftover``: the tail past the last whole page,
    not cached (the caller frees these too). ``prefix_len``: tokens that were already
    cached; ``node``: the node the inserted sequence ends at. ``duplicates`` and
    ``leftover`` are views of the caller's indices, cut when first read;
    ``duplicate_count`` says how many duplicates there are without cutting.
    """

    __slots__ = ("_dup", "_values", "duplicate_count", "node", "prefix_len", "taken",
                 "taken_count")

    def __init__(self, prefix_len: int, node: RadixNode, taken: torch.Tensor,
                 values: torch.Tensor | np.ndarray, owned_from: int, dup_end: int,
                 cached_end: int) -> None:
        self.prefix_len = prefix_len
        self.node = node
        self.taken = taken
        self.taken_count = cached_end - prefix_len if cached_end > prefix_len else 0
        """``taken.numel()``, without asking the tensor."""
        self._values = values
        self._dup = (owned_from, dup_end, cached_end if cached_end > owned_from else owned_from)
        self.duplicate_count = dup_end - owned_from
        """``duplicates.numel()``, without cutting the view."""

    @property
    def duplicates(self) -> torch.Tensor:
        """The caller's indices of tokens the tree already held (the caller frees them)."""
        lo, hi, _ = self._dup
        v = self._values
        if isinstance(v, np.ndarray):  # insert_host: the array as it is now, int64
            return torch.from_numpy(v[lo:hi].astype(np.int64))
        return v[lo:hi]

    @property
    def leftover(self) -> torch.Tensor:
        """The caller's indices past the last whole page (not cached; the caller frees)."""
        v = self._values
        if isinstance(v, np.ndarray):
            return torch.from_numpy(v[self._dup[2]:].astype(np.int64))
        return v[self._dup[2]:]


def _common(a: tuple[int, ...], b: tuple[int, ...], page: int, at: int = 0) -> int:
    """Length of the common prefix of `a` and `b[at:]`, rounded down to whole pages.

    A binary search over slice equality: O(log n) comparisons done in C, instead of a
    Python loop over every token (and no copy of `b`'s tail).
    """
    hi = min(len(a), len(b) - at) // page
    if a[:hi * page] == b[at:at + hi * page]:
        return hi * page
    lo = 0  # a[:lo*page] == b[at:at+lo*page] holds; a[:hi*page] != b[at:at+hi*page]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid * page] == b[at:at + mid * page]:
            lo = mid
        else:
            hi = mid
    return lo * page


class RadixTree:
    """The prefix cache's tree (see the module docstring).

    Args:
        page_size: tokens per KV page; keys are cut to whole pages.
        device: where the empty index tensors it returns live (values keep the device
            of the indices they were inserted with).
    """

    def __init__(self, page_size: int = 1, device: str | torch.device = "cpu") -> None:
        if page_size < 1:
            raise ValueError(f"RadixTree: page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.device = torch.device(device)
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self.root = RadixNode((), self._empty, None)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        # The unlocked leaves (what eviction may drop), kept as the tree changes, and a
        # heap of (last_access, tiebreak, node) over them with stale entries skipped at
        # pop time (a node no longer an unlocked leaf, or accessed since): an eviction
        # pops what it drops instead of walking the whole tree.
        self._leaves: dict[RadixNode, None] = {}
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._tie = 0

    # -- sizes ----------------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Cached tokens no running request locks (eviction may free them)."""
        return self._evictable

    def protected_size(self) -> int:
        """Cached tokens some running request locks."""
        return self._protected

    def total_size(self) -> int:
        """Every cached token."""
        return self._evictable + self._protected

    # -- lookups --------------------------------------------------------------------------

    def _aligned(self, tokens: Sequence[int] | torch.Tensor,
                 limit: int | None = None) -> tuple[Sequence[int], int]:
        """`tokens` (a tensor as a list) and the length of `tokens[:limit]` cut to whole
        pages: the lookups read the tokens where they are, so a match or an insert copies
        only what it compares or keeps, never the whole sequence into a tuple first."""
        cls = tokens.__class__
        if cls is not list and cls is not tuple and isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        n = len(tokens)
        if limit is not None and limit < n:
            n = limit if limit > 0 else 0
        page = self.page_size
        if page != 1:
            n -= n % page
        return tokens, n  # type: ignore[return-value]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, key: tuple[int, ...]) -> tuple[int, ...]:
        return key[:self.page_size]

    def _leaf(self, n: RadixNode) -> None:
        """`n` is an unlocked leaf now (or was accessed as one): queue it for eviction."""
        self._leaves[n] = None
        self._tie += 1
        heapq.heappush(self._heap, (n.last_access, self._tie, n))
        if len(self._heap) > 2 * len(self._leaves) + 64:  # mostly stale: rebuild
            self._heap = [(m.last_access, i, m) for i, m in enumerate(self._leaves)]
            heapq.heapify(self._heap)
            self._tie = len(self._heap)

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut `child` after `at` tokens (a page boundary): a new parent holds the head."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        host = child.host
        head = RadixNode(child.key[:at], child.value[:at], parent,
                         None if host is None else host[:at])
        head.lock_ref = child.lock_ref  # (its `held` 0: the locks were taken at `child`)
        head.last_access = child.last_access
        child.key, child.value = child.key[at:], child.value[at:]
        if host is not None:
            child.host = host[at:]
        child.parent = head
        head.children[self._child_key(child.key)] = child
        parent.children[self._child_key(head.key)] = head
        return head

    def _descend(self, tokens: Sequence[int], end: int,
                 ) -> tuple[list[RadixNode], int, int]:
        """Follow `tokens[:end]` (`end` whole pages; `tokens` a tuple, or any sequence
        whose slices are made tuples) from the root without changing anything: (the
        nodes it matches in order, tokens matched, and where the match ends inside the
        last node, or 0 when it matches that node whole)."""
        path: list[RadixNode] = []
        node, done = self.root, 0
        page = self.page_size
        tup = tokens.__class__ is tuple
        while done < end:
            head = tokens[done:done + page]
            child = node.children.get(head if tup else tuple(head))  # type: ignore[call-overload]
            if child is None:
                break
            ck = child.key
            stop = done + len(ck)
            if stop <= end:
                seg = tokens[done:stop]
                if (seg if tup else tuple(seg)) == ck:  # the whole node (one compare, in C)
                    path.append(child)
                    done = stop
                    node = child
                    continue
            # The match ends inside `child` (its first page matched, so n >= page).
            n = _common(ck, tuple(tokens[done:end]), page)
            if n == 0:
                break
            path.append(child)
            return path, done + n, n
        return path, done, 0

    def _touch(self, path: list[RadixNode], cut: int) -> RadixNode:
        """Mark `path` (from `_descend`) accessed now, splitting its last node `cut`
        tokens in when the match ends inside it; returns the node the match ends at."""
        self._clock = now = self._clock + 1
        self.root.last_access = now
        if not path:
            return self.root
        if cut:
            path[-1] = self._split(path[-1], cut)
        for n in path:
            n.last_access = now
        node = path[-1]
        if node in self._leaves:  # its recency changed
            self._leaf(node)
        return node

    def match_prefix(self, tokens: Sequence[int], *, limit: int | None = None) -> RadixMatch:
        """The longest cached prefix of `tokens` (of `tokens[:limit]` when a limit is
        given) in whole pages (may be empty).

        The match may split a node at the page where it ends (the cached data is
        unchanged). Lock the returned node before anything can evict it.
        """
        path, done, cut = self._descend(*self._aligned(tokens, limit))
        node = self._touch(path, cut)
        if not path:
            return RadixMatch(self._empty, node, 0)
        if len(path) == 1:
            return RadixMatch(node.value, node, done, node.host)
        hosts = [n.host for n in path]
        if any(h is None for h in hosts):
            return RadixMatch(torch.cat([n.value for n in path]), node, done)
        # Every node from the host: one numpy concatenation (the same indices), wrapped.
        host: np.ndarray = np.concatenate(hosts)  # type: ignore[arg-type]
        return RadixMatch(torch.from_numpy(host), node, done, host)

    # -- insert ---------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], kv_indices: torch.Tensor,
               *, owned_from: int = 0) -> RadixInsert:
        """Cache `tokens` (their KV at `kv_indices`, one index per token).

        `owned_from`: the caller's own indices start there; below it is the prefix the
        caller matched and still locks (the tree's already). Returns how every one of
        the caller's indices was accounted for (see `RadixInsert`).

        Raises ValueError (nothing changed) when the lengths differ, `owned_from` is out
        of range, or the tree no longer holds the caller's matched prefix.
        """
        shape = kv_indices.shape  # (one attribute read: dim() and numel() are two calls)
        if len(shape) != 1 or shape[0] != len(tokens):
            raise ValueError(
                f"RadixTree.insert: {len(tokens)} tokens but kv_indices of shape "
                f"{tuple(kv_indices.shape)}; pass one KV index per token (a 1-D tensor)")
        dtype = kv_indices.dtype
        if dtype is not torch.int64 and (dtype.is_floating_point or dtype == torch.bool):
            raise ValueError(f"RadixTree.insert: kv_indices must be an integer tensor, "
                             f"got {kv_indices.dtype}")
        values = kv_indices if dtype is torch.int64 else kv_indices.to(torch.int64)
        return self._insert(tokens, values, None, owned_from)

    def insert_host(self, tokens: Sequence[int], kv_indices: np.ndarray,
                    *, owned_from: int = 0) -> RadixInsert:
        """`insert` of a CPU tree with the KV indices as a 1-D numpy integer array (a row
        of a CPU table, int32 or int64): the tree copies what it takes as int64 (numpy
        copies, no torch op but the wrap of what it keeps), and keeps that array as the
        node's ``host`` (`match_prefix` hands it back without a ``.numpy()`` call).

        The same decisions, nodes, values and errors as `insert` of
        ``torch.from_numpy(kv_indices)``; the result's ``duplicates`` and ``leftover``
        are read from ``kv_indices`` as it is when they are read (the caller may
        overwrite its array after the call: read them first). ValueError (nothing
        changed) for a tree off the CPU or anything `insert` refuses.
        """
        if self.device.type != "cpu":
            raise ValueError(f"RadixTree.insert_host: the tree is on {self.device}; pass "
                             "a tensor to insert()")
        if (not isinstance(kv_indices, np.ndarray) or kv_indices.ndim != 1
                or kv_indices.shape[0] != len(tokens)):
            raise ValueError(
                f"RadixTree.insert_host: {len(tokens)} tokens but kv_indices "
                f"{type(kv_indices).__name__} of shape {getattr(kv_indices, 'shape', None)}"
                "; pass one KV index per token (a 1-D numpy array)")
        dt = kv_indices.dtype
        if not (dt.kind == "i" or (dt.kind == "u" and dt.itemsize < 8)):
            raise ValueError(f"RadixTree.insert_host: kv_indices must be an integer array, "
                             f"got {kv_indices.dtype}")
        return self._insert(tokens, kv_indices, kv_indices, owned_from)

    def _insert(self, tokens: Sequence[int], values: torch.Tensor | np.ndarray,
                host: np.ndarray | None, owned_from: int) -> RadixInsert:
        """`insert` once its indices are checked: `values` int64 (a tensor), or `host`
        (= `values`, a numpy integer array) for `insert_host`."""
        if owned_from.__class__ is not int:
            as_i = as_int(owned_from)
            if as_i is None:
                raise TypeError(f"RadixTree.insert: owned_from={owned_from!r} is not an int "
                                "(where the caller's own indices start)")
            owned_from = as_i
        if not 0 <= owned_from <= len(tokens):
            raise ValueError(f"RadixTree.insert: owned_from={owned_from} is outside "
                             f"0..{len(tokens)} (the length of the sequence)")
        seq, end = self._aligned(tokens)
        # Read-only pass first: decide, then mutate.
        path, prefix_len, cut = self._descend(seq, end)
        if prefix_len < owned_from:
            raise ValueError(
                f"RadixTree.insert: the caller's matched prefix ({owned_from} tokens) is "
                f"no longer cached (the tree holds {prefix_len} of them); lock the matched "
                "node from match_prefix until the insert so eviction cannot drop it")
        node = self._touch(path, cut)
        taken = self._empty
        if prefix_len < end:
            taken_np = None
            if host is None:
                # One dispatched op (narrow + clone is two, ~2.5x the time on a CPU).
                taken = values.narrow_copy(0, prefix_len, end - prefix_len)  # type: ignore[union-attr]
            else:
                # A numpy copy (astype copies), wrapped: one torch call, not dispatched.
                taken_np = host[prefix_len:end].astype(np.int64)
                taken = torch.from_numpy(taken_np)
            key = seq[prefix_len:end]  # (a tuple kept whole is not copied)
            if key.__class__ is not tuple:
                key = tuple(key)
            new = RadixNode(key, taken, node, taken_np)
            self._clock = new.last_access = self._clock + 1
            node.children[key[:self.page_size]] = new
            self._evictable += end - prefix_len
            self._leaves.pop(node, None)  # a leaf no more
            self._leaf(new)
            node = new
        return RadixInsert(prefix_len, node, taken, values, owned_from,
                           prefix_len if prefix_len > owned_from else owned_from, end)

    # -- locks ----------------------------------------------------------------------------

    def _path(self, node: RadixNode) -> list[RadixNode]:
        """`node` and its ancestors up to (not including) the root; raises if detached.

        The tree keeps its parent links exact (a split relinks, an eviction sets the
        dropped leaf's parent to None, and only leaves are dropped), so a node is in
        this tree when its parent holds it under its first page and its parents lead
        to this root: a node evicted, or one of an evicted subtree or of another tree,
        meets a None parent (another tree's root has none) before this root."""
        root = self.root
        if node is root:
            return []
        parent = node.parent
        if parent is None or parent.children.get(node.key[:self.page_size]) is not node:
            raise StaleNode(f"{node!r} is not in this tree (evicted, or from another "
                            "tree); lock the node match_prefix returned before evicting")
        path = [node]
        cur: RadixNode | None = parent
        while cur is not root:
            if cur is None:
                raise StaleNode(f"{node!r} is not in this tree (evicted, or from another "
                                "tree); lock the node match_prefix returned before "
                                "evicting")
            path.append(cur)
            cur = cur.parent
        return path

    def inc_lock_ref(self, node: RadixNode) -> int:
        """Lock the path from `node` to the root; returns the tokens that became protected."""
        delta = 0
        path = self._path(node)
        for n in path:
            if not n.lock_ref:
                delta += len(n.key)
                self._leaves.pop(n, None)
            n.lock_ref += 1
        if path:  # (the root is never counted)
            node.held += 1
        if delta:
            self._evictable -= delta
            self._protected += delta
        return delta

    def dec_lock_ref(self, node: RadixNode) -> int:
        """Unlock the path from `node`; returns the tokens that became evictable.

        Raises `LockUnderflow` (nothing changed) when a node on the path is not locked,
        or when `node` holds no lock of its own (only its descendants' locks).
        """
        path = self._path(node)
        for n in path:
            if n.lock_ref <= 0:
                raise LockUnderflow(f"dec_lock_ref({node!r}): {n!r} is not locked; every "
                                    "dec_lock_ref must follow an inc_lock_ref of the same "
                                    "node")
        if path:
            if node.held <= 0:
                # Its locks are all a descendant's: the unlock is another owner's, and
                # taking it would underflow that owner's later unlock.
                raise LockUnderflow(
                    f"dec_lock_ref({node!r}): its locks are all held through its "
                    f"descendants ({node.lock_ref}), none taken at this node; unlock the "
                    "node that inc_lock_ref locked")
            node.held -= 1
        delta = 0
        for n in path:
            n.lock_ref -= 1
            if not n.lock_ref:
                delta += len(n.key)
                if not n.children:
                    self._leaf(n)
        if delta:
            self._evictable += delta
            self._protected -= delta
        return delta

    # -- eviction -------------------------------------------------------------------------

    def _nodes(self) -> Iterator[RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Drop least-recently-used unlocked leaves until `num_tokens` tokens are dropped
        (or nothing evictable is left); returns their KV indices, for the caller to free.
        Never drops a locked node (nor, so, any ancestor of one)."""
        dropped = self._drop(num_tokens)
        if not dropped:
            return self._empty
        return torch.cat([n.value for n in dropped]) if len(dropped) > 1 else dropped[0].value

    def evict_host(self, num_tokens: int) -> np.ndarray:
        """`evict` of a CPU tree, the dropped indices as an int64 numpy array (the same
        indices in the same order; the nodes' ``host`` arrays, no torch op when every
        dropped node was inserted from the host). ValueError for a tree off the CPU."""
        if self.device.type != "cpu":
            raise ValueError(f"RadixTree.evict_host: the tree is on {self.device}; use "
                             "evict()")
        dropped = self._drop(num_tokens)
        if not dropped:
            return np.empty(0, dtype=np.int64)
        arrs = [n.host if n.host is not None else n.value.cpu().numpy() for n in dropped]
        return np.concatenate(arrs) if len(arrs) > 1 else arrs[0]

    def _drop(self, num_tokens: int) -> list[RadixNode]:
        """Drop the leaves `evict` drops; returns them in the order dropped."""
        if num_tokens < 0:
            raise ValueError(f"RadixTree.evict: num_tokens must be >= 0, got {num_tokens}")
        if num_tokens == 0 or not self._evictable:
            return []
        heap, leaves = self._heap, self._leaves
        dropped: list[RadixNode] = []
        count = 0
        page = self.page_size
        while count < num_tokens and heap:
            access, _, leaf = heapq.heappop(heap)
            if leaf not in leaves or leaf.last_access != access:
                continue  # stale: locked, a parent, evicted, or accessed since
            del leaves[leaf]
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[:page]]
            leaf.parent = None
            dropped.append(leaf)
            count += len(leaf.key)
            self._evictable -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._leaf(parent)
                heap = self._heap  # (rebuilt when mostly stale)
        return dropped

    # -- audits ---------------------------------------------------------------------------

    def cached_indices(self, *, locked: bool | None = None) -> torch.Tensor:
        """Every KV index the tree holds (`locked=True`/`False`: only locked/unlocked)."""
        vals = [n.value for n in self._nodes()
                if locked is None or (n.lock_ref > 0) == locked]
        return torch.cat(vals) if vals else self._empty

    def check(self) -> None:
        """Recount the tree and raise AssertionError naming the first inconsistency: keys
        not whole pages, a child under the wrong key, a value of the wrong length, a lock
        count below its children's, sizes that disagree with the nodes, or an eviction
        queue that misses an unlocked leaf (or holds anything else)."""
        evictable = protected = 0
        for n in self._nodes():
            assert n.parent is not None
            assert len(n.key) and len(n.key) % self.page_size == 0, f"{n!r}: partial page"
            assert n.value.numel() == len(n.key), f"{n!r}: {n.value.numel()} indices"
            assert n.host is None or (n.host.shape[0] == len(n.key) and np.shares_memory(
                n.host, n.value.numpy())), f"{n!r}: its host array is not its value's"
            assert n.parent.children.get(self._child_key(n.key)) is n, f"{n!r}: misplaced"
            below = sum(c.lock_ref for c in n.children.values())
            assert n.lock_ref >= below, f"{n!r}: lock_ref below its children's ({below})"
            assert n.lock_ref == below + n.held, \
                f"{n!r}: lock_ref is not its own locks ({n.held}) plus its children's"
            if n.lock_ref:
                protected += len(n.key)
            else:
                evictable += len(n.key)
            leaf = not n.children and not n.lock_ref
            assert leaf == (n in self._leaves), (
                f"{n!r}: {'an' if leaf else 'not an'} unlocked leaf, but "
                f"{'missing from' if leaf else 'kept in'} the eviction queue")
        assert (evictable, protected) == (self._evictable, self._protected), (
            f"sizes: counted evictable={evictable}, protected={protected}; kept "
            f"{self._evictable}, {self._protected}")
        assert all(n.parent is not None for n in self._leaves), "evicted node queued"
        current = {id(m) for a, _, m in self._heap if a == m.last_access}
        assert all(id(n) in current for n in self._leaves), "queued leaf not in the heap"
