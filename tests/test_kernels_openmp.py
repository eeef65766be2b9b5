"""Kernel hot paths open no OpenMP parallel region on small tensors.

torch runs an op in parallel when its input is past the op's grain; for most ops that
is 32,768 elements, but some (``repeat_interleave``: a grain of one row) go parallel on a
handful of elements. On a busy machine each such region waits for a worker thread to be
scheduled: milliseconds on a few hundred elements, with torch's default thread count.

The check counts context switches of the process's other threads (torch's OpenMP
workers) while the hot paths run in a child process with two torch threads and
``OMP_WAIT_POLICY=PASSIVE`` (a worker sleeps between regions, so every region wakes it
and shows as a switch). ``repeat_interleave`` on 300 rows is the positive control: if it
shows no switch, the probe cannot see regions here and the test says so. Counts, never
timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import json, os, threading, time
    import torch
    torch.set_num_threads(2)
    from terminus.kernels import (HostPagePool, MambaStatePool, ReqToTokenTable,
                                  TokenKVAllocator, release_batch)
    from terminus.kernels.batched import gather_kv, repeat_rows

    main = str(threading.get_native_id())

    def switches():
        total = 0
        for tid in os.listdir("/proc/self/task"):
            if tid != main:
                with open(f"/proc/self/task/{tid}/status") as f:
                    for line in f:
                        if "ctxt_switches" in line:
                            total += int(line.split()[1])
        return total

    def hot_paths():
        g = torch.Generator().manual_seed(0)
        for page in (1, 16):
            kv = TokenKVAllocator(1 << 14, page_size=page)
            table = ReqToTokenTable(200, 64)
            mamba = MambaStatePool(200, 1, 4, 2, 1, 2, 2)
            lengths = torch.randint(1, 64, (200,), generator=g).tolist()
            for uniform in (True, False):
                slots = table.alloc(200)
                states = mamba.alloc(200)
                for i, s in enumerate(slots.tolist()):
                    table.write(s, 0, kv.alloc(64 if uniform else lengths[i]))
                table.mamba_slots[slots] = states
                gather_kv(table, slots, torch.full((200,), 3))
                repeat_rows(torch.tensor(lengths))
                release_batch(slots[:100], table, kv, mamba)
                release_batch(slots[100:], table, kv, mamba,
                              kv_start=torch.zeros(100, dtype=torch.int64))
            kv.free_group_begin()
            held = [kv.alloc(40) for _ in range(50)]
            for t in held:
                kv.free(t)
            kv.free_group_end()
            snap = kv.backup_state()
            kv.alloc(100)
            kv.restore_state(snap)
            for pool in (kv, table, mamba):
                pool.check()
                pool.assert_full()
        host = HostPagePool(512)
        anchor = host.alloc(8)
        p = host.prefetch(200, anchor=anchor)
        p.advance(120)
        host.lock(p.pages[150:160])
        p.terminate()
        host.unlock(p.pages[150:160])
        p.release()
        host.free(anchor)
        host.assert_full()

    torch.ones(1 << 20).add_(1)  # start the worker threads
    hot_paths()                  # and warm every path up
    time.sleep(0.05)
    before = switches()
    for _ in range(5):
        hot_paths()
    hot = switches() - before
    counts = torch.randint(1, 8, (300,), generator=torch.Generator().manual_seed(1))
    time.sleep(0.05)
    before = switches()
    for _ in range(20):
        torch.repeat_interleave(counts)
    control = switches() - before
    print(json.dumps({"hot": hot, "control": control, "threads": torch.get_num_threads()}))
    """
)


def test_hot_paths_open_no_openmp_region_on_small_tensors():
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["threads"] == 2
    assert got["control"] > 0, (
        "the probe saw no OpenMP region even for repeat_interleave: it cannot check here"
    )
    assert got["hot"] == 0, f"kernel hot paths opened OpenMP regions: {got}"
