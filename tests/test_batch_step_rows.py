"""`Batch.step_rows` (a CPU batch's step decided on the host, row by row) is the same
step as `Batch.step` of the dense (rounds, n) tensor: states, terminal rows and plan ids,
plans run, recorder counts, ignored counts, sink records, and refusals (the same error,
naming the same instance, changing nothing)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from terminus.fsm import Plan, TransitionNotAllowed, observe, release_effect
from terminus.fsm import batch as batch_mod
from terminus.fsm.bench import Finish, Resume, Tick, Yield, bench_spec
from terminus.fsm.plan import Action

N = 6


class Counts:
    """A recorder keeping the counts a batch hands it, per (machine, cell)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def record(self, machine, source, event, alt) -> None:
        self.counts[(machine.name, source, event, alt)] += 1

    def record_counts(self, machine, counts) -> None:
        for (s, e, k), c in counts.items():
            self.counts[(machine.name, s, e, k)] += c


def built(log):
    @release_effect
    def release_rows(ctx):
        log.append(ctx.rows.tolist())

    m = bench_spec().build()
    return m, m.batch(N, plans={"release": Plan(Action(release_rows))})


def outcome(fn):
    try:
        step = fn()
    except (TransitionNotAllowed, IndexError) as e:
        return type(e).__name__, str(e)
    return step.terminal.tolist(), step.plan_ids.tolist()


@pytest.mark.parametrize("seed", range(40))
def test_step_rows_is_the_dense_step(seed):
    rng = random.Random(seed)
    choices = [None, None, Tick, Yield, Resume, Resume, Finish]
    dense_log, rows_log = [], []
    m, dense = built(dense_log)
    _, by_row = built(rows_log)
    heard_dense, heard_rows = [], []
    for _ in range(6):
        k = rng.randint(1, 3)
        rounds = [[rng.choice(choices) for _ in range(N)] for _ in range(k)]
        if rng.random() < 0.1:  # an id out of range somewhere
            rounds[rng.randrange(k)][rng.randrange(N)] = 99
        reset = sorted(rng.sample(range(N), rng.randint(0, 2)))
        ids = [[-1 if e is None else e if isinstance(e, int) else m.event_id(e)
                for e in r] for r in rounds]
        results = []
        for b, heard, rec in ((dense, heard_dense, Counts()), (by_row, heard_rows, Counts())):
            prev = observe.set_recorder(rec)
            b.machine.add_sink(heard.append)
            try:
                if b is dense:
                    res = outcome(lambda b=b, ids=ids, reset=reset: b.step(
                        torch.tensor(ids, dtype=torch.int64),
                        reset=torch.tensor(reset, dtype=torch.int64) if reset else None))
                else:
                    res = outcome(lambda b=b, ids=ids, reset=reset: b.step_rows(
                        [{r: e for r, e in enumerate(rd) if e != -1} for rd in ids], reset))
            finally:
                b.machine.remove_sink(heard.append)
                observe.set_recorder(prev)
            results.append((res, rec.counts, b.states.tolist()))
        assert results[0] == results[1]
        assert dense_log == rows_log
        assert [(r.instance, r.source, r.event, r.target, r.decision, r.plan)
                for r in heard_dense] == [(r.instance, r.source, r.event, r.target,
                                           r.decision, r.plan) for r in heard_rows]
    assert dense.machine.stats.ignored == by_row.machine.stats.ignored


def test_step_rows_refuses_a_foreign_row_changing_nothing():
    m, b = built([])
    with pytest.raises(IndexError, match=r"row 6 is out of range 0\.\.5"):
        b.step_rows([{6: m.event_id(Resume)}])
    with pytest.raises(IndexError, match="row -1 is out of range"):
        b.step_rows([{-1: m.event_id(Resume)}])
    assert b.states.tolist() == [m.initial] * N


def test_a_refused_step_rows_changes_nothing_and_names_the_first_refused_instance():
    log = []
    m, b = built(log)
    b.step_rows([{0: m.event_id(Resume), 3: m.event_id(Resume)}])
    before = b.states.tolist()
    # Row 3 finishes in round one; row 0's reset in the same step is refused (live).
    with pytest.raises(TransitionNotAllowed, match="<recycle>") as err:
        b.step_rows([{3: m.event_id(Finish)}], reset=[0])
    assert err.value.instance == 0
    assert b.states.tolist() == before and log == []


def sequence_batch(n, log):
    """A batch of the scheduler's machine whose every plan logs (plan, rows)."""
    from terminus.states.sequence import SEQUENCE

    def plan_for(name):
        @release_effect
        def release(ctx):
            log.append((name, ctx.rows.tolist()))
        return Plan(Action(release))
    return SEQUENCE.batch(n, plans={p: plan_for(p) for p in SEQUENCE.plan_names})


