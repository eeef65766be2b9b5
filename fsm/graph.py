"""Breadth-first traversal of a machine's transition graph, written once.

Declaration checks (`Spec.build`: every state reachable, a terminal state reachable from
every state), model-based paths (`fsm.paths`: the shortest route to every state and to a
terminal one) and the tests that cross-check them all walk the graph through here.

Nodes are hashable (state ids); `edges(node)` yields `(label, target)` pairs in the order
ties are to be broken (declaration order); a route is the tuple of labels taken::

    shortest_routes([0], edges)  {0: (), 1: (l01,), 2: (l01, l12), ...}  (BFS order)
    reachable([0], edges)        {0, 1, 2, ...}
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

N = TypeVar("N", bound=Hashable)
L = TypeVar("L")

Edges = Callable[[N], Iterable[tuple[L, N]]]
"""`edges(node)`: the `(label, target)` pairs leaving `node`, in tie-breaking order."""


def shortest_routes(starts: Iterable[N], edges: Edges[N, L]) -> dict[N, tuple[L, ...]]:
    """The shortest route (labels) from any of `starts` to every node reached from them.

    The dict's order is the order nodes were reached (BFS), so its first key satisfying
    a predicate is a nearest such node; ties go to the earlier edge.
    """
    best: dict[N, tuple[L, ...]] = {s: () for s in starts}
    todo = deque(best)
    while todo:
        node = todo.popleft()
        here = best[node]
        for label, target in edges(node):
            if target not in best:
                best[target] = (*here, label)
                todo.append(target)
    return best


def reachable(starts: Iterable[N], edges: Callable[[N], Iterable[N]]) -> set[N]:
    """Every node reached from `starts` (the starts included); `edges(node)` yields the
    nodes one step away."""
    seen = set(starts)
    todo = deque(seen)
    while todo:
        for target in edges(todo.popleft()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def invert(succ: list[set[int]]) -> list[set[int]]:
    """Predecessor sets of a graph given by successor sets over nodes 0..n-1."""
    pred: list[set[int]] = [set() for _ in succ]
    for node, targets in enumerate(succ):
        for t in targets:
            pred[t].add(node)
    return pred
