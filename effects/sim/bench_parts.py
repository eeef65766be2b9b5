"""`terminus bench e2e-parts`: `terminus bench e2e`'s overhead, split by the part it is in.

The serving loop's parts differ between the two loops of `terminus bench e2e` in three
places: the tokenizer side (REQUEST and SAMPLING over the LoRA ledger, against
`rid_to_state`), the disaggregated-prefill server (DISAGG_PREFILL and CHUNK, against the
naive result loop) and the storage prefetch across the ranks (PREFETCH and the
collective abort, against each rank's local decision); the running batch is the same in
both. This benchmark runs the same workload with the naive parts and one or more of
them swapped for the machines':

    naive       every part naive (the baseline of each round)
    disagg      the disagg server's machines, the rest naive
    prefetch    the prefetch machines, the rest naive
    tok+disagg  the machines but the prefetch (the tokenizer side's machines run with the
                disagg server's: the workload's client-stream faults are the machines'
                loop's only, and the naive disagg server has no answer to a closed stream)
    machines    every part the machines' (`terminus bench e2e`'s machines loop)

in rounds (seven; one with `--quick`), the order reversed every other round, each run
timed as `bench e2e` times its loops (the same `_run`: pool calls taken out, the
collector's passes left in). A part's overhead is the median over the rounds of its
mix's lifecycle µs/request less the naive one's in the same round; the tokenizer side's
is tok+disagg's less disagg's in each round. The parts' sum beside the whole shows how
far they add up (they share the scheduler, the pools and the collector's passes).

Every mix's machine parts are checked for leaks after each run (`leaks()` of each), as
`bench e2e` checks its machines loop.

JSON keys: `requests`, `rounds`, `requests_by_kind` (`colocated`, `disagg`,
`prefetch`: the workload's), `lifecycle_us_per_request` (`naive`, `disagg`, `prefetch`,
`tok+disagg`, `machines`: medians), `overhead_us_per_request` (the four mixes over
naive), `overhead_by_part_us_per_request` (`tokenizer`, `disagg`, `prefetch`: per
request of the whole workload), `overhead_us_per_request_of_part` (the same per request
the part serves: `disagg` per disagg request, `prefetch` per prefetch request,
`tokenizer` per request the tokenizer side takes, colocated and prefetch),
`overhead_by_part_us_per_round` (each part's figure, round by round).
"""

from __future__ import annotations

import functools
from collections import Counter
from statistics import median
from typing import Any

from .bench import _run, in_rounds, sizes
from .naive import NaiveParts, NaivePrefetch
from .serving import MachineParts, PartsFactory, Shared, SimDisagg, SimPrefetch
from .workload import WorkloadConfig, generate

MIXES = ("naive", "disagg", "prefetch", "tok+disagg", "machines")
"""The mixes of parts each round runs, in its order (reversed every other round)."""
PARTS = ("tokenizer", "disagg", "prefetch")


class MixedParts:
    """A serving loop's parts with `machine` (a set of "tokenizer", "disagg",
    "prefetch") the machines' and the rest naive. The tokenizer side's machines come
    with the disagg server's (see the module docstring): asked for alone, ValueError.
    `leaks()` counts the machine parts' leaks only (the naive ones leak by design)."""

    def __init__(self, shared: Shared, machine: frozenset[str]) -> None:
        unknown = machine - set(PARTS)
        if unknown:
            raise ValueError(f"unknown part(s) {sorted(unknown)}; parts: {', '.join(PARTS)}")
        if "tokenizer" in machine and "disagg" not in machine:
            raise ValueError("the tokenizer side's machines run with the disagg server's "
                             "(the machines' client-stream faults close streams the naive "
                             "disagg server cannot handle); add 'disagg'")
        self.machine = machine
        self._registry = shared.registry
        base: Any = MachineParts(shared) if "tokenizer" in machine else NaiveParts(shared)
        if "tokenizer" not in machine and "disagg" in machine:
            base.disagg = SimDisagg(shared.cfg, shared.sink, shared.workload)
        if "prefetch" not in machine and "tokenizer" in machine:
            base.prefetch = NaivePrefetch(shared.cfg)
        elif "prefetch" in machine and "tokenizer" not in machine:
            base.prefetch = SimPrefetch(shared.cfg)
        self._base = base
        self.loop = base.loop
        self.tokenizer = base.tokenizer
        self.scheduler = base.scheduler
        self.disagg = base.disagg
        self.prefetch = base.prefetch

    def machines(self) -> list[Any]:
        """The bound machines of the machine parts."""
        out: list[Any] = []
        if "tokenizer" in self.machine:
            out += [self.tokenizer.requests, self.tokenizer.sampling]
        if "disagg" in self.machine:
            out += [self.disagg.engine.requests_machine, self.disagg.engine.chunks_machine]
        if "prefetch" in self.machine:
            out += [site.machine for site in self.prefetch.sites]
        return out

    @property
    def settled(self) -> bool:
        """As the tokenizer side's parts say."""
        return bool(self._base.settled)

    def leaks(self) -> dict[str, int]:
        """The machine parts' leaks, each key prefixed with its part (the tokenizer's with
        the LoRA references its registry still counts)."""
        out: dict[str, int] = {}
        if "tokenizer" in self.machine:
            out.update({f"tokenizer {k}": v for k, v in self._base.leaks().items()})
            # References the registry still counts (the naive tokenizer's are its bug).
            out["tokenizer lora_refs"] = sum(abs(c) for c in self._registry.counts().values())
        if "disagg" in self.machine:
            out.update({f"disagg {k}": v for k, v in self.disagg.leaks().items()})
        if "prefetch" in self.machine:
            out.update({f"prefetch {k}": v for k, v in self.prefetch.leaks().items()})
        return out

    def stuck(self) -> dict[str, Any]:
        """As the tokenizer side's parts say."""
        return dict(self._base.stuck())


