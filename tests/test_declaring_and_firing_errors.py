"""Declarations and errors as a new user meets them: inline guard functions, plain
strings as states, event classes fired as events, another machine's event of the same
name, the reprs of Machine and Spec, and what Batch.step and event_ids accept."""

from __future__ import annotations

import re

import pytest
import torch

from terminus.fsm import (
    ANY,
    IGNORE,
    Event,
    InvalidDefinition,
    Spec,
    TransitionNotAllowed,
    UnknownEvent,
    go,
)
from terminus.fsm.bench import Finish, Resume, Tick, bench_spec
from terminus.fsm.diagram import extract
from tests.lifecycle import GUARDS, LIFECYCLE, TABLE, Chunk, Job, Start, chunks_in_flight
from tests.lifecycle import spec as lifecycle_spec


def exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


def is_last(inst, ev):
    """The chunk result is the final one."""
    return bool(ev.last)


def _inline_table(when):
    t = {k: dict(v) for k, v in TABLE.items()}
    t["prefilling"][Chunk] = [go("decoding", when=when), go("prefilling")]
    return t


def test_a_guard_function_given_inline_is_named_after_the_function():
    m = lifecycle_spec(table=_inline_table(is_last),
                       guards={"chunks_in_flight": chunks_in_flight}).build()
    assert m.cells[m.state_id("prefilling")][m.event_id(Chunk)][0].guard == "is_last"
    assert m.guards["is_last"] is is_last
    assert any(e.guard == "is_last" for e in extract(m).edges)
    job = Job(m.bind(partial=True), "r")
    job.fire(Start())
    job.fire(Chunk(last=False))
    assert job.state == "prefilling"
    job.fire(Chunk(last=True))
    assert job.state == "decoding"


def test_an_inline_guard_that_never_holds_is_named_in_the_error():
    t = {k: dict(v) for k, v in TABLE.items()}
    t["prefilling"][Chunk] = go("decoding", when=is_last)
    m = lifecycle_spec(table=t, guards={"chunks_in_flight": chunks_in_flight}).build()
    job = Job(m, "r")
    job.fire(Start())
    with pytest.raises(TransitionNotAllowed, match=exactly(
            "machine 'lifecycle' (instance 'r'): event 'Chunk' is not allowed in state "
            "'prefilling': no guard held (is_last)")):
        job.fire(Chunk(last=False))
    assert job.state == "prefilling"


def test_two_different_lambdas_as_guards_are_refused_as_ambiguous():
    t = _inline_table(lambda r, ev: ev.last)
    t["draining"] = {Chunk: [go("aborted", plan="release_aborted", when=lambda r, ev: True),
                             go("aborted", plan="release_aborted")], ANY: IGNORE}
    with pytest.raises(InvalidDefinition, match=exactly(
            "machine 'lifecycle', state 'draining', event 'Chunk': two different guard "
            "functions are named '<lambda>'; give each guard function its own name (a def, "
            "not a lambda, when there are several), or use the same function")):
        lifecycle_spec(table=t, guards={"chunks_in_flight": chunks_in_flight}).build()


def test_an_inline_guard_that_is_not_a_function_is_refused():
    with pytest.raises(InvalidDefinition, match=exactly(
            "machine 'lifecycle', state 'prefilling', event 'Chunk': guard 3 is neither a "
            "name nor a function; write go(..., when='name') with guards={'name': fn}, or "
            "go(..., when=fn)")):
        lifecycle_spec(table=_inline_table(3), guards=dict(GUARDS)).build()


def test_plain_strings_as_states_are_a_clear_invalid_definition():
    with pytest.raises(InvalidDefinition, match=exactly(
            "machine 'lifecycle': state 'queued' is a str, not a State; declare it as "
            "State('queued') (State('queued', initial=True) for the initial one, "
            "terminal=True where the lifecycle ends)")):
        lifecycle_spec(states=("queued", "prefilling")).build()


def test_firing_an_event_class_says_to_fire_an_instance_and_changes_nothing():
    job = Job(LIFECYCLE, "r")
    with pytest.raises(UnknownEvent, match=exactly(
            "machine 'lifecycle', state 'queued': the event class Start was fired itself, "
            "not an instance of it; fire an instance: Start(...)")):
        job.fire(Start)
    assert job.state == "queued"


class Start2(Event):
    """Stands for another machine's event that happens to share a name."""


Start2.__name__ = Start2.__qualname__ = "Start"


