"""Private pools (a `MemPool`'s, a CUDA graph's) in the allocator's model and in a replayed trace: a pool's
blocks serve only its requests, and `empty_cache` and the out-of-memory retry release what torch's
`release_cached_blocks` does. Every figure is derived by hand in the comments, from
`c10/cuda/CUDACachingAllocator.cpp` (`get_pool`, `try_mempool_fallback`, `should_split`,
`release_cached_blocks`, `releasePool`) and `MemPool`'s constructor and destructor."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuda_allocator_model import DEFAULT_POOL, ModelError
from cuda_allocator_model.model import AllocatorOutOfMemory, AllocatorSettings, CachingAllocatorModel
from cuda_allocator_model.snapshots.agreement import PoolAtEnd, agree
from cuda_allocator_model.snapshots.read import snapshot_from_bytes
from pytest_gpumem.cli import main

MiB = 1 << 20
A, B = (0, 1), (1, 0)  # a MemPool's id, a CUDA graph's
FIRST = 1 << 32  # the model's first segment address
LARGE = 0x7F0000000000


def used(m: CachingAllocatorModel, pool: tuple[int, int], key: int, nbytes: int) -> None:
    """A request served in `pool` and freed there (a `use_mem_pool` block: begun, ended, released)."""
    m.allocate_to_pool(pool)
    m.malloc(key, nbytes)
    m.free(key)
    m.allocate_to_pool(None)
    m.release_pool(pool)


# ------------------------------------------------------------------------------------------- the model


def test_a_free_block_of_a_private_pool_serves_only_that_pools_requests() -> None:
    m = CachingAllocatorModel()
    m.create_pool(A)
    used(m, A, 1, 12 * MiB)  # A: one 12 MiB segment at FIRST (12 MiB >= 10 MiB: its own size), cached free
    m.malloc(2, 12 * MiB)  # the default pool finds no block of its own: a second segment
    assert (m.reserved, m.reserved_by_pool()) == (24 * MiB, {DEFAULT_POOL: 12 * MiB, A: 12 * MiB})
    m.allocate_to_pool(B)  # a graph's capture: its pool made, in use by the graph
    m.malloc(3, 12 * MiB)  # B holds no block: a third
    m.allocate_to_pool(None)
    m.allocate_to_pool(A)
    m.malloc(4, 12 * MiB)  # A's cached block, at its segment's address: nothing new
    assert (m.reserved, m.block_address(4)) == (36 * MiB, FIRST)
    m.free(2)  # the default pool's block goes back to the default pool, whatever the pool now
    m.malloc(5, 12 * MiB)  # in A: A has no free block: a fourth segment
    assert m.reserved == 48 * MiB
    m.check_consistency()


def test_empty_cache_releases_the_default_pool_and_the_pools_no_longer_in_use() -> None:
    m = CachingAllocatorModel()
    m.create_pool(A)  # the MemPool object holds A: in use after its use_mem_pool ends
    used(m, A, 1, 12 * MiB)
    m.allocate_to_pool(B)  # a capture: B in use by its graph
    m.malloc(2, 12 * MiB)
    m.free(2)
    m.allocate_to_pool(None)
    m.release_pool(B)  # graph.reset(): nobody uses B
    m.malloc(3, 12 * MiB)
    m.free(3)
    assert m.reserved == 36 * MiB
    m.empty_cache()  # the default pool's 12 MiB and B's 12 MiB; A's stays
    assert (m.reserved, m.reserved_by_pool()) == (12 * MiB, {A: 12 * MiB})
    m.delete_pool(A)  # ~MemPool: releasePool, then emptyCache(A)
    assert (m.reserved, m.reserved_by_pool()) == (0, {})
    m.check_consistency()


def test_a_mempools_destructor_releases_its_own_pool_only() -> None:
    m = CachingAllocatorModel()
    m.create_pool(A)
    used(m, A, 1, 12 * MiB)
    m.malloc(2, 12 * MiB)
    m.free(2)
    m.delete_pool(A)  # emptyCache(A): A's 12 MiB; the default pool's stays cached
    assert m.reserved_by_pool() == {DEFAULT_POOL: 12 * MiB}


def test_empty_cache_during_an_allocation_to_a_private_pool_leaves_the_default_pool() -> None:
    m = CachingAllocatorModel()
    m.malloc(1, 12 * MiB)
    m.free(1)
    m.create_pool(A)
    m.allocate_to_pool(A)
    m.empty_cache()  # captures_underway is not empty: release_cached_blocks skips the default pool
    assert m.reserved == 12 * MiB
    m.allocate_to_pool(None)
    m.empty_cache()
    assert m.reserved == 0


def retry_setup(graph_reset: bool) -> CachingAllocatorModel:
    """Within 24 MiB: a cached 12 MiB segment in the default pool and one in a graph's pool, reset or not."""
    m = CachingAllocatorModel(capacity=24 * MiB)
    m.malloc(1, 12 * MiB)
    m.free(1)
    m.allocate_to_pool(B)
    m.malloc(2, 12 * MiB)
    m.free(2)
    m.allocate_to_pool(None)
    if graph_reset:
        m.release_pool(B)
    return m


