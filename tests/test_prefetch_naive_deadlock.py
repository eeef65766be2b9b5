"""The bug the collective abort exists for: deciding on local state alone deadlocks.

The naive abort (the pre-fix logic) lets a rank without active I/O return before the
barrier while its peer with active I/O enters it. On a real gloo group the active
rank's bounded barrier times out instead of hanging; its abort is left `stalled`,
holding the completed pages, the anchor lock and the occupancy; once the late peer
arrives, a retry waits on the same barrier and releases. The simulated ranks show the
same thing deterministically.
"""

from __future__ import annotations

import datetime
import queue
import socket
import time
import traceback
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from terminus.effects.prefetch import (
    AbortOutcome,
    PrefetchAbortTimeout,
    PrefetchSite,
)
from terminus.effects.sim.ranks import SimulatedRanks
from terminus.kernels.collective import RankCollectives, grid_partitions
from terminus.kernels.host import HostPagePool
from terminus.states.prefetch import Local

PAGES, DONE, ANCHOR = 5, 3, 2
TIMEOUT_S = 1.0


def _prepare(site: PrefetchSite, local: Local) -> Any:
    anchor = site.host.alloc(ANCHOR)
    site.queue("rid", anchor)
    if local == Local.ACTIVE:
        site.start("rid", PAGES)
        site.transfer("rid", DONE)
    return anchor


def test_naive_abort_on_simulated_ranks_stalls_the_active_rank() -> None:
    sites = [PrefetchSite(HostPagePool(16), rank=r) for r in range(2)]
    anchors = [_prepare(sites[0], Local.ACTIVE), _prepare(sites[1], Local.PENDING)]
    sim = SimulatedRanks(sites, grid_partitions(2, 2))
    out = sim.abort("rid", naive=True)
    assert isinstance(out[1], AbortOutcome) and not out[1].barrier  # returned early
    assert isinstance(out[0], PrefetchAbortTimeout) and out[0].state == "stalled"
    assert sim.barriers == [[1], [0]]  # the collective contract is broken
    assert sites[0].host.locked_pages() == ANCHOR and sites[0].occupancy_tokens == PAGES
    # The fixed protocol on the same classes: both ranks enter, nothing stalls.
    sites[0].close_group("rid")
    for s, a in zip(sites, anchors, strict=True):
        s.host.free(a)
    fixed = [PrefetchSite(HostPagePool(16), rank=r) for r in range(2)]
    anchors = [_prepare(fixed[0], Local.ACTIVE), _prepare(fixed[1], Local.PENDING)]
    sim = SimulatedRanks(fixed, grid_partitions(2, 2))
    assert [o.barrier for o in sim.abort("rid") if isinstance(o, AbortOutcome)] == [True, True]
    for s, a in zip(sites + fixed, anchors + anchors, strict=True):
        s.assert_released()
        if s in fixed:
            s.host.free(a)
        s.host.assert_full()
        s.ledger.assert_empty()


def _naive_rank(rank: int, port: int, peer_may_join: Any, out: Any) -> None:
    """Rank 0 has active I/O, rank 1 a pending prefetch; both run the naive abort."""
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=60))
        coll = RankCollectives([("tp", dist.group.WORLD)], timeout=TIMEOUT_S)
        site = PrefetchSite(HostPagePool(16), rank=rank)
        anchor = _prepare(site, Local.ACTIVE if rank == 0 else Local.PENDING)
        report: dict[str, Any] = {}
        if rank == 0:
            t0 = time.monotonic()
            try:
                site.abort("rid", coll, naive=True)
            except PrefetchAbortTimeout as e:
                report["error"] = str(e)
                report["waited_s"] = time.monotonic() - t0
            report["stalled_state"] = site.requests["rid"].state
            report["kept"] = (site.host.locked_pages(), site.occupancy_tokens,
                              site.host.available)
            peer_may_join.set()
            report["retry"] = site.retry("rid", coll).state
        else:
            report["outcome"] = site.abort("rid", coll, naive=True).state
            # The late peer: arrives at the barrier rank 0 is still waiting on.
            assert peer_may_join.wait(30)
            coll.barrier(0, "late peer")
        site.assert_released()
        site.host.free(anchor)
        site.host.assert_full()
        site.ledger.assert_empty()
        report["barriers"] = coll.barriers
        out.put((rank, report, None))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, None, traceback.format_exc()))


@pytest.mark.slow
def test_naive_abort_on_gloo_times_out_instead_of_hanging_and_a_retry_releases() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ev = ctx.Event()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    procs = [ctx.Process(target=_naive_rank, args=(r, port, ev, out), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        for _ in range(2):
            rank, report, err = out.get(timeout=120)
            assert err is None, f"rank {rank}:\n{err}"
            got[rank] = report
    except queue.Empty:
        pytest.fail(f"ranks {sorted({0, 1} - set(got))} reported nothing: a hang")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    r0, r1 = got[0], got[1]
    assert r1["outcome"] == "released"  # the pending rank returned before the barrier
    assert "prefetch abort of request 'rid' on rank 0: barrier on attention group 'tp' " \
        "(ranks [0, 1]) timed out after 1s" in r0["error"]
    assert r0["waited_s"] >= TIMEOUT_S
    assert r0["stalled_state"] == "stalled"
    # Kept for the retry: the anchor lock, the occupancy, every reserved page (the
    # stopped I/O's unwritten tail too: nothing is freed before the barrier).
    assert r0["kept"] == (ANCHOR, PAGES, 16 - ANCHOR - PAGES)
    assert r0["retry"] == "released"
    assert r0["barriers"] == [1]  # the retry waited on the same barrier


def test_simulate_abort_shows_the_naive_logic_breaking_all_or_none_and_the_fix_keeping_it(
) -> None:
    from terminus.effects.sim.ranks import simulate_abort

    naive = simulate_abort([Local.ACTIVE, Local.MISSING, Local.PENDING, Local.MISSING],
                           tp=2, naive=True)
    assert naive.deadlocked and not naive.all_or_none
    assert naive.states[0] == "stalled" and naive.barrier == (True, False, False, False)
    assert "barrier on attention group 'tp' (ranks [0, 1])" in naive.errors[0]
    fixed = simulate_abort([Local.ACTIVE, Local.MISSING, Local.PENDING, Local.MISSING], tp=2)
    assert not fixed.deadlocked and fixed.all_or_none and fixed.released_after_barrier
    assert fixed.states == ("released",) * 4 and fixed.barriers == (2,) * 4
    assert fixed.reduces == (2,) * 4
