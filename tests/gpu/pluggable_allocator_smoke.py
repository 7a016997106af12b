"""libvmstash.so as PyTorch's CUDA allocator through CUDAPluggableAllocator (label gpu).

Usage: python3 pluggable_allocator_smoke.py PATH/TO/libvmstash.so
Checks that torch allocates through vmstash_malloc/vmstash_free with the exact
pluggable-allocator signatures: tensors work, tags route memory, stats see it, and
freeing returns it. Exits non-zero on any failure.
"""
import ctypes
import json
import sys

import torch


def main(path):
    lib = ctypes.CDLL(path)
    lib.vmstash_stats_json.restype = ctypes.c_void_p
    lib.vmstash_string_free.argtypes = [ctypes.c_void_p]
    lib.vmstash_last_error.restype = ctypes.c_char_p
    assert lib.vmstash_init(b"driver:cuda") == 0, lib.vmstash_last_error()
    assert lib.vmstash_create_tag(b"weights", b"backup") == 0, lib.vmstash_last_error()

    def stats():
        raw = lib.vmstash_stats_json(0)
        text = ctypes.string_at(raw).decode()
        lib.vmstash_string_free(raw)
        return json.loads(text)

    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "vmstash_malloc", "vmstash_free")
    torch.cuda.memory.change_current_allocator(alloc)
    a = torch.randn(1024, 1024, device="cuda")
    assert lib.vmstash_set_current_tag(b"weights") == 0
    w = torch.ones(4096, 4096, device="cuda")
    assert lib.vmstash_set_current_tag(b"default") == 0
    b = (a @ a).sum()
    assert torch.isfinite(b).item()
    assert w.sum().item() == 4096 * 4096
    s = stats()
    tags = {t["name"]: t for t in s["tags"]}
    assert tags["weights"]["allocated_bytes"]["current"] >= 4096 * 4096 * 4, tags["weights"]
    assert tags["weights"]["policy"] == "backup"
    assert tags["default"]["allocated_bytes"]["current"] >= 1024 * 1024 * 4, tags["default"]
    del w
    torch.cuda.synchronize()
    assert stats()["tags"][[t["name"] for t in stats()["tags"]].index("weights")]["allocated_bytes"]["current"] == 0
    print("pluggable allocator smoke: OK", json.dumps({k: s["total"][k] for k in ("allocated_bytes", "reserved_bytes")}))


if __name__ == "__main__":
    main(sys.argv[1])
