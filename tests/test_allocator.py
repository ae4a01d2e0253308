"""The caching-allocator model on cases worked out by hand from
c10/cuda/CUDACachingAllocator.cpp (round_size, get_allocation_size, get_free_block,
should_split, free_block/try_merge_blocks, release_cached_blocks, expandable segments)."""
import pytest

from vramplan.allocator import CachingAllocator, OutOfMemory, allocation_size, replay, round_size
from vramplan.spec import SpecError
from vramplan.spec.alloc_conf import AllocConf, parse_alloc_conf

MiB = 2**20


def test_rounding_to_512_bytes_and_power2_divisions():
    conf = AllocConf()
    assert round_size(1, conf) == 512
    assert round_size(513, conf) == 1024
    # 1200 MiB with 4 divisions of [1024, 2048) MiB: 1024, 1280, 1536, 1792 -> 1280 MiB
    four = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1200 * MiB, four) == 1280 * MiB
    # per-interval form, keyed by MB: "[256:2]" gives 2 divisions to every interval up to
    # [256, 512) MB (the first entry fills the ones below it) and 0 above.
    listed = parse_alloc_conf("roundup_power2_divisions:[256:2]")
    assert round_size(300 * MiB, listed) == 384 * MiB        # [256, 512) in halves
    assert round_size(100 * MiB + 1, listed) == 128 * MiB    # [64, 128) in halves
    assert round_size(600 * MiB + 1, listed) == 600 * MiB + 512
    # ">" fills from the last named interval on, overwriting it
    assert round_size(300 * MiB, parse_alloc_conf("roundup_power2_divisions:[256:2,>:0]")) == 300 * MiB


def test_segment_sizes():
    assert allocation_size(MiB) == 2 * MiB          # small pool: 2 MiB segments
    assert allocation_size(MiB + 512) == 20 * MiB   # 1-10 MiB: a 20 MiB segment
    assert allocation_size(10 * MiB) == 10 * MiB    # >= 10 MiB: rounded to 2 MiB
    assert allocation_size(11 * MiB) == 12 * MiB


def test_one_mib_plus_one_byte_gets_a_20_mib_segment_and_is_split():
    a = CachingAllocator()
    b = a.malloc(MiB + 1)
    assert a.reserved == 20 * MiB
    assert b.size == MiB + 512 and a.allocated == MiB + 512   # remainder > 1 MiB: split
    small = a.malloc(MiB)
    assert a.reserved == 22 * MiB and small.pool.small         # 1 MiB: a 2 MiB small segment


def test_unsplit_remainder_counts_as_allocated():
    a = CachingAllocator()
    a.malloc(11 * MiB + 1)         # 12 MiB segment; remainder 1 MiB - 512 <= kSmallSize
    assert a.allocated == 12 * MiB and a.requested == 11 * MiB + 1


def test_larger_request_after_free_opens_a_new_segment():
    a = CachingAllocator()
    a.free(a.malloc(12 * MiB))
    a.malloc(14 * MiB)             # the cached 12 MiB block is too small
    assert a.reserved == 26 * MiB
    a.malloc(12 * MiB)             # ... and serves the next 12 MiB request
    assert a.reserved == 26 * MiB
    assert sorted(s for _, s in a.segment_sizes()) == [12 * MiB, 14 * MiB]


def test_freed_neighbours_merge_within_a_segment():
    a = CachingAllocator()
    x, y = a.malloc(4 * MiB), a.malloc(4 * MiB)   # both from one 20 MiB segment
    assert a.reserved == 20 * MiB
    a.free(x)
    a.free(y)
    a.malloc(18 * MiB)             # fits only in the merged 20 MiB block
    assert a.reserved == 20 * MiB


def test_max_split_size_keeps_oversize_blocks_whole():
    plain = CachingAllocator()
    plain.free(plain.malloc(40 * MiB))
    plain.malloc(25 * MiB)         # split from the cached 40 MiB block
    assert plain.reserved == 40 * MiB
    capped = CachingAllocator(parse_alloc_conf("max_split_size_mb:32"))
    capped.free(capped.malloc(40 * MiB))
    capped.malloc(25 * MiB)        # an oversize block is not given to a smaller request
    assert capped.reserved == 66 * MiB
    # an oversize request takes an oversize block only within kLargeBuffer (20 MiB) of it,
    # and does not split it
    c = CachingAllocator(parse_alloc_conf("max_split_size_mb:32"))
    c.free(c.malloc(50 * MiB))
    blk = c.malloc(35 * MiB)
    assert c.reserved == 50 * MiB and blk.size == 50 * MiB
    d = CachingAllocator(parse_alloc_conf("max_split_size_mb:32"))
    d.free(d.malloc(60 * MiB))
    d.malloc(35 * MiB)             # 60 >= 35 + 20: a new segment
    assert d.reserved == 96 * MiB


