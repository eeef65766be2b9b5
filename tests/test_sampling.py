"""Parallel sampling (n > 1): the bookkeeping parents own batch x n LoRA references until
fan-out, warm-ups own none, exactly batch x n children own one each afterwards, and a
failure before fan-out releases every reference from the parents."""

from __future__ import annotations

import asyncio

import pytest

from terminus.effects.request import LORA, FanOutMismatch, bind_sampling
from terminus.effects.sanitize import sanitizing
from terminus.effects.tokenizer import NotCreatedYet, RequestKey
from terminus.fsm import EffectError, ReleaseFailed
from terminus.states.request import LoRAAcquired, Request, RequestAbort, Submitted, Validated
from terminus.states.sampling import FanOut, SamplingGroup, WarmupFinished
from tests.tokenizer_side import make_side, settle


def run(coro):
    return asyncio.run(coro)


def finish_warmups(s, groups):
    for g in groups:
        for w in g.warmups:
            s.side.on_finish(w.key, reason="length")


@pytest.mark.parametrize("explicit", [False, True], ids=["one-parent", "parent-rids"])
def test_parallel_sampling_gives_exactly_one_reference_to_each_child(explicit):
    async def main():
        s = await make_side()
        a = s.adapters["a"]
        kw = {"rids": ["p0", "p1"]} if explicit else {"rid": "grp"}
        groups = await s.side.submit_batch(["first prompt", "second prompt"], "a", n=4, **kw)
        assert s.registry.count(a) == 2 * 4  # B x n acquires
        if explicit:
            assert [len(s.ledger.owned(g, LORA)) for g in groups] == [4, 4]
        else:
            assert [len(s.ledger.owned(g, LORA)) for g in groups] == [8]
        warmups = [w for g in groups for w in g.warmups]
        assert len(warmups) == 2
        for w in warmups:  # a warm-up uses its prompt's references but owns none
            assert s.ledger.owned(w) == [] and w.lora_id == a
            assert w.state == "dispatched" and s.scheduler.sent[w.rid][1] == a
        assert all(any(w in s.ledger.observers(h) for w in warmups)
                   for g in groups for h in s.ledger.owned(g))
        assert all(g.state == "warming_up" for g in groups)
        finish_warmups(s, groups)
        assert [g.state for g in groups] == ["fanned_out"] * len(groups)
        children = [c for g in groups for c in s.side.children(g.key)]
        assert len(children) == 8
        assert all(s.ledger.owned(g) == [] for g in groups)  # parents own nothing now
        assert all(s.ledger.owned(w) == [] for w in warmups)
        assert [len(s.ledger.owned(c, LORA)) for c in children] == [1] * 8
        assert {c.state for c in children} == {"dispatched"}
        assert all(s.scheduler.sent[c.rid] == (c.tokens, a) for c in children)
        assert s.registry.count(a) == 8
        for c in children:
            s.side.on_finish(c.key)
        assert s.ledger.released == 8
        assert sorted(s.sink.outputs) == sorted(c.rid for c in children)  # parents: none
        await s.finish_clean()

    run(main())


def test_two_adapters_in_one_batch_route_each_reference_to_its_prompts_children():
    async def main():
        s = await make_side()
        a, b = s.adapters["a"], s.adapters["b"]
        (g,) = await s.side.submit_batch(["p a", "p b", "p none"], ["a", "b", None], n=3,
                                         rid="g")
        assert s.registry.counts() == {a: 3, b: 3}
        assert [h.value for h in s.ledger.owned(g, LORA)] == [a] * 3 + [b] * 3
        assert [w.lora_id for w in g.warmups] == [a, b, None]
        finish_warmups(s, [g])
        kids = s.side.children("g")
        assert [c.lora_id for c in kids] == [a] * 3 + [b] * 3 + [None] * 3
        assert [[h.value for h in s.ledger.owned(c, LORA)] for c in kids] == \
            [[a]] * 3 + [[b]] * 3 + [[]] * 3
        for c in kids[:4]:
            s.side.on_finish(c.key)
        assert s.registry.counts() == {a: 0, b: 2}
        for c in kids[4:]:
            s.side.abort(c.key)
        await s.finish_clean()

    run(main())


