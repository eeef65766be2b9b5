"""Declaration errors surface when a machine is built, with machine, state, event and fix."""

from __future__ import annotations

import re

import msgspec
import pytest

from terminus.fsm import ANY, ERROR, IGNORE, Event, InvalidDefinition, Spec, State, go
from tests.lifecycle import EVENTS, GUARDS, LIFECYCLE, STATES, TABLE, Abort, Chunk, Finish, Start
from tests.lifecycle import spec as lifecycle_spec


def table(**rows: dict) -> dict:
    t = {k: dict(v) for k, v in TABLE.items()}
    t.update(rows)
    return t


def raises(message: str):  # exact message, as STYLE.md asks
    return pytest.raises(InvalidDefinition, match="^" + re.escape(message) + "$")


def test_a_declaration_with_no_initial_state_is_rejected():
    states = tuple(State(s.name, terminal=s.terminal) for s in STATES)
    with raises("machine 'lifecycle': no initial state; mark exactly one state "
                "State(name, initial=True)"):
        lifecycle_spec(states=states).build()


def test_a_declaration_with_two_initial_states_is_rejected():
    states = (State("queued", initial=True), State("prefilling", initial=True), *STATES[2:])
    with raises("machine 'lifecycle': several initial states: queued, prefilling; keep "
                "initial=True on exactly one of them"):
        lifecycle_spec(states=states).build()


def test_an_edge_out_of_a_terminal_state_is_rejected():
    with raises("machine 'lifecycle', state 'finished', event 'Start': a terminal state has "
                "an edge to 'queued' (I2: a machine enters a terminal state once and never "
                "leaves); declare the event IGNORE or ERROR in terminal states"):
        lifecycle_spec(table=table(finished={Start: go("queued"), ANY: IGNORE})).build()


def test_an_unreachable_state_is_rejected():
    states = (*STATES, State("orphan"))
    with raises("machine 'lifecycle', state 'orphan': state is unreachable from the initial "
                "state 'queued'; add a transition into it, or remove it"):
        lifecycle_spec(states=states,
                       table=table(orphan={Abort: go("aborted", plan="release_aborted"),
                                           ANY: IGNORE})).build()


def test_a_state_that_cannot_reach_a_terminal_state_is_rejected():
    t = table(draining={ANY: IGNORE})
    with raises("machine 'lifecycle', state 'draining': no terminal state can be reached "
                "from this state, so whatever it owns could never be released; add a "
                "transition from it (an abort, a failure) toward a terminal state"):
        lifecycle_spec(table=t).build()


def test_an_undeclared_state_event_pair_is_rejected():
    row = dict(TABLE["decoding"])
    del row[Chunk]
    with raises("machine 'lifecycle', state 'decoding', event 'Chunk': no transition, IGNORE "
                "or ERROR is declared for this pair (I4: every (state, event) pair is "
                "declared); add the event to the row as go(...), IGNORE or ERROR, or give the "
                "row an ANY entry"):
        lifecycle_spec(table=table(decoding=row)).build()


def test_a_state_without_a_row_is_rejected_for_its_first_event():
    t = table()
    del t["draining"]
    with raises("machine 'lifecycle', state 'draining', event 'Start': no transition, IGNORE "
                "or ERROR is declared for this pair (I4: every (state, event) pair is "
                "declared); add the event to the row as go(...), IGNORE or ERROR, or give the "
                "row an ANY entry"):
        lifecycle_spec(table=t).build()


def test_a_release_plan_on_an_edge_to_a_non_terminal_state_is_rejected():
    row = dict(TABLE["queued"], **{})
    row[Start] = go("prefilling", plan="release_early")
    with raises("machine 'lifecycle', state 'queued', event 'Start': release plan "
                "'release_early' on an edge to non-terminal state 'prefilling' (I1: release "
                "effects run only on entering a terminal state); move the plan to the edge "
                "that enters the terminal state"):
        lifecycle_spec(table=table(queued=row)).build()


def test_a_guard_without_an_implementation_is_rejected():
    with raises("machine 'lifecycle', state 'prefilling', event 'Chunk': guard 'last_chunk' "
                "has no implementation; pass guards={'last_chunk': predicate} to the Spec, "
                "or the function itself: go(..., when=predicate)"):
        lifecycle_spec(guards={"chunks_in_flight": GUARDS["chunks_in_flight"]}).build()


def test_an_implemented_guard_no_edge_uses_is_rejected():
    with raises("machine 'lifecycle': guard 'spare' is implemented but no edge uses it; "
                "remove it from guards=, or use it with go(..., when=...)"):
        lifecycle_spec(guards={**GUARDS, "spare": lambda i, e: True}).build()


def test_two_unguarded_edges_for_one_pair_are_rejected():
    row = dict(TABLE["prefilling"])
    row[Chunk] = [go("decoding"), go("prefilling")]
    with raises("machine 'lifecycle', state 'prefilling', event 'Chunk': two unguarded "
                "alternatives for one (state, event) pair; give all but the last alternative "
                "a guard with when='name'"):
        lifecycle_spec(table=table(prefilling=row)).build()


def test_an_unguarded_alternative_before_a_guarded_one_is_rejected():
    row = dict(TABLE["prefilling"])
    row[Chunk] = [go("prefilling"), go("decoding", when="last_chunk")]
    with raises("machine 'lifecycle', state 'prefilling', event 'Chunk': an unguarded "
                "alternative comes before others, which could never be taken; put the "
                "unguarded alternative last"):
        lifecycle_spec(table=table(prefilling=row)).build()


