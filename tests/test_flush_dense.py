"""`RunningBatch.flush` of an unobserved CPU batch builds its (rounds, n) event tensor
with `fsm.batch.dense_rounds`, a fixed number of numpy calls, where `rounds_of` builds the
rounds row by row: the same tensor for any runs (rows repeated across runs or within one,
empty runs), and the same steps as an observed batch's `Batch.step_runs`."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from terminus.effects.sequence import RunningBatch, SchedulerPools
from terminus.fsm import TransitionNotAllowed, observe
from terminus.fsm.batch import _BASE_MASK, _CheckedRuns, dense_rounds, rounds_of
from terminus.states.sequence import SEQUENCE, Admit, ChunkDone, SequenceAbort
from tests.test_batch_step_rows import sequence_batch


def dense_of_rounds(runs, n):
    """The general path: `rounds_of`, then one fancy assignment per round."""
    rounds = rounds_of(runs)
    host = np.full((len(rounds), n), -1, dtype=np.int64)
    for j, rd in enumerate(rounds):
        host[j, list(rd)] = list(rd.values())
    return host


@pytest.mark.parametrize("seed", range(30))
def test_dense_rounds_is_rounds_of_for_any_runs(seed):
    rng = random.Random(seed)
    shapes = Counter()
    for _ in range(40):
        n = rng.randint(1, 40)
        runs = []
        for _ in range(rng.randint(0, 8)):
            k = rng.choice([0, 1, 2, rng.randint(0, n), rng.randint(0, 2 * n)])
            if rng.random() < 0.5:  # distinct rows (a queue() call's usual run)
                rows = rng.sample(range(n), min(k, n))
            else:  # a row may be named twice in one run
                rows = [rng.randrange(n) for _ in range(k)]
            runs.append((rows, rng.randrange(9)))
        got, want = dense_rounds(runs, n), dense_of_rounds(runs, n)
        assert got.dtype == want.dtype == np.int64
        assert got.shape == want.shape
        assert (got == want).all()
        shapes[min(len(want), 2)] += 1
    assert shapes[0] and shapes[1] and shapes[2]  # no rounds, one round, several


def test_dense_rounds_puts_a_rows_events_in_the_order_of_its_runs():
    runs = [([3, 1], 5), ([1, 1], 6), ([], 2), ([0, 3], 7)]
    assert dense_rounds(runs, 4).tolist() == [[7, 5, -1, 5],
                                              [-1, 6, -1, 7],
                                              [-1, 6, -1, -1]]
    assert dense_rounds([([2, 0], 4)], 3).tolist() == [[4, -1, 4]]
    assert dense_rounds([([], 4)], 3).shape == (0, 3)


class Counts:
    def record(self, machine, source, event, alt) -> None:
        pass

    def record_counts(self, machine, counts) -> None:
        pass


def _flush(rb, observed):
    """Flush `rb` observed (a recorder attached: `Batch.step_runs`) or not (the dense
    tensor; its deferred refusal read at once): the error's type, or None."""
    prev = observe.set_recorder(Counts() if observed else None)
    try:
        rb.flush()
        rb.check()
    except (TransitionNotAllowed, IndexError) as e:
        return type(e).__name__
    finally:
        observe.set_recorder(prev)
    return None