@pytest.mark.parametrize("explicit", [False, True], ids=["one-parent", "parent-rids"])
def test_failure_before_fan_out_releases_every_reference_from_the_parents(explicit):
    async def main():
        s = await make_side()
        kw = {"rids": ["p0", "p1", "p2"]} if explicit else {"rid": "g"}
        groups = await s.side.submit_batch(["ok one", "bad two", "ok three"],
                                           ["a", "b", "a"], n=2, **kw)
        assert [g.state for g in groups] == ["rejected"] * len(groups)
        assert s.registry.counts() == {s.adapters["a"]: 0, s.adapters["b"]: 0}
        assert s.ledger.released == 6  # all B x n, from the parents
        assert all(g.children == [] for g in groups)
        # A parent whose prompt tokenized first may have sent its warm-up: it is aborted.
        warmups = {w.rid for g in groups for w in g.warmups}
        assert set(s.scheduler.sent) <= warmups
        assert sorted(s.scheduler.aborted) == sorted(s.scheduler.sent)
        assert all(w.state == "aborted" for g in groups for w in g.warmups)
        outs = {g.rid: s.sink.outputs[g.rid] for g in groups}
        assert all(o.outcome == "rejected" and o.status == 400 for o in outs.values())
        await s.finish_clean()

    run(main())


def test_warmup_failure_fails_the_whole_batch_before_fan_out():
    async def main():
        s = await make_side()
        groups = await s.side.submit_batch(["one", "two"], "a", n=3,
                                           rids=["p0", "p1"])
        s.side.on_finish(groups[0].warmups[0].key)
        assert groups[0].state == "ready"
        s.side.on_error(groups[1].warmups[0].key, 503, "overloaded")
        assert [g.state for g in groups] == ["errored", "errored"]
        assert [s.sink.outputs[k].status for k in ("p0", "p1")] == [503, 503]
        assert s.registry.count(s.adapters["a"]) == 0
        assert all(s.side.children(g.key) == [] for g in groups)
        await s.finish_clean()

    run(main())


def test_a_one_prompt_group_whose_tokenizer_raises_fails_when_a_gather_would_have():
    # Each group has one prompt, tokenized without a gathered task: a tokenizer error
    # reaches its group when it would have through the gather, so the other group's
    # warm-up is dispatched first and the batch fails on the dispatch error (503), as
    # before, not on the late tokenizer error (400).
    from terminus.effects.tokenizer import InvalidRequest

    class Timed:
        async def tokenize(self, p):
            await asyncio.sleep(0)
            if p == "bad":
                await asyncio.sleep(0)
                raise InvalidRequest("bad prompt")
            return p.split()

    async def main():
        s = await make_side()
        s.side.tokenizer = Timed()
        s.scheduler.fail = {"*"}  # the scheduler's socket is down
        groups = await s.side.submit_batch(["bad", "good"], ["a", "b"], n=2,
                                           rids=["g0", "g1"])
        await settle()
        assert [g.state for g in groups] == ["errored", "errored"]
        assert [s.sink.outputs[k].status for k in ("g0", "g1")] == [503, 503]
        assert [str(k) for k in s.scheduler.keys] == ["g1-warmup-0"]
        await s.finish_clean()

    run(main())


def test_warmup_dispatch_failure_fails_the_batch_and_aborts_unsent_warmups():
    async def main():
        s = await make_side()
        s.scheduler.fail.add("g-warmup-0")
        (g,) = await s.side.submit_batch(["one", "two"], "b", n=2, rid="g")
        assert g.state == "errored" and s.sink.outputs["g"].status == 503
        assert [w.state for w in g.warmups] == ["dispatch_failed", "aborted"]
        assert "g-warmup-1" not in s.scheduler.sent
        assert s.ledger.released == 4
        await s.finish_clean()

    run(main())


def test_abort_of_a_group_during_warm_up_releases_all_and_aborts_its_warmups():
    async def main():
        s = await make_side()
        (g,) = await s.side.submit_batch(["one", "two"], "a", n=2, rid="g")
        assert s.side.abort("g")
        assert g.state == "aborted" and s.sink.outcome("g") == "aborted"
        assert {w.state for w in g.warmups} == {"aborted"}
        assert sorted(s.scheduler.aborted) == ["g-warmup-0", "g-warmup-1"]
        assert s.registry.count(s.adapters["a"]) == 0
        for w in g.warmups:  # the scheduler's abort echoes are absorbed
            s.side.on_finish(w.key, reason="abort")
        assert g.children == []
        assert list(s.sink.outputs) == ["g"]  # warm-ups stream nothing
        await s.finish_clean()

    run(main())