def test_a_transition_to_an_undeclared_state_is_rejected():
    row = dict(TABLE["queued"])
    row[Start] = go("prefiling")
    with raises("machine 'lifecycle', state 'queued', event 'Start': transition to "
                "undeclared state 'prefiling'; declare the target in states=, or fix its "
                "name"):
        lifecycle_spec(table=table(queued=row)).build()


def test_a_row_for_an_undeclared_state_is_rejected():
    with raises("machine 'lifecycle', state 'ghost': the table has a row for a state that is "
                "not declared; add State('ghost') to states, or remove the row"):
        lifecycle_spec(table=table(ghost={ANY: IGNORE})).build()


def test_an_event_that_is_not_a_frozen_tagged_struct_is_rejected():
    class Loose(msgspec.Struct):
        pass

    with raises("machine 'lifecycle', event 'Loose': event classes must be frozen and tagged "
                "msgspec Structs; subclass fsm.Event, or pass frozen=True, tag=True to "
                "msgspec.Struct"):
        lifecycle_spec(events=(*EVENTS, Loose)).build()


def test_a_row_naming_an_undeclared_event_is_rejected():
    class Stray(Event):
        pass

    with raises("machine 'lifecycle', state 'queued', event 'Stray': the row names an event "
                "that is not declared; add it to events=, or remove it from the row"):
        lifecycle_spec(table=table(queued={**TABLE["queued"], Stray: IGNORE})).build()


def test_a_declaration_without_terminal_states_is_rejected():
    class Go(Event):
        pass

    s = Spec("loop", states=(State("a", initial=True),), events=(Go,),
             table={"a": {Go: go("a")}})
    with raises("machine 'loop': no terminal state; mark the states where the lifecycle ends "
                "State(name, terminal=True)"):
        s.build()


def test_the_error_names_machine_state_and_event_as_fields():
    row = dict(TABLE["decoding"])
    del row[Finish]
    with pytest.raises(InvalidDefinition) as info:
        lifecycle_spec(table=table(decoding=row)).build()
    e = info.value
    assert (e.machine, e.state, e.event) == ("lifecycle", "decoding", "Finish")
    assert "ANY entry" in e.fix


def test_a_built_machine_is_frozen():
    with pytest.raises(AttributeError, match="machine 'lifecycle' is frozen"):
        LIFECYCLE.initial = 3  # type: ignore[misc]


def test_compiled_tables_encode_every_kind_of_cell():
    t = LIFECYCLE.tables
    s, e = LIFECYCLE.state_id, LIFECYCLE.event_id
    assert t.next[s("queued")][e(Start)] == s("prefilling")
    assert t.decision[s("queued")][e(Start)] == 0  # transition
    assert t.decision[s("prefilling")][e(Start)] == 1  # ignore
    assert t.next[s("prefilling")][e(Start)] == s("prefilling")
    assert (t.decision[s("queued")][e(Chunk)], t.next[s("queued")][e(Chunk)]) == (2, -1)
    assert (t.decision[s("prefilling")][e(Chunk)], t.next[s("prefilling")][e(Chunk)]) == (3, -2)
    assert t.plan_names == ("release_aborted", "release_finished")
    assert t.plan[s("decoding")][e(Finish)] == 1
    assert t.plan[s("queued")][e(Start)] == -1
    assert t.terminal == (False, False, False, False, True, True)


def test_compiled_tables_move_to_torch_on_the_chosen_device():
    import torch

    t = LIFECYCLE.tables
    tt = t.to_torch("cpu")
    assert tt["next"].shape == (6, 4) and tt["next"].device.type == "cpu"
    assert tt["terminal"].tolist() == list(LIFECYCLE.terminal)
    assert tt["next"].tolist() == [list(r) for r in t.next]
    assert tt["decision"].tolist() == [list(r) for r in t.decision]
    assert tt["plan"].tolist() == [list(r) for r in t.plan]
    assert {k: v.dtype for k, v in tt.items()} == {
        "next": torch.int64, "decision": torch.int64, "plan": torch.int64,
        "terminal": torch.bool}


def test_the_declaration_builds_a_transitions_machine_with_final_terminal_states():
    from terminus.fsm.oracle import transitions_machine

    tm = transitions_machine(LIFECYCLE)
    assert tm.auto_transitions is False
    assert {n for n, st in tm.states.items() if st.final} == {"finished", "aborted"}
    assert tm.initial == "queued"
    assert set(tm.events) == {"Start", "Chunk", "Finish", "Abort"}


def test_binding_requires_every_declared_plan():
    from terminus.fsm import Ledger, Plan

    with pytest.raises(InvalidDefinition, match="plan 'release_finished' has no implementation"):
        LIFECYCLE.bind({"release_aborted": Plan()}, Ledger())
    with pytest.raises(InvalidDefinition, match="plan 'bogus' is implemented but no edge runs"):
        LIFECYCLE.bind({"bogus": Plan()}, Ledger())


def test_binding_rejects_a_release_step_for_a_kind_the_ledger_cannot_release():
    from terminus.fsm import Ledger, Plan, Release

    with pytest.raises(InvalidDefinition, match="plan 'release_aborted' releases kind 'kv' "
                       "but the ledger has no releaser for it"):
        LIFECYCLE.bind({"release_aborted": Plan(Release("kv")),
                        "release_finished": Plan()}, Ledger())


def test_error_is_still_usable_as_a_cell_marker():
    assert repr(ERROR) == "ERROR" and repr(IGNORE) == "IGNORE" and repr(ANY) == "ANY"
