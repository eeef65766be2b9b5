"""Parallel sampling (n > 1): the bookkeeping parents own batch x n LoRA references until
fan-out, warm-ups own none, exactly batch x n children own one each afterwards, and a
failure before fan-out releases every reference from the parents."""

from __future__ import annotations

import asyncio

import pytest

from terminus.effects.request import LORA, FanOutMismatch, bind_sampling
from terminus.fsm import EffectError, ReleaseFailed
from terminus.states.request import LoRAAcquired, Request, Submitted, Validated
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
        kw = {"parent_rids": ["p0", "p1"]} if explicit else {"rid": "grp"}
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
            assert w.state == "dispatched" and s.scheduler.sent[w.key][1] == a
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
        assert all(s.scheduler.sent[c.key] == (c.tokens, a) for c in children)
        assert s.registry.count(a) == 8
        for c in children:
            s.side.on_finish(c.key)
        assert s.ledger.released == 8
        assert sorted(s.sink.outputs) == sorted(c.key for c in children)  # parents: none
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
        kw = {"parent_rids": ["p0", "p1", "p2"]} if explicit else {"rid": "g"}
        groups = await s.side.submit_batch(["ok one", "bad two", "ok three"],
                                           ["a", "b", "a"], n=2, **kw)
        assert [g.state for g in groups] == ["rejected"] * len(groups)
        assert s.registry.counts() == {s.adapters["a"]: 0, s.adapters["b"]: 0}
        assert s.ledger.released == 6  # all B x n, from the parents
        assert all(g.children == [] for g in groups)
        # A parent whose prompt tokenized first may have sent its warm-up: it is aborted.
        warmups = {w.key for g in groups for w in g.warmups}
        assert set(s.scheduler.sent) <= warmups
        assert sorted(s.scheduler.aborted) == sorted(s.scheduler.sent)
        assert all(w.state == "aborted" for g in groups for w in g.warmups)
        outs = {g.key: s.sink.outputs[g.key] for g in groups}
        assert all(o.outcome == "rejected" and o.status == 400 for o in outs.values())
        await s.finish_clean()

    run(main())


def test_warmup_failure_fails_the_whole_batch_before_fan_out():
    async def main():
        s = await make_side()
        groups = await s.side.submit_batch(["one", "two"], "a", n=3,
                                           parent_rids=["p0", "p1"])
        s.side.on_finish(groups[0].warmups[0].key)
        assert groups[0].state == "ready"
        s.side.on_error(groups[1].warmups[0].key, 503, "overloaded")
        assert [g.state for g in groups] == ["errored", "errored"]
        assert [s.sink.outputs[k].status for k in ("p0", "p1")] == [503, 503]
        assert s.registry.count(s.adapters["a"]) == 0
        assert all(s.side.children(g.key) == [] for g in groups)
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
        assert [s.sink.outcome(c.key) for c in kids] == ["finished", "aborted", "aborted"]
        await s.finish_clean()

    run(main())


def test_abort_of_one_parent_rid_lets_its_siblings_fan_out():
    async def main():
        s = await make_side()
        groups = await s.side.submit_batch(["one", "two"], "a", n=2,
                                           parent_rids=["p0", "p1"])
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
                                           parent_rids=["p0", "p1"])
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
        task = asyncio.create_task(s.side.submit_batch(["one", "two"], "a", n=3, rid="g"))
        await asyncio.sleep(0)  # submit_batch registers the group; its preparation is queued
        g = s.side.get("g")
        assert g is not None and g.state == "created"
        assert s.side.abort("g")
        assert g.state == "aborted"
        assert await task == [g]  # the queued preparation finds it terminal and returns
        assert s.registry.counts() == {s.adapters["a"]: 0, s.adapters["b"]: 0}
        assert s.ledger.released == 0 and s.ledger.late_released == 0
        assert s.tokenizer.calls == 0 and s.scheduler.sent == {}
        assert g.warmups == [] and g.children == []
        assert list(s.sink.outputs) == ["g"] and s.sink.outcome("g") == "aborted"
        assert s.side.live == {}
        await s.finish_clean()  # counters zero, and each adapter's unload completes

    run(main())


def test_a_parent_aborted_before_its_preparation_ran_lets_its_sibling_fan_out():
    async def main():
        s = await make_side()
        a = s.adapters["a"]
        task = asyncio.create_task(s.side.submit_batch(["one", "two"], "a", n=2,
                                                       parent_rids=["p0", "p1"]))
        await asyncio.sleep(0)
        p1 = s.side.get("p1")
        assert p1 is not None and p1.state == "created"
        s.side.abort("p1")
        p0, p1_again = await task
        assert p1_again is p1 and p1.state == "aborted" and s.ledger.owned(p1) == []
        assert s.registry.count(a) == 2  # only p0's n references were ever taken
        assert [w.key for w in p0.warmups] == ["p0-warmup-0"] and p1.warmups == []
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
        assert [c.key for c in children] == ["g-0", "g-1"]
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
