"""LoRA registry: stable ids, atomic acquire, underflow, unload waiting and timing out."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from terminus.kernels import (
    LeakError,
    LoRARegistry,
    RegistryFull,
    ReleaseUnderflow,
    UnknownAdapter,
    UnloadTimeout,
    protocols,
)


def run(coro):
    return asyncio.run(coro)


def test_register_gives_stable_distinct_ids_and_acquire_counts():
    async def main():
        r = LoRARegistry()
        a, b = await r.register("a"), await r.register("b", "/w/b")
        assert a != b
        assert await r.acquire("a") == a
        assert await r.acquire(["a", "b", "a"]) == [a, b, a]
        assert r.counts() == {a: 3, b: 1}
        await r.release([a, b, a])
        await r.release(a)
        assert r.counts() == {a: 0, b: 0}
        r.assert_full()

    run(main())


def test_register_twice_points_to_upsert():
    async def main():
        r = LoRARegistry()
        a = await r.register("a")
        with pytest.raises(ValueError, match=r"already registered \(id 1\); use upsert\(\)"):
            await r.register("a")
        assert r.available == r.capacity - 1  # the refused register added nothing
        assert r.counts() == {a: 0}
        r.assert_full()

    run(main())


def test_upsert_keeps_the_stable_id_and_in_flight_counts():
    async def main():
        r = LoRARegistry()
        a = await r.upsert("a", "/v1")
        await r.acquire("a")
        assert await r.upsert("a", "/v2") == a
        assert r.count(a) == 1
        await r.release(a)  # released against the same id across the upsert
        r.assert_full()

    run(main())


def test_acquire_of_an_unknown_name_acquires_nothing():
    async def main():
        r = LoRARegistry()
        a = await r.register("a")
        with pytest.raises(UnknownAdapter, match=r"unknown LoRA adapter\(s\) \['zz'\]"):
            await r.acquire(["a", "zz"])
        assert r.count(a) == 0
        with pytest.raises(KeyError):
            await r.acquire("zz")
        assert r.counts() == {a: 0}
        r.assert_full()

    run(main())


def test_release_below_zero_raises_at_that_release_and_releases_nothing():
    async def main():
        r = LoRARegistry()
        a, b = await r.register("a"), await r.register("b")
        await r.acquire(["a", "b"])
        with pytest.raises(ReleaseUnderflow, match=rf"release of LoRA id {a} x2 would drive"):
            await r.release([b, a, a])
        assert r.counts() == {a: 1, b: 1}
        r.release_nowait([a, b])
        with pytest.raises(ReleaseUnderflow, match="count is 0"):
            r.release_nowait(a)
        assert r.counts() == {a: 0, b: 0}  # the refused release left no -1 behind
        await r.unload("a", timeout=1)
        await r.unload("b", timeout=1)
        assert r.counts() == {}
        r.assert_full()

    run(main())


def test_unload_waits_until_the_counter_is_exactly_zero():
    async def main():
        r = LoRARegistry()
        a = await r.register("a")
        await r.acquire(["a", "a"])
        unload = asyncio.create_task(r.unload("a", timeout=5))
        await asyncio.sleep(0)
        with pytest.raises(UnknownAdapter):
            await r.acquire("a")  # unregistered at once: no new references
        await r.release(a)
        await asyncio.sleep(0)
        assert not unload.done()
        await r.release(a)
        assert await unload == a
        assert r.counts() == {}
        r.assert_full()

    run(main())


def test_unload_timeout_names_the_id_and_its_count():
    async def main():
        r = LoRARegistry()
        a = await r.register("a")
        await r.acquire("a")
        with pytest.raises(
            UnloadTimeout,
            match=rf"unload of LoRA id {a} \('a'\) timed out after 0.01s with count 1",
        ):
            await r.unload("a", timeout=0.01)
        r.release_nowait(a)
        await r.wait_for_unload(a, timeout=1)
        assert r.counts() == {}
        r.assert_full()

    run(main())


def test_unload_of_an_idle_adapter_returns_at_once():
    async def main():
        r = LoRARegistry()
        a = await r.register("a")
        assert await r.unload("a", timeout=0.01) == a
        assert r.available == r.capacity
        assert r.counts() == {}
        r.assert_full()

    run(main())


def test_release_of_an_id_never_registered_names_count_zero_and_releases_nothing():
    async def main():
        r = LoRARegistry()
        a = await r.register("a")
        await r.acquire("a")
        with pytest.raises(ReleaseUnderflow, match=r"release of LoRA id 99 x1 .*\(count is 0\)"):
            await r.release([a, 99])
        assert r.counts() == {a: 1}
        await r.release(a)
        r.assert_full()

    run(main())


def test_two_waiters_of_one_unload_both_return_at_the_last_release():
    async def main():
        r = LoRARegistry()
        a = await r.register("a")
        await r.acquire(["a", "a"])
        await r.unregister("a")
        waiters = [asyncio.create_task(r.wait_for_unload(a, timeout=5)) for _ in range(2)]
        await asyncio.sleep(0)
        r.release_nowait([a])
        await asyncio.sleep(0)
        assert not any(w.done() for w in waiters) and r.count(a) == 1
        r.release_nowait(a)
        await asyncio.gather(*waiters)
        assert r.counts() == {}
        r.assert_full()

    run(main())


def test_wait_for_unload_of_a_registered_id_says_unregister_first():
    async def main():
        r = LoRARegistry()
        a = await r.register("a")
        with pytest.raises(ValueError, match="still registered; unregister"):
            await r.wait_for_unload(a)
        assert r.id_of("a") == a and r.counts() == {a: 0}  # the refusal changed nothing
        r.assert_full()

    run(main())


def test_a_name_registered_again_after_unload_gets_a_new_id():
    async def main():
        r = LoRARegistry()
        a = await r.register("a")
        await r.unload("a")
        b = await r.register("a")
        assert b != a
        assert r.counts() == {b: 0}
        r.assert_full()

    run(main())


def test_registry_full_says_unload_one():
    async def main():
        r = LoRARegistry(capacity=1)
        a = await r.register("a")
        with pytest.raises(
            RegistryFull, match="full \\(1 adapters\\); unload one before registering 'b'"
        ):
            await r.register("b")
        assert r.available == 0 and r.counts() == {a: 0}  # the refusal changed nothing
        r.assert_full()

    run(main())


def test_assert_full_names_ids_with_references():
    async def main():
        r = LoRARegistry()
        a = await r.register("a")
        await r.acquire("a")
        with pytest.raises(LeakError, match=rf"1 references of ids still held, e.g. \[{a}\]"):
            r.assert_full()
        await r.release(a)
        r.assert_full()

    run(main())


def test_registry_satisfies_the_protocol():
    assert isinstance(LoRARegistry(), protocols.LoRARegistry)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=30))
def test_any_sequence_keeps_counts_equal_to_outstanding_references(ops):
    async def main():
        r = LoRARegistry()
        names = ["a", "b", "c"]
        ids = {n: await r.register(n) for n in names}
        held: list[int] = []
        for is_acquire, k in ops:
            if is_acquire:
                held += await r.acquire([names[i % 3] for i in range(k)])
            elif held:
                await r.release(held.pop(k % len(held)))
            for i in ids.values():
                assert r.count(i) == held.count(i)
        await r.release(held)
        r.assert_full()

    run(main())