@pytest.mark.parametrize("seed", range(6))
def test_an_unobserved_flush_steps_as_an_observed_one(seed):
    # Two batches over pools of their own take the same random scheduler steps (queued
    # admissions, several runs, rows repeated across runs, now and then a refused cell):
    # one unobserved (dense_rounds' tensor, the quiet path where it applies), one
    # observed (step_runs). States, retirements, refusals and pools agree.
    rng = random.Random(seed)
    n = 24
    side = []
    for _ in range(2):
        pools = SchedulerPools(rows=n, max_context_len=64, kv_tokens=512, mamba_slots=n,
                               strict=True, page_size=4)
        side.append(RunningBatch(pools))
    b0 = side[0].batch
    w, table, vacant = b0._w, b0._packed_list, SEQUENCE.state_id("vacant")
    events = [cls for cls in SEQUENCE.events if cls is not Admit]
    refused = multi = 0
    for _ in range(60):
        base = b0._base.tolist()
        k = rng.randint(0, 3)
        free = side[0].pools.table.available
        cur = list(base)
        if k and free >= k:
            mamba = rng.random() < 0.5
            got = [rb.admit(k, mamba, queued=True) for rb in side]
            assert got[0].tolist() == got[1].tolist()
            for r in got[0].tolist():
                cur[r] = table[SEQUENCE.initial * w + 1 + b0._reset_id] & _BASE_MASK
                cur[r] = table[cur[r] + SEQUENCE.event_id(Admit)] & _BASE_MASK
        for _ in range(rng.randint(1, 6)):
            cls = rng.choice(events)
            e = SEQUENCE.event_id(cls)
            rows = [r for r in range(n) if (cur[r] - 1) // w != vacant
                    and rng.random() < 0.3
                    and (table[cur[r] + e] >= 0 or rng.random() < 0.01)]
            rng.shuffle(rows)
            for r in rows:
                if table[cur[r] + e] >= 0:
                    cur[r] = table[cur[r] + e] & _BASE_MASK
            for rb in side:
                rb.queue(rows, cls)
        multi += len(rounds_of(side[0]._runs)) > 1
        errors = [_flush(side[0], False), _flush(side[1], True)]
        assert errors[0] == errors[1]
        refused += errors[0] is not None
        assert side[0].batch.states.tolist() == side[1].batch.states.tolist()
        assert side[0].retired == side[1].retired
        assert side[0].pools.in_use() == side[1].pools.in_use()
    assert refused and multi
    for rb in side:  # end every live row, then the pools are full again
        rb.fire(rb.rows_in("prefill", "prefill_1", "prefill_2", "decoding"), SequenceAbort)
        for _ in range(2):  # an aborted row drains its chunks in flight
            rb.fire(rb.rows_in("draining_1", "draining_2"), ChunkDone)
        assert not rb.rows_in(*[s for s in SEQUENCE.states if s != "vacant"
                                and not b0._terminal[SEQUENCE.state_id(s)]]).numel()
        rb.pools.assert_full()


@pytest.mark.parametrize("seed", range(4))
def test_runs_of_checked_rows_step_as_the_public_step_runs(seed):
    # RunningBatch hands `Batch.step` runs whose rows it made ints of the batch already
    # (`_CheckedRuns`: no type or range scan per run); any such runs (a row twice in a
    # run included, and refused cells) step as the public, checking `step_runs` does.
    from collections import Counter as C

    rng = random.Random(seed)
    n = 32
    logs: list[list] = [[], []]

    class Rec:
        def __init__(self):
            self.counts = C()

        def record(self, machine, source, event, alt):
            self.counts[(source, event, alt)] += 1

        def record_counts(self, machine, counts):
            self.counts.update(counts)

    pub, fast = sequence_batch(n, logs[0]), sequence_batch(n, logs[1])
    w, table = pub._w, pub._packed_list
    refused = 0
    for _ in range(50):
        base = pub._base.tolist()
        terminal = pub._terminal.tolist()
        reset = [r for r in range(n) if ((base[r] - 1) // w == SEQUENCE.initial
                                         or terminal[(base[r] - 1) // w])
                 and rng.random() < 0.5]
        cur = [SEQUENCE.initial * w + 1 if r in reset else base[r] for r in range(n)]
        runs = []
        for _ in range(rng.randint(1, 6)):
            e = rng.randrange(len(SEQUENCE.events))
            rows = [r for r in range(n) if rng.random() < 0.3
                    and (table[cur[r] + e] >= 0 or rng.random() < 0.01)]
            rng.shuffle(rows)
            if rows and rng.random() < 0.05:
                rows.append(rows[0])  # a row twice in a run
            for r in rows:
                if table[cur[r] + e] >= 0:
                    cur[r] = table[cur[r] + e] & _BASE_MASK
            runs.append((rows, e))
        results = []
        for b, how in ((pub, "public"), (fast, "checked")):
            rec = Rec()
            prev = observe.set_recorder(rec)
            try:
                if how == "public":
                    step = b.step_runs(runs, reset)
                else:
                    step = b.step(_CheckedRuns(runs, reset))
                res = (step.terminal.tolist(), step.plan_ids.tolist())
            except TransitionNotAllowed as e:
                res = (str(e), e.instance)
            finally:
                observe.set_recorder(prev)
            results.append((res, b.states.tolist(), rec.counts))
        assert results[0] == results[1]
        assert logs[0] == logs[1]
        refused += isinstance(results[0][0][0], str)
    assert refused and logs[0]
    with pytest.raises(ValueError, match="_CheckedRuns carry their reset rows"):
        pub.step(_CheckedRuns([([0], 0)]), reset=pub._empty)