def mixed_parts(*machine: str) -> PartsFactory:
    """The factory of `MixedParts` with the parts named the machines'."""
    parts = frozenset(machine)

    def make(shared: Shared) -> MixedParts:
        return MixedParts(shared, parts)

    return make


_FACTORIES: dict[str, PartsFactory | None] = {
    "naive": None, "disagg": mixed_parts("disagg"), "prefetch": mixed_parts("prefetch"),
    "tok+disagg": mixed_parts("tokenizer", "disagg"), "machines": None}


def _lifecycle_us(workload: list[Any], mix: str) -> float:
    """One run of `mix` over `workload`: lifecycle µs per request (pool calls out)."""
    seconds, pools, _, _ = _run(workload, mix == "naive", _FACTORIES[mix])
    return (seconds - pools) * 1e6 / len(workload)


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    """Every mix on one workload, in rounds; see the module docstring for the keys."""
    n, rounds = sizes(quick, rounds)
    workload = generate(WorkloadConfig(requests=n, seed=11, n=3))
    kinds = Counter(s.kind for s in workload)
    life = in_rounds(workload, [(m, functools.partial(_lifecycle_us, mix=m)) for m in MIXES],
                     rounds)
    over = {m: [a - b for a, b in zip(life[m], life["naive"], strict=True)]
            for m in MIXES[1:]}
    per_round = {"tokenizer": [a - b for a, b in zip(over["tok+disagg"], over["disagg"],
                                                      strict=True)],
                 "disagg": over["disagg"], "prefetch": over["prefetch"]}
    by_part = {p: median(v) for p, v in per_round.items()}
    served = {"tokenizer": kinds["colocated"] + kinds["prefetch"],
              "disagg": kinds["disagg"], "prefetch": kinds["prefetch"]}
    return {
        "requests": n,
        "rounds": rounds,
        "requests_by_kind": {k: kinds[k] for k in ("colocated", "disagg", "prefetch")},
        "lifecycle_us_per_request": {m: median(v) for m, v in life.items()},
        "overhead_us_per_request": {m: median(v) for m, v in over.items()},
        "overhead_by_part_us_per_request": by_part,
        "overhead_us_per_request_of_part": {
            p: (by_part[p] * n / served[p] if served[p] else 0.0) for p in PARTS},
        "overhead_by_part_us_per_round": per_round,
    }


def table(r: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows (figure, value) for the printed table."""
    life, over = r["lifecycle_us_per_request"], r["overhead_us_per_request"]
    part, of_part = r["overhead_by_part_us_per_request"], r["overhead_us_per_request_of_part"]
    kinds = r["requests_by_kind"]
    med = f" (median of {r['rounds']} rounds)" if r["rounds"] > 1 else ""
    noun = {"tokenizer": ("tokenizer-side", kinds["colocated"] + kinds["prefetch"]),
            "disagg": ("disagg", kinds["disagg"]), "prefetch": ("prefetch", kinds["prefetch"])}
    rows = [(f"lifecycle, naive parts ({r['requests']:,} requests)",
             f"{life['naive']:.0f} µs/req")]
    rows += [(f"lifecycle, {m}", f"{life[m]:.0f} µs/req ({over[m]:+.1f})") for m in MIXES[1:]]
    for p in PARTS:
        rows.append((f"overhead: {p} part{med}",
                     f"{part[p]:+.1f} µs/req, {of_part[p]:+.1f} µs per {noun[p][0]} request "
                     f"({noun[p][1]:,})"))
    rows.append(("  sum of the parts / whole",
                 f"{sum(part.values()):+.1f} / {over['machines']:+.1f} µs/req"))
    return rows
