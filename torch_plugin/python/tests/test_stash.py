"""vmstash.stash without a GPU: the paged stash arena on the simulated driver (host executor)."""
import ctypes

import pytest

import vmstash


def test_stash_arena_round_trip_overflow_reset_and_pause_refusal(sim):
    from vmstash import stash
    row, p_rows = 64, 4
    with pytest.raises(ValueError):
        stash.Arena(row_bytes=0, device_pages=4, device=0)
    with pytest.raises(vmstash.Error) as e:
        stash.Arena(row_bytes=row, device_pages=4, page_rows=3, device=0)
    assert "power of two" in str(e.value)
    arena = stash.Arena(row_bytes=row, device_pages=3, host_pages=2, page_rows=p_rows, tag="stash_py",
                        device=0)
    assert arena.info()["executor"] == "host"
    assert arena.info()["device_bytes"] == 3 * p_rows * row
    max_rows = 10
    src = sim.malloc("default", max_rows * row)
    dst = sim.malloc("default", max_rows * row)
    n = sim.malloc("default", 8)
    ctypes.memmove(src, bytes(range(256)) * (max_rows * row // 256), max_rows * row)
    h1, h2, h3 = (arena._new_handle(max_rows) for _ in range(3))
    ctypes.c_int64.from_address(n).value = 9          # 3 pages: the whole device tier
    arena.stash_ptr(src, n, max_rows, h1)
    assert arena.pages_in_use() == 3
    with pytest.raises(vmstash.Error) as e:
        vmstash.pause("stash_py", device=0)
    assert e.value.code_name == "FAILED_PRECONDITION"
    ctypes.c_int64.from_address(n).value = 5          # 2 pages: spills to the host tier
    arena.stash_ptr(src, n, max_rows, h2)
    f = arena.flags()
    assert f.host_spill
    assert not f.overflow
    ctypes.c_int64.from_address(n).value = 1          # no room anywhere: sticky overflow
    arena.stash_ptr(src, n, max_rows, h3)
    f = arena.flags()
    assert f.overflow
    assert f.last_failed_pages == 1
    ctypes.memset(dst, 0xAA, max_rows * row)
    arena.reset()                                     # forgets all, clears overflow
    assert not arena.flags().overflow
    assert arena.pages_in_use() == 0
    ctypes.c_int64.from_address(n).value = 6
    arena.stash_ptr(src, n, max_rows, h1)
    arena.restore_ptr(h1, dst, max_rows, zero_tail=True)
    assert ctypes.string_at(dst, 6 * row) == ctypes.string_at(src, 6 * row)
    assert ctypes.string_at(dst + 6 * row, 4 * row) == bytes(4 * row)
    vmstash.pause("stash_py", device=0)               # idle: allowed, memory released
    vmstash.resume("stash_py", device=0)
    arena.reset()
    arena.stash_ptr(src, n, max_rows, h1)
    arena.discard_ptr(h1, max_rows)
    assert arena.pages_in_use() == 0
    arena.close()
    with pytest.raises(vmstash.Error):
        arena.reset()
    for p, size in ((src, max_rows * row), (dst, max_rows * row), (n, 8)):
        sim.free(p, size)


def test_stash_linked_flags_and_launch_shape(sim):
    from vmstash import stash
    with pytest.raises(vmstash.Error) as e:
        stash.set_launch_shape(264, 33)
    assert "multiple of 32" in str(e.value)
    stash.set_launch_shape(0, 0)  # keeps both
    row, p_rows, max_rows = 32, 4, 8
    a = stash.Arena(row_bytes=row, device_pages=2, page_rows=p_rows, tag="stash_link", device=0)
    b = stash.Arena(row_bytes=2 * row, device_pages=4, page_rows=p_rows, tag="stash_link", device=0)
    flags = sim.malloc("default", 16)
    ctypes.memset(flags, 0, 16)
    a.link_flags(flags, flags + 8)
    b.link_flags(flags, flags + 8)
    src, dst = sim.malloc("default", max_rows * 2 * row), sim.malloc("default", max_rows * 2 * row)
    n = sim.malloc("default", 8)
    ctypes.memmove(src, bytes(range(256))[: max_rows * 2 * row], max_rows * 2 * row)
    ha, hb = a._new_handle(max_rows), b._new_handle(max_rows)
    ctypes.c_int64.from_address(n).value = max_rows + 1   # clamped to 8 rows: 2 pages, fits
    a.stash_ptr(src, n, max_rows, ha)
    a.discard_ptr(ha, max_rows)
    ctypes.c_int64.from_address(n).value = max_rows
    a.stash_ptr(src, n, max_rows, ha)
    hc = a._new_handle(max_rows)
    a.stash_ptr(src, n, max_rows, hc)                    # no room: the shared overflow is set
    assert ctypes.c_int64.from_address(flags).value == 1
    b.stash_ptr(src, n, max_rows, hb)                    # a no-op in the other arena
    assert b.pages_in_use() == 0
    ctypes.c_int64.from_address(flags).value = 0         # the owner clears it, then resets
    a.reset()
    b.reset()
    b.stash_ptr(src, n, max_rows, hb)
    ctypes.memset(dst, 0, max_rows * 2 * row)
    b.restore_ptr(hb, dst, max_rows)
    assert ctypes.string_at(dst, max_rows * 2 * row) == ctypes.string_at(src, max_rows * 2 * row)
    a.close()
    b.close()
    for p, size in ((src, max_rows * 2 * row), (dst, max_rows * 2 * row), (n, 8), (flags, 16)):
        sim.free(p, size)