def test_the_out_of_memory_retry_releases_what_empty_cache_would() -> None:
    # 20 MiB needs a 20 MiB segment: 24 + 20 > 24 MiB; the retry releases the default pool's 12 MiB and the
    # reset graph's 12 MiB, and 0 + 20 MiB fits
    m = retry_setup(graph_reset=True)
    m.malloc(3, 20 * MiB)
    assert (m.reserved, m.num_alloc_retries, m.reserved_by_pool()) == (20 * MiB, 1, {DEFAULT_POOL: 20 * MiB})
    # the graph alive: only the default pool's 12 MiB goes, and 12 + 20 > 24 MiB
    m = retry_setup(graph_reset=False)
    with pytest.raises(AllocatorOutOfMemory) as error:
        m.malloc(3, 20 * MiB)
    assert (error.value.reserved, m.reserved_by_pool()) == (12 * MiB, {B: 12 * MiB})


def test_no_retry_is_made_while_an_allocation_to_a_private_pool_is_underway() -> None:
    # the default pool's cached 12 MiB would make room for 20 MiB within 24 MiB, but malloc's last retry
    # runs only when captures_underway is empty
    m = CachingAllocatorModel(capacity=24 * MiB)
    m.malloc(1, 12 * MiB)
    m.free(1)
    m.create_pool(A)
    m.allocate_to_pool(A)
    with pytest.raises(AllocatorOutOfMemory):
        m.malloc(2, 20 * MiB)
    assert (m.reserved, m.num_alloc_retries) == (12 * MiB, 0)
    m.allocate_to_pool(None)
    m.malloc(2, 20 * MiB)
    assert (m.reserved, m.num_alloc_retries) == (20 * MiB, 1)


@pytest.mark.parametrize("use_on_oom", [True, False])
def test_a_mempool_used_on_oom_lends_its_cached_block_before_any_is_released(use_on_oom: bool) -> None:
    m = CachingAllocatorModel(capacity=20 * MiB)
    m.create_pool(A, use_on_oom=use_on_oom)
    used(m, A, 1, 12 * MiB)  # A: a cached 12 MiB block at FIRST
    m.malloc(2, 1000)  # the default pool: a 2 MiB small segment, cached once freed
    m.free(2)
    if not use_on_oom:  # 14 + 12 > 20 MiB; the retry frees the 2 MiB segment: 12 + 12 > 20 MiB still
        with pytest.raises(AllocatorOutOfMemory):
            m.malloc(3, 12 * MiB)
        return
    # 14 + 12 > 20 MiB: A's block serves it (try_mempool_fallback comes before any release: the 2 MiB stays)
    assert m.malloc(3, 12 * MiB) == 12 * MiB
    assert (m.block_address(3), m.reserved, m.num_alloc_retries) == (FIRST, 14 * MiB, 0)
    m.free(3)  # back to A, whose block it is
    m.malloc(4, 12 * MiB)  # so the default pool has none again: A's, lent once more
    assert m.block_address(4) == FIRST
    m.check_consistency()


def test_a_no_split_pool_hands_its_blocks_out_whole() -> None:
    m = CachingAllocatorModel()
    m.create_pool(A, no_split=True)
    m.allocate_to_pool(A)
    m.malloc(1, 12 * MiB)
    m.free(1)
    # 4 MiB takes the cached 12 MiB block whole (the default pool would split it: 8 MiB > 1 MiB remain),
    # and 1000 B a 2 MiB small segment whole
    assert (m.malloc(2, 4 * MiB), m.malloc(3, 1000)) == (12 * MiB, 2 * MiB)
    assert (m.allocated, m.requested, m.reserved, m.inactive_split) == (14 * MiB, 4 * MiB + 1000, 14 * MiB, 0)
    m.check_consistency()


