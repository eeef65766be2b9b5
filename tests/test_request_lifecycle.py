"""A tokenizer-side request releases its LoRA reference exactly once, on every path, and
streams exactly one terminal output. Every test ends with the ledger empty, every
registry counter at zero and an unload of every adapter completing (`finish_clean`)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from terminus.effects.request import (
    LORA,
    RequestResources,
    TerminalOutput,
    bind_request,
    lora_ledger,
)
from terminus.effects.tokenizer import RequestKey, TokenizerSide, _derived_keys
from terminus.fsm import Ledger, TransitionNotAllowed
from terminus.kernels.errors import UnloadTimeout
from terminus.states.request import (
    Finished,
    LoRAAcquired,
    Output,
    Request,
    RequestAbort,
    SchedulerError,
    Submitted,
    Validated,
)
from tests.tokenizer_side import FakeScheduler, GatedRegistry, RecordingSink, make_side, settle


def run(coro):
    return asyncio.run(coro)


def test_normal_completion_releases_the_reference_once_and_streams_finished():
    async def main():
        s = await make_side()
        req = await s.side.submit("hello world", "a", rid="r1")
        assert req.state == "dispatched"
        assert s.scheduler.sent["r1"] == (["hello", "world"], s.adapters["a"])
        assert s.registry.count(s.adapters["a"]) == 1
        assert [h.value for h in s.ledger.owned(req, LORA)] == [s.adapters["a"]]
        assert s.side.on_output("r1") and s.side.on_output("r1")
        assert s.side.on_finish("r1", reason="length")
        assert req.state == "finished"
        assert s.sink.outputs["r1"] == TerminalOutput("r1", "finished", 200, "", "length")
        assert s.side.requests.stats.plans_run["release_finished"] == 1
        await s.finish_clean()

    run(main())


def test_results_by_the_key_the_scheduler_was_sent_end_the_request_once():
    async def main():
        s = await make_side()
        await s.side.submit("hello", "a", rid="r1")
        await s.side.submit("hi there", None, rid="r2")
        await s.side.submit("bye", "b", rid="r3")
        k1, k2, k3 = s.scheduler.keys
        assert (k1, k2, k3) == (RequestKey("r1"), RequestKey("r2"), RequestKey("r3"))
        assert s.side.on_output(k1) and s.side.on_output(k1)
        assert s.side.on_finish(k1, "length") and s.side.on_finish(k2, "custom-stop")
        assert s.sink.outputs["r1"] == TerminalOutput("r1", "finished", 200, "", "length")
        assert s.sink.outputs["r2"] == TerminalOutput("r2", "finished", 200, "",
                                                      "custom-stop")
        assert s.side.abort("r3") and s.scheduler.aborted == ["r3"]
        released = s.ledger.released
        # Ended, so forgotten: late results by key (the abort echo, a duplicate finish, an
        # output) are counted and dropped, and change nothing.
        assert not s.side.on_finish(k3, "abort")
        assert not s.side.on_finish(k1, "length")
        assert not s.side.on_output(k2)
        assert not s.side.on_error(k3, 500, "late")
        assert s.side.unknown_events == 4 and s.ledger.released == released == 2
        assert [s.sink.outcome(r) for r in ("r1", "r2", "r3")] == ["finished", "finished",
                                                                   "aborted"]
        assert s.side.live_count == 0 and not s.sink.duplicates
        await s.finish_clean()

    run(main())


def test_a_group_key_is_refused_by_every_result_and_changes_nothing():
    async def main():
        s = await make_side()
        await s.side.submit_batch(["p"], "a", n=2, rid="g")
        for deliver in (s.side.on_output, s.side.on_finish):
            with pytest.raises(ValueError, match="'g' is a sampling group"):
                deliver(RequestKey("g", "group"))
        assert s.side.get("g").state == "warming_up" and s.side.unknown_events == 0
        # A request key of the group's name is none of the family's: counted, dropped.
        assert not s.side.on_finish(RequestKey("g"), "abort")
        assert s.side.unknown_events == 1 and s.side.get("g").state == "warming_up"
        assert s.side.abort("g")
        await s.finish_clean()

    run(main())


def test_batch_completion_releases_each_request_once():
    async def main():
        s = await make_side()
        reqs = await s.side.submit_batch(["p one", "p two", "p three"], ["a", "b", None],
                                         rids=["x", "y", "z"])
        assert [r.key for r in reqs] == [RequestKey(r) for r in "xyz"]
        assert [r.rid for r in reqs] == ["x", "y", "z"]
        assert s.registry.counts() == {s.adapters["a"]: 1, s.adapters["b"]: 1}
        assert [s.scheduler.sent[r][1] for r in "xyz"] == [s.adapters["a"], s.adapters["b"],
                                                           None]
        for r in "xyz":
            s.side.on_finish(r)
        assert {s.sink.outcome(r) for r in "xyz"} == {"finished"}
        await s.finish_clean()

    run(main())


def test_client_abort_while_running_releases_once_and_tells_the_scheduler():
    async def main():
        s = await make_side()
        await s.side.submit("hello", "a", rid="r1")
        s.side.on_output("r1")
        assert s.side.abort("r1")
        assert s.scheduler.aborted == ["r1"]
        assert s.sink.outputs["r1"].outcome == "aborted"
        assert s.sink.outputs["r1"].status == 499
        assert s.registry.count(s.adapters["a"]) == 0
        await s.finish_clean()

    run(main())


def test_abort_echo_after_finish_releases_nothing():
    async def main():
        s = await make_side()
        await s.side.submit("hello", "a", rid="r1")
        s.side.on_finish("r1")
        released = s.ledger.released
        # The request ended, so its id is forgotten: the client's abort, the scheduler's
        # echo of it and a late error are counted and dropped; nothing is released.
        assert not s.side.abort("r1")  # the client gave up just as the request finished
        assert not s.side.on_finish("r1", reason="abort")
        assert not s.side.on_error("r1", 500, "late duplicate error")
        assert s.side.unknown_events == 3
        assert s.ledger.released == released
        assert s.scheduler.aborted == []  # a finished request is not aborted again
        assert s.sink.outcome("r1") == "finished" and not s.sink.duplicates
        await s.finish_clean()

    run(main())


@pytest.mark.parametrize(("status", "outcome"),
                         [(400, "rejected"), (500, "errored"), (503, "errored")])
def test_scheduler_error_releases_once_by_kind(status, outcome):
    async def main():
        s = await make_side()
        req = await s.side.submit("hello", "b", rid="r1")
        if status == 503:
            s.side.on_output("r1")  # overloaded mid-stream
        assert s.side.on_error("r1", status, "scheduler says no")
        assert not s.side.on_error("r1", status, "and says it twice")  # ended: dropped
        assert req.state == outcome
        assert s.sink.outputs["r1"] == TerminalOutput("r1", outcome, status,
                                                      "scheduler says no")
        assert s.ledger.released == 1
        await s.finish_clean()

    run(main())


@pytest.mark.parametrize(("prompt", "outcome", "status"),
                         [("bad prompt", "rejected", 400), ("crash now", "errored", 500)])
def test_validation_or_tokenization_failure_releases_once(prompt, outcome, status):
    async def main():
        s = await make_side()
        req = await s.side.submit(prompt, "a", rid="r1")
        assert req.state == outcome
        assert s.sink.outputs["r1"].status == status
        assert "r1" not in s.scheduler.sent
        assert s.ledger.released == 1
        await s.finish_clean()

    run(main())


def test_failed_dispatch_releases_once():
    async def main():
        s = await make_side()
        s.scheduler.fail.add("r1")
        req = await s.side.submit("hello", "a", rid="r1")
        assert req.state == "dispatch_failed"
        out = s.sink.outputs["r1"]
        assert (out.outcome, out.status) == ("dispatch_failed", 503)
        assert "socket closed" in out.message
        assert s.ledger.released == 1
        # a transport that reports the failure again later is counted and dropped
        assert not s.side.on_dispatch_failed("r1", "again")
        assert s.side.unknown_events == 1
        assert s.ledger.released == 1
        await s.finish_clean()

    run(main())


def test_request_without_lora_releases_nothing():
    async def main():
        s = await make_side()
        req = await s.side.submit("hello", None, rid="r1")
        assert req.state == "dispatched" and s.ledger.owned(req) == []
        assert s.scheduler.sent["r1"] == (["hello"], None)
        s.side.on_finish("r1")
        assert s.ledger.released == 0
        assert s.sink.outcome("r1") == "finished"
        await s.finish_clean()

    run(main())


def test_unknown_adapter_is_rejected_and_releases_no_missing_id():
    async def main():
        s = await make_side()
        req = await s.side.submit("hello", "nope", rid="r1")
        assert req.state == "rejected"
        out = s.sink.outputs["r1"]
        assert out.status == 400 and "nope" in out.message
        assert s.ledger.released == 0 and s.ledger.count() == 0
        assert s.tokenizer.calls == 0 and s.scheduler.sent == {}
        await s.finish_clean()

    run(main())


def test_abort_while_acquire_in_flight_releases_the_late_reference_at_once():
    async def main():
        s = await make_side(gated=True)
        s.front.gate = asyncio.Event()
        task = asyncio.create_task(s.side.submit("hello", "a", rid="r1"))
        await settle()
        req = s.side.get("r1")
        assert req is not None and req.state == "acquiring_lora" and s.front.waiting == 1
        s.side.abort("r1")
        assert req.state == "aborted"
        assert s.sink.outcome("r1") == "aborted"
        assert s.scheduler.aborted == []  # never reached the scheduler
        s.front.gate.set()
        await task
        # The registry did count the acquire; the ledger released it at once (I6).
        assert s.ledger.late_released == 1
        assert s.registry.count(s.adapters["a"]) == 0
        assert s.side.requests.stats.ignored[("aborted", "LoRAAcquired")] == 1
        assert s.tokenizer.calls == 0 and s.scheduler.sent == {}
        assert list(s.sink.outputs) == ["r1"]
        await s.finish_clean()

    run(main())


def test_abort_while_tokenizing_releases_once_and_never_dispatches():
    async def main():
        s = await make_side()
        s.tokenizer.gates["slow"] = asyncio.Event()
        task = asyncio.create_task(s.side.submit("slow", "b", rid="r1"))
        await settle()
        assert s.side.get("r1").state == "validating"
        s.side.abort("r1")
        assert s.registry.count(s.adapters["b"]) == 0
        s.tokenizer.gates["slow"].set()
        await task
        assert s.scheduler.sent == {}
        assert s.side.requests.stats.ignored[("aborted", "Validated")] == 1
        assert s.sink.outcome("r1") == "aborted"
        await s.finish_clean()

    run(main())


def test_cancelled_submit_aborts_the_request_and_releases_its_reference():
    async def main():
        s = await make_side()
        s.tokenizer.gates["slow"] = asyncio.Event()
        task = asyncio.create_task(s.side.submit("slow", "a", rid="r1"))
        await settle()
        assert s.registry.count(s.adapters["a"]) == 1
        req = s.side.get("r1")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert req.state == "aborted" and s.side.get("r1") is None
        assert s.sink.outputs["r1"].message == "submission was interrupted"
        await s.finish_clean()

    run(main())


def test_upsert_while_requests_hold_the_adapter_keeps_the_stable_id_and_counts():
    async def main():
        s = await make_side()
        a = s.adapters["a"]
        await s.side.submit("one", "a", rid="r1")
        await s.side.submit("two", "a", rid="r2")
        assert await s.registry.upsert("a", "/weights/a-v2") == a
        await s.side.submit("three", "a", rid="r3")
        assert s.scheduler.sent["r3"][1] == a
        assert s.registry.count(a) == 3
        for rid in ("r1", "r2", "r3"):
            s.side.on_finish(rid)
        assert s.registry.count(a) == 0
        await s.finish_clean()

    run(main())


def test_ownership_is_keyed_on_the_acquired_id_never_the_name():
    async def main():
        s = await make_side("a")
        old = s.adapters["a"]
        await s.side.submit("hello", "a", rid="r1")
        unload = asyncio.create_task(s.registry.unload("a", timeout=5))
        await settle()
        assert not unload.done()  # r1 still holds the old id
        new = await s.registry.register("a", "/weights/a-new")  # same name, new adapter
        assert new != old
        await s.side.submit("again", "a", rid="r2")
        assert s.scheduler.sent["r2"][1] == new
        s.side.on_finish("r1")  # releases `old`, whatever "a" means now
        assert await unload == old
        assert s.registry.count(new) == 1
        s.side.on_finish("r2")
        s.adapters["a"] = new
        await s.finish_clean()

    run(main())


def test_async_release_tasks_stay_referenced_until_they_finish_even_after_gc():
    async def main():
        s = await make_side(gated=True, async_release=True)
        for i in range(20):
            await s.side.submit(f"p {i}", "a", rid=f"r{i}")
        for i in range(20):
            s.side.on_finish(f"r{i}")  # the reports (and their tasks) are dropped here
        assert s.ledger.pending == 20
        gc.collect()
        assert s.ledger.pending == 20
        assert s.registry.count(s.adapters["a"]) == 20  # released only when tasks run
        await s.side.drain()
        assert s.ledger.pending == 0
        assert s.registry.count(s.adapters["a"]) == 0
        await s.finish_clean()

    run(main())


def test_unload_completes_as_soon_as_the_last_user_releases():
    async def main():
        s = await make_side("a")
        await s.side.submit("one", "a", rid="r1")
        await s.side.submit("two", "a", rid="r2")
        unload = asyncio.create_task(s.registry.unload("a", timeout=5))
        await settle()
        s.side.on_finish("r1")
        await settle()
        assert not unload.done()
        s.side.abort("r2")
        await asyncio.wait_for(unload, 1)
        del s.adapters["a"]
        await s.finish_clean()

    run(main())


def test_unload_times_out_naming_the_id_and_count_when_a_user_never_releases():
    async def main():
        s = await make_side("a")
        a = s.adapters["a"]
        await s.side.submit("one", "a", rid="r1")
        with pytest.raises(UnloadTimeout, match=rf"LoRA id {a} \('a'\).*count 1"):
            await s.registry.unload("a", timeout=0.05)
        s.side.on_finish("r1")
        await s.registry.wait_for_unload(a, timeout=1)
        del s.adapters["a"]
        await s.finish_clean()

    run(main())


def test_duplicate_live_rid_is_refused_before_anything_is_acquired():
    async def main():
        s = await make_side()
        await s.side.submit("one", "a", rid="r1")
        with pytest.raises(ValueError, match="'r1' is already in flight"):
            await s.side.submit("two", "a", rid="r1")
        assert s.registry.count(s.adapters["a"]) == 1
        s.side.on_finish("r1")
        await s.finish_clean()

    run(main())


def test_events_for_unknown_rids_are_counted_and_dropped():
    async def main():
        s = await make_side()
        assert not s.side.abort("ghost")
        assert not s.side.on_finish("ghost")
        assert s.side.unknown_events == 2
        await s.finish_clean()

    run(main())


def test_a_finished_rid_is_free_for_a_new_request():
    async def main():
        s = await make_side()
        await s.side.submit("one", "a", rid="r1")
        s.side.on_finish("r1")
        assert s.sink.outputs.pop("r1").outcome == "finished"  # the client read it
        s.scheduler.sent.clear()  # the scheduler forgot r1 when it finished it
        second = await s.side.submit("two", "a", rid="r1")  # a new life of the id
        assert s.side.get("r1") is second and second.state == "dispatched"
        assert s.side.abort("r1") and second.state == "aborted"
        assert s.ledger.released == 2
        await s.finish_clean()

    run(main())


def test_scheduler_result_before_dispatch_is_a_loud_error_not_a_release():
    async def main():
        s = await make_side()
        s.tokenizer.gates["slow"] = asyncio.Event()
        task = asyncio.create_task(s.side.submit("slow", "a", rid="r1"))
        await settle()
        with pytest.raises(TransitionNotAllowed, match="'Finished' is not allowed in "
                                                       "state 'validating'"):
            s.side.on_finish("r1")
        assert s.registry.count(s.adapters["a"]) == 1
        s.tokenizer.gates["slow"].set()
        await task
        s.side.on_finish("r1")
        await s.finish_clean()

    run(main())


def test_bad_arguments_are_refused_with_what_to_do():
    async def main():
        s = await make_side()
        with pytest.raises(ValueError, match="2 LoRA names for 3 prompts"):
            await s.side.submit_batch(["a", "b", "c"], ["a", "b"])
        with pytest.raises(ValueError, match=r"n \(samples per prompt\) must be >= 1"):
            await s.side.submit_batch(["a"], n=0)
        with pytest.raises(ValueError, match="at least one prompt"):
            await s.side.submit_batch([])
        with pytest.raises(ValueError, match="not a RequestKey"):
            await s.side.submit("x", "a", rid=RequestKey("x"))
        assert s.ledger.count() == 0
        await s.finish_clean()

    run(main())


def test_a_shared_ledger_gets_the_lora_releaser():
    async def main():
        s = await make_side()
        shared = Ledger(resources=s.side.ledger.resources)  # no "lora" kind yet
        side = TokenizerSide(s.registry, s.tokenizer, s.scheduler, s.sink, ledger=shared)
        assert side.ledger is shared and "lora" in shared.kinds
        await side.submit("hello", "a", rid="q1")
        side.on_finish("q1")
        shared.assert_empty()
        await s.finish_clean()

    run(main())


def test_machine_level_terminal_states_absorb_late_events_and_refuse_resubmission():
    async def main():
        s = await make_side()
        m = bind_request(s.ledger)
        req = Request(m, "m1", prompt="x")
        req.fire(RequestAbort())
        runs = dict(m.stats.plans_run)
        for ev in (Output(), Finished(), SchedulerError(500), RequestAbort()):
            assert req.fire(ev) is None
            assert req.state == "aborted"
        assert dict(m.stats.plans_run) == runs  # absorbed: no plan ran again
        assert sum(m.stats.ignored[("aborted", n)] for n in
                   ("Output", "Finished", "SchedulerError", "RequestAbort")) == 4
        from terminus.states.request import Submitted

        with pytest.raises(TransitionNotAllowed, match="'Submitted' is not allowed"):
            req.fire(Submitted())
        await s.finish_clean()

    run(main())


def test_an_abort_before_a_batched_request_starts_ends_only_that_request():
    async def main():
        s = await make_side()
        a = s.adapters["a"]
        batch = asyncio.ensure_future(
            s.side.submit_batch(["p one", "p two"], "a", rids=["x", "y"]))
        await asyncio.sleep(0)  # both created; their gathered tasks have not started
        assert s.side.get("y").state == "created"
        assert s.side.abort("y")  # nothing acquired yet: nothing to release
        reqs = await batch  # the batch goes on without it (no error)
        assert [r.state for r in reqs] == ["dispatched", "aborted"]
        assert s.sink.outcome("y") == "aborted" and "y" not in s.scheduler.sent
        assert s.registry.count(a) == 1  # x's reference only
        s.side.on_finish("x")
        assert s.sink.outcome("x") == "finished" and s.registry.count(a) == 0
        await s.finish_clean()

    run(main())


def test_submit_batch_with_n_1_uses_the_rid_it_is_given():
    async def main():
        s = await make_side()
        a = s.adapters["a"]
        (req,) = await s.side.submit_batch(["hello"], "a", n=1, rid="g")
        assert s.side.abort("g")  # the id the caller chose names the request
        assert req.key == RequestKey("g") and req.state == "aborted"
        assert s.scheduler.aborted == ["g"] and s.sink.outcome("g") == "aborted"
        assert s.registry.count(a) == 0
        await s.finish_clean()

    run(main())


def test_submit_batch_refuses_a_rid_it_could_not_use_and_changes_nothing():
    async def main():
        s = await make_side()
        with pytest.raises(ValueError, match=r"rid='g' names one request, but with n == 1 "
                                             r"these 2 prompts .* rids=\[\.\.\.\]"):
            await s.side.submit_batch(["one", "two"], "a", n=1, rid="g")
        with pytest.raises(ValueError, match=r"rid= .* or rids= .*, not both"):
            await s.side.submit_batch(["one"], "a", n=2, rid="g", rids=["h"])
        with pytest.raises(ValueError, match="1 rids for 2 prompts"):
            await s.side.submit_batch(["one", "two"], "a", n=2, rids=["h"])
        await s.side.submit("first", "a", rid="taken")
        with pytest.raises(ValueError, match="'taken' is already in flight"):
            await s.side.submit_batch(["one", "two"], "a", rids=["free", "taken"])
        with pytest.raises(ValueError, match="'dup' is already in flight"):
            await s.side.submit_batch(["one", "two"], "a", n=3, rids=["dup", "dup"])
        # Nothing was created, acquired or tokenized by any refused call.
        assert list(s.side.live) == [RequestKey("taken")]
        assert s.side.get("g") is None and s.side.get("free") is None
        assert s.registry.count(s.adapters["a"]) == 1 and s.tokenizer.calls == 1
        s.side.on_finish("taken")
        await s.finish_clean()

    run(main())


def test_request_keys_name_each_role_and_refuse_what_no_request_is():
    assert RequestKey("r1").rid == "r1" and str(RequestKey(7)) == "7"
    assert RequestKey(7).rid == 7  # a client's own id is kept as given
    assert RequestKey("g", "group").rid == "g"
    assert RequestKey("g", "child", 3).rid == "g-3"
    assert RequestKey("g", "warmup", 1).rid == "g-warmup-1"
    assert {RequestKey("g", "child", 3): 1}[RequestKey("g", "child", 3)] == 1
    assert RequestKey("g", "child", 0) != RequestKey("g", "warmup", 0)
    with pytest.raises(ValueError, match="role must be one of"):
        RequestKey("g", "parent")
    with pytest.raises(ValueError, match="index 2 is not valid for role 'request'"):
        RequestKey("g", "request", 2)
    with pytest.raises(ValueError, match="index -1 is not valid"):
        RequestKey("g", "child", -1)
    with pytest.raises(ValueError, match="index -2 is not valid for role 'group'"):
        RequestKey("g", "group", -2)
    with pytest.raises(ValueError, match="role must be one of"):
        RequestKey("g", "parent", 3)  # the role is named first, whatever the index
    with pytest.raises(TypeError, match=r"index must be an int .* got None"):
        RequestKey("g", "child", None)
    with pytest.raises(TypeError, match=r"index must be an int .* got '1'"):
        RequestKey("g", "request", "1")
    with pytest.raises(TypeError, match=r"index must be an int .* got 1\.5; pass int"):
        RequestKey("g", "child", 1.5)  # it was accepted, naming the child "g-1.5"
    with pytest.raises(TypeError, match=r"index must be an int .* got True"):
        RequestKey("g", "child", True)
    assert RequestKey("g", "child", 2).rid == "g-2"


@pytest.mark.parametrize("group", ["g", 7, "grp-0"])
def test_a_groups_derived_ids_are_its_keys_rids_in_order(group):
    """The tokenizer side writes each warm-up's and child's id itself (without the
    property, for keys it makes): each must be the id `RequestKey.rid` names, with the
    warm-ups first and both in index order, or a client's abort by id misses it."""
    derived = _derived_keys(RequestKey(group, "group"), 2, 3)
    assert [(k.role, k.index) for k in derived.values()] == (
        [("warmup", 0), ("warmup", 1)] + [("child", k) for k in range(6)])
    for rid, key in derived.items():
        assert rid == key.rid and key.group == group
    assert len(set(derived)) == 8  # no two keys share an id


