"""REQUEST, SAMPLING and LORA_ADAPTER as declared: the compiled engine agrees with the
`transitions` oracle on random event sequences, and driving a fresh instance along a
path to every declared transition and (state, event) pair, with real LoRA references,
releases everything each path acquired."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from terminus.effects.request import (
    LORA,
    RequestResources,
    bind_request,
    bind_sampling,
    lora_ledger,
)
from terminus.fsm import TransitionNotAllowed
from terminus.fsm.oracle import Differential
from terminus.fsm.paths import complete, covering_paths
from terminus.kernels.lora import LoRARegistry
from terminus.states import lora_adapter as la
from terminus.states import request as rq
from terminus.states import sampling as sm
from tests.tokenizer_side import FakeScheduler, RecordingSink

STATUS = st.sampled_from([400, 404, 500, 503])
REQUEST_EVENTS = st.one_of(
    st.builds(rq.Submitted, acquire=st.booleans()),
    st.just(rq.SubmittedAcquiring()),
    st.just(rq.SubmittedNoAcquire()),
    st.builds(rq.LoRAAcquired, lora_ids=st.just((1,))),
    st.builds(rq.AcquireFailed, status=STATUS),
    st.just(rq.Validated()),
    st.builds(rq.ValidationFailed, status=STATUS),
    st.just(rq.DispatchFailed()),
    st.just(rq.Output()),
    st.builds(rq.Finished, reason=st.sampled_from(["stop", "length", "abort"])),
    st.builds(rq.SchedulerError, status=STATUS),
    st.just(rq.RequestAbort()),
)
SAMPLING_EVENTS = st.one_of(
    st.builds(rq.Submitted, acquire=st.booleans()),
    st.just(rq.SubmittedAcquiring()),
    st.just(rq.SubmittedNoAcquire()),
    st.just(rq.LoRAAcquired()),
    st.builds(rq.AcquireFailed, status=STATUS),
    st.just(rq.Validated()),
    st.builds(rq.ValidationFailed, status=STATUS),
    st.just(sm.WarmupFinished()),
    st.builds(sm.BatchFailed, status=STATUS),
    st.just(sm.FanOut()),
    st.just(rq.RequestAbort()),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(REQUEST_EVENTS, max_size=25))
def test_request_agrees_with_the_transitions_oracle_on_random_sequences(events):
    diff = Differential(rq.Request(rq.REQUEST.bind(partial=True), "r"))
    for ev in events:
        diff.deliver(ev)
    assert diff.plans_match()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(SAMPLING_EVENTS, st.integers(0, 2)), max_size=25))
def test_sampling_agrees_with_the_transitions_oracle_on_random_sequences(steps):
    group = sm.SamplingGroup(sm.SAMPLING.bind(partial=True), "g", prompts=["x"], n=2)
    diff = Differential(group)
    for ev, pending in steps:
        group.pending_warmups = pending  # the guard reads it, in both engines
        diff.deliver(ev)
    assert diff.plans_match()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([la.Loaded(), la.LoadFailed(), la.Upserted(),
                                 la.UnloadRequested(), la.UsersDrained(),
                                 la.UnloadTimedOut()]), max_size=20))
def test_lora_adapter_agrees_with_the_transitions_oracle_on_random_sequences(events):
    diff = Differential(la.LORA_ADAPTER.bind(partial=True).create("a"))
    for ev in events:
        diff.deliver(ev)
    assert diff.plans_match()


# -- every transition and pair, with real references -----------------------------------


class Rig:
    """A real registry and a ledger over it, driven without an event loop (the registry's
    synchronous release path), to walk generated paths."""

    def __init__(self) -> None:
        self.registry = LoRARegistry()
        self.a = asyncio.run(self.registry.register("a"))
        self.sink = RecordingSink()
        self.scheduler = FakeScheduler()
        self.ledger = lora_ledger(RequestResources(self.registry, self.sink, self.scheduler))
        self.requests = bind_request(self.ledger)
        self.sampling = bind_sampling(self.ledger)

    def acquire(self, owner, k: int) -> tuple[int, ...]:
        ids = asyncio.run(self.registry.acquire(["a"] * k))
        for i in ids:
            self.ledger.acquire(owner, LORA, i)
        return tuple(ids)

    def status(self, step) -> int:
        return 400 if step.guard == "client_error" else 500

    def walk(self, machine, make, arrange, after=None) -> int:
        """Drive every covering path, completed to a terminal state; returns the count."""
        paths = covering_paths(machine)
        for path in paths:
            inst = make()
            for step in complete(machine, path).steps:
                assert inst.state == step.source, (path, step)
                ev = arrange(inst, step)
                if step.decision == "error":
                    with pytest.raises(TransitionNotAllowed):
                        inst.fire(ev)
                else:
                    inst.fire(ev)
                assert inst.state == step.target, (path, step, inst.state)
            assert inst.terminal and self.ledger.owned(inst) == [], (path, inst)
            if after is not None:
                after(inst)
        return len(paths)

    def finish_clean(self) -> None:
        assert not self.ledger.errors, self.ledger.errors
        assert not self.sink.duplicates
        self.ledger.assert_empty()
        self.registry.assert_full()
        asyncio.run(self.registry.unload("a", timeout=1))


def test_every_request_transition_and_pair_releases_what_its_path_acquired():
    rig = Rig()
    n = 0

    def make():
        nonlocal n
        n += 1
        return rq.Request(rig.requests, f"r{n}", prompt="x", lora="a")

    def arrange(req, step):
        ev = step.event
        if ev is rq.Submitted:
            return rq.Submitted(acquire=step.guard == "wants_lora")
        if ev is rq.LoRAAcquired:
            if step.decision == "error":
                return rq.LoRAAcquired()
            # an ignore here is an acquire that lost the race with a terminal step: the
            # ledger gives the reference back at once (I6)
            return rq.LoRAAcquired(rig.acquire(req, 1))
        if ev in (rq.AcquireFailed, rq.ValidationFailed, rq.SchedulerError):
            return ev(status=rig.status(step))
        return ev()

    paths = rig.walk(rig.requests, make, arrange)
    assert paths > 20
    stats = rig.requests.stats
    assert set(stats.plans_run) == set(rq.REQUEST_PLANS)
    assert len(rig.sink.outputs) == n  # every path ended with exactly one output
    assert rig.ledger.late_released > 0
    rig.finish_clean()


def test_every_sampling_transition_and_pair_releases_or_hands_over_its_references():
    rig = Rig()
    n = 0
    children = []

    def make():
        nonlocal n
        n += 1
        return sm.SamplingGroup(rig.sampling, f"g{n}", prompts=["x", "y"], loras=["a", None],
                                n=2)

    def arrange(group, step):
        ev = step.event
        if ev is rq.Submitted:
            return rq.Submitted(acquire=step.guard == "wants_lora")
        if ev is rq.LoRAAcquired:
            if step.decision == "error":
                return rq.LoRAAcquired()
            return rq.LoRAAcquired(rig.acquire(group, 2))
        if ev in (rq.AcquireFailed, rq.ValidationFailed, sm.BatchFailed):
            return ev(status=rig.status(step))
        if ev is sm.WarmupFinished:
            group.pending_warmups = 1 if step.guard == "warmups_pending" else 0
        if ev is sm.FanOut and step.decision == "transition":
            uses = bool(rig.ledger.owned(group, LORA))
            group.children = [
                rq.Request(rig.requests, f"{group.key}-{k}", prompt=p, lora=lo,
                           role="child", parent=group)
                for k, (p, lo) in enumerate([("x", "a" if uses else None)] * 2
                                            + [("y", None)] * 2)]
            children.extend(group.children)
        return ev()

    def after(group):
        for c in group.children:  # each child owns exactly the one it was handed
            want = [c.lora_id] if c.lora is not None else []
            assert [h.value for h in rig.ledger.owned(c)] == want
            c.fire(rq.RequestAbort())

    paths = rig.walk(rig.sampling, make, arrange, after)
    assert paths > 20
    assert children and set(rig.sampling.stats.plans_run) == set(sm.SAMPLING_PLANS)
    rig.finish_clean()


def test_every_lora_adapter_transition_and_pair_is_reachable():
    rig = Rig()
    machine = la.LORA_ADAPTER.bind()
    paths = rig.walk(machine, lambda: machine.create("a"), lambda inst, step: step.event())
    assert paths >= len(la.LORA_ADAPTER.states)
    rig.finish_clean()
