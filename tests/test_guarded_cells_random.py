"""Compiled guarded cells (`fsm.machine._compile_guarded`, `_compile_guarded_else`, and
`_compile_guarded_else_plain` for a guard and an else that are both plain transitions)
against the general path (`Machine._step`, taken while a sink observes the machine).
Differential, on random cells (a guard then an unguarded alternative, each a plain
transition, an ignore or a terminal edge; or three alternatives) and random guard
behaviour: true, false, raising, a result whose truth raises, firing an event at the
instance first (then raising or not)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from terminus.fsm import IGNORE, Ledger, Plan, Release, Spec, go, release_effect
from terminus.kernels import TokenKVAllocator
from tests.lifecycle import EVENTS, GUARDS, STATES, TABLE, Abort, Chunk, Finish, Job, Start


@release_effect
def _free(ctx: Any, handle: Any) -> None:
    ctx.resources.free(handle.value)


class _Falsy:
    def __bool__(self) -> bool:
        raise ValueError("the truth of this guard result is ambiguous")


def _sink(record: Any) -> None:
    """While a sink observes the machine, every step takes the general path."""


_ALTS = {
    "plain": go("decoding"),
    "plain2": go("draining"),
    "ignore": IGNORE,
    "terminal": go("finished", plan="release_finished"),
}


def _run(seed: int, observed: bool) -> tuple[Any, ...]:
    rng = random.Random(seed)
    log: list[Any] = []
    plays = [rng.choice(("true", "false", "false", "raise", "falsy", "fire", "fire_raise",
                         "fire_true"))
             for _ in range(3)]

    def guard(k: int) -> Any:
        def g(inst: Any, ev: Any) -> Any:
            play = plays[k]
            log.append(("guard", k, play, inst.state))
            if play.startswith("fire"):
                inst.fire(Abort() if rng.random() < 0.5 else Start())
                if play == "fire_raise":
                    raise RuntimeError(f"guard {k} raised after firing")
                return play == "fire_true"
            if play == "raise":
                raise RuntimeError(f"guard {k} raised")
            if play == "falsy":
                return _Falsy()
            return play == "true"

        return g

    names = rng.sample(sorted(_ALTS), 3)
    if rng.random() < 0.7:  # a guard and an else: the common cell
        cell = [go(_ALTS[names[0]].target, when="g0", plan=_ALTS[names[0]].plan)
                if names[0] != "ignore" else go("prefilling", when="g0"), _ALTS[names[1]]]
    else:
        cell = [go("decoding", when="g0"), go("draining", when="g1"), _ALTS[names[2]]]
    table = {k: dict(v) for k, v in TABLE.items()}
    table["prefilling"][Chunk] = cell
    table["draining"][Abort] = go("aborted", plan="release_aborted")
    table["queued"][Finish] = go("decoding")  # every state reachable whatever the cell
    kv = TokenKVAllocator(64, strict=True)
    ledger = Ledger({"kv": _free}, resources=kv)
    spec = Spec("guarded", states=STATES, events=EVENTS, table=table,
                guards={"chunks_in_flight": GUARDS["chunks_in_flight"], "g0": guard(0),
                        **({"g1": guard(1)} if len(cell) == 3 else {})})
    m = spec.build().bind({"release_aborted": Plan(Release("kv")),
                           "release_finished": Plan(Release("kv"))}, ledger)
    if observed:
        m.add_sink(_sink)
    job = Job(m, "r")
    ledger.acquire(job, "kv", kv.alloc(2))
    job.fire(Start())
    outcome: list[Any] = []
    for _ in range(2):
        try:
            report = job.fire(Chunk(last=True))
            outcome.append(("ok", job.state, report is not None and report.plan))
        except Exception as e:  # what the step raised, and what it left
            outcome.append((type(e).__name__, str(e).split("\n")[0], job.state))
        assert not job.busy
    out = (log, outcome, job.state, dict(m.stats.ignored), dict(m.stats.plans_run),
           ledger.count())
    if not job.terminal:
        job.fire(Abort())
    if not job.terminal:
        job.fire(Abort())
    ledger.assert_empty()
    kv.assert_full()
    return out


@pytest.mark.usefixtures("unobserved")
@pytest.mark.parametrize("seed", range(200))
def test_a_compiled_guarded_cell_does_what_the_general_path_does(seed):
    assert _run(seed, observed=False) == _run(seed, observed=True)


@pytest.mark.usefixtures("unobserved")
def test_the_seeds_reach_each_compiled_guarded_function():
    """The random cells above compile to each of the three guarded functions."""
    from terminus.fsm import machine as M

    seen: set[str] = set()
    prev = M._compile_guarded

    def spy(cell: int, alts: Any) -> Any:
        f = prev(cell, alts)
        seen.add(f.__name__)
        return f

    M._compile_guarded = spy  # type: ignore[assignment]
    try:
        for seed in range(200):
            _run(seed, observed=False)
    finally:
        M._compile_guarded = prev  # type: ignore[assignment]
    assert seen == {"fire_guarded", "fire_guarded_else", "fire_guarded_else_plain"}