def test_an_output_whose_observer_ends_the_request_retires_it_once_by_either_id():
    """An observer that aborts the request inside an output's fire gets it retired once,
    whether the output names the request by its key or by the client's id."""
    async def main():
        s = await make_side()
        reqs = [await s.side.submit("hello", "a", rid=r) for r in ("r1", "r2")]

        def sink(rec):
            if rec.target == "running":
                s.side.get(rec.instance).fire(RequestAbort("observer ended it"))

        s.side.requests.add_sink(sink)
        assert s.side.on_output(reqs[0].key)  # by key
        assert s.side.on_output("r2")  # by the client's id
        s.side.requests.remove_sink(sink)
        for r in ("r1", "r2"):
            assert s.sink.outcome(r) == "aborted"
            assert s.side.get(r) is None  # retired: its id is free again
        assert s.side.live_count == 0 and not s.sink.duplicates
        assert s.ledger.released == 2
        # Late results for the retired requests are counted and change nothing.
        assert not s.side.on_output(reqs[0].key) and not s.side.on_finish("r2")
        assert s.side.unknown_events == 2 and s.ledger.released == 2
        await s.finish_clean()

    run(main())


class _PlainResources:
    """Resources of another class than `RequestResources` (the attributes will do);
    without `async_release` unless given."""

    def __init__(self, registry, sink, scheduler, **extra):
        self.lora_registry, self.sink, self.scheduler = registry, sink, scheduler
        self.__dict__.update(extra)


