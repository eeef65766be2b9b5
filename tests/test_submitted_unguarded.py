"""`SubmittedAcquiring()` and `SubmittedNoAcquire()` are `Submitted(acquire=True/False)`
without the guard: in every state of REQUEST and SAMPLING they do what the guarded form
does (the same target, the same refusal), and the tokenizer side, which fires them, ends
with every reference back."""

from __future__ import annotations

import asyncio

import pytest

from terminus.effects.request import LORA
from terminus.fsm import TransitionNotAllowed
from terminus.states import request as rq
from terminus.states import sampling as sm
from tests.test_tokenizer_machines import Rig
from tests.tokenizer_side import make_side

# The events that bring a fresh instance to each state (then the Submitted form is fired).
_TO_REQUEST_STATE = {
    "created": [],
    "acquiring_lora": [rq.Submitted(acquire=True)],
    "validating": [rq.Submitted()],
    "dispatched": [rq.Submitted(), rq.Validated()],
    "running": [rq.Submitted(), rq.Validated(), rq.Output()],
    "finished": [rq.Submitted(), rq.Validated(), rq.Finished()],
    "aborted": [rq.RequestAbort()],
}
_TO_SAMPLING_STATE = {
    "created": [],
    "acquiring_lora": [rq.Submitted(acquire=True)],
    "validating": [rq.Submitted()],
    "aborted": [rq.RequestAbort()],
}


def _outcome(inst, event):
    try:
        inst.fire(event)
    except TransitionNotAllowed as e:
        return ("refused", type(e).__name__, inst.state)
    return ("moved", inst.state)


@pytest.mark.parametrize("acquire", [True, False])
@pytest.mark.parametrize("state", sorted(_TO_REQUEST_STATE))
def test_request_unguarded_submitted_does_what_the_guarded_form_does(state, acquire):
    rig = Rig()
    fast = rq.SubmittedAcquiring() if acquire else rq.SubmittedNoAcquire()
    outcomes = []
    for i, event in enumerate((rq.Submitted(acquire=acquire), fast)):
        req = rq.Request(rig.requests, f"r{i}", prompt="x")
        for ev in _TO_REQUEST_STATE[state]:
            req.fire(ev)
        assert req.state == state
        outcomes.append(_outcome(req, event))
        if not req.terminal:
            req.fire(rq.RequestAbort())
    assert outcomes[0] == outcomes[1]
    assert (outcomes[0][0] == "moved") == (state == "created")  # twice: a driver bug
    rig.finish_clean()


@pytest.mark.parametrize("acquire", [True, False])
@pytest.mark.parametrize("state", sorted(_TO_SAMPLING_STATE))
def test_sampling_unguarded_submitted_does_what_the_guarded_form_does(state, acquire):
    rig = Rig()
    fast = rq.SubmittedAcquiring() if acquire else rq.SubmittedNoAcquire()
    outcomes = []
    for i, event in enumerate((rq.Submitted(acquire=acquire), fast)):
        g = sm.SamplingGroup(rig.sampling, f"g{i}", prompts=["x"], loras=[None], n=2)
        for ev in _TO_SAMPLING_STATE[state]:
            g.fire(ev)
        assert g.state == state
        outcomes.append(_outcome(g, event))
        if not g.terminal:
            g.fire(rq.RequestAbort())
    assert outcomes[0] == outcomes[1]
    assert (outcomes[0][0] == "moved") == (state == "created")
    rig.finish_clean()


@pytest.mark.parametrize("lora", [None, "a"])
def test_the_side_fires_the_unguarded_forms_and_gives_every_reference_back(lora, monkeypatch):
    fired = []
    fire = rq.Request.fire

    def record(self, event):
        fired.append(type(event).__name__)
        return fire(self, event)

    monkeypatch.setattr(rq.Request, "fire", record)

    async def main():
        s = await make_side()
        got = await s.side.submit("a prompt", lora, rid="r1")
        assert fired[0] == ("SubmittedAcquiring" if lora else "SubmittedNoAcquire")
        assert got.state == "dispatched"
        assert len(s.ledger.owned(got, LORA)) == (1 if lora else 0)
        s.side.on_finish(got.key)
        assert got.state == "finished"
        await s.side.drain()
        s.registry.assert_full()
        s.ledger.assert_empty()

    asyncio.run(main())
