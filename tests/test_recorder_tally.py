"""A recorder's optional `cell_counter` (`observe.Recorder`): compiled cells add 1 to the
counter it gives instead of calling `record`. Differential: the same events under a
recorder that only records and one that tallies make the same decisions, states,
plans, ignores and the same counts per (state, event, alternative)."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from terminus.fsm import Ledger, Plan, Release, TransitionNotAllowed, observe, release_effect
from tests.lifecycle import LIFECYCLE, Abort, Chunk, Finish, Job, Start


@release_effect
def free_kv(ctx, handle):
    ctx.resources.free(handle.value)


class Recording:
    """Counts every decision by (machine name, state, event, alt) through `record`."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, str, int]] = Counter()

    def record(self, machine: Any, source: int, event: int, alt: int) -> None:
        self.counts[(machine.name, machine.states[source], machine.event_names[event],
                     alt)] += 1

    def record_counts(self, machine: Any, counts: Any) -> None:
        for (s, e, k), n in counts.items():
            self.counts[(machine.name, machine.states[s], machine.event_names[e], k)] += n


class Tallying(Recording):
    """The same counts, a compiled cell's through the counter `cell_counter` gave it."""

    def __init__(self) -> None:
        super().__init__()
        self.slots: dict[tuple[str, str, str, int], list[int]] = {}
        self.asked = 0

    def cell_counter(self, machine: Any, source: int, event: int, alt: int) -> list[int]:
        self.asked += 1
        key = (machine.name, machine.states[source], machine.event_names[event], alt)
        return self.slots.setdefault(key, [0])

    @property
    def all_counts(self) -> Counter[tuple[str, str, str, int]]:
        out = Counter(self.counts)
        for key, slot in self.slots.items():
            if slot[0]:
                out[key] += slot[0]
        return out


def bound(kv: Any) -> tuple[Any, Ledger]:
    ledger = Ledger({"kv": free_kv}, resources=kv)
    return LIFECYCLE.bind({"release_aborted": Plan(Release("kv")),
                           "release_finished": Plan(Release("kv"))}, ledger), ledger


def drive(rec: Any, seed: int, kv: Any, m: Any = None,
          ledger: Any = None) -> tuple[list[Any], Counter[Any], Any]:
    """Random events at a few jobs of a bound LIFECYCLE (`m` over `ledger`, or a new
    one) under `rec`: what each fire returned or raised, the ignores and plans run."""
    if m is None:
        m, ledger = bound(kv)
    rng = random.Random(seed)
    log: list[Any] = []
    prev = observe.set_recorder(rec)
    try:
        for _ in range(30):
            job = Job(m, "j")
            ledger.acquire(job, "kv", kv.alloc(2))
            while not job.terminal and len(log) < 10_000:
                job.in_flight = rng.randrange(2)
                ev = rng.choice((Start(), Chunk(last=False), Chunk(last=True), Finish(),
                                 Abort()))
                try:
                    r = job.fire(ev)
                    log.append((job.state, None if r is None else r.plan))
                except TransitionNotAllowed as exc:
                    log.append((job.state, str(exc)))
            for ev in (Start(), Finish()):  # in a terminal state: an ignore or an error
                try:
                    job.fire(ev)
                    log.append(job.state)
                except TransitionNotAllowed as exc:
                    log.append(str(exc))
    finally:
        observe.set_recorder(prev)
    ledger.assert_empty()
    return log, Counter(m.stats.ignored), dict(m.stats.plans_run)


@pytest.mark.parametrize("seed", range(6))
def test_a_tallying_recorder_counts_what_a_recording_one_records(seed, kv):
    plain, tallying = Recording(), Tallying()
    a = drive(plain, seed, kv)
    b = drive(tallying, seed, kv)
    assert a == b
    assert tallying.asked and any(s[0] for s in tallying.slots.values())
    assert tallying.all_counts == plain.counts
    # Guarded alternatives, ignores, terminal edges and errors were all compared.
    kinds = {(s, e) for _, s, e, _ in plain.counts}
    assert {("prefilling", "Chunk"), ("prefilling", "Abort"), ("decoding", "Start"),
            ("decoding", "Finish"), ("queued", "Chunk")} <= kinds


def test_a_new_recorder_gets_its_own_counters(kv):
    # One machine under one recorder, another, none, then the first again: each
    # attach compiles the cells again with the counters of the recorder attached.
    first, second = Tallying(), Tallying()
    m, ledger = bound(kv)
    drive(first, 0, kv, m, ledger)
    before = first.all_counts
    assert before
    drive(second, 0, kv, m, ledger)
    assert first.all_counts == before
    assert second.all_counts == before
    drive(None, 0, kv, m, ledger)
    drive(first, 0, kv, m, ledger)
    assert first.all_counts == before + before and second.all_counts == before


@pytest.mark.parametrize("attr", [Counter(), 3])
def test_a_recorder_whose_cell_counter_is_not_a_method_records_every_decision(attr, kv):
    # Only a callable `cell_counter` is the hook: a recorder that keeps data under that
    # name (or any other) is a plain recorder, every decision through `record`.
    plain, odd = Recording(), Recording()
    odd.cell_counter = attr  # type: ignore[attr-defined]
    odd.tally = Counter()  # type: ignore[attr-defined]  (a name recorders may use)
    assert drive(plain, 0, kv) == drive(odd, 0, kv)
    assert odd.counts == plain.counts and odd.counts


def test_simulate_counts_the_same_transitions_with_or_without_its_tally(monkeypatch):
    from terminus.effects.sim import simulate
    from terminus.effects.sim.workload import WorkloadConfig

    wcfg = WorkloadConfig(requests=150, seed=5, n=3)
    tallied = simulate.run_simulation(wcfg)
    monkeypatch.setattr(simulate._Counting, "cell_counter", None)  # every decision via record
    recorded = simulate.run_simulation(wcfg)
    assert tallied["transitions"] > 0
    for key in ("transitions", "transitions_by_machine", "terminal_states", "effects",
                "leaks"):
        assert tallied[key] == recorded[key], key
    assert tallied["leaks"] == dict.fromkeys(tallied["leaks"], 0)  # pools full, LoRA 0


def test_a_row_code_indexes_its_own_cell_in_every_table(kv):
    # `Instance.fire` calls `_on[code]` for a code < 0: the code must name its own
    # (state, event) cell from the end of each table, and a cell the general path takes
    # must be told its own index.
    from terminus.fsm import machine as machine_mod

    m, _ = bound(kv)
    n_ev = len(m.events)
    n = len(m.states) * n_ev
    for s, row in enumerate(m._slow_rows):
        for cls, code in row.items():
            cell = s * n_ev + m.events.index(cls)
            assert code < 0 and code + n == cell
            for table in (m._on_watched, m._on_recorded, m._on_unobserved):
                assert len(table) == n and table[code] is table[cell]
            assert m._on_watched[code].func is machine_mod._general_fire
            assert m._on_watched[code].args == (cell,)
        for cls, code in m._fast_rows[s].items():
            assert code >= 0 or code == row[cls]