@pytest.mark.parametrize(("make", "nowait", "sync"), [
    (lambda reg, sink: RequestResources(reg, sink, FakeScheduler()), True, True),
    (lambda reg, sink: RequestResources(reg, sink, FakeScheduler(), async_release=True),
     True, False),
    (lambda reg, sink: RequestResources(reg, sink, FakeScheduler()), False, False),
    (lambda reg, sink: _PlainResources(reg, sink, FakeScheduler()), True, True),
    (lambda reg, sink: _PlainResources(reg, sink, FakeScheduler(), async_release=False),
     True, True),
    (lambda reg, sink: _PlainResources(reg, sink, FakeScheduler(), async_release=True),
     True, False),
    (lambda reg, sink: _PlainResources(reg, sink, FakeScheduler()), False, False),
], ids=["ours", "ours-async", "ours-no-nowait", "plain", "plain-sync", "plain-async",
        "plain-no-nowait"])
def test_the_reference_goes_back_at_once_or_through_the_awaitable_release(make, nowait,
                                                                         sync):
    """`release_lora` returns the reference at once through `release_nowait` unless the
    resources ask for `async_release` (read as a field of ours, by getattr of others) or
    the registry has no `release_nowait`: then through the awaited `release`."""
    async def main():
        s = await make_side()
        reg = GatedRegistry(s.registry, async_only=not nowait)
        sink = RecordingSink()
        ledger = lora_ledger(make(reg, sink))
        machine = bind_request(ledger)
        req = Request(machine, RequestKey("r1"), prompt="p", lora="a")
        req.fire(Submitted(acquire=True))
        (lora_id,) = await reg.acquire(["a"])
        ledger.acquire(req, LORA, lora_id)
        req.fire(LoRAAcquired((lora_id,)))
        req.fire(Validated())
        req.fire(Finished("stop"))
        assert req.state == "finished" and sink.outcome("r1") == "finished"
        assert s.registry.count(lora_id) == (0 if sync else 1)
        await ledger.drain()
        assert s.registry.count(lora_id) == 0
        assert not ledger.errors
        ledger.assert_empty()
        await s.finish_clean()

    run(main())
