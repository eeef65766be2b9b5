"""The registry-side adapter lifecycle: an unload completes as soon as the last user
releases, times out with the id and count when one never does, and an upsert keeps the
stable id while requests hold it."""

from __future__ import annotations

import asyncio

import pytest

from terminus.effects.lora_adapter import AdapterManager
from terminus.effects.tokenizer import TokenizerSide
from terminus.fsm import TransitionNotAllowed
from terminus.kernels.errors import UnloadTimeout
from terminus.kernels.lora import LoRARegistry
from terminus.states.lora_adapter import Upserted
from tests.tokenizer_side import FakeScheduler, FakeTokenizer, RecordingSink, settle


async def rig():
    registry = LoRARegistry()
    manager = AdapterManager(registry)
    side = TokenizerSide(registry, FakeTokenizer(), FakeScheduler(), RecordingSink())
    return registry, manager, side


def test_unload_waits_for_the_last_user_and_completes_when_it_releases():
    async def main():
        registry, manager, side = await rig()
        a = await manager.load("a", "/w/a")
        assert manager.state("a") == "ready"
        await side.submit("one", "a", rid="r1")
        await side.submit("two", "a", rid="r2")
        unload = asyncio.create_task(manager.unload("a", timeout=5))
        await settle()
        assert manager.state("a") == "unloading" and not unload.done()
        late = await side.submit("three", "a", rid="r3")  # no new acquires while unloading
        assert late.state == "rejected"
        side.on_finish("r1")
        await settle()
        assert not unload.done() and manager.count("a") == 1
        side.abort("r2")
        assert await asyncio.wait_for(unload, 1) == a
        assert manager.state("a") == "unloaded"
        side.ledger.assert_empty()
        registry.assert_full()
        assert registry.counts() == {}

    asyncio.run(main())


def test_unload_times_out_with_the_id_and_count_and_can_be_waited_again():
    async def main():
        registry, manager, side = await rig()
        a = await manager.load("a")
        await side.submit("one", "a", rid="r1")
        with pytest.raises(UnloadTimeout, match=rf"LoRA id {a} \('a'\) timed out .* count 1"):
            await manager.unload("a", timeout=0.05)
        assert manager.state("a") == "unloading"
        assert manager.machine.stats.plans_run == {}
        side.on_finish("r1")
        assert await manager.wait_unloaded("a", timeout=1) == a
        assert manager.state("a") == "unloaded"
        side.ledger.assert_empty()
        registry.assert_full()

    asyncio.run(main())


def test_upsert_while_held_keeps_the_id_and_the_holders_release_against_it():
    async def main():
        registry, manager, side = await rig()
        a = await manager.load("a", "/w/a-v1")
        await side.submit("one", "a", rid="r1")
        assert await manager.upsert("a", "/w/a-v2") == a
        await side.submit("two", "a", rid="r2")
        assert manager.count("a") == 2
        side.on_finish("r1")
        side.on_finish("r2")
        assert await manager.unload("a", timeout=1) == a
        side.ledger.assert_empty()
        registry.assert_full()

    asyncio.run(main())


def test_misuse_is_refused_with_what_to_do():
    async def main():
        registry, manager, _ = await rig()
        with pytest.raises(ValueError, match="'a' is not ready \\(never loaded\\)"):
            await manager.upsert("a")
        with pytest.raises(ValueError, match="cannot be unloaded: it is unknown here"):
            await manager.unload("a")
        with pytest.raises(KeyError, match="no adapter 'zz' was loaded here"):
            manager.state("zz")
        await manager.load("a")
        with pytest.raises(ValueError, match="upsert\\(\\) it"):
            await manager.load("a")
        await manager.unload("a", timeout=1)
        with pytest.raises(TransitionNotAllowed, match="'Upserted' is not allowed"):
            manager.adapters["a"].fire(Upserted())
        assert await manager.load("a") != 0  # a name is reusable once unloaded
        assert manager.state("a") == "ready"
        await manager.unload("a", timeout=1)
        registry.assert_full()

    asyncio.run(main())


def test_a_failed_load_ends_in_load_failed_and_holds_nothing():
    async def main():
        registry = LoRARegistry(capacity=1)
        manager = AdapterManager(registry)
        await manager.load("a")
        with pytest.raises(Exception, match="registry is full"):
            await manager.load("b")
        assert manager.state("b") == "load_failed"
        await manager.unload("a", timeout=1)
        registry.assert_full()

    asyncio.run(main())
