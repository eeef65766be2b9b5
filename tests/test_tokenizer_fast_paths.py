"""The tokenizer side's fast paths beside the general ones they stand for.

`SubmittedAcquiring()` and `SubmittedNoAcquire()` are `Submitted(acquire=True/False)`
without the guard: in every state of REQUEST and SAMPLING they do what the guarded form
does (the same target, the same refusal), and the side, which fires them, ends with
every reference back. A script of scheduler reports through `on_output`/`on_finish`
(which hand them to `_deliver`) covers every kind of report they take."""

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


# -- on_output / on_finish: the scheduler's reports through `_deliver` ---------------------


def _script():
    """One script of scheduler reports through `on_output` / `on_finish`: what each
    returned, the live and unknown counts after it, the outputs and the states."""

    async def main():
        s = await make_side()
        side = s.side
        log = []

        def deliver(how, rid, arg):
            return side.on_output(rid) if how == "output" else side.on_finish(rid, arg)

        r1 = await side.submit("one", "a", rid="r1")
        r2 = await side.submit("two", None, rid="r2")
        r3 = await side.submit("three", "b", rid="r3")
        groups = await side.submit_batch(["p"], "a", n=2, rid="g")
        warm = groups[0].warmups[0]
        for rid, how, arg in [
            (r1.key, "output", None), (r1.key, "finish", "length"),
            (r1.key, "finish", "abort"),  # the echo after finish: absorbed
            ("r2", "output", None),  # by the client's id, not the key
            ("r2", "finish", "stop"), ("r2", "finish", "stop"),  # a dead id: unknown
            (r3.key, "finish", "weird reason"),  # a reason not made once
            (warm.key, "finish", "length"),  # fans the group out
        ]:
            log.append((str(rid), how, deliver(how, rid, arg), side.live_count,
                        side.unknown_events))
        with pytest.raises(ValueError, match="is a sampling group"):
            deliver("finish", "g", "stop")
        for c in side.children("g"):
            log.append((c.rid, deliver("output", c.key, None),
                        deliver("finish", c.key, "stop"), side.live_count))
        log.append(sorted((str(k), v.outcome, v.status, v.finish_reason)
                          for k, v in s.sink.outputs.items()))
        log.append([(i.rid, i.state) for i in (r1, r2, r3, warm, *groups)])
        await s.finish_clean()  # every pool full, every LoRA reference back
        return log

    return asyncio.run(main())


def test_on_output_and_on_finish_deliver_every_kind_of_report():
    log = _script()
    # (live requests, unknown events): an echo or a report for a forgotten id is counted
    assert log[:8] == [("r1", "output", True, 5, 0), ("r1", "finish", True, 4, 0),
                       ("r1", "finish", False, 4, 1), ("r2", "output", True, 4, 1),
                       ("r2", "finish", True, 3, 1), ("r2", "finish", False, 3, 2),
                       ("r3", "finish", True, 2, 2), ("g-warmup-0", "finish", True, 2, 2)]
    assert log[8:10] == [("g-0", True, True, 1), ("g-1", True, True, 0)]
    assert log[10] == [("g-0", "finished", 200, "stop"), ("g-1", "finished", 200, "stop"),
                       ("r1", "finished", 200, "length"), ("r2", "finished", 200, "stop"),
                       ("r3", "finished", 200, "weird reason")]
    assert log[11] == [("r1", "finished"), ("r2", "finished"), ("r3", "finished"),
                       ("g-warmup-0", "finished"), ("g", "fanned_out")]