def test_abort_of_a_group_after_fan_out_aborts_each_child_once():
    async def main():
        s = await make_side()
        (g,) = await s.side.submit_batch(["one"], "a", n=3, rid="g")
        finish_warmups(s, [g])
        kids = s.side.children("g")
        s.side.on_finish(kids[0].key)
        s.side.abort("g")
        assert [c.state for c in kids] == ["finished", "aborted", "aborted"]
        assert s.side.sampling.stats.ignored[("fanned_out", "RequestAbort")] == 1
        assert s.ledger.released == 3
        assert [s.sink.outcome(c.rid) for c in kids] == ["finished", "aborted", "aborted"]
        await s.finish_clean()

    run(main())


def test_a_group_abort_reaches_every_child_when_one_childs_release_raises():
    """A child's LoRA release that raises (a registry hiccup) is raised by the group's
    abort only after every other child was aborted too: raised at once, it left the
    later children live, each holding its reference, behind an abort the caller saw."""
    async def main():
        s = await make_side()
        a = s.adapters["a"]
        (g,) = await s.side.submit_batch(["one"], "a", n=3, rid="g")
        finish_warmups(s, [g])
        kids = s.side.children("g")
        inner, refused = s.front.release_nowait, []

        def release_nowait(ids):
            if not refused:  # the first child's release fails
                refused.append(ids)
                raise ConnectionError("registry unreachable")
            inner(ids)

        s.front.release_nowait = release_nowait
        # (the sanitizer would report the refused reference at the call: held with no
        # owner, which is what a refused release is; checked by hand below)
        with sanitizing(False), pytest.raises(ReleaseFailed, match="release_aborted"):
            s.side.abort("g")
        assert [c.state for c in kids] == ["aborted"] * 3
        assert s.registry.count(a) == 1  # only the refused reference is still counted
        assert [s.sink.outcome(c.rid) for c in kids] == ["aborted"] * 3
        inner(refused[0])
        s.ledger.errors.clear()
        await s.finish_clean()

    run(main())


def test_abort_of_one_parent_rid_lets_its_siblings_fan_out():
    async def main():
        s = await make_side()
        groups = await s.side.submit_batch(["one", "two"], "a", n=2,
                                           rids=["p0", "p1"])
        s.side.on_finish(groups[0].warmups[0].key)
        s.side.abort("p1")
        assert groups[0].state == "fanned_out" and groups[1].state == "aborted"
        assert len(s.side.children("p0")) == 2 and s.side.children("p1") == []
        assert s.registry.count(s.adapters["a"]) == 2
        for c in s.side.children("p0"):
            s.side.on_finish(c.key)
        await s.finish_clean()

    run(main())


def test_abort_while_the_group_acquire_is_in_flight_releases_all_late_references():
    async def main():
        s = await make_side(gated=True)
        s.front.gate = asyncio.Event()
        task = asyncio.create_task(s.side.submit_batch(["one", "two"], "a", n=2, rid="g"))
        await settle()
        g = s.side.get("g")
        assert g.state == "acquiring_lora"
        s.side.abort("g")
        s.front.gate.set()
        await task
        assert s.ledger.late_released == 4
        assert s.registry.count(s.adapters["a"]) == 0
        assert list(s.sink.outputs) == ["g"]
        await s.finish_clean()

    run(main())


def test_unknown_adapter_in_a_batch_acquires_nothing_for_any_parent():
    async def main():
        s = await make_side()
        groups = await s.side.submit_batch(["one", "two"], ["a", "nope"], n=2,
                                           rids=["p0", "p1"])
        assert {g.state for g in groups} == {"rejected"}
        assert s.registry.count(s.adapters["a"]) == 0
        assert s.scheduler.sent == {}
        await s.finish_clean()

    run(main())


