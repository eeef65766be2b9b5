"""The leak sanitizer (I9): after every driver call, each pool's in-use units equal what
the ledger says its owners hold, kind by kind. A unit taken outside the ledger, or freed
while a handle owns it, fails at the next driver call, naming the units and the call."""

from __future__ import annotations

import asyncio

import pytest
import torch

from terminus.effects import sanitize
from terminus.effects.disagg import DisaggPools, DisaggPrefill
from terminus.effects.lora_adapter import AdapterManager
from terminus.effects.prefetch import PrefetchSite
from terminus.effects.sanitize import LeakSanitizerError, sanitizing
from terminus.effects.sequence import RunningBatch, SchedulerPools
from terminus.effects.sim.transport import FakeTransport
from terminus.kernels import HostPagePool, LoRARegistry
from terminus.states.sequence import SequenceAbort as SeqAbort
from tests.tokenizer_side import make_side

pytest_plugins = ["pytester"]


def disagg(strict: bool = True) -> DisaggPrefill:
    return DisaggPrefill(DisaggPools.make(strict=strict), transport=FakeTransport())


def test_the_suite_runs_with_the_sanitizer_on():
    # pyproject.toml: terminus_sanitize = true (the pytest plugin's ini switch).
    assert sanitize.enabled()


def test_it_is_off_by_default(monkeypatch):
    monkeypatch.delenv(sanitize.ENV, raising=False)
    assert not sanitize.refresh()  # the variable is read once per process: read it again
    assert not sanitize.enabled()
    e = disagg()
    stray = e.pools.kv.alloc(3)  # not recorded: with the sanitizer off nobody notices
    e.add("r", 8, chunk_size=4)
    e.abort("r")
    e.pools.kv.free(stray)
    e.finish()


def test_a_unit_taken_outside_the_ledger_fails_at_the_next_driver_call():
    e = disagg()
    e.add("r", 8, chunk_size=4)
    stray = e.pools.kv.alloc(3)
    with pytest.raises(LeakSanitizerError) as info:
        e.bootstrap("r")
    msg = str(info.value)
    assert "DisaggPrefill.bootstrap" in msg and "test_sanitize.py" in msg
    assert "kv: the ledger's owners hold 0, the pool has 3 in use" in msg
    assert str(stray.tolist()).strip("[]") in msg  # the stray units, by index
    assert info.value.findings[0].kind == "kv"
    e.pools.kv.free(stray)
    e.abort("r")
    e.finish()


def test_a_unit_freed_while_its_handle_owns_it_is_named():
    e = disagg(strict=False)
    e.add("r", 8, chunk_size=4)
    e.bootstrap("r")
    chunk = e.schedule("r")
    owned = e.ledger.owned(chunk, "kv")[0].value
    e.pools.kv.free(owned[:2])  # a bug elsewhere: the pool takes them back
    with pytest.raises(LeakSanitizerError) as info:
        e.result("r", 0)
    msg = str(info.value)
    assert "freed while owned" in msg and str(owned[:2].tolist()).strip("[]") in msg
    again = e.pools.kv.alloc(2)  # take them back out so the request's release balances
    assert sorted(again.tolist()) == sorted(owned[:2].tolist())
    with sanitizing(False):
        e.abort("r")
        e.result("r", 1) if len(e.req("r").chunks) > 1 else None
    e.finish()


def test_a_double_free_that_balances_a_leak_is_caught_by_the_pools_own_check():
    e = disagg(strict=False)
    e.add("r", 8, chunk_size=4)
    e.bootstrap("r")
    e.schedule("r")
    kv = e.pools.kv
    x = kv.alloc(1)
    kv.free(x)
    kv.free(x)  # a double free: the non-strict pool only records it ...
    leaked = kv.alloc(1)  # ... and a leak: the counts balance again
    with pytest.raises(LeakSanitizerError, match=r"kv: .*the pool's own check raised "
                                                 r"DoubleFree"):
        e.abort("r")
    with sanitizing(False):
        e.result("r", 0)
    assert leaked.numel() == 1
    kv.clear()  # the deliberate corruption is wiped; everything else came back
    e.finish()


def test_running_batch_rows_own_their_table_contents():
    pools = SchedulerPools(rows=4, max_context_len=16, kv_tokens=64, mamba_slots=4,
                           strict=True)
    rb = RunningBatch(pools)
    rows = rb.admit(2, mamba=True)
    assert rb.append_kv(rows, torch.tensor([3, 2]))
    stray = pools.mamba.alloc(1)
    with pytest.raises(LeakSanitizerError, match=r"RunningBatch.fire .*\n  mamba: the "
                                                 r"ledger's owners hold 0, the pool has 1 "
                                                 rf"in use; .* include \[{int(stray)}\]"):
        rb.fire(rows, SeqAbort)
    pools.mamba.free(stray)
    pools.assert_full()


