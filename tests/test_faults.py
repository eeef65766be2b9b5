"""Fault injection at every call that leaves the engine (effects.callsites).

Each driver runs a scenario that reaches its call sites through recording proxies. A
call the registry does not list fails the recording run; then every listed site of the
driver raises once, in turn, and the run must still end with pools full, counters zero,
one terminal output per request and the injected error reported clearly (raised by the
call, or recorded by a best-effort step).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
import torch

from terminus.effects.callsites import (
    KINDS,
    RELEASES,
    FaultPlan,
    InjectedFault,
    call_sites,
    faulty,
    proxy,
    register_call_site,
)
from terminus.effects.disagg import DisaggPools, DisaggPrefill
from terminus.effects.output import OutputLog
from terminus.effects.prefix_cache import PrefixCache
from terminus.effects.sanitize import LeakSanitizerError, sanitizing
from terminus.effects.sim.transport import FakeTransport
from terminus.effects.tokenizer import TokenizerSide
from terminus.effects.transport import TransportError
from terminus.fsm import ReleaseFailed
from terminus.kernels import LoRARegistry, release_batch
from tests.tokenizer_side import FakeScheduler, FakeTokenizer


def chain(e: BaseException) -> list[BaseException]:
    """`e`, its causes, and the errors of exception groups / ReleaseFailed inside it."""
    out: list[BaseException] = []
    todo = [e]
    while todo:
        x = todo.pop()
        if x is None or x in out:
            continue
        out.append(x)
        todo += [x.__cause__, x.__context__, getattr(x, "error", None)]
        todo += list(getattr(x, "exceptions", ()) or ())
    return [x for x in out if isinstance(x, BaseException)]


def injected(errors: list[BaseException]) -> list[InjectedFault]:
    return [x for e in errors for x in chain(e) if isinstance(x, InjectedFault)]


def assert_reported(site: Any, errors: list[BaseException], sink: OutputLog) -> None:
    """The fault surfaced: raised by a call (or recorded by a best-effort step) naming
    the site, or, where the driver turns it into an ending, in a terminal output."""
    name = f"{site.resource}.{site.method}"
    faults = injected(errors)
    if faults:
        assert name in str(faults[0])
        return
    msgs = [o.message for o in sink.outputs if name in o.message]
    assert msgs, f"the fault at {name} was swallowed: {errors} {sink.outputs}"


# -- disaggregated prefill -------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def attempter(errors: list[BaseException], state: Any = None) -> Any:
    """`attempt(fn, *args)`: call it as a serving loop would, recording (in `errors`)
    whatever it raises except a sanitizer finding, which fails the test at once. With
    `state` (a function of no arguments), a call that raises must leave `state()` as it
    found it: a raised error is a refusal, which changes nothing."""

    def attempt(fn: Any, *a: Any) -> Any:
        before = state() if state is not None else None
        try:
            return fn(*a)
        except LeakSanitizerError:
            raise
        except Exception as err:
            errors.append(err)
            if state is not None:
                assert state() == before, (
                    f"{fn.__name__}{a} raised {err!r} after it changed something")
            return None

    return attempt


def disagg_state(e: DisaggPrefill, real: DisaggPools) -> Any:
    """What a refused driver call must not change: every request's state and its chunks',
    what the ledger holds, what each pool has free."""
    return ({rid: (r.state, [c.state for c in r.chunks]) for rid, r in e.requests.items()},
            e.ledger.count(), {k: p.available_size() if hasattr(p, "available_size")
                               else p.available for k, p in real.pools().items()})


def disagg_run(plan: FaultPlan, *, refusals_change_nothing: bool = False,
               ) -> tuple[list[BaseException], DisaggPools, Any, Any]:
    """Three requests: one succeeds, one is aborted mid-prefill, one during its transfer.
    `refusals_change_nothing`: every driver call that raises is checked to have changed
    nothing (`attempter`'s `state`)."""
    real = DisaggPools.make(kv_tokens=256, requests=4, mamba_slots=8, metadata_slots=4,
                            host_pages=16, max_context_len=64)
    pools = DisaggPools(
        kv=proxy(real.kv, "kv", plan), mamba=proxy(real.mamba, "mamba", plan),
        metadata=proxy(real.metadata, "metadata", plan),
        host=proxy(real.host, "host", plan, returns={"prefetch": "host_prefetch"}),
        table=proxy(real.table, "table", plan))
    transport = FakeTransport()
    cache = PrefixCache(real.kv)
    sink = OutputLog()
    clock = Clock()
    e = DisaggPrefill(pools, transport=proxy(transport, "transport", plan),
                      cache=proxy(cache, "cache", plan), sink=proxy(sink, "sink", plan),
                      clock=clock, sender_deadline_s=5)
    errors: list[BaseException] = []
    attempt = attempter(errors, (lambda: disagg_state(e, real)) if refusals_change_nothing
                        else None)

    rids = ("ok", "cut", "late")
    for rid in rids:
        attempt(lambda r: e.add(r, 8, chunk_size=4, host_pages=2), rid)
    for rid in rids:
        if rid in e.requests:
            attempt(e.advance_prefetch, rid, 1)
            attempt(e.bootstrap, rid)
    for rid in rids:
        if rid in e.requests:
            for _ in range(2):
                attempt(e.schedule, rid)
    attempt(e.abort, "cut", "client gone")
    for rid in rids:
        if rid in e.requests:
            for k in range(len(e.req(rid).chunks)):
                attempt(e.result, rid, k)
    attempt(e.abort, "late", "client gone during the transfer")
    transport.complete("ok")
    attempt(e.poll_transfer, "ok")
    # Recovery, as a serving loop does: abort what is left, settle chunks in flight,
    # let the sender deadline pass.
    for rid in list(e.requests):
        req = e.req(rid)
        if not req.terminal:
            attempt(e.abort, rid, "recovery")
        for k, c in enumerate(req.chunks):
            if not c.terminal:
                attempt(e.result, rid, k)
    clock.now += 10
    for rid in list(e.requests):
        attempt(e.poll_transfer, rid)
    for rid in rids:
        if rid in e.requests:
            assert e.req(rid).terminal, (rid, e.req(rid).state)
    errors += e.errors
    errors += [x.error for x in e.ledger.errors]
    return errors, real, sink, e


def test_every_disagg_call_is_a_registered_call_site():
    plan = FaultPlan()
    errors, real, sink, e = disagg_run(plan)
    assert not errors
    used = {s for s, n in plan.calls.items() if n}
    wanted = {(s.resource, s.method) for s in call_sites()
              if s.resource in ("transport", "cache", "sink", "metadata",
                                "host_prefetch")}
    assert wanted - {("host_prefetch", "stop"), ("host_prefetch", "take"),
                     ("transport", "poll")} <= used | {("transport", "abort")}
    finish_disagg(real, sink, e, plan)


def finish_disagg(real: DisaggPools, sink: OutputLog, e: DisaggPrefill,
                  plan: FaultPlan) -> None:
    plan.strict = False
    e.cache.evict_all()
    for p in real.pools().values():
        p.assert_full()
    e.ledger.assert_empty()
    assert_one_output_each(sink, e.requests, plan)


def assert_one_output_each(sink: OutputLog, rids: Any, plan: FaultPlan) -> dict[Any, int]:
    """One terminal output per request; a faulted `sink.put` was the attempt of its rid."""
    counts = dict(sink.counts)
    for site, (_, args) in zip(plan.fired, plan.fired_calls, strict=True):
        if (site.resource, site.method) == ("sink", "put"):
            counts[args[0].rid] = counts.get(args[0].rid, 0) + 1
    if rids is not None:
        assert sorted(map(str, counts)) == sorted(map(str, rids))
    assert set(counts.values()) == {1}
    return counts


DISAGG_SITES = [s for s in call_sites() if s.resource in (
    "transport", "kv", "mamba", "table", "metadata", "host",
    "host_prefetch", "cache", "sink")]


def refused_release(site: Any, plan: FaultPlan) -> None:
    """A fault at a release leaves exactly that call's units held (the error names the
    call): give them back as a retry would, so the pools' fullness proves that nothing
    else was held."""
    if site.method not in RELEASES:
        return
    plan.strict = False
    for fn, args in plan.fired_calls:
        if (site.resource, site.method) == ("host_prefetch", "take"):
            fn.__self__.release()  # the pages the cache never got go back
            continue
        fn(*args)
        if site.resource == "host_prefetch" and site.method == "terminate":
            fn.__self__.release()  # the effect's next step, which the fault skipped


def sanitizer_for(site: Any) -> Any:
    # The sanitizer reports a refused release's units at the call (they are held with
    # no owner): correct, and what the test then checks by hand.
    return sanitizing(False) if site is not None and site.method in RELEASES \
        else contextlib.nullcontext()


@pytest.mark.parametrize("site", DISAGG_SITES, ids=lambda s: f"{s.resource}.{s.method}")
def test_a_fault_at_each_disagg_call_site_ends_clean(site):
    plan = FaultPlan()
    plan.arm(site)
    with sanitizer_for(site):
        errors, real, sink, e = disagg_run(plan)
    if not plan.fired:
        pytest.skip(f"{site.resource}.{site.method} is not called by this scenario")
    assert_reported(site, errors, sink)
    refused_release(site, plan)
    finish_disagg(real, sink, e, plan)


TRANSPORT_SITES = [s for s in DISAGG_SITES if s.resource == "transport"]


@pytest.mark.parametrize("site", TRANSPORT_SITES, ids=lambda s: f"{s.resource}.{s.method}")
def test_a_sender_error_outside_the_protocol_at_each_transport_site_ends_clean(site):
    """A real sender raises what its library raises, not only `TransportError`: each
    transport site raising a `ConnectionError` instead ends as clean, and no driver call
    raises after it changed something (`init`'s left the request waiting with a
    metadata slot the decode side never heard of, `send`'s left it waiting on a transfer
    that never started, both raised out of the driver)."""
    plan = FaultPlan()
    plan.arm(site, error=ConnectionError)
    errors, real, sink, e = disagg_run(plan, refusals_change_nothing=True)
    assert plan.fired == [site]
    faults = injected(errors)
    assert faults and all(isinstance(f, ConnectionError) and not isinstance(f, TransportError)
                          for f in faults)
    assert_reported(site, errors, sink)
    finish_disagg(real, sink, e, plan)


def test_arm_refuses_an_error_that_is_not_an_exception_class():
    plan = FaultPlan()
    site = TRANSPORT_SITES[0]
    for bad in (ConnectionError("an instance"), KeyboardInterrupt, "ConnectionError"):
        with pytest.raises(TypeError, match="must be an Exception class"):
            plan.arm(site, error=bad)
    assert not plan._armed


# -- tokenizer side -----------------------------------------------------------------------------


async def tokenizer_run(plan: FaultPlan) -> tuple[list[BaseException], Any, Any, TokenizerSide]:
    reg = LoRARegistry()
    await reg.register("a")
    sink = OutputLog()
    side = TokenizerSide(proxy(reg, "lora_registry", plan),
                         proxy(FakeTokenizer(), "tokenizer", plan),
                         proxy(FakeScheduler(), "scheduler", plan), proxy(sink, "sink", plan))
    errors: list[BaseException] = []

    async def attempt(coro: Any) -> None:
        try:
            await coro
        except LeakSanitizerError:
            raise
        except Exception as err:
            errors.append(err)

    await attempt(side.submit("one two", "a", rid="done"))
    await attempt(side.submit("three", "a", rid="cut"))
    await attempt(side.submit_batch(["p q"], "a", n=2, rid="g"))
    for rid in ("done", "g-warmup-0"):
        try:
            side.on_finish(rid)
        except Exception as err:
            errors.append(err)
    for rid in ("cut", "g"):
        try:
            side.abort(rid)
        except Exception as err:
            errors.append(err)
    for rid in list(side.live):  # recovery: whatever is left is aborted
        try:
            side.abort(rid, "recovery")
        except Exception as err:
            errors.append(err)
    await side.drain()
    errors += [x.error for x in side.ledger.errors]
    return errors, reg, sink, side


TOKENIZER_SITES = [s for s in call_sites() if s.resource in (
    "lora_registry", "tokenizer", "scheduler", "sink")]


@pytest.mark.parametrize("site", [None, *TOKENIZER_SITES],
                         ids=lambda s: "none" if s is None else f"{s.resource}.{s.method}")
def test_a_fault_at_each_tokenizer_call_site_ends_clean(site):
    plan = FaultPlan()
    if site is not None:
        plan.arm(site)
    with sanitizer_for(site):
        errors, reg, sink, side = asyncio.run(tokenizer_run(plan))
    if site is None:
        assert not errors
    elif not plan.fired:
        pytest.skip(f"{site.resource}.{site.method} is not called by this scenario")
    else:
        assert_reported(site, errors, sink)
    plan.strict = False
    assert not side.live
    side.ledger.assert_empty()
    if site is not None and site.method in ("release", "release_nowait"):
        # The registry refused one release: that reference is the one the error names.
        assert sum(reg.counts().values()) == 1
        for i, c in reg.counts().items():
            if c:
                reg.release_nowait([i] * c)
    reg.assert_full()
    assert {"done", "cut"} <= {str(r) for r in assert_one_output_each(sink, None, plan)}


# -- the registry itself -----------------------------------------------------------------------


def test_the_registry_lists_every_kind_and_refuses_an_unknown_one():
    assert {s.kind for s in call_sites()} == set(KINDS)
    with pytest.raises(ValueError, match="call-site kind 'telepathy' is not one of"):
        register_call_site("telepathy", "mind", "read", "nowhere")


def test_a_call_no_registered_site_names_fails_at_once():
    from terminus.effects.callsites import UnregisteredCallSite

    plan = FaultPlan()
    kv = proxy(DisaggPools.make().kv, "kv", plan)
    idx = kv.alloc(2)
    with pytest.raises(UnregisteredCallSite, match=r"kv\.backup_state left the engine"):
        kv.backup_state()
    kv.free(idx)


def test_a_users_own_call_site_is_registered_and_faulted():
    site = register_call_site("stream", "metrics", "emit", "my driver's step")
    assert site in call_sites("stream")
    seen: list[int] = []
    plan = FaultPlan()
    metrics = proxy(type("Metrics", (), {"emit": lambda self, x: seen.append(x)})(),
                    "metrics", plan)
    callback = faulty(seen.append, "callback", FaultPlan(strict=False))
    plan.arm(site)
    with pytest.raises(InjectedFault, match=r"injected fault at metrics\.emit"):
        metrics.emit(1)
    metrics.emit(2)
    callback(3)
    assert seen == [2, 3] and plan.calls[("metrics", "emit")] == 2


def test_a_fault_at_an_async_lora_release_is_reported_and_holds_only_that_reference():
    async def run():
        reg = LoRARegistry()
        await reg.register("a")
        plan = FaultPlan()
        sink = OutputLog()
        side = TokenizerSide(proxy(reg, "lora_registry", plan), FakeTokenizer(),
                             FakeScheduler(), sink, async_release=True)
        site = next(s for s in call_sites() if (s.resource, s.method)
                    == ("lora_registry", "release"))
        plan.arm(site)
        with sanitizing(False):
            await side.submit("x y", "a", rid="x")
            await side.submit("z", "a", rid="y")
            with pytest.raises(ReleaseFailed) as info:
                side.on_finish("x")  # the release step raised; the output still went
            assert "lora_registry.release" in str(injected([info.value])[0])
            side.abort("y")
            await side.drain()
        assert plan.fired == [site] and plan.calls[("lora_registry", "release")] == 2
        assert sum(reg.counts().values()) == 1  # exactly the refused one
        plan.strict = False
        for fn, args in plan.fired_calls:
            await fn(*args)
        reg.assert_full()
        side.ledger.assert_empty()
        assert dict(sink.counts) == {"x": 1, "y": 1}

    asyncio.run(run())


# -- prefetch site (one rank; its collectives through a proxy) ---------------------------------


class OneRank:
    """The collectives of a one-rank group: what RankCollectives offers `drive`."""

    names = ("tp",)

    def reduce_max(self, group: int, value: int, what: str) -> int:
        return value

    def barrier(self, group: int, what: str, ticket: Any = None) -> None:
        return None


def prefetch_run(plan: FaultPlan) -> tuple[list[BaseException], Any, dict[Any, Any], Any]:
    from terminus.effects.prefetch import PrefetchAbortError, PrefetchSite
    from terminus.kernels import HostPagePool

    real = HostPagePool(32)
    cache: dict[Any, Any] = {}
    site = PrefetchSite(proxy(real, "host", plan, returns={"prefetch": "host_prefetch"}),
                        insert=faulty(cache.__setitem__, "insert", plan))
    coll = proxy(OneRank(), "collectives", plan)
    errors: list[BaseException] = []
    attempt = attempter(errors)

    anchor = real.alloc(2)  # cached pages the prefetches extend (the cache owns them)
    for rid in ("done", "cut", "queued"):
        attempt(site.queue, rid, anchor)
    for rid in ("done", "cut"):
        attempt(site.start, rid, 4)
        attempt(site.transfer, rid, 2 if rid == "cut" else 4)
    attempt(site.complete, "done")
    for rid in ("cut", "queued"):
        out = attempt(site.abort, rid, coll)
        if out is None and isinstance(errors[-1], PrefetchAbortError):
            attempt(site.close_group, rid)  # the documented recovery
    for rid, inst in site.requests.items():  # recovery: whatever is left is aborted
        if not inst.terminal:
            attempt(site.abort, rid, coll)
            if not site.requests[rid].terminal:
                attempt(site.close_group, rid)
    errors += [x.error for x in site.ledger.errors]
    cache["anchor"] = anchor
    return errors, real, cache, site


PREFETCH_SITES = [s for s in call_sites() if s.resource in ("collectives", "insert", "host",
                                                             "host_prefetch")]


@pytest.mark.parametrize("site", [None, *PREFETCH_SITES], ids=lambda s: (
    "none" if s is None else f"{s.resource}.{s.method}"))
def test_a_fault_at_each_prefetch_call_site_ends_clean(site):
    plan = FaultPlan()
    if site is not None:
        plan.arm(site)
    with sanitizer_for(site):
        errors, real, cache, ps = prefetch_run(plan)
    if site is None:
        assert not errors
    elif not plan.fired:
        pytest.skip(f"{site.resource}.{site.method} is not called by this scenario")
    else:
        faults = injected(errors)
        assert faults and f"{site.resource}.{site.method}" in str(faults[0]), errors
        refused_release(site, plan)
    plan.strict = False
    assert all(i.terminal for i in ps.requests.values()), {
        k: i.state for k, i in ps.requests.items()}
    ps.assert_released()
    for pages in cache.values():  # the host cache evicts what it holds
        real.free(pages)
    real.assert_full()


# -- running batch -----------------------------------------------------------------------------


def batch_run(plan: FaultPlan) -> tuple[list[BaseException], Any, list[Any]]:
    from terminus.effects.sequence import RunningBatch, SchedulerPools
    from terminus.states.sequence import ChunkLaunched, Finish, LastChunkDone
    from terminus.states.sequence import SequenceAbort as SeqAbort

    pools = SchedulerPools(rows=4, max_context_len=32, kv_tokens=64, mamba_slots=4,
                           strict=True)
    real = (pools.table, pools.kv, pools.mamba)
    pools.table = proxy(pools.table, "table", plan)
    pools.kv = proxy(pools.kv, "kv", plan)
    pools.mamba = proxy(pools.mamba, "mamba", plan)
    retired: list[Any] = []
    rb = RunningBatch(pools, faulty(lambda rows, st: retired.extend(
        (int(r), st) for r in rows), "on_retired", plan))
    errors: list[BaseException] = []
    attempt = attempter(errors)

    rows = attempt(rb.admit, 2, True)
    if rows is not None:
        attempt(rb.append_kv, rows, torch.tensor([3, 2]))
        attempt(rb.fire, rows, ChunkLaunched)
        attempt(rb.fire, rows, LastChunkDone)
        attempt(rb.fire, rows[:1], Finish)
        attempt(rb.fire, rows[1:], SeqAbort)
    live = rb.rows_in("prefill", "prefill_1", "prefill_2", "decoding")
    if live.numel():
        attempt(rb.fire, live, SeqAbort)
    pools.table, pools.kv, pools.mamba = real
    return errors, pools, retired


BATCH_SITES = [s for s in call_sites() if s.resource in ("table", "kv", "mamba",
                                                          "on_retired")]


@pytest.mark.parametrize("site", [None, *BATCH_SITES],
                         ids=lambda s: "none" if s is None else f"{s.resource}.{s.method}")
def test_a_fault_at_each_running_batch_call_site_ends_clean(site):
    plan = FaultPlan()
    if site is not None:
        plan.arm(site)
    with sanitizer_for(site):
        errors, pools, retired = batch_run(plan)
    if site is None:
        assert not errors and len(retired) == 2
    elif not plan.fired:
        pytest.skip(f"{site.resource}.{site.method} is not called by this scenario")
    else:
        faults = injected(errors)
        assert faults and f"{site.resource}.{site.method}" in str(faults[0]), errors
        if site.method in RELEASES and site.resource in ("kv", "mamba"):
            # release_batch leaves what a refused pool free covered where its owner
            # finds it: the rows keep their slots (and, for a refused KV free, their
            # lengths). Releasing those rows again returns exactly what is left.
            held = torch.tensor(pools.table.held(limit=pools.table.capacity),
                                dtype=torch.int64)
            assert held.numel() > 0
            release_batch(held, pools.table, pools.kv, pools.mamba)
        else:
            refused_release(site, plan)
    pools.assert_full()


# -- adapter manager ---------------------------------------------------------------------------


@pytest.mark.parametrize("site", [s for s in call_sites() if s.resource == "adapter_registry"],
                         ids=lambda s: f"{s.resource}.{s.method}")
def test_a_fault_at_each_adapter_registry_call_ends_in_a_declared_state(site):
    from terminus.effects.lora_adapter import AdapterManager

    async def run():
        reg = LoRARegistry()
        plan = FaultPlan()
        mgr = AdapterManager(proxy(reg, "adapter_registry", plan))
        plan.arm(site)
        errors = []
        for step in (lambda: mgr.load("a"), lambda: mgr.upsert("a", "/v2"),
                     lambda: mgr.unload("a", timeout=1.0)):
            try:
                await step()
            except InjectedFault as e:
                errors.append(e)
            except ValueError as e:  # a step after the fault is refused, naming why
                errors.append(e)
        assert plan.fired == [site]
        assert f"{site.resource}.{site.method}" in str(errors[0])
        state = mgr.state("a")
        if state == "unloading":  # the documented recovery: wait again
            await mgr.wait_unloaded("a", timeout=1.0)
        elif state == "ready":
            await mgr.unload("a", timeout=1.0)
        assert mgr.state("a") in ("unloaded", "load_failed")
        plan.strict = False
        reg.assert_full()
        assert reg.counts() == {}

    asyncio.run(run())


def test_the_scenarios_reach_every_registered_call_site():
    """The fixture covers the registry: each built-in site is called by some scenario
    above (so each is faulted by its parametrized test)."""
    from terminus.effects.callsites import CALL_SITES

    plan = FaultPlan()
    disagg_run(plan)
    asyncio.run(tokenizer_run(plan))
    prefetch_run(plan)
    batch_run(plan)

    async def more():
        from terminus.effects.lora_adapter import AdapterManager

        reg = LoRARegistry()
        mgr = AdapterManager(proxy(reg, "adapter_registry", plan))
        await mgr.load("a")
        await mgr.upsert("a", "/v2")
        side = TokenizerSide(proxy(reg, "lora_registry", plan), FakeTokenizer(),
                             FakeScheduler(), OutputLog(), async_release=True)
        await side.submit("x", "a", rid="x")
        side.on_finish("x")
        await side.drain()
        await mgr.unload("a", timeout=1.0)

    asyncio.run(more())
    # host.free runs only when the host cache refuses the pages: under that fault.
    refused = FaultPlan()
    refused.arm(next(s for s in call_sites() if s.resource == "insert"))
    prefetch_run(refused)
    called = {k for k, n in (plan.calls + refused.calls).items() if n}
    assert {(s.resource, s.method) for s in CALL_SITES} - called == set()


def test_the_readme_call_site_example_runs():
    from pathlib import Path

    text = (Path(__file__).parent.parent / "README.md").read_text()
    start = text.index("from terminus.effects.callsites import FaultPlan")
    exec(compile(text[start:text.index("```", start)], "README.md", "exec"), {})