def test_child_dispatch_failure_releases_only_that_childs_reference():
    async def main():
        s = await make_side()
        s.scheduler.fail.add("g-1")
        (g,) = await s.side.submit_batch(["one"], "b", n=3, rid="g")
        finish_warmups(s, [g])
        kids = s.side.children("g")
        assert [c.state for c in kids] == ["dispatched", "dispatch_failed", "dispatched"]
        assert s.registry.count(s.adapters["b"]) == 2
        for c in (kids[0], kids[2]):
            s.side.on_finish(c.key)
        await s.finish_clean()

    run(main())


def test_a_group_without_lora_owns_and_releases_nothing():
    async def main():
        s = await make_side()
        (g,) = await s.side.submit_batch(["one", "two"], None, n=2, rid="g")
        finish_warmups(s, [g])
        kids = s.side.children("g")
        assert len(kids) == 4 and all(s.ledger.owned(c) == [] for c in kids)
        for c in kids:
            s.side.on_finish(c.key)
        assert s.ledger.released == 0
        await s.finish_clean()

    run(main())


def test_scheduler_results_for_a_group_rid_are_refused_clearly():
    async def main():
        s = await make_side()
        await s.side.submit_batch(["one"], "a", n=2, rid="g")
        with pytest.raises(ValueError, match="'g' is a sampling group"):
            s.side.on_finish("g")
        s.side.abort("g")
        await s.finish_clean()

    run(main())


def test_fan_out_mismatch_releases_the_references_instead_of_leaking_them():
    async def main():
        s = await make_side()
        m = bind_sampling(s.ledger)
        g = SamplingGroup(m, "g", prompts=["x"], loras=["a"], n=2)
        g.fire(Submitted(acquire=True))
        for i in await s.registry.acquire(["a", "a"]):
            s.ledger.acquire(g, LORA, i)
        g.fire(LoRAAcquired())
        g.fire(Validated())
        g.fire(WarmupFinished())
        g.children = [Request(s.side.requests, "only-one", lora="a")]  # one short
        with pytest.raises(ReleaseFailed) as info:
            g.fire(FanOut())
        assert isinstance(info.value.exceptions[0].error, FanOutMismatch)
        assert "owns 2 LoRA reference(s) but 1 child" in str(info.value.exceptions[0])
        assert g.state == "fanned_out" and s.ledger.owned(g) == []
        s.ledger.errors.clear()  # the failure above is the point of this test
        await s.finish_clean()

    run(main())


def test_a_group_aborted_before_its_preparation_ran_acquires_nothing_and_streams_one_abort():
    async def main():
        s = await make_side()
        # Two groups: their preparations are gathered, so they start at the loop's next
        # iteration (one group's is awaited at once, with nothing between).
        task = asyncio.create_task(s.side.submit_batch(["one", "two"], "a", n=3,
                                                       rids=["g", "h"]))
        await asyncio.sleep(0)  # submit_batch registers the groups; their preparation is queued
        g, h = s.side.get("g"), s.side.get("h")
        assert g is not None and h is not None and g.state == h.state == "created"
        assert s.side.abort("g") and s.side.abort("h")
        assert g.state == h.state == "aborted"
        assert await task == [g, h]  # the queued preparations find them terminal, return
        assert s.registry.counts() == {s.adapters["a"]: 0, s.adapters["b"]: 0}
        assert s.ledger.released == 0 and s.ledger.late_released == 0
        assert s.tokenizer.calls == 0 and s.scheduler.sent == {}
        assert g.warmups == [] and g.children == [] and h.warmups == []
        assert sorted(s.sink.outputs) == ["g", "h"]
        assert s.sink.outcome("g") == s.sink.outcome("h") == "aborted"
        assert s.side.live == {}
        await s.finish_clean()  # counters zero, and each adapter's unload completes

    run(main())


