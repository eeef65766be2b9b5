"""The prefix cache's figures for ``terminus bench kernels`` (JSON key ``radix``).

A tree holding about 1M cached tokens (prompts of 4,096 tokens: a few shared system
prompts, then distinct conversations), then: match a new 4,096-token prompt that shares
3,000 tokens with a cached one, insert it, evict 64k tokens. Beside it, the same
operations on a plain dict of page tuples (each whole page keyed by (key of the previous
page, the page's token ids), as block-hashing caches do), measured in the same run.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from terminus.kernels.radix import RadixTree

__all__ = ["rows", "run"]


class _PageDict:
    """The baseline: one dict entry per cached page, keyed by its whole prefix chain."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.pages: dict[tuple[int, tuple[int, ...]], tuple[int, torch.Tensor]] = {}
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}
        self.lru: dict[tuple[int, tuple[int, ...]], None] = {}

    def _key(self, parent: int, chunk: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        return (parent, chunk)

    def match(self, tokens: tuple[int, ...]) -> torch.Tensor:
        found, parent = [], 0
        for i in range(0, len(tokens) - len(tokens) % self.page, self.page):
            key = (parent, tokens[i:i + self.page])
            hit = self.pages.get(key)
            if hit is None:
                break
            parent, value = hit
            found.append(value)
            self.lru.pop(key, None)
            self.lru[key] = None
        return torch.cat(found) if found else torch.empty(0, dtype=torch.int64)

    def insert(self, tokens: tuple[int, ...], kv: torch.Tensor) -> None:
        parent = 0
        for i in range(0, len(tokens) - len(tokens) % self.page, self.page):
            key = (parent, tokens[i:i + self.page])
            hit = self.pages.get(key)
            if hit is None:
                hit = (len(self.pages) + 1, kv[i:i + self.page])
                self.pages[key] = hit
            parent = hit[0]
            self.lru.pop(key, None)
            self.lru[key] = None

    def evict(self, n: int) -> int:
        # Oldest first; a page whose child is still cached is kept (no orphans).
        parents = {k[0] for k in self.pages}
        done = 0
        for key in list(self.lru):
            if done >= n:
                break
            if self.pages[key][0] in parents:
                continue
            del self.pages[key]
            del self.lru[key]
            done += self.page
        return done


def _median_us(fn: Callable[..., object], calls: list[tuple[Any, ...]]) -> float:
    """Median µs of `fn(*args)` over `calls`, one call each."""
    times = []
    for args in calls:
        t0 = time.perf_counter_ns()
        fn(*args)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)


def run(quick: bool = False, page: int = 16) -> dict:
    """Build both caches, time match/insert/evict on each; returns the JSON object."""
    rng = random.Random(0)
    prompt_len = 4096
    cached_tokens = (1 << 16) if quick else (1 << 20)
    systems = [tuple(rng.randrange(32000) for _ in range(1024)) for _ in range(4)]
    prompts: list[tuple[int, ...]] = []
    tree, plain = RadixTree(page), _PageDict(page)
    next_kv = 0
    while tree.total_size() < cached_tokens:
        head = systems[len(prompts) % len(systems)]
        p = head + tuple(rng.randrange(32000) for _ in range(prompt_len - 1024))
        prompts.append(p)
        kv = torch.arange(next_kv, next_kv + len(p), dtype=torch.int64)
        next_kv += len(p)
        tree.insert(p, kv)
        plain.insert(p, kv)
    reps = 3 if quick else 21
    evict_tokens = 1 << 12 if quick else 1 << 16
    # One new prompt per repetition (3,000 tokens shared with a cached one), so each
    # timed insert adds a new suffix; the tree grows by < 3 % over the run.
    shared = prompts[len(prompts) // 2][:3000]
    queries = [shared + tuple(rng.randrange(32000) for _ in range(prompt_len - 3000))
               for _ in range(reps)]
    kvs = [torch.arange(next_kv + i * prompt_len, next_kv + (i + 1) * prompt_len,
                        dtype=torch.int64) for i in range(reps)]

    out: dict = {"page_size": page, "cached_tokens": tree.total_size(),
                 "prompt_tokens": prompt_len, "evict_tokens": evict_tokens}
    out["matched_tokens"] = tree.match_prefix(queries[0]).length
    pairs = list(zip(queries, kvs, strict=True))
    out["match_us"] = _median_us(tree.match_prefix, [(q,) for q in queries])
    out["baseline_match_us"] = _median_us(plain.match, [(q,) for q in queries])
    out["insert_us"] = _median_us(tree.insert, pairs)
    out["baseline_insert_us"] = _median_us(plain.insert, pairs)
    t0 = time.perf_counter()
    tree.evict(evict_tokens)
    out["evict_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    plain.evict(evict_tokens)
    out["baseline_evict_ms"] = (time.perf_counter() - t0) * 1e3
    out["speedup_vs_dict"] = {
        "match": out["baseline_match_us"] / out["match_us"],
        "insert": out["baseline_insert_us"] / out["insert_us"],
        "evict": out["baseline_evict_ms"] / out["evict_ms"],
    }
    return out


def rows(r: dict) -> list[tuple[str, str]]:
    """Table rows for ``run``'s result."""
    what = f"radix, {r['cached_tokens']:,} cached tokens, page {r['page_size']}"
    return [
        (f"{what}: match a {r['prompt_tokens']}-token prompt ({r['matched_tokens']} hit)",
         f"{r['match_us']:.1f} us (dict of pages: {r['baseline_match_us']:.1f} us)"),
        (f"{what}: insert it", f"{r['insert_us']:.1f} us (dict of pages: "
                               f"{r['baseline_insert_us']:.1f} us)"),
        (f"{what}: evict {r['evict_tokens']:,} tokens",
         f"{r['evict_ms']:.2f} ms (dict of pages: {r['baseline_evict_ms']:.2f} ms)"),
    ]
