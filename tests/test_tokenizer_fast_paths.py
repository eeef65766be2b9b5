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


# -- submit_batch's id check: `_take` beside `_take_each` ----------------------------------


def test_take_accepts_and_refuses_what_take_each_does():
    """`_take` (a group's ids checked in a few set operations) against `_take_each` (one
    at a time): the same ids taken, the same refusal naming the same id, nothing else
    changed, for ids free, a live request's, a created warm-up's, one a live group
    reserved, one this call already took, and one listed twice."""

    async def main():
        s = await make_side()
        side = s.side
        r = await side.submit("one", None, rid="y-0")
        await side.submit_batch(["p"], None, n=2, rid="g")  # g-0, g-1 reserved
        assert "g-warmup-0" in side._names and {"g-0", "g-1"} <= set(side._reserved)
        group = rq.RequestKey("new", "group")
        expected = {
            ("x-warmup-0", "x-0", "x-1"): None,
            ("y-warmup-0", "y-0", "y-1"): "y-0",
            ("z-0", "g-warmup-0"): "g-warmup-0",
            ("h-0", "g-1", "h-2"): "g-1",
            ("t-0", "t-1"): "t-1",
            ("d", "e", "d"): "d",
            (): None,
        }
        for names, refused in expected.items():
            outcomes = []
            for take in (side._take, side._take_each):
                taken = {"t-1", "q"}
                before = (dict(side._names), dict(side._reserved))
                try:
                    take(list(names), group, taken)
                    outcomes.append(("took", sorted(taken)))
                except ValueError as e:
                    outcomes.append(("refused", str(e)))
                assert (dict(side._names), dict(side._reserved)) == before
            assert outcomes[0] == outcomes[1], names
            if refused is None:
                assert outcomes[0] == ("took", sorted({"t-1", "q", *names}))
            else:
                assert outcomes[0][0] == "refused"
                assert f"would name a request {refused!r}" in outcomes[0][1]
        side.abort("g")
        side.on_finish(r.key)
        await s.finish_clean()

    asyncio.run(main())


def test_every_request_the_side_makes_carries_its_keys_id():
    """The side gives each request it makes its client id (`Request._rid`), which its
    terminal output and family bookkeeping read: it is its key's `rid`, as a request made
    without it works out when asked."""

    async def main():
        s = await make_side()
        side = s.side
        plain = await side.submit("one", "a", rid="r")
        groups = await side.submit_batch(["p", "q"], "a", n=2, rid="g")
        warm = groups[0].warmups
        for w in warm:
            side.on_finish(w.key)
        made = [plain, *warm, *side.children("g")]
        assert len(made) == 1 + 2 + 4
        for req in made:
            assert req._rid == req.key.rid == req.rid
            assert rq.Request(side.requests, req.key).rid == req.rid  # worked out
        for req in made[3:]:
            side.on_finish(req.key)
        side.on_finish(plain.key)
        assert sorted(str(o.rid) for o in s.sink.outputs.values()) == [
            "g-0", "g-1", "g-2", "g-3", "r"]
        await s.finish_clean()

    asyncio.run(main())