def test_a_parent_aborted_before_its_preparation_ran_lets_its_sibling_fan_out():
    async def main():
        s = await make_side()
        a = s.adapters["a"]
        task = asyncio.create_task(s.side.submit_batch(["one", "two"], "a", n=2,
                                                       rids=["p0", "p1"]))
        await asyncio.sleep(0)
        p1 = s.side.get("p1")
        assert p1 is not None and p1.state == "created"
        s.side.abort("p1")
        p0, p1_again = await task
        assert p1_again is p1 and p1.state == "aborted" and s.ledger.owned(p1) == []
        assert s.registry.count(a) == 2  # only p0's n references were ever taken
        assert [w.rid for w in p0.warmups] == ["p0-warmup-0"] and p1.warmups == []
        finish_warmups(s, [p0])
        assert p0.state == "fanned_out" and len(s.side.children("p0")) == 2
        for c in s.side.children("p0"):
            s.side.on_finish(c.key)
        assert s.sink.outcome("p1") == "aborted"
        assert sorted(s.sink.outputs) == ["p0-0", "p0-1", "p1"]
        assert s.registry.count(a) == 0
        await s.finish_clean()

    run(main())


def test_a_client_rid_cannot_take_a_name_a_live_sampling_group_will_give_a_child():
    async def main():
        s = await make_side()
        a = s.adapters["a"]
        (group,) = await s.side.submit_batch(["p"], "a", n=2, rid="g")
        with pytest.raises(ValueError, match=r"'g-1' belongs to a request of sampling group "
                                             r"'g'"):
            await s.side.submit("other", "a", rid="g-1")
        finish_warmups(s, [group])
        children = s.side.children("g")
        assert [c.rid for c in children] == ["g-0", "g-1"]
        assert all(s.side.get(c.key) is c for c in children)  # none orphaned
        for c in children:
            s.side.on_finish(c.key)
        assert s.registry.count(a) == 0
        await s.finish_clean()

    run(main())


def test_a_sampling_group_whose_child_name_is_taken_is_refused_before_acquiring():
    async def main():
        s = await make_side()
        a = s.adapters["a"]
        r = await s.side.submit("first", "a", rid="g-0")
        with pytest.raises(ValueError, match=r"sampling group 'g' would name a request 'g-0'"):
            await s.side.submit_batch(["p"], "a", n=2, rid="g")
        assert s.registry.count(a) == 1 and s.side.get("g") is None
        s.side.on_finish(r.key)
        # Once the group has ended, its names are free again.
        await s.side.submit_batch(["p"], None, n=2, rid="h")
        s.side.abort("h")
        await s.side.submit("late", None, rid="h-0")
        s.side.on_finish("h-0")
        await s.finish_clean()

    run(main())


def test_a_late_release_that_raises_does_not_leave_the_groups_other_ids_unrecorded():
    async def main():
        s = await make_side(gated=True)
        a = s.adapters["a"]
        s.front.gate = asyncio.Event()
        refused = []
        inner = s.registry.release_nowait

        def release_nowait(ids):
            if not refused:  # the first late release fails (a registry hiccup)
                refused.append(ids)
                raise ConnectionError("registry unreachable")
            inner(ids)

        s.front.release_nowait = release_nowait
        task = asyncio.create_task(s.side.submit_batch(["p"], "a", n=3, rid="g"))
        await settle()
        assert s.side.abort("g")  # the abort overtakes the acquire
        s.front.gate.set()
        with pytest.raises(EffectError, match="registry unreachable"):
            await task
        # All three ids were recorded and released at once; only the refused one is
        # still counted by the registry.
        assert s.ledger.count() == 0 and s.ledger.late_released == 3
        assert s.registry.count(a) == 1
        inner(refused[0])
        s.ledger.errors.clear()
        await s.finish_clean()

    run(main())


# -- a group's family: reachable while any member lives; nothing created half-way ------


def test_an_abort_by_group_rid_reaches_its_children_after_many_other_requests_ended():
    async def main():
        s = await make_side()
        a = s.adapters["a"]
        (g,) = await s.side.submit_batch(["one"], "a", n=2, rid="g")
        finish_warmups(s, [g])
        kids = s.side.children("g")
        assert g.state == "fanned_out" and [c.state for c in kids] == ["dispatched"] * 2
        for i in range(1100):  # a busy server: far more requests end than any window held
            await s.side.submit(f"other {i}", None, rid=f"o{i}")
            s.side.on_finish(f"o{i}")
        assert s.registry.count(a) == 2  # the children still hold their references
        assert s.side.abort("g")
        assert [c.state for c in kids] == ["aborted", "aborted"]
        assert sorted(s.scheduler.aborted) == ["g-0", "g-1"]
        assert [s.sink.outcome(c.rid) for c in kids] == ["aborted", "aborted"]
        assert s.side.unknown_events == 0 and s.registry.count(a) == 0
        assert s.side.get("g") is None  # its last member ended: the family is forgotten
        await s.finish_clean()

    run(main())


