"""`FaultPlan(count=False)`: proxies that only inject faults (the simulator's), next to
the counting plans the fault tests use (effects.callsites)."""

from __future__ import annotations

from collections import Counter

import pytest

from terminus.effects.callsites import (
    FaultPlan,
    InjectedFault,
    UnregisteredCallSite,
    call_sites,
    proxy,
)
from terminus.effects.disagg import DisaggPools, DisaggPrefill
from terminus.effects.sim.transport import FakeTransport

_ALLOC = next(s for s in call_sites() if (s.resource, s.method) == ("kv", "alloc"))


def _site(resource: str, method: str):
    return next(s for s in call_sites() if (s.resource, s.method) == (resource, method))


def test_a_plan_that_counts_nothing_calls_the_resource_directly_until_a_site_is_armed():
    plan = FaultPlan(count=False)
    real = DisaggPools.make(kv_tokens=64).kv
    kv = proxy(real, "kv", plan)
    idx = kv.alloc(4)
    assert kv.alloc == real.alloc and "alloc" in vars(kv)  # the pool's own method, kept
    plan.arm(_ALLOC, times=2)
    assert "alloc" not in vars(kv)  # read again: the recording call while armed
    for _ in range(2):
        with pytest.raises(InjectedFault, match=r"injected fault at kv\.alloc"):
            kv.alloc(4)
    assert real.available_size() == 60  # the refused calls took nothing
    more = kv.alloc(4)  # its faults fired: the pool's own method again
    assert kv.alloc == real.alloc
    assert plan.fired == [_ALLOC, _ALLOC] and plan.calls == Counter()
    kv.free(idx)
    kv.free(more)
    real.assert_full()


def test_a_plan_that_counts_nothing_still_refuses_an_unregistered_call():
    plan = FaultPlan(count=False)
    real = DisaggPools.make().kv
    kv = proxy(real, "kv", plan)
    with pytest.raises(UnregisteredCallSite, match=r"kv\.backup_state left the engine"):
        kv.backup_state()
    host = proxy(DisaggPools.make().host, "host", plan, returns={"prefetch": "host_prefetch"})
    pf = host.prefetch(2)  # a result proxied under its own resource name
    plan.arm(_site("host_prefetch", "terminate"))
    with pytest.raises(InjectedFault, match=r"host_prefetch\.terminate"):
        pf.terminate()
    pf.terminate()
    pf.release()
    host.__wrapped__.assert_full()
    real.assert_full()
    assert plan.calls == Counter()


def test_a_counting_plan_counts_into_the_counter_it_holds_now():
    plan = FaultPlan()
    real = DisaggPools.make(kv_tokens=64).kv
    kv = proxy(real, "kv", plan)
    a = kv.alloc(2)
    plan.calls = Counter()  # a fresh count (the wrapper made above is still used)
    b = kv.alloc(2)
    assert plan.calls == Counter({("kv", "alloc"): 1})
    plan.arm(_ALLOC)
    with pytest.raises(InjectedFault):
        kv.alloc(2)
    kv.free(a)
    kv.free(b)
    assert plan.calls == Counter({("kv", "alloc"): 2, ("kv", "free"): 2})
    real.assert_full()


@pytest.mark.parametrize("count", [True, False])
def test_a_driver_over_either_plan_takes_the_same_path_and_ends_clean(count):
    """The disagg driver over a counting plan and over one that counts nothing: the
    same armed fault fires at the same call, and the run ends with every pool full."""
    plan = FaultPlan(strict=False, count=count)
    real = DisaggPools.make(kv_tokens=64, requests=4, mamba_slots=4, metadata_slots=4,
                            host_pages=8, max_context_len=32)
    pools = DisaggPools(kv=proxy(real.kv, "kv", plan), mamba=real.mamba,
                        metadata=real.metadata, host=real.host, table=real.table)
    t = FakeTransport(auto_complete=True)
    e = DisaggPrefill(pools, transport=t)
    e.add("a", 8, chunk_size=4, tokens=tuple(range(8)))
    e.bootstrap("a")
    assert e.schedule("a") is not None
    plan.arm(_ALLOC)
    with pytest.raises(InjectedFault):
        e.schedule("a")
    assert len(e.req("a").chunks) == 1  # the refused call changed nothing
    assert e.schedule("a") is not None
    e.result("a", 0)
    e.result("a", 1)
    e.poll_transfer("a")
    assert e.req("a").state == "succeeded" and plan.fired == [_ALLOC]
    assert (plan.calls[("kv", "alloc")] == 3) is count
    e.finish()
    real.assert_full()
    e.ledger.assert_empty()


@pytest.mark.parametrize("count", [True, False])
def test_a_method_kept_from_before_arm_faults_only_on_a_counting_plan(count):
    # Documented: under count=False a caller reads the method through the proxy at each
    # call; a reference kept from before `arm` is the pool's own and does not fault.
    plan = FaultPlan(count=count)
    real = DisaggPools.make(kv_tokens=64).kv
    kv = proxy(real, "kv", plan)
    kept = kv.alloc
    plan.arm(_ALLOC)
    got = []
    if count:
        with pytest.raises(InjectedFault):
            kept(4)
    else:
        got.append(kept(4))  # not faulted: the fault waits for a call through the proxy
        with pytest.raises(InjectedFault):
            kv.alloc(4)
    assert len(plan.fired) == 1
    for idx in got:
        real.free(idx)
    real.assert_full()