def test_small_pool_packs_2_mib_segments():
    a = CachingAllocator()
    for _ in range(100):
        a.malloc(64 * 1024)        # 32 per 2 MiB segment
    assert a.reserved == 4 * 2 * MiB


def test_expandable_segments_reuse_freed_space():
    a = CachingAllocator(parse_alloc_conf("expandable_segments:True"))
    a.free(a.malloc(12 * MiB))     # maps one 20 MiB page
    assert a.reserved == 20 * MiB
    a.malloc(14 * MiB)             # the freed page is reused, no new segment
    assert a.reserved == 20 * MiB
    # growing: a free tail of 6 MiB is extended by one more page for a 12 MiB request
    a.malloc(12 * MiB)
    assert a.reserved == 40 * MiB
    assert a.segment_sizes() == [("large", 40 * MiB)]


def test_free_cached_blocks_and_retry_at_capacity():
    a = CachingAllocator(capacity=40 * MiB)
    a.free(a.malloc(30 * MiB))
    a.malloc(36 * MiB)             # 30 + 36 > 40: free the cached 30 MiB segment, retry
    assert a.reserved == 36 * MiB and a.num_retries == 1
    with pytest.raises(OutOfMemory):
        a.malloc(10 * MiB)


def test_garbage_collection_frees_old_segments_before_retrying():
    conf = parse_alloc_conf("garbage_collection_threshold:0.5")
    runs = {}
    for name, fraction in (("gc", 1.0), ("no fraction", None)):
        a = CachingAllocator(conf, capacity=100 * MiB, memory_fraction=fraction)
        a.free(a.malloc(30 * MiB))
        a.free(a.malloc(32 * MiB))
        a.malloc(40 * MiB)
        runs[name] = a
    assert runs["gc"].num_retries == 0 and runs["gc"].reserved <= 100 * MiB
    # without a memory fraction the threshold is inactive (malloc: `set_fraction &&`)
    assert runs["no fraction"].num_retries == 1


def test_replay_peaks_and_fragmentation():
    step = ((1, 30 * MiB), (2, 8 * MiB), (1, 0), (3, 36 * MiB), (2, 0), (3, 0))
    res = replay(((0, 100 * MiB),), step)
    # the 36 MiB request cannot use the freed 30 MiB segment: reserved 100 + 30 + 20 + 36
    assert res.reserved_bytes == 186 * MiB
    assert res.requested_bytes == 144 * MiB
    assert res.fragmentation_bytes == res.inactive_bytes + res.rounding_bytes == 42 * MiB
    exp = replay(((0, 100 * MiB),), step, parse_alloc_conf("expandable_segments:True"))
    assert exp.reserved_bytes < res.reserved_bytes


def test_state_made_by_the_first_step_lands_in_a_freed_block():
    # Worked by hand from DeviceCachingAllocator::malloc. The step makes and frees a 30 MiB
    # activation; the optimizer state (20 MiB) is made either at setup or by the first step.
    step = ((1, 30 * MiB), (1, 0))
    # At setup: a 20 MiB segment, then a 30 MiB one for the activation, reused by every step.
    eager = replay(((0, 20 * MiB),), step)
    assert eager.reserved_bytes == 50 * MiB
    # By the first step: the state takes 20 MiB of the freed 30 MiB block (best fit, split:
    # the 10 MiB remainder is above kSmallSize); the second step's activation finds no 30
    # MiB block and opens a second 30 MiB segment.
    lazy = replay((), step, first=((1, 30 * MiB), (1, 0), (0, 20 * MiB)))
    assert lazy.reserved_bytes == 60 * MiB
    # A state the size of the activation takes its block whole, and the next step opens
    # one segment for its activation: 60 MiB as well, against 60 at setup.
    same = replay((), step, first=((1, 30 * MiB), (1, 0), (0, 30 * MiB)))
    assert same.reserved_bytes == replay(((0, 30 * MiB),), step).reserved_bytes == 60 * MiB


@pytest.mark.parametrize("text, word", [
    ("expandable_segment:True", "did you mean 'expandable_segments'"),
    ("max_split_size_mb:10", "too small"),
    ("garbage_collection_threshold:1.5", "(0.0, 1.0)"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("expandable_segments:yes", "True or False"),
    ("max_split_size_mb", "key:value"),
])
def test_bad_alloc_conf_names_the_option(text, word):
    with pytest.raises(SpecError) as err:
        parse_alloc_conf(text)
    assert word in str(err.value) and str(err.value).startswith("alloc_conf:")


def test_alloc_conf_parses_several_options():
    conf = parse_alloc_conf("expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.6")
    assert conf.expandable_segments and conf.max_split_size == 128 * MiB
    assert conf.garbage_collection_threshold == 0.6
