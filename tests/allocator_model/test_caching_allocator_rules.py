"""The CUDA caching allocator's model (`cuda_allocator_model/model.py`): one test per rule, each figure
derived by hand in its comments from the rules of torch's `CUDACachingAllocator.cpp`; property tests over
random allocation sequences; the parsing of `PYTORCH_CUDA_ALLOC_CONF`, bad values included."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuda_allocator_model import ModelError
from cuda_allocator_model.model import AllocatorOutOfMemory, CachingAllocatorModel
from cuda_allocator_model.settings import INTERVALS, AllocatorSettings

KiB = 1 << 10
MiB = 1 << 20


def shape(model: CachingAllocatorModel) -> list[tuple[float, list[tuple[float, bool]]]]:
    """segments() in MiB, for readable expectations."""
    return [(size / MiB, [(b / MiB, live) for b, live in blocks]) for size, blocks in model.segments()]


def model(text: str | None = None, capacity: int | None = None) -> CachingAllocatorModel:
    return CachingAllocatorModel(AllocatorSettings.parse(text), capacity)


# ------------------------------------------------------------------------------------ request rounding


def test_requests_round_to_512_bytes_and_at_least_512() -> None:
    # round_size: below 512 -> 512; else up to a multiple of 512
    m = model()
    assert m.malloc(1, 1) == 512
    assert m.malloc(2, 512) == 512
    assert m.malloc(3, 513) == 1024
    assert (m.allocated, m.requested) == (2048, 1 + 512 + 513)


def test_randn_256_float32_adds_1024_bytes_in_a_2_mib_segment() -> None:
    # 256 x 4 B = 1024 B: a multiple of 512, small pool, a fresh 2 MiB segment split after the block
    m = model()
    assert m.malloc(1, 1024) == 1024
    assert (m.allocated, m.reserved, m.requested) == (1024, 2 * MiB, 1024)
    assert shape(m) == [(2.0, [(1024 / MiB, True), (2 - 1024 / MiB, False)])]


def test_a_request_of_zero_bytes_touches_nothing() -> None:
    # NativeCachingAllocator::allocate skips malloc for size 0: no block, no segment, no counter
    m = model()
    assert m.malloc(1, 0) == 0
    m.free(1)
    assert (m.allocated, m.reserved, m.requested, m.segments()) == (0, 0, 0, [])


def test_roundup_power2_divisions_4_and_8() -> None:
    # 84 MiB lies in [64, 128) MiB: 4 steps of 16 MiB -> 96 MiB; 8 steps of 8 MiB -> 88 MiB
    assert model("roundup_power2_divisions:4").round_size(84 * MiB) == 96 * MiB
    assert model("roundup_power2_divisions:8").round_size(84 * MiB) == 88 * MiB
    # a power of two stays; a size on a step stays
    assert model("roundup_power2_divisions:4").round_size(64 * MiB) == 64 * MiB
    assert model("roundup_power2_divisions:4").round_size(80 * MiB) == 80 * MiB


def test_roundup_power2_divisions_do_not_touch_requests_up_to_512_times_d() -> None:
    # round_size rounds by divisions only above 512 * d: with d = 4, 1200 B <= 2048 B rounds to 512 B
    # steps (1536 B), not to the docs' 1280 B; 3000 B > 2048 B: [2048, 4096) in 4 steps of 512 -> 3072 B
    m = model("roundup_power2_divisions:4")
    assert m.round_size(1200) == 1536
    assert m.round_size(3000) == 3072
    assert m.malloc(1, 84 * MiB) == 96 * MiB  # and the block is that size: 84 MiB -> 96 MiB segment


def test_divided_sizes_are_the_same_read_again_and_past_the_sizes_kept() -> None:
    # [2, 4) MiB with d = 4: steps of 512 KiB. The model keeps the sizes it rounded (4,096 of them, then
    # starts again): 4,200 requests, each served twice, round up to the next 512 KiB every time
    m = model("roundup_power2_divisions:4")
    step = 512 * KiB
    for n in range(4200):
        nbytes = 2 * MiB + 1 + 256 * n
        expected = -(-nbytes // step) * step
        assert (m.malloc(1, nbytes), m.malloc(1, nbytes)) == (expected, expected), nbytes


def test_roundup_power2_divisions_per_interval() -> None:
    # [256:1,512:2,>:4]: intervals 0..8 ([1 MiB, 512 MiB)) 1, interval 9 ([512 MiB, 1 GiB)) 2, the rest 4
    m = model("roundup_power2_divisions:[256:1,512:2,>:4]")
    assert m.round_size(300 * MiB) == 300 * MiB  # d = 1: no power-of-two rounding
    assert m.round_size(600 * MiB) == 768 * MiB  # d = 2: [512, 1024) MiB in 2 steps of 256 MiB
    assert m.round_size(1100 * MiB) == 1280 * MiB  # d = 4: [1, 2) GiB in 4 steps of 256 MiB


# -------------------------------------------------------------------------------- pools and segments


def test_three_live_1_mib_tensors_take_two_2_mib_segments() -> None:
    # 1 MiB <= kSmallSize: small pool; the first splits its 2 MiB segment (1 MiB >= 512 B remains), the
    # second takes that remainder, the third needs a new segment
    m = model()
    for key in range(3):
        m.malloc(key, MiB)
    assert (m.allocated, m.reserved) == (3 * MiB, 4 * MiB)
    assert shape(m) == [(2.0, [(1.0, True), (1.0, True)]), (2.0, [(1.0, True), (1.0, False)])]


def test_large_requests_below_10_mib_get_a_20_mib_segment_and_the_pools_are_apart() -> None:
    # 2 MiB > 1 MiB: large pool, 20 MiB segment; 0.5 MiB: small pool, its own 2 MiB segment -> 22 MiB
    m = model()
    m.malloc(1, 2 * MiB)
    m.malloc(2, MiB // 2)
    assert m.reserved == 22 * MiB
    # two 2 MiB tensors: the second is split off the first's 20 MiB segment -> 20 MiB
    m = model()
    m.malloc(1, 2 * MiB)
    m.malloc(2, 2 * MiB)
    assert m.reserved == 20 * MiB
    assert shape(m) == [(20.0, [(2.0, True), (2.0, True), (16.0, False)])]


def test_large_segment_size_mb_sets_the_segment_of_small_large_requests() -> None:
    # get_allocation_size: below 10 MiB the large segment is large_segment_size (32 MiB here)
    m = model("large_segment_size_mb:32")
    m.malloc(1, 2 * MiB)
    assert m.reserved == 32 * MiB


def test_from_10_mib_a_segment_is_the_request_rounded_to_2_mib_with_its_tail() -> None:
    # 13.5 MiB -> segment 14 MiB; 0.5 MiB would remain, not more than 1 MiB: not split, counts 14 MiB
    m = model()
    assert m.malloc(1, 27 * MiB // 2) == 14 * MiB
    assert shape(m) == [(14.0, [(14.0, True)])]
    # 12.5 MiB -> segment 14 MiB; 1.5 MiB remains (> 1 MiB): split, counts 12.5 MiB, 1.5 MiB free in it
    m = model()
    assert m.malloc(1, 25 * MiB // 2) == 25 * MiB // 2
    assert shape(m) == [(14.0, [(12.5, True), (1.5, False)])]
    assert m.inactive_split == 3 * MiB // 2


# ------------------------------------------------------------------------------------------ best fit


def test_eight_16_mib_freed_then_four_32_mib_reserve_256_mib_and_the_reverse_128() -> None:
    # no cached 16 MiB block fits 32 MiB: four new 32 MiB segments on top of the eight 16 MiB ones
    m = model()
    for key in range(8):
        m.malloc(key, 16 * MiB)
    for key in range(8):
        m.free(key)
    for key in range(4):
        m.malloc(10 + key, 32 * MiB)
    assert (m.reserved, m.allocated) == (256 * MiB, 128 * MiB)
    # the reverse: each cached 32 MiB block splits into two 16 MiB ones (16 MiB > 1 MiB remains)
    m = model()
    for key in range(4):
        m.malloc(key, 32 * MiB)
    for key in range(4):
        m.free(key)
    for key in range(8):
        m.malloc(10 + key, 16 * MiB)
    assert (m.reserved, m.allocated) == (128 * MiB, 128 * MiB)


def test_the_smallest_fitting_block_serves_and_the_lowest_address_among_equals() -> None:
    # cached: 16 MiB (older segment) and 12 MiB; 11 MiB takes the 12 MiB block (1 MiB remains, not
    # split: counts 12 MiB); then a 16 MiB request takes the 16 MiB one
    m = model()
    m.malloc(1, 16 * MiB)
    m.malloc(2, 12 * MiB)
    m.free(1)
    m.free(2)
    assert m.malloc(3, 11 * MiB) == 12 * MiB
    assert shape(m) == [(16.0, [(16.0, False)]), (12.0, [(12.0, True)])]
    # two equal free blocks: the one at the lower address (the older segment) serves
    m = model()
    m.malloc(1, 12 * MiB)
    m.malloc(2, 12 * MiB)
    m.free(2)
    m.free(1)
    m.malloc(3, 12 * MiB)
    assert shape(m) == [(12.0, [(12.0, True)]), (12.0, [(12.0, False)])]


def test_a_block_freed_on_another_stream_is_not_reused() -> None:
    # blocks are ordered by (stream, size, address) and taken only on the request's stream
    m = model()
    m.malloc(1, 1024, stream=1)
    m.free(1)
    m.malloc(2, 1024, stream=0)
    assert m.reserved == 4 * MiB
    m.malloc(3, 1024, stream=1)  # but on its own stream it is
    assert m.reserved == 4 * MiB


# ------------------------------------------------------------------------------------- split and merge


def test_free_merges_with_free_neighbours_and_inactive_split_follows() -> None:
    # one 2 MiB small segment: a, b, c of 256 KiB then 1280 KiB free (inactive split: 1280 KiB)
    m = model()
    for key in "abc":
        m.malloc(ord(key), 256 * KiB)
    assert m.inactive_split == 1280 * KiB
    m.free(ord("b"))  # b: both neighbours live, no merge; a free split block of 256 KiB more
    assert m.inactive_split == 1536 * KiB
    m.free(ord("a"))  # a merges with b: one free block of 512 KiB instead of 256 KiB
    assert m.inactive_split == 1792 * KiB
    assert shape(m) == [(2.0, [(0.5, False), (0.25, True), (1.25, False)])]
    m.free(ord("c"))  # c merges both sides: the whole 2 MiB segment free and unsplit, no longer inactive
    assert (m.inactive_split, m.allocated, m.reserved) == (0, 0, 2 * MiB)
    assert shape(m) == [(2.0, [(2.0, False)])]
    assert m.peak_inactive_split == 1792 * KiB


def test_inactive_split_is_fragmentation_that_a_bigger_request_cannot_use() -> None:
    # a 2 MiB block in a 20 MiB segment leaves 18 MiB inactive; 19 MiB does not fit it: a new 20 MiB
    # segment (19 MiB -> rounded to 2 MiB: 20 MiB, 1 MiB remains, not split)
    m = model()
    m.malloc(1, 2 * MiB)
    m.malloc(2, 19 * MiB)
    assert (m.allocated, m.reserved, m.inactive_split) == (22 * MiB, 40 * MiB, 18 * MiB)


# ----------------------------------------------------------------------------------- max_split_size


def test_max_split_size_keeps_oversize_blocks_from_small_requests() -> None:
    # max_split_size 20 MiB: a cached 40 MiB block does not serve 5 MiB (5 < 20 and 40 >= 20): a new 20
    # MiB segment, split
    m = model("max_split_size_mb:20")
    m.malloc(1, 40 * MiB)
    m.free(1)
    m.malloc(2, 5 * MiB)
    assert shape(m) == [(40.0, [(40.0, False)]), (20.0, [(5.0, True), (15.0, False)])]


def test_max_split_size_serves_large_requests_only_within_the_rounding_limit_and_unsplit() -> None:
    # 25 MiB >= 20 MiB and the cached 40 MiB < 25 + 20 MiB: it serves, unsplit (25 MiB is not below
    # max_split_size), counting 40 MiB
    m = model("max_split_size_mb:20")
    m.malloc(1, 40 * MiB)
    m.free(1)
    assert m.malloc(2, 25 * MiB) == 40 * MiB
    assert m.reserved == 40 * MiB
    # 30 MiB and a cached 56 MiB: 56 >= 30 + 20, so not; a new 30 MiB segment
    m = model("max_split_size_mb:20")
    m.malloc(1, 56 * MiB)
    m.free(1)
    assert m.malloc(2, 30 * MiB) == 30 * MiB
    assert m.reserved == 86 * MiB
    # without max_split_size the 56 MiB block serves and splits (26 MiB > 1 MiB remains)
    m = model()
    m.malloc(1, 56 * MiB)
    m.free(1)
    assert m.malloc(2, 30 * MiB) == 30 * MiB
    assert m.reserved == 56 * MiB
    # max_non_split_rounding_mb:40 widens the limit: 56 < 30 + 40, served whole
    m = model("max_split_size_mb:20,max_non_split_rounding_mb:40")
    m.malloc(1, 56 * MiB)
    m.free(1)
    assert m.malloc(2, 30 * MiB) == 56 * MiB


# ------------------------------------------------------------------------------------- out of memory


def test_out_of_memory_frees_cached_unsplit_blocks_and_retries_once() -> None:
    # capacity 64 MiB; cached 32 MiB; 40 MiB fits no block and 32 + 40 > 64: release_cached_blocks frees
    # the 32 MiB segment, the retry takes 40 MiB
    m = model(capacity=64 * MiB)
    m.malloc(1, 32 * MiB)
    m.free(1)
    m.malloc(2, 40 * MiB)
    assert (m.reserved, m.peak_reserved, m.num_alloc_retries) == (40 * MiB, 40 * MiB, 1)


def test_out_of_memory_raises_after_the_retry_with_cuda_s_figures() -> None:
    # 6 MiB a: a 20 MiB segment (14 MiB free); 14 MiB b takes that exactly; 6 MiB c: a second 20 MiB
    # segment; b freed: reserved 40, allocated 12, two free split 14 MiB blocks. 15 MiB: no fit, a 16 MiB
    # segment would make 56 > 48 MiB; nothing unsplit is cached: raised, naming the 16 MiB segment
    m = model(capacity=48 * MiB)
    m.malloc(1, 6 * MiB)
    m.malloc(2, 14 * MiB)
    m.malloc(3, 6 * MiB)
    m.free(2)
    with pytest.raises(AllocatorOutOfMemory) as caught:
        m.malloc(4, 15 * MiB)
    error = caught.value
    assert (error.requested, error.segment) == (15 * MiB, 16 * MiB)
    assert (error.allocated, error.reserved, error.capacity) == (12 * MiB, 40 * MiB, 48 * MiB)
    assert str(error) == (
        "CUDA out of memory (allocator model). Tried to allocate 16.0 MiB. Of the capacity of 48.0 MiB, "
        "40.0 MiB is reserved by PyTorch, of which 12.0 MiB is allocated and 28.0 MiB reserved but "
        "unallocated; if reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation"
    )
    assert (m.allocated, m.reserved, m.num_ooms) == (12 * MiB, 40 * MiB, 1)
    assert pickle.loads(pickle.dumps(error)).reserved == 40 * MiB


def test_out_of_memory_without_fragmentation_names_no_setting() -> None:
    # a 16 MiB segment fully used; 8 MiB needs a 20 MiB segment: 36 > 20 MiB; unallocated 0
    m = model(capacity=20 * MiB)
    m.malloc(1, 16 * MiB)
    with pytest.raises(AllocatorOutOfMemory) as caught:
        m.malloc(2, 8 * MiB)
    assert str(caught.value) == (
        "CUDA out of memory (allocator model). Tried to allocate 20.0 MiB. Of the capacity of 20.0 MiB, "
        "16.0 MiB is reserved by PyTorch, of which 16.0 MiB is allocated and 0 B reserved but unallocated"
    )


def test_with_max_split_size_one_cached_oversize_block_is_freed_before_all() -> None:
    # max_split_size 20 MiB, capacity 150 MiB; cached 40 MiB and 90 MiB; 60 MiB: the 90 MiB block is too
    # big (90 >= 60 + 20), 130 + 60 > 150: release_available_cached_blocks frees the smallest block of at
    # least 60 MiB (the 90 MiB one) only, and the next try fits: 40 + 60
    m = model("max_split_size_mb:20", capacity=150 * MiB)
    m.malloc(1, 40 * MiB)
    m.malloc(2, 90 * MiB)
    m.free(1)
    m.free(2)
    m.malloc(3, 60 * MiB)
    assert shape(m) == [(40.0, [(40.0, False)]), (60.0, [(60.0, True)])]
    assert m.num_alloc_retries == 0  # not the last retry
    # no single block big enough: the largest oversize ones go until 60 MiB are freed (50 then 40)
    m = model("max_split_size_mb:20", capacity=100 * MiB)
    m.malloc(1, 40 * MiB)
    m.malloc(2, 50 * MiB)
    m.free(1)
    m.free(2)
    m.malloc(3, 60 * MiB)
    assert shape(m) == [(60.0, [(60.0, True)])]


def test_fraction_limit_refuses_by_the_segment_size() -> None:
    # set_per_process_memory_fraction: alloc_block refuses when reserved + the new segment passes it
    m = model()
    m.fraction_limit = 30 * MiB
    m.malloc(1, 16 * MiB)
    with pytest.raises(AllocatorOutOfMemory) as caught:
        m.malloc(2, 16 * MiB)
    assert caught.value.capacity == 30 * MiB


def test_a_request_of_an_exabyte_fails_at_once() -> None:
    with pytest.raises(AllocatorOutOfMemory, match="more than 1EB"):
        model().malloc(1, 1 << 60)


# ------------------------------------------------------------------------------- expandable segments


def test_expandable_segments_grow_by_pages_and_reserve_140_mib_for_the_sequence() -> None:
    # large pages of 20 MiB: eight 16 MiB tensors fill one segment of 7 pages (128 MiB -> 140 MiB); freed
    # they merge into one 140 MiB block (no unmapping on free), where four 32 MiB tensors fit
    m = model("expandable_segments:True")
    for key in range(8):
        m.malloc(key, 16 * MiB)
    assert (m.reserved, m.allocated) == (140 * MiB, 128 * MiB)
    for key in range(8):
        m.free(key)
    assert shape(m) == [(140.0, [(140.0, False)])]
    for key in range(4):
        m.malloc(10 + key, 32 * MiB)
    assert (m.reserved, m.peak_reserved, m.inactive_split) == (140 * MiB, 140 * MiB, 0)


def test_expandable_small_pool_pages_are_2_mib_and_blocks_split_to_512_bytes() -> None:
    # three 1 MiB: one small segment growing 2 MiB a page: 4 MiB, one run of mapped memory
    m = model("expandable_segments:True")
    for key in range(3):
        m.malloc(key, MiB)
    assert shape(m) == [(4.0, [(1.0, True), (1.0, True), (1.0, True), (1.0, False)])]
    # large pool, expandable: 12.5 MiB splits off 1.5 MiB... and 13.5 MiB leaves 0.5 MiB split too
    m = model("expandable_segments:True")
    assert m.malloc(1, 27 * MiB // 2) == 27 * MiB // 2
    assert shape(m) == [(20.0, [(13.5, True), (6.5, False)])]


def test_empty_cache_unmaps_only_whole_free_pages_of_an_expandable_segment() -> None:
    # a, b, c of 16 MiB in 3 pages [0, 60) MiB: a [0,16) b [16,32) c [32,48) free [48,60); a and c freed:
    # free [0,16) and [32,60). Page 0 is [0,20): not all free, kept. Page 2 [40,60) is: unmapped; [32,40)
    # stays mapped and free. 60 - 20 = 40 MiB reserved.
    m = model("expandable_segments:True")
    for key in "abc":
        m.malloc(ord(key), 16 * MiB)
    m.free(ord("a"))
    m.free(ord("c"))
    assert m.reserved == 60 * MiB
    m.empty_cache()
    assert m.reserved == 40 * MiB
    assert shape(m) == [(40.0, [(16.0, False), (16.0, True), (8.0, False)])]
    m.free(ord("b"))
    m.empty_cache()
    assert (m.reserved, m.segments()) == (0, [])


def test_expandable_segments_refill_an_unmapped_gap_first() -> None:
    # a, b, c of 20 MiB each take one whole large page: [0,20) [20,40) [40,60). b freed and emptied: its
    # page is unmapped and the segment shows two runs. d (20 MiB) maps the lowest unmapped space with room:
    # the gap, not the end, and the runs are one again
    m = model("expandable_segments:True")
    for key in "abc":
        m.malloc(ord(key), 20 * MiB)
    m.free(ord("b"))
    m.empty_cache()
    assert shape(m) == [(20.0, [(20.0, True)]), (20.0, [(20.0, True)])]
    assert m.reserved == 40 * MiB
    m.malloc(ord("d"), 20 * MiB)
    assert shape(m) == [(60.0, [(20.0, True), (20.0, True), (20.0, True)])]


def test_expandable_out_of_memory_retry_unmaps_free_pages() -> None:
    # capacity 60 MiB; 50 MiB maps 3 large pages (60 MiB) and is freed: still mapped. 1 KiB in the small
    # pool needs a 2 MiB page: 62 > 60 MiB; the retry unmaps the 3 free large pages, then it fits
    m = model("expandable_segments:True", capacity=60 * MiB)
    m.malloc(1, 50 * MiB)
    m.free(1)
    m.malloc(2, KiB)
    assert (m.reserved, m.num_alloc_retries) == (2 * MiB, 1)


def test_expandable_segments_take_the_free_tail_before_new_pages() -> None:
    # 16 MiB a maps a 20 MiB page, 4 MiB free after it; 10 MiB b: the 4 MiB tail plus 6 MiB of a new page
    # (one more page: 40 MiB), so b starts at 16 MiB and 14 MiB stay free after it
    m = model("expandable_segments:True")
    m.malloc(1, 16 * MiB)
    m.malloc(2, 10 * MiB)
    assert shape(m) == [(40.0, [(16.0, True), (10.0, True), (14.0, False)])]


# -------------------------------------------------------------------------------------- empty_cache


def test_empty_cache_releases_every_segment_without_a_live_block() -> None:
    # a 16 MiB (its own segment) freed; b 2 MiB lives in a 20 MiB segment: only b's segment stays
    m = model()
    m.malloc(1, 16 * MiB)
    m.malloc(2, 2 * MiB)
    m.free(1)
    m.empty_cache()
    assert shape(m) == [(20.0, [(2.0, True), (18.0, False)])]
    assert (m.reserved, m.inactive_split) == (20 * MiB, 18 * MiB)


# ------------------------------------------------------------------------------------ the counters


def test_peaks_and_reset_peak() -> None:
    m = model()
    m.malloc(1, 16 * MiB)
    m.free(1)
    m.empty_cache()
    assert (m.peak_allocated, m.peak_reserved, m.peak_requested) == (16 * MiB, 16 * MiB, 16 * MiB)
    m.malloc(2, 1000)
    m.reset_peak()
    assert (m.peak_allocated, m.peak_reserved, m.peak_requested) == (1024, 2 * MiB, 1000)


def test_unknown_keys_are_ignored_and_a_live_key_is_freed_before_reuse() -> None:
    m = model()
    m.free(99)
    m.malloc(1, 4 * MiB)
    m.malloc(1, 8 * MiB)  # the 4 MiB block is freed first
    assert (m.allocated, m.live_blocks()) == (8 * MiB, {1: 8 * MiB})
    m.check_consistency()


def test_allocation_size_follows_get_allocation_size() -> None:
    m = model()
    assert [m.allocation_size(size) for size in (512, MiB, MiB + 512, 10 * MiB - 512, 10 * MiB, 11 * MiB)] == [
        2 * MiB,
        2 * MiB,
        20 * MiB,
        20 * MiB,
        10 * MiB,
        12 * MiB,
    ]


# -------------------------------------------------------------------------------------- properties

SETTINGS = st.sampled_from(
    [
        "",
        "max_split_size_mb:20",
        "max_split_size_mb:32,max_non_split_rounding_mb:64",
        "expandable_segments:True",
        "roundup_power2_divisions:4",
        "roundup_power2_divisions:[1:8,16:2,>:4]",
        "large_segment_size_mb:32",
        "expandable_segments:True,max_split_size_mb:24,roundup_power2_divisions:2",
    ]
)
SIZES = st.one_of(
    st.integers(1, 4 * KiB),
    st.integers(4 * KiB, 2 * MiB),
    st.integers(MiB, 12 * MiB),
    st.integers(10 * MiB, 90 * MiB),
    st.sampled_from([MiB, 2 * MiB, 16 * MiB, 20 * MiB, 32 * MiB, 25 * MiB // 2, 27 * MiB // 2]),
)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), SIZES, st.sampled_from([0, 0, 0, 1])),
        st.tuples(st.just("free"), st.integers(0, 63), st.just(0)),
        st.tuples(st.just("empty"), st.just(0), st.just(0)),
    ),
    max_size=120,
)


def check(m: CachingAllocatorModel, requested: dict[int, int]) -> None:
    m.check_consistency()
    segments = m.segments()
    assert m.reserved == sum(size for size, _ in segments)
    assert all(size == sum(b for b, _ in blocks) for size, blocks in segments)
    assert m.allocated <= m.reserved
    assert m.allocated == sum(b for _, blocks in segments for b, live in blocks if live)
    assert m.allocated == sum(m.live_blocks().values())
    assert m.requested == sum(requested.values()) <= m.allocated
    assert m.peak_allocated >= m.allocated and m.peak_reserved >= m.reserved
    assert m.peak_requested >= m.requested and m.peak_inactive_split >= m.inactive_split
    assert m.capacity is None or m.reserved <= m.capacity


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SETTINGS, st.one_of(st.none(), st.integers(16, 400).map(lambda mib: mib * MiB)), OPS)
def test_random_sequences_keep_the_invariants(text: str, capacity: int | None, ops: list[tuple[str, int, int]]) -> None:
    m = model(text, capacity)
    requested: dict[int, int] = {}
    next_key = 0
    for op, value, stream in ops:
        if op == "malloc":
            before = (m.allocated, m.requested)
            try:
                counted = m.malloc(next_key, value, stream)
            except AllocatorOutOfMemory as error:
                assert (m.allocated, m.requested) == before  # nothing was handed out
                assert error.reserved == m.reserved and error.allocated == m.allocated
                assert capacity is not None and error.capacity == capacity
                assert m.reserved + error.segment > capacity or m.settings.expandable_segments
            else:
                assert counted >= m.round_size(value)
                requested[next_key] = value
            next_key += 1
        elif op == "free" and requested:
            key = sorted(requested)[value % len(requested)]
            m.free(key)
            del requested[key]
        elif op == "empty":
            m.empty_cache()
            # only segments with a live block remain (an expandable one keeps only partial free pages)
            assert all(any(live for _, live in blocks) for _, blocks in m.segments())
            assert m.inactive_split <= m.reserved - m.allocated
        check(m, requested)
    for key in list(requested):
        m.free(key)
        del requested[key]
    check(m, requested)
    assert (m.allocated, m.requested) == (0, 0)
    m.empty_cache()
    assert (m.reserved, m.segments(), m.inactive_split) == (0, [], 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40 * MiB), min_size=1, max_size=40))
def test_a_sequence_replayed_after_empty_cache_reserves_the_same(sizes: list[int]) -> None:
    # the allocator's state after empty_cache with nothing live is its initial state
    m = model()

    def run() -> tuple[int, int]:
        for key, size in enumerate(sizes):
            m.malloc(key, size)
        figures = (m.reserved, m.allocated)
        for key in range(len(sizes)):
            m.free(key)
        m.empty_cache()
        return figures

    assert run() == run()


# ----------------------------------------------------------------------------------------- parsing


def test_parse_defaults() -> None:
    for text in (None, "", "   "):
        assert AllocatorSettings.parse(text) == AllocatorSettings()
    assert AllocatorSettings().describe() == ""


def test_parse_the_usual_settings() -> None:
    s = AllocatorSettings.parse("max_split_size_mb:128,expandable_segments:True")
    assert (s.max_split_size, s.expandable_segments, s.ignored) == (128 * MiB, True, ())
    assert s.describe() == "max_split_size_mb:128, expandable_segments"
    # blanks anywhere are dropped, as torch's tokenizer drops them; a trailing comma is accepted
    assert AllocatorSettings.parse(" max_split_size_mb : 128 , expandable_segments:True, ") == s
    assert AllocatorSettings.parse("expandable_segments:False") == AllocatorSettings()


def test_parse_roundup_power2_divisions() -> None:
    assert AllocatorSettings.parse("roundup_power2_divisions:4").roundup_power2_divisions == (4,)
    assert AllocatorSettings.parse("roundup_power2_divisions:4").describe() == "roundup_power2_divisions:4"
    # [256:1,512:2,>:4]: the first entry fills the intervals below it too; '>' the ones after the last
    table = AllocatorSettings.parse("roundup_power2_divisions:[256:1,512:2,>:4]").roundup_power2_divisions
    assert table == (1,) * 9 + (2,) + (4,) * 6
    # [64:8,256:4]: 0..6 -> 8, interval 7 unnamed stays 0, 8 -> 4, the rest 0
    table = AllocatorSettings.parse("roundup_power2_divisions:[64:8,256:4]").roundup_power2_divisions
    assert table == (8,) * 7 + (0, 4) + (0,) * 7
    # [>:4] alone fills from interval 1: interval 0 keeps 0
    table = AllocatorSettings.parse("roundup_power2_divisions:[>:4]").roundup_power2_divisions
    assert table == (0,) + (4,) * (INTERVALS - 1)
    # only 0s and 1s: no power-of-two rounding at all
    assert AllocatorSettings.parse("roundup_power2_divisions:1") == AllocatorSettings()
    assert AllocatorSettings(roundup_power2_divisions=(4,) * INTERVALS).roundup_power2_divisions == (4,)


def test_parse_segment_and_rounding_sizes() -> None:
    s = AllocatorSettings.parse("large_segment_size_mb:32,max_split_size_mb:32")
    assert (s.large_segment_size, s.max_split_size, s.non_split_rounding) == (32 * MiB, 32 * MiB, 32 * MiB)
    assert s.describe() == "large_segment_size_mb:32, max_split_size_mb:32"
    s = AllocatorSettings.parse("max_split_size_mb:20,max_non_split_rounding_mb:40")
    assert s.describe() == "max_split_size_mb:20, max_non_split_rounding_mb:40"


def test_parse_lists_the_keys_it_does_not_model() -> None:
    text = (
        "garbage_collection_threshold:0.6,backend:native,release_lock_on_cudamalloc:True,"
        "pinned_use_cuda_host_register:True,pinned_num_register_threads:8,per_process_memory_fraction:0.5,"
        "expandable_segments:True"
    )
    s = AllocatorSettings.parse(text)
    assert s.ignored == (
        "garbage_collection_threshold",
        "backend",
        "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register",
        "pinned_num_register_threads",
    )
    assert s.per_process_memory_fraction == 0.5
    assert s.describe() == "expandable_segments"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_split_size_mb:abc", "invalid value 'abc' for max_split_size_mb (expected a whole number)"),
        (
            "max_split_size_mb:10",
            "invalid value '10' for max_split_size_mb (must be at least 20 MiB, the large segment size)",
        ),
        (
            "large_segment_size_mb:32,max_split_size_mb:24",
            "invalid value '24' for max_split_size_mb (must be at least 32 MiB, the large segment size)",
        ),
        ("large_segment_size_mb:10", "invalid value '10' for large_segment_size_mb (must be more than 10 MiB)"),
        ("expandable_segments:yes", "invalid value 'yes' for expandable_segments (expected True or False)"),
        ("expandable_segments:true", "invalid value 'true' for expandable_segments (expected True or False)"),
        (
            "roundup_power2_divisions:3",
            "invalid value '3' for roundup_power2_divisions (the divisions must be a power of 2)",
        ),
        (
            "roundup_power2_divisions:[100:4]",
            "invalid value '100' for roundup_power2_divisions (the interval must be a power of 2 MiB)",
        ),
        (
            "garbage_collection_threshold:1.5",
            "invalid value '1.5' for garbage_collection_threshold (must be in (0.0, 1.0))",
        ),
        ("per_process_memory_fraction:x", "invalid value 'x' for per_process_memory_fraction (expected a number)"),
        ("backend:nativ", "invalid value 'nativ' for backend (torch knows native and cudaMallocAsync)"),
        ("foo:1", "unrecognized key 'foo' (torch 2.13 rejects it too)"),
        ("max_split_size_mb", "expected ':' after max_split_size_mb"),
        ("max_split_size_mb:", "max_split_size_mb has no value"),
        ("max_split_size_mb:128:3", "unrecognized key '3' (torch 2.13 rejects it too)"),
    ],
)
def test_parse_rejects_bad_values_in_one_line(text: str, message: str) -> None:
    with pytest.raises(ModelError) as caught:
        AllocatorSettings.parse(text)
    assert str(caught.value) == f"PYTORCH_CUDA_ALLOC_CONF: {message}"
    assert "\n" not in str(caught.value)


def test_parse_says_cuda_malloc_async_is_not_modelled() -> None:
    with pytest.raises(ModelError) as caught:
        AllocatorSettings.parse("backend:cudaMallocAsync")
    assert str(caught.value) == (
        "PYTORCH_CUDA_ALLOC_CONF: backend:cudaMallocAsync (the driver's stream-ordered allocator) is not "
        "modelled; only the native caching allocator is"
    )


def test_from_environ_reads_pytorch_cuda_alloc_conf_then_pytorch_alloc_conf() -> None:
    assert AllocatorSettings.from_environ({}) == AllocatorSettings()
    both = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert AllocatorSettings.from_environ(both).max_split_size == 64 * MiB
    assert AllocatorSettings.from_environ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}).expandable_segments
    with pytest.raises(ModelError, match=r"^PYTORCH_ALLOC_CONF: invalid value"):
        AllocatorSettings.from_environ({"PYTORCH_ALLOC_CONF": "expandable_segments:1"})