def test_with_expandable_segments_each_pool_maps_pages_of_its_own_segment() -> None:
    # 8 MiB in A maps one 20 MiB page of A's segment; the default pool's 8 MiB cannot use the 12 MiB left in
    # it and maps a page of its own segment (mixed: 20 MiB in all)
    m = CachingAllocatorModel(AllocatorSettings.parse("expandable_segments:True"))
    m.create_pool(A)
    m.allocate_to_pool(A)
    m.malloc(1, 8 * MiB)
    m.allocate_to_pool(None)
    m.malloc(2, 8 * MiB)
    assert m.reserved_by_pool() == {DEFAULT_POOL: 20 * MiB, A: 20 * MiB}
    m.free(1)
    m.release_pool(A)
    m.release_pool(A)  # the use_mem_pool, then the MemPool itself: A is no longer in use
    m.empty_cache()  # A's page is unmapped and its segment dropped; the default pool's page holds a block
    assert m.reserved_by_pool() == {DEFAULT_POOL: 20 * MiB}
    m.check_consistency()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: m.allocate_to_pool(None), "allocate_to_pool(None): no allocation to a private pool is underway"),
        (lambda m: m.release_pool(A), "release_pool((0, 1)): no private pool of that id is in use"),
        (lambda m: m.create_pool(DEFAULT_POOL), "(0, 0) is the default pool, not a private one"),
        (lambda m: m.allocate_to_pool("kv"), "a pool's id is a pair of whole numbers such as (0, 1), not 'kv'"),
    ],
)
def test_a_pool_call_torch_would_refuse_is_one_line(call: Any, message: str) -> None:
    with pytest.raises(ModelError) as error:
        call(CachingAllocatorModel())
    assert str(error.value) == message


POOL_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), st.integers(1, 48 * MiB)),
        st.tuples(st.just("free"), st.integers(0, 63)),
        st.tuples(st.sampled_from(["enter", "leave", "release", "delete", "empty"]), st.integers(0, 1)),
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["", "expandable_segments:True", "max_split_size_mb:32"]), st.booleans(), POOL_OPS)
def test_random_sequences_over_two_pools_keep_the_invariants(
    conf: str, tight: bool, ops: list[tuple[str, int]]
) -> None:
    # MemPool A (lent on out-of-memory) and a graph's pool B, entered and left, released, deleted, emptied
    # in any order torch allows; every block in a pool's lists is that pool's, each pool's reserved bytes
    # add up to the device's
    m = CachingAllocatorModel(AllocatorSettings.parse(conf or None), 96 * MiB if tight else None)
    m.create_pool(A, use_on_oom=True)
    users = {A: 1, B: 0}
    routed: list[tuple[int, int]] = []
    live: list[int] = []
    for key, (op, value) in enumerate(ops):
        pool = (A, B)[value % 2]
        if op == "malloc":
            try:
                m.malloc(key, value)
                live.append(key)
            except AllocatorOutOfMemory:
                pass
        elif op == "free" and live:
            m.free(live.pop(value % len(live)))
        elif op == "enter":
            m.allocate_to_pool(pool)
            routed.append(pool)
            users[pool] += 1
        elif op == "leave" and routed:
            m.allocate_to_pool(None)
            if routed.pop() == A:  # use_mem_pool's exit releases; a capture's end does not
                m.release_pool(A)
                users[A] -= 1
        elif op in ("release", "delete") and users[pool] > len([p for p in routed if p == pool]):
            (m.delete_pool if op == "delete" and pool == A else m.release_pool)(pool)
            users[pool] -= 1
        elif op == "empty":
            m.empty_cache()
        m.check_consistency()
        assert sum(m.reserved_by_pool().values()) == m.reserved


# ------------------------------------------------------------------------------------ a replayed trace

_EMPTY_CACHE = [{"name": "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::emptyCache()",
                 "filename": "??", "line": 0}]  # fmt: skip


def entry(action: str, addr: int, size: int, pool: tuple[int, int] = DEFAULT_POOL, **extra: Any) -> dict[str, Any]:
    frames = [{"name": "step", "filename": "/home/me/serve.py", "line": 3}]
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames, "pool_id": pool, **extra}


def used_and_freed(addr: int, pool: tuple[int, int]) -> list[dict[str, Any]]:
    """A 12 MiB segment made for a 12 MiB request in `pool`, the request freed."""
    actions = ("segment_alloc", "alloc", "free_requested", "free_completed")
    return [entry(action, addr, 12 * MiB, pool) for action in actions]


def emptied(addr: int, pool: tuple[int, int]) -> dict[str, Any]:
    return entry("segment_free", addr, 12 * MiB, pool, frames=_EMPTY_CACHE)


def cached(addr: int, pool: tuple[int, int]) -> dict[str, Any]:
    block = {"address": addr, "size": 12 * MiB, "requested_size": 0, "state": "inactive"}
    return {"device": 0, "address": addr, "total_size": 12 * MiB, "stream": 0, "segment_type": "large",
            "segment_pool_id": pool, "blocks": [block]}  # fmt: skip


def graph_and_default() -> dict[str, Any]:
    """A graph's pool B uses 12 MiB at LARGE and frees it; the default pool then makes its own 12 MiB segment
    at LARGE + 1 GiB (B's free block is not its own), frees it, and `empty_cache()` gives back only the
    default pool's (the graph is alive). The card: 12 then 24 MiB reserved; at the end B's 12 MiB."""
    second = LARGE + 1024 * MiB
    trace = [*used_and_freed(LARGE, B), *used_and_freed(second, DEFAULT_POOL), emptied(second, DEFAULT_POOL)]
    return {"segments": [cached(LARGE, B)], "device_traces": [trace]}