def test_firing_another_machines_event_of_the_same_name_says_whose_it_is():
    job = Job(LIFECYCLE, "r")
    here = f"{__name__}"
    with pytest.raises(UnknownEvent, match=exactly(
            f"machine 'lifecycle', state 'queued': Start from {here} is another machine's "
            "event; this machine's Start is tests.lifecycle.Start; import and fire "
            "tests.lifecycle.Start (each machine accepts only its own event classes)")):
        job.fire(Start2())
    with pytest.raises(UnknownEvent, match=r"Start from .* is another machine.s event"):
        job.fire(Start2)
    assert job.state == "queued"


def test_an_unknown_event_class_is_named_by_its_own_name():
    with pytest.raises(UnknownEvent, match=exactly(
            "machine 'lifecycle', state 'queued': 'Tick' is not an event of this machine; "
            "fire one of Start, Chunk, Finish, Abort (declare new events in the Spec)")):
        Job(LIFECYCLE, "r").fire(Tick)


def test_event_id_takes_the_class_and_says_so_for_an_instance():
    assert LIFECYCLE.event_id(Start) == 0 and LIFECYCLE.event_id("Chunk") == 1
    with pytest.raises(UnknownEvent, match=exactly(
            "machine 'lifecycle', state '-': Start() is an event instance; event_id takes "
            "the event class; pass Start (or the name 'Start')")):
        LIFECYCLE.event_id(Start())  # type: ignore[arg-type]


def test_machine_and_spec_have_reprs_that_say_what_they_are():
    spec = lifecycle_spec()
    assert repr(spec) == (
        "Spec('lifecycle', states=['queued', 'prefilling', 'decoding', 'draining', "
        "'finished', 'aborted'], initial='queued', terminal=['finished', 'aborted'], "
        "events=['Start', 'Chunk', 'Finish', 'Abort'])")
    assert repr(LIFECYCLE) == (
        "<Machine 'lifecycle': 6 states (initial 'queued'; terminal 'finished', "
        "'aborted'), 4 events (Start, Chunk, Finish, Abort), plans release_aborted, "
        "release_finished; unbound (bind it to run its plans)>")
    assert repr(LIFECYCLE.bind(partial=True)).endswith(
        "; bound without ledger, missing plans run empty>")
    bench = bench_spec().build()
    assert repr(bench.batch(3)) == "<Batch of 3 'bench_request' instances on cpu>"
    assert repr(Spec("s", states=("a",), events=(), table={})) == (
        "Spec('s', states=[\"'a'\"], initial=[], terminal=[], events=[])")


@pytest.fixture
def batch():
    return bench_spec().build().batch(3)


def test_batch_step_takes_a_tensor_and_says_how_to_build_one(batch):
    with pytest.raises(TypeError, match=exactly(
            "machine 'bench_request': Batch.step takes an int64 tensor of event ids (one "
            "per instance, -1 for none), a list of rounds {row: id} or a list of runs "
            "(rows, id); got list; build it with batch.event_ids([...])")):
        batch.step([0, 1, 2])
    with pytest.raises(ValueError, match=exactly(
            "machine 'bench_request': Batch.step takes 3 int64 event ids, one per "
            "instance (or a (rounds, 3) tensor of them); got torch.int32 of shape (3,); "
            "build it with batch.event_ids([...]) or torch.full((n,), -1, dtype=torch.int64)")):
        batch.step(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"got torch.int64 of shape \(2,\)"):
        batch.step(torch.zeros(2, dtype=torch.int64))
    assert batch.count("waiting") == 3


def test_batch_step_refuses_an_out_of_range_id_and_changes_nothing(batch):
    ids = batch.event_ids([Resume, None, None])
    ids[2] = 9
    with pytest.raises(IndexError, match=exactly(
            "machine 'bench_request': event id 9 at instance 2 is out of range; use "
            "Batch.event_ids() or -1 for no event")):
        batch.step(ids)
    assert batch.count("waiting") == 3


def test_event_ids_takes_a_list_of_classes(batch):
    with pytest.raises(TypeError, match=exactly(
            "machine 'bench_request': event_ids takes a list of event classes (None for "
            "no event), one per instance; got the class Resume; pass [Cls, None, ...]")):
        batch.event_ids(Resume)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=exactly(
            "machine 'bench_request': event_ids takes a list of event classes (None for "
            "no event), one per instance; got the event instance Resume(); pass "
            "[Cls, None, ...]")):
        batch.event_ids(Resume())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=exactly(
            "machine 'bench_request': event_ids takes event classes; item 1 is the event "
            "instance Finish(); pass its class Finish")):
        batch.event_ids([None, Finish(), None])
    assert batch.event_ids([Resume, None, Finish]).tolist() == [2, -1, 3]


def test_a_batch_needs_a_whole_number_of_instances():
    with pytest.raises(ValueError, match=exactly(
            "machine 'bench_request': a batch holds n >= 0 instances (an int), got 2.5")):
        bench_spec().build().batch(2.5)  # type: ignore[arg-type]