def test_a_group_rid_stays_taken_while_any_of_its_children_lives():
    async def main():
        s = await make_side()
        (g,) = await s.side.submit_batch(["one"], "a", n=2, rid="g")
        finish_warmups(s, [g])
        first, second = s.side.children("g")
        s.side.on_finish(first.rid)
        with pytest.raises(ValueError, match="'g' is already in flight"):
            await s.side.submit("again", "a", rid="g")
        assert s.side.get("g-0") is first  # an ended member of a live family is found
        assert s.side.abort("g-0") and first.state == "finished"  # and absorbs its echo
        s.side.on_finish(second.rid)
        assert s.side.get("g") is None and s.side.live == {}
        await s.finish_clean()

    run(main())


@pytest.mark.parametrize("n", [1, 2])
def test_cancelling_a_batch_ends_every_request_in_it(n):
    async def main():
        s = await make_side()
        s.tokenizer.gates["two"] = asyncio.Event()  # the second prompt is still tokenizing
        task = asyncio.create_task(s.side.submit_batch(["one", "two"], "a", n=n,
                                                       rids=["p0", "p1"]))
        await settle()
        p0, p1 = s.side.get("p0"), s.side.get("p1")
        if n == 1:
            assert p0.state == "dispatched" and list(s.scheduler.sent) == ["p0"]
        else:  # p0 warmed up and waits for p1: it would fan out as soon as p1 ended
            s.side.on_finish("p0-warmup-0")
            assert p0.state == "ready"
        assert p1.state == "validating"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (p0.state, p1.state) == ("aborted", "aborted")
        assert s.sink.outcome("p0") == "aborted" and s.sink.outcome("p1") == "aborted"
        if n == 1:
            assert s.scheduler.aborted == ["p0"]
        else:
            assert p0.children == [] and p1.children == []
            assert list(s.scheduler.sent) == ["p0-warmup-0"]
        assert s.side.live == {} and s.registry.count(s.adapters["a"]) == 0
        s.tokenizer.gates["two"].set()
        await s.finish_clean()

    run(main())


def test_an_event_for_a_child_not_created_yet_raises_and_changes_nothing():
    async def main():
        s = await make_side()
        a = s.adapters["a"]
        (g,) = await s.side.submit_batch(["one"], "a", n=2, rid="g")
        assert g.state == "warming_up" and g.children == []
        for call in (lambda: s.side.on_finish("g-0"),
                     lambda: s.side.on_error("g-1", 503),
                     lambda: s.side.on_finish(RequestKey("g", "child", 0)),
                     lambda: s.side.abort("g-1")):
            with pytest.raises(NotCreatedYet, match=r"'g-\d' is its child \d of sampling "
                                                    r"group 'g'.*warming_up.*abort 'g'"):
                call()
        assert g.state == "warming_up" and g.children == [] and s.side.unknown_events == 0
        assert s.registry.count(a) == 2 and len(s.ledger.owned(g)) == 2
        finish_warmups(s, [g])  # fan-out creates them: now the same events are delivered
        kids = s.side.children("g")
        assert s.side.on_finish("g-0")
        assert s.side.on_error("g-1", 503)
        assert [c.state for c in kids] == ["finished", "errored"]
        assert s.registry.count(a) == 0
        await s.finish_clean()

    run(main())


def test_an_event_for_a_warmup_not_created_yet_raises_and_changes_nothing():
    async def main():
        s = await make_side()
        s.tokenizer.gates["one"] = asyncio.Event()
        task = asyncio.create_task(s.side.submit_batch(["one"], "a", n=2, rid="g"))
        await settle()
        g = s.side.get("g")
        assert g.state == "validating"
        with pytest.raises(NotCreatedYet, match="'g-warmup-0' is the warm-up of its prompt 0"):
            s.side.on_finish("g-warmup-0")
        assert g.state == "validating" and g.warmups == []
        s.tokenizer.gates["one"].set()
        await task
        assert s.side.on_finish("g-warmup-0") and g.state == "fanned_out"
        for c in s.side.children("g"):
            s.side.on_finish(c.rid)
        await s.finish_clean()

    run(main())