@pytest.mark.parametrize("seed", range(8))
def test_step_rows_of_many_sequence_rows_is_the_dense_step(seed):
    # The scheduler's own machine, 64 rows, three release plans: several plans run in one
    # step, rows recycled by reset, and now and then a refused cell.
    from terminus.states.sequence import SEQUENCE

    n = 64
    rng = random.Random(seed)
    dense_log, rows_log = [], []
    dense, by_row = sequence_batch(n, dense_log), sequence_batch(n, rows_log)
    w, e_count = dense._w, len(SEQUENCE.events)
    table = dense._packed_list
    heard_dense, heard_rows = [], []
    for _ in range(25):
        base = dense._base.tolist()
        terminal = dense._terminal.tolist()
        reset = sorted(r for r in range(n) if ((base[r] - 1) // w == SEQUENCE.initial
                                               or terminal[(base[r] - 1) // w])
                       and rng.random() < 0.5)
        cur = [SEQUENCE.initial * w + 1 if r in reset else base[r] for r in range(n)]
        rounds = []
        for _ in range(rng.randint(1, 3)):
            rd = {}
            for r in range(n):
                if rng.random() < 0.3:
                    continue
                ok = [e for e in range(e_count) if table[cur[r] + e] >= 0]
                e = rng.choice(ok) if ok and rng.random() > 0.01 else rng.randrange(e_count)
                rd[r] = e
                if table[cur[r] + e] >= 0:
                    cur[r] = table[cur[r] + e] & batch_mod._BASE_MASK
            rounds.append(rd)
        dense_ev = torch.full((len(rounds), n), -1, dtype=torch.int64)
        for j, rd in enumerate(rounds):
            for r, e in rd.items():
                dense_ev[j, r] = e
        results = []
        for b, heard, rec in ((dense, heard_dense, Counts()), (by_row, heard_rows, Counts())):
            prev = observe.set_recorder(rec)
            SEQUENCE.add_sink(heard.append)
            try:
                if b is dense:
                    res = outcome(lambda b=b, ev=dense_ev, reset=reset: b.step(
                        ev, reset=torch.tensor(reset, dtype=torch.int64)))
                else:
                    res = outcome(lambda b=b, rounds=rounds, reset=reset: b.step_rows(
                        rounds, reset))
            finally:
                SEQUENCE.remove_sink(heard.append)
                observe.set_recorder(prev)
            results.append((res, rec.counts, b.states.tolist()))
        assert results[0] == results[1]
        assert dense_log == rows_log
    assert len({name for name, _ in dense_log}) >= 2  # several plans ran
    assert [(r.instance, r.source, r.event, r.target, r.decision, r.plan)
            for r in heard_dense] == [(r.instance, r.source, r.event, r.target,
                                       r.decision, r.plan) for r in heard_rows]


@pytest.mark.parametrize("seed", range(12))
def test_step_runs_is_step_rows_of_its_rounds(seed):
    # Runs (rows, event id) as a scheduler queues them: the same step as step_rows of
    # the rounds they make (a row's j-th event in round j), on the scheduler's machine,
    # with resets, several plans, and now and then a refused cell, an id or a row out of
    # range, a row twice in one run, or a sink watching: states, terminal rows and plan
    # ids, plans run, recorder and ignored counts, sink records and errors all agree.
    from terminus.states.sequence import SEQUENCE

    n = 48
    rng = random.Random(seed)
    rows_log, runs_log = [], []
    by_rows, by_runs = sequence_batch(n, rows_log), sequence_batch(n, runs_log)
    w, e_count = by_rows._w, len(SEQUENCE.events)
    table = by_rows._packed_list
    refused = ignored_seen = single = 0
    for _ in range(40):
        base = by_rows._base.tolist()
        terminal = by_rows._terminal.tolist()
        reset = sorted(r for r in range(n) if ((base[r] - 1) // w == SEQUENCE.initial
                                               or terminal[(base[r] - 1) // w])
                       and rng.random() < 0.5)
        cur = [SEQUENCE.initial * w + 1 if r in reset else base[r] for r in range(n)]
        runs = []
        for _ in range(rng.randint(1, 6)):
            e = rng.randrange(e_count)
            dense = rng.choice((0.25, 0.03))  # sparse runs: often one row (its own path)
            rows = [r for r in range(n) if rng.random() < dense
                    and (table[cur[r] + e] >= 0 or rng.random() < 0.004)]
            rng.shuffle(rows)
            for r in rows:
                if table[cur[r] + e] >= 0:
                    cur[r] = table[cur[r] + e] & batch_mod._BASE_MASK
            runs.append((rows, e))
            single += len(rows) == 1
        odd = rng.random()
        if odd < 0.05 and runs[0][0]:
            runs.append(([runs[0][0][0], n], runs[0][1]))  # a row out of range
        elif odd < 0.1:
            runs.append(([0], e_count))  # an id out of range
        elif odd < 0.15 and runs[-1][0]:
            runs.append(([runs[-1][0][0]] * 2, runs[-1][1]))  # a row twice in a run
        elif odd < 0.2:
            runs.append(([1, 2], -1))  # no event
        watched = rng.random() < 0.2
        results = []
        for b, rec in ((by_rows, Counts()), (by_runs, Counts())):
            heard = []
            ignored = Counter(b.machine.stats.ignored)  # one machine: each step's own
            prev = observe.set_recorder(rec)
            if watched:
                SEQUENCE.add_sink(heard.append)
            try:
                if b is by_rows:
                    res = outcome(lambda b=b, runs=runs, reset=reset: b.step_rows(
                        batch_mod.rounds_of(runs), reset))
                else:
                    res = outcome(lambda b=b, runs=runs, reset=reset: b.step_runs(runs, reset))
            finally:
                if watched:
                    SEQUENCE.remove_sink(heard.append)
                observe.set_recorder(prev)
            results.append((res, rec.counts, b.states.tolist(),
                            [(r.instance, r.source, r.event, r.target, r.decision, r.plan)
                             for r in heard], b.machine.stats.ignored - ignored))
        assert results[0] == results[1]
        assert rows_log == runs_log
        refused += isinstance(results[0][0][0], str)
        ignored_seen += sum(results[0][4].values())
    assert refused and len({name for name, _ in rows_log}) >= 2
    assert ignored_seen  # the ignored counts compared above were not all zero
    assert single  # runs of one row were compared too


@pytest.mark.parametrize("vec", [0, 10_000])
@pytest.mark.parametrize("seed", range(6))
def test_step_runs_with_the_bases_in_numpy_is_step_rows_of_its_rounds(seed, vec,
                                                                      monkeypatch):
    # The path a step with a long run takes (`_NP_RUN`: the bases in a numpy copy), on
    # every step here: each run vectorized (vec 0) or taken row by row (vec 10,000);
    # the same comparison as above (the list path keeps it: 48 rows, no long run).
    monkeypatch.setattr(batch_mod, "_NP_RUN", 0)
    monkeypatch.setattr(batch_mod, "_NP_VEC", vec)
    test_step_runs_is_step_rows_of_its_rounds(seed)


def test_step_runs_of_an_unobserved_batch_counts_nothing_and_refuses_exactly():
    m, b = built([])
    resume, finish = m.event_id(Resume), m.event_id(Finish)
    step = b.step_runs([([0, 3], resume), ([3], finish)])
    assert step.terminal.tolist() == [3]
    before = b.states.tolist()
    with pytest.raises(TransitionNotAllowed, match="<recycle>") as err:
        b.step_runs([([2], resume)], reset=[0])  # row 0 is live: its reset is refused
    assert err.value.instance == 0 and b.states.tolist() == before
    with pytest.raises(IndexError, match=r"row 6 is out of range 0\.\.5"):
        b.step_runs([([1], resume), ([6], resume)])
    assert b.states.tolist() == before
    with pytest.raises(ValueError, match="step_runs steps a CPU batch"):
        type(b).step_runs(type("Fake", (), {"device": torch.device("meta"),
                                            "machine": m})(), [])


def test_malformed_runs_and_rows_that_are_not_ints_get_errors_naming_them():
    m, b = built([])
    resume = m.event_id(Resume)
    before = b.states.tolist()
    with pytest.raises(TypeError, match=r"run 0 is \(\[0\], <class .*Resume.*\).*event_id"):
        b.step([([0], Resume)])  # the class where its id goes
    with pytest.raises(TypeError, match=r"run 1 is \(3, .*rows are a list of row ints"):
        b.step([([0], resume), (3, resume)])  # (row, id) pairs instead of runs
    with pytest.raises(TypeError, match=r"row np.int64\(1\) is a int64, not an int; "
                       "pass rows as Python ints"):
        b.step_rows([{np.int64(1): resume}])
    with pytest.raises(TypeError, match="a list of runs"):
        b.step(((0,), resume))
    for rows in ([[1]], [np.array([1, 2])]):  # rows that cannot even be hashed
        with pytest.raises(TypeError, match=r"run 0 is .*rows are a list of row ints"):
            b.step_runs([(rows, resume)])
    assert b.states.tolist() == before


@pytest.mark.parametrize("np_run", [batch_mod._NP_RUN, 0], ids=["list path", "numpy path"])
def test_step_runs_reads_a_generator_of_runs_as_it_reads_a_list(np_run, monkeypatch):
    # A one-shot iterable of runs (a generator, a zip) was read once by the check for a
    # long run, and the step then saw no runs: every event dropped, no error (I4).
    monkeypatch.setattr(batch_mod, "_NP_RUN", np_run)
    resume, finish = None, None
    states = []
    for how in ("list", "generator", "zip"):
        m, b = built([])
        resume, finish = m.event_id(Resume), m.event_id(Finish)
        runs = [([0, 1, 2], resume), ([3], resume), ([3], finish)]
        arg = {"list": runs, "generator": (r for r in runs),
               "zip": zip([r for r, _ in runs], [e for _, e in runs], strict=True)}[how]
        step = b.step_runs(arg)
        states.append((b.states.tolist(), step.terminal.tolist()))
    assert states[0] == states[1] == states[2]
    assert states[0][1] == [3] and states[0][0][:3] != [0, 0, 0]
