"""The prefetch abort across real processes: a gloo group on loopback, 2 and 4 ranks.

One process group per world size runs every combination of local classes (missing,
pending, active per rank: 9 for 2 ranks, 81 for 4 ranks over a 2x2 tp/cp grid); each
rank sends what it did back to the test through a queue, and the test checks the
collective contract across ranks. Each rank checks its own pools are full after every
combination.
"""

from __future__ import annotations

import datetime
import itertools
import os
import queue
import socket
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from terminus.effects.prefetch import PrefetchCollectiveFailed, PrefetchSite
from terminus.kernels.collective import RankCollectives, grid_partitions
from terminus.kernels.host import HostPagePool
from terminus.states.prefetch import Local

pytestmark = pytest.mark.slow

PAGES, DONE, ANCHOR = 5, 3, 2
RESULT_WAIT_S = 120  # generous: spawning a torch process costs seconds on 2 busy cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_groups(rank: int, world: int, tp: int, port: int) -> RankCollectives:
    """Join the gloo world and make this rank's tp/cp groups (every rank makes them all)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    mine = []
    for name, parts in grid_partitions(world, tp):
        for members in parts:
            g = dist.new_group(members)
            if rank in members:
                mine.append((name, g))
    return RankCollectives(mine, timeout=20.0)


def prepare(site: PrefetchSite, rid: str, local: Local) -> torch.Tensor | None:
    anchor = None
    if local >= Local.PENDING:
        anchor = site.host.alloc(ANCHOR)
        site.queue(rid, anchor)
    if local == Local.ACTIVE:
        assert site.start(rid, PAGES) is not None
        site.transfer(rid, DONE)
    return anchor


def all_combinations(rank: int, world: int, tp: int, port: int, out: Any) -> None:
    """Spawned rank: run the abort for every combination of local classes."""
    try:
        coll = init_groups(rank, world, tp, port)
        results = []
        for i, combo in enumerate(itertools.product(list(Local), repeat=world)):
            rid = f"rid-{i}"
            site = PrefetchSite(HostPagePool(16), rank=rank)
            anchor = prepare(site, rid, combo[rank])
            before = (list(coll.reduces), list(coll.barriers))
            outcome = site.abort(rid, coll)
            site.assert_released()
            if anchor is not None:
                site.host.free(anchor)
            site.host.assert_full()
            results.append((combo, outcome, site.trace,
                            [a - b for a, b in zip(coll.reduces, before[0], strict=True)],
                            [a - b for a, b in zip(coll.barriers, before[1], strict=True)]))
        out.put((rank, results, None))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, None, traceback.format_exc()))


def run_world(world: int, tp: int) -> dict[int, list[Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=all_combinations, args=(r, world, tp, port, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, list[Any]] = {}
    errors = []
    try:
        for _ in range(world):
            rank, results, err = out.get(timeout=RESULT_WAIT_S)
            if err is not None:
                errors.append(f"rank {rank}:\n{err}")
            got[rank] = results
    except queue.Empty:
        errors.append(f"ranks {sorted(set(range(world)) - set(got))} sent nothing in "
                      f"{RESULT_WAIT_S}s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(errors)
    return got


def check_world(world: int, tp: int) -> None:
    got = run_world(world, tp)
    groups = len(grid_partitions(world, tp))
    combos = list(itertools.product(list(Local), repeat=world))
    assert all(len(got[r]) == len(combos) for r in range(world))
    for i, combo in enumerate(combos):
        rows = [got[r][i] for r in range(world)]
        assert all(row[0] == combo for row in rows)
        barrier = max(combo) == Local.ACTIVE
        # Every rank entered each reduction once, and the barrier: all ranks or none.
        assert [row[3] for row in rows] == [[1] * groups] * world, combo
        assert [row[4] for row in rows] == [[int(barrier)] * groups] * world, combo
        assert [row[1].barrier for row in rows] == [barrier] * world, combo
        assert [row[1].decision for row in rows] == [max(combo)] * world, combo
        for r, (_, outcome, trace, _, _) in enumerate(rows):
            local = combo[r]
            assert outcome.state == "released"
            kinds = [t[0] for t in trace]
            assert kinds[:groups] == ["reduce"] * groups
            releases = [t for t in trace if t[0] in ("free_prefix", "unlock")]
            # Released only by the owner, exactly what it owned ...
            want = ([("free_prefix", f"rid-{i}", DONE)] if local == Local.ACTIVE else []) + (
                [("unlock", f"rid-{i}", ANCHOR)] if local >= Local.PENDING else [])
            assert releases == want, (combo, r, trace)
            # ... and only after the last barrier (every peer had drained and arrived).
            if barrier:
                last_exit = max(j for j, k in enumerate(kinds) if k == "barrier_exit")
                first_enter = min(j for j, k in enumerate(kinds) if k == "barrier_enter")
                assert all(kinds.index(t[0]) > last_exit for t in releases), (combo, r)
                assert all(j < first_enter for j, k in enumerate(kinds)
                           if k in ("revoke", "drain")), (combo, r)


def test_two_ranks_every_combination_enter_the_barrier_all_or_none() -> None:
    check_world(2, 2)


def test_four_ranks_on_a_tp_cp_grid_every_combination_enter_the_barrier_all_or_none() -> None:
    check_world(4, 2)


# -- a peer process that dies after the reduction ---------------------------------------------


def dies_after_reduce(rank: int, port: int, out: Any) -> None:
    """Spawned rank: rank 0 has active I/O; rank 1 (missing) takes part in the reduction,
    then its process exits where it would enter the barrier."""
    try:
        coll = init_groups(rank, 2, 2, port)
        coll.timeout = 60.0  # the error must come from the backend, not from our deadline
        site = PrefetchSite(HostPagePool(16), rank=rank)
        if rank == 1:
            assert coll.reduce_max(0, int(Local.MISSING), "peer") == Local.ACTIVE
            out.put((rank, "exiting", None))
            out.close()
            out.join_thread()
            os._exit(0)  # no barrier, no teardown: the process is simply gone
        anchor = prepare(site, "rid", Local.ACTIVE)
        try:
            site.abort("rid", coll)
            raise AssertionError("the abort returned although its peer died")
        except PrefetchCollectiveFailed as e:
            err = (e.rid, e.rank, e.group, e.state, type(e.error).__name__, str(e))
        kept = (site.host.locked_pages(), site.occupancy_tokens)
        try:
            site.retry("rid", coll)
            retried = "accepted"
        except ValueError:
            retried = "refused"
        dist.destroy_process_group()  # the documented recovery: tear the group down ...
        report = site.close_group("rid")  # ... then release, exactly once
        released = sorted(h.kind for h in report.released) if report is not None else []
        try:
            site.close_group("rid")
            again = "accepted"
        except ValueError:
            again = "refused"
        site.assert_released()
        assert anchor is not None
        site.host.free(anchor)
        site.host.assert_full()
        site.ledger.assert_empty()
        out.put((rank, (err, kept, retried, released, again,
                        site.machine.stats.plans_run["release_aborted"]), None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))


def test_a_peer_process_that_dies_after_the_reduction_raises_ours_and_close_group_releases(
) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=dies_after_reduce, args=(r, port, out), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        for _ in range(2):
            rank, result, err = out.get(timeout=RESULT_WAIT_S)
            assert err is None, f"rank {rank}:\n{err}"
            got[rank] = result
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert got[1] == "exiting"
    (rid, rank, group, state, cause, message), kept, retried, released, again, runs = got[0]
    assert (rid, rank, group, state, cause) == ("rid", 0, "tp", "broken", "CollectiveError")
    assert message.startswith("prefetch abort of request 'rid' on rank 0: barrier on "
                              "attention group 'tp' raised RuntimeError: ")
    assert "close_group(rid) releases it" in message
    assert kept == (ANCHOR, PAGES)  # nothing released before the group was torn down
    assert retried == "refused" and again == "refused"
    assert released == ["host_lock", "host_pages"] and runs == 1
