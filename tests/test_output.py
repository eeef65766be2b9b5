"""One terminal output type and one sink for both driver families: the tokenizer side and
the disaggregated-prefill server stream the same `TerminalOutput` into the same
`OutputSink`, exactly once per request id, and a closed client stream skips no release.
Every test ends with every pool full, the ledgers empty and LoRA counters at zero."""

from __future__ import annotations

import asyncio

from terminus.effects import disagg, request
from terminus.effects.disagg import DisaggPools, DisaggPrefill
from terminus.effects.output import OutputLog, OutputSink, TerminalOutput
from terminus.effects.sim.transport import FakeTransport
from terminus.effects.tokenizer import TokenizerSide
from terminus.kernels.lora import LoRARegistry
from tests.tokenizer_side import FakeScheduler, FakeTokenizer


def test_the_request_side_and_the_disagg_side_share_one_output_type_and_sink():
    assert request.TerminalOutput is TerminalOutput and request.OutputSink is OutputSink
    assert disagg.TerminalOutput is TerminalOutput and not hasattr(disagg, "TerminalStream")
    assert isinstance(OutputLog(), OutputSink)

    async def main() -> None:
        sink = OutputLog()
        registry = LoRARegistry()
        lora = await registry.register("a", "/weights/a")
        side = TokenizerSide(registry, FakeTokenizer(), FakeScheduler(), sink)
        pools = DisaggPools.make()
        engine = DisaggPrefill(pools, transport=FakeTransport(), sink=sink)

        await side.submit("hello world", "a", rid="r1")
        assert registry.count(lora) == 1
        side.on_finish("r1", reason="length")
        await side.submit("bye", None, rid="r2")
        side.abort("r2")
        engine.add("p1", 8, chunk_size=4)
        engine.bootstrap("p1")
        engine.abort("p1", "client gone")
        engine.add("p2", 4, chunk_size=4)
        engine.bootstrap_failed("p2", "peer unreachable")

        assert sink.outputs == [
            TerminalOutput("r1", "finished", 200, "", "length"),
            TerminalOutput("r2", "aborted", 499, "aborted by client"),
            TerminalOutput("p1", "aborted", message="client gone"),
            TerminalOutput("p2", "bootstrap_failed", message="peer unreachable"),
        ]
        assert dict(sink.counts) == {"r1": 1, "r2": 1, "p1": 1, "p2": 1}
        # Events after the end reach the machines and stream nothing more.
        side.on_finish("r1")
        engine.abort("p1")
        assert sink.first() == {o.rid: o for o in sink.outputs} and len(sink.outputs) == 4

        await side.drain()
        side.ledger.assert_empty()
        registry.assert_full()
        engine.finish()
        await registry.unload("a", timeout=1.0)
        assert registry.counts() == {}

    asyncio.run(main())


def test_a_closed_client_stream_is_recorded_once_and_skips_no_release():
    sink = OutputLog()
    sink.failing.add("p1")
    pools = DisaggPools.make()
    engine = DisaggPrefill(pools, transport=FakeTransport(), sink=sink)
    engine.add("p1", 8, chunk_size=4, host_pages=2)
    engine.bootstrap("p1")
    assert engine.schedule("p1") is not None
    engine.result("p1", 0)  # chunk 0 commits: the request owns KV, Mamba, a row, a slot
    report = engine.abort("p1")
    assert report is not None and engine.req("p1").state == "aborted"
    # The stream step failed best-effort: recorded, and every local release still ran.
    assert [(e.step, e.best_effort, type(e.error)) for e in report.errors] == [
        ("stream_terminal", True, ConnectionError)]
    assert {h.kind for h in report.released} == {"kv", "mamba", "req_slot", "metadata",
                                                   "hicache"}
    assert sink.counts["p1"] == 1 and sink.outputs[0].outcome == "aborted"
    engine.finish()


def test_first_is_each_ids_first_output_with_or_without_repeats():
    # One output per id takes a C-level path; a repeated id (a bug the counts expose)
    # the general one: both give each id's first output, in order of first appearance.
    import random

    rng = random.Random(3)
    for _ in range(50):
        log = OutputLog()
        rids = [rng.randrange(12) for _ in range(rng.randint(0, 15))]
        if rng.random() < 0.5:
            rids = list(dict.fromkeys(rids))  # no repeats
        for k, rid in enumerate(rids):
            log.put(TerminalOutput(rid, "finished", 200, str(k)))
        want: dict = {}
        for o in log.outputs:
            want.setdefault(o.rid, o)
        got = log.first()
        assert got == want and list(got) == list(want)