def test_a_replayed_trace_keeps_a_graphs_pool_apart_from_the_default_pool() -> None:
    a = agree(snapshot_from_bytes(pickle.dumps(graph_and_default())))
    # mixed in one pool, the second request would take B's free block: no new segment, the wrong address
    assert (a.requests, a.decisions_matched, a.new_segments, a.placements_matched, a.reserved_matched) == (
        2,
        2,
        2,
        2,
        2,
    )
    assert (a.peak_reserved_card, a.peak_reserved_model) == (24 * MiB, 24 * MiB)
    # mixed, empty_cache() would have released B's segment too
    assert a.pools == (PoolAtEnd(B, 12 * MiB, 12 * MiB),) and a.exact


def test_a_mempools_own_empty_cache_in_a_trace_leaves_the_default_pool() -> None:
    # MemPool A's block and the default pool's are both cached; deleting A releases A's segment alone
    # (emptyCache(A)), so the next 12 MiB of the default pool takes its cached block: no new segment, 12 MiB
    # reserved (had the model emptied the default pool too: a new segment, 24 MiB at its peak)
    second = LARGE + 1024 * MiB
    trace = [*used_and_freed(LARGE, A), *used_and_freed(second, DEFAULT_POOL), emptied(LARGE, A)]
    trace.append(entry("alloc", second, 12 * MiB))
    live = {
        **cached(second, DEFAULT_POOL),
        "blocks": [{"address": second, "size": 12 * MiB, "requested_size": 12 * MiB, "state": "active_allocated"}],
    }
    a = agree(snapshot_from_bytes(pickle.dumps({"segments": [live], "device_traces": [trace]})))
    assert (a.requests, a.decisions_matched, a.new_segments, a.reserved_matched) == (3, 3, 2, 3)
    assert (a.peak_reserved_model, a.pools) == (24 * MiB, ()) and a.exact


def test_a_trace_entrys_pool_id_is_read_and_a_bad_one_refused_in_one_line() -> None:
    raw = graph_and_default()
    trace = snapshot_from_bytes(pickle.dumps(raw)).trace()
    assert [e.pool for e in trace[:2]] == [B, B] and trace[4].pool == DEFAULT_POOL
    raw["device_traces"][0][1]["pool_id"] = (1, "x")
    with pytest.raises(ModelError) as error:
        snapshot_from_bytes(pickle.dumps(raw), "card.pickle")
    assert (
        str(error.value) == "card.pickle: device_traces[0][1]: 'pool_id' is not a pair of whole numbers in [0, 2**64)"
    )


def without_pool_ids(raw: dict[str, Any]) -> dict[str, Any]:
    """The snapshot as a torch that wrote `segment_pool_id` but no `pool_id` per entry would have."""
    traces = [[{k: v for k, v in e.items() if k != "pool_id"} for e in trace] for trace in raw["device_traces"]]
    return {**raw, "device_traces": traces}


def test_a_trace_without_pool_ids_takes_each_entrys_pool_from_the_segment_holding_it_then() -> None:
    # LARGE is first the default pool's (used, freed, given back by empty_cache), then a segment of B's at the
    # same address, which the final segments hold: walked back, the first five entries are the default pool's
    d = DEFAULT_POOL
    trace = [*used_and_freed(LARGE, d), emptied(LARGE, d), *used_and_freed(LARGE, B)]
    raw = without_pool_ids({"segments": [cached(LARGE, B)], "device_traces": [trace]})
    snap = snapshot_from_bytes(pickle.dumps(raw))
    assert snap.pools_inferred and [e.pool for e in snap.trace()] == [d, d, d, d, d, B, B, B, B]
    a = agree(snapshot_from_bytes(pickle.dumps(without_pool_ids(graph_and_default()))))
    assert (a.decisions_matched, a.placements_matched, a.pools) == (2, 2, (PoolAtEnd(B, 12 * MiB, 12 * MiB),))


def test_replay_says_each_pools_reserved_bytes_at_the_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, report = tmp_path / "card.pickle", tmp_path / "pools.json"
    path.write_bytes(pickle.dumps(graph_and_default()))
    assert main(["replay", str(path), "--json", str(report)]) == 0
    line = "  reserved at the end, pools kept apart: private pool (1, 0) card 12.0 MiB, model equal"
    assert line in capsys.readouterr().out.splitlines()
    pools = json.loads(report.read_text())["devices"][0]["agreement"]["pools_at_end"]
    assert pools == [{"pool": [1, 0], "card_reserved": 12 * MiB, "model_reserved": 12 * MiB}]
