"""The seed (disagg-prefill-abort-leak): aborts racing overlapped chunk results on a
hybrid Mamba model leak whole chunks of KV and Mamba states through the pre-fix loop,
and nothing through the declared machines, on the same scripts."""

from __future__ import annotations

import pytest

from terminus.effects.sim.scenarios import DisaggLeak, disagg_seed


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_naive_loop_loses_whole_chunks_of_kv_and_mamba_states(seed):
    r = disagg_seed(True, seed)
    assert r.kv_tokens_leaked > 0 and r.kv_tokens_leaked % r.chunk_size == 0
    assert r.mamba_states_leaked > 0
    assert r.aborted_cached > 0 and r.wrong_status > 0 and r.streams_missing > 0
    assert r.leaked


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_machines_leak_nothing_on_the_same_script(seed):
    naive = disagg_seed(True, seed)
    r = disagg_seed(False, seed)
    assert (r.requests, r.aborts, r.sender_abort_failures) == (
        naive.requests, naive.aborts, naive.sender_abort_failures)
    assert not r.leaked
    zero = {f: 0 for f in DisaggLeak.__struct_fields__[6:]}
    assert {f: getattr(r, f) for f in zero} == zero


def test_the_production_shaped_case_shows_the_seeds_deficit():
    # 16,384-token chunks, three Mamba states per request (state plus overlap buffers):
    # one aborted middle result dropped while the final chunk ran, and one sender abort
    # that raised before the local releases.
    kw = dict(requests=4, chunk_size=16384, mamba_per_request=3)
    naive = disagg_seed(True, 19, **kw)
    assert (naive.kv_tokens_leaked, naive.mamba_states_leaked) == (16384, 3)
    assert not disagg_seed(False, 19, **kw).leaked


def test_bad_scenario_input_names_what_was_wrong():
    with pytest.raises(ValueError, match="requests, chunk_size and max_chunks must be >= 1"):
        disagg_seed(False, 0, requests=0)
