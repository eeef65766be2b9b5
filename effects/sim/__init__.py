"""The reference simulator: every machine of `terminus.states` driven on a workload.

Nothing of the library imports this package; only the `terminus simulate` and
`terminus bench e2e` entry points reach it.

- `workload`: the seeded workload (plain data: what arrives when, what goes wrong);
- `serving`: the serving loop (`ServingLoop`) and the parts it drives through the
  declared machines (`machine_parts`);
- `naive`: the seeds' pre-fix logic, the same parts without the machines (`naive_parts`);
- `scenarios`: the disaggregated-prefill seed's production case;
- `transport`: `FakeTransport`, an in-memory KV sender that fails on cue;
- `ranks`: `SimulatedRanks`, the prefetch abort protocol on N ranks in one process;
- `simulate`: the `terminus simulate` command; `bench`: `terminus bench e2e`.
"""