def test_a_lora_reference_taken_outside_the_ledger_is_named_by_adapter_id():
    async def run():
        s = await make_side()
        await s.side.submit("hello", "a", rid="x")
        extra = await s.registry.acquire("a")  # behind the side's back
        with pytest.raises(LeakSanitizerError, match=f"adapter id {extra}: the registry "
                                                     "counts 1 references, the ledger's "
                                                     "handles hold 0"):
            s.side.abort("x")
        s.registry.release_nowait(extra)
        s.side.on_finish("x")
        await s.finish_clean()

    asyncio.run(run())


def test_the_audit_forgets_a_registry_once_its_sides_are_gone():
    """Sides over one registry are audited together through a table by registry; a
    process that makes a registry and a side per run (a benchmark, a test session)
    keeps an entry per live registry, not one per registry it ever made."""
    import gc

    async def run():
        s = await make_side()
        await s.finish_clean()

    gc.collect()
    before = len(sanitize._LORA_SIDES)
    for _ in range(20):
        asyncio.run(run())
        gc.collect()
    assert len(sanitize._LORA_SIDES) <= before + 1  # the last run's, until the next side


def test_prefetch_pages_reserved_outside_the_ledger_are_caught():
    cache = {}
    site = PrefetchSite(HostPagePool(16), insert=cache.__setitem__)
    site.queue("r")
    stray = site.host.prefetch(2)
    with pytest.raises(LeakSanitizerError, match="host_pages: the ledger's owners hold 3, "
                                                 "the pool has 5 in use; pages reserved "
                                                 "by prefetches the ledger does not own"):
        site.start("r", 3)
    with sanitizing(False):
        stray.terminate()
        stray.release()
    site.transfer("r", 3)
    site.complete("r")
    site.assert_released()
    site.host.free(cache.pop("r"))  # the host cache evicts what it took
    site.host.assert_full()


def test_an_adapter_unregistered_behind_the_managers_back_is_caught():
    async def run():
        reg = LoRARegistry()
        mgr = AdapterManager(reg)
        await mgr.load("a")
        await reg.unregister("a")
        with pytest.raises(LeakSanitizerError, match="'a' is ready with id 1"):
            await mgr.load("b")
        with sanitizing(False):  # 'a' stays wrong for good: nothing more to audit
            await mgr.unload("b")
        reg.assert_full()

    asyncio.run(run())


def test_the_pytest_switch_sets_the_environment_variable(pytester, monkeypatch):
    monkeypatch.delenv(sanitize.ENV, raising=False)
    pytester.makepyfile("""
        import os
        import pytest

        def test_on():
            assert os.environ.get("TERMINUS_SANITIZE") == "1"

        @pytest.mark.terminus_no_sanitize("shows the opt-out")
        def test_opted_out():
            assert os.environ.get("TERMINUS_SANITIZE") == "0"
    """)
    pytester.runpytest_subprocess("--terminus-sanitize").assert_outcomes(passed=2)
    pytester.makeini("[pytest]\nterminus_sanitize = true\n")
    pytester.runpytest_subprocess().assert_outcomes(passed=2)
    pytester.makeini("[pytest]\n")
    pytester.runpytest_subprocess().assert_outcomes(passed=1, failed=1)  # off by default


def test_the_variable_is_read_once_per_process_and_again_on_refresh(monkeypatch):
    assert sanitize.enabled()
    monkeypatch.setenv(sanitize.ENV, "0")
    assert sanitize.enabled()  # cached: no environment lookup per driver call
    assert not sanitize.refresh()
    assert not sanitize.enabled()
    monkeypatch.setenv(sanitize.ENV, "yes")
    assert sanitize.refresh() and sanitize.enabled()


def test_off_the_class_carries_the_plain_method_and_on_the_auditing_wrapper(monkeypatch):
    from terminus.effects.tokenizer import TokenizerSide

    plain = TokenizerSide.__dict__["on_finish"]
    assert plain.__wrapped__.__name__ == "on_finish"  # on: the wrapper is installed
    with sanitizing(False):
        off = TokenizerSide.__dict__["on_finish"]
        assert off is plain.__wrapped__ and not hasattr(off, "__wrapped__")
        with sanitizing(True):
            assert TokenizerSide.__dict__["on_finish"] is plain
        assert TokenizerSide.__dict__["on_finish"] is off
    assert TokenizerSide.__dict__["on_finish"] is plain
    monkeypatch.setenv(sanitize.ENV, "0")
    sanitize.refresh()
    assert TokenizerSide.__dict__["on_finish"] is off


def test_a_refused_call_is_audited_whichever_way_the_switch_was_turned_on(monkeypatch):
    # Off by the variable, on again by refresh: the wrapper is back and catches a leak.
    monkeypatch.setenv(sanitize.ENV, "0")
    sanitize.refresh()
    e = disagg()
    stray = e.pools.kv.alloc(3)
    e.add("r", 8, chunk_size=4)  # not audited
    monkeypatch.setenv(sanitize.ENV, "1")
    sanitize.refresh()
    with pytest.raises(LeakSanitizerError, match=r"DisaggPrefill\.abort"):
        e.abort("r")
    e.pools.kv.free(stray)
    with sanitizing(False):
        e.finish()
    e.pools.assert_full()