def test_a_registry_that_returns_too_few_ids_fails_the_group_before_any_child_exists():
    async def main():
        s = await make_side(gated=True)
        a = s.adapters["a"]

        async def acquire_one_short(names):  # breaks the one-id-per-name protocol
            ids = await s.registry.acquire(names)
            s.registry.release_nowait(ids[-1])
            return ids[:-1]

        s.front.acquire = acquire_one_short
        (g,) = await s.side.submit_batch(["one"], "a", n=3, rid="g")
        assert g.state == "errored" and g.warmups == [] and g.children == []
        out = s.sink.outputs["g"]
        assert out.status == 500 and "returned 2 id(s) for 3" in out.message
        assert s.scheduler.sent == {} and s.side.live == {}
        assert s.ledger.released == 2 and s.registry.count(a) == 0
        await s.finish_clean()

    run(main())


def test_a_batch_whose_references_do_not_match_its_children_fans_out_no_child():
    async def main():
        s = await make_side()
        groups = await s.side.submit_batch(["one", "two"], "a", n=2, rids=["p0", "p1"])
        # Something outside the side moved one of p0's references away (a registry or
        # an engine breaking its protocol): p0 no longer owns one per child.
        stray = Request(s.side.requests, "stray", lora="a")
        s.ledger.transfer(s.ledger.owned(groups[0])[0], to=stray)
        finish_warmups(s, groups)
        assert [g.state for g in groups] == ["errored", "errored"]
        assert all(g.children == [] for g in groups) and s.side.live == {}
        assert "owns 1 LoRA reference(s) but 2 of its children" in \
            s.sink.outputs["p0"].message
        assert s.registry.count(s.adapters["a"]) == 1  # the stray one, still owned
        stray.fire(RequestAbort())
        assert s.registry.count(s.adapters["a"]) == 0
        s.sink.outputs.pop("stray")
        await s.finish_clean()

    run(main())


def test_the_scheduler_link_is_sent_keys_and_the_stream_carries_client_ids():
    async def main():
        s = await make_side()
        (g,) = await s.side.submit_batch(["one", "two"], "a", n=2, rid="g")
        finish_warmups(s, [g])
        assert s.scheduler.keys == [RequestKey("g", "warmup", 0), RequestKey("g", "warmup", 1),
                                    *(RequestKey("g", "child", k) for k in range(4))]
        assert g.key == RequestKey("g", "group")
        assert [c.rid for c in s.side.children("g")] == ["g-0", "g-1", "g-2", "g-3"]
        for k in s.scheduler.keys[2:]:
            assert s.side.on_finish(k)  # the key itself finds the request too
        assert sorted(s.sink.outputs) == ["g-0", "g-1", "g-2", "g-3"]
        await s.finish_clean()

    run(main())



@pytest.mark.parametrize("ending", ["children-finish", "abort-in-warm-up"])
def test_a_forgotten_family_lets_go_of_its_group_so_no_reference_cycle_outlives_it(ending):
    """Each warm-up and child points at its group, which lists them: a cycle that kept
    every ended family in memory until the cyclic collector ran. Forgotten (its last
    member ended), the family's members let go of the group and all of it is freed by
    reference counts, whichever ended last: a child, or the group's warm-ups."""
    from tests.garbage import cyclic_garbage

    async def main():
        s = await make_side()
        (g,) = await s.side.submit_batch(["a prompt", "another"], "a", n=2, rid="g")
        if ending == "children-finish":
            finish_warmups(s, [g])
            kids = s.side.children("g")
            assert [c.parent for c in kids] == [g] * 4
            for c in kids:
                s.side.on_finish(c.key)
        else:
            s.side.abort("g")
        members = g.warmups + g.children
        assert len(members) == (6 if ending == "children-finish" else 2)
        assert s.side.get("g") is None  # forgotten: every member ended
        assert [m.parent for m in members] == [None] * len(members)
        assert all(m.terminal for m in members) and g.terminal
        await s.finish_clean()

    with cyclic_garbage() as found:
        run(main())
    left = [o for o in found if isinstance(o, (SamplingGroup, Request))]
    assert left == []
