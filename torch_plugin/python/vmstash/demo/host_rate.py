"""What the host allows a pause into backup memory that went back to the OS after the last
resume (torch_memory_saver's default mode), measured with torch alone in a process of its
own: the RL demo's peer bound (tms_peer.py) uses it where it is below the pinned link.

    python3 -m vmstash.demo.host_rate [--device 0] [--gib 4] [--rounds 3]

NBYTES of huge-page host memory get the life of such a backup (registered in 64 MiB pieces,
written by D2H copies, unregistered, handed back with MADV_FREE, faulted in again), then a
D2H of NBYTES goes into it, timed (best of --rounds), two ways:
  inline   each piece registered again, then its copy queued (it runs while the next piece
           registers): the fastest of the registering ways bench/host_ceiling_bench.cc's
           `reuse` rows compare
  staged   through a ring of 8 pinned 16 MiB slots, each slot copied into the pageable memory
           by torch's CPU threads while the link fills the next ones (nothing registered;
           host_ceiling_bench's `staged` rows)
Prints one JSON line, {"inline": B/s, "staged": B/s, "rate": the faster} with exit status 0,
or {"error": "..."} with 1. A process of its own: a refused registration leaves no pinned
pages or CUDA error behind in the caller, and no vmstash code runs here (the caller drops
its preload library from the environment).
"""
import argparse
import json
import mmap
import sys
import time

PIECE = 64 << 20
SLOT, SLOTS = 16 << 20, 8
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14


def copy_staged(src, host, ring, events, stream):
    """src (device) into host (pageable) through the pinned ring's SLOTS slots: the link
    fills a slot while torch's CPU threads copy an earlier one out; a slot is refilled only
    after its copy out."""
    import torch
    nbytes = src.numel()
    chunks = (nbytes + SLOT - 1) // SLOT

    def view(t, i, at):
        return t[at:at + min(SLOT, nbytes - i * SLOT)]

    def fill(i):
        with torch.cuda.stream(stream):
            view(ring, i, (i % SLOTS) * SLOT).copy_(view(src, i, i * SLOT), non_blocking=True)
            events[i % SLOTS].record(stream)
    for i in range(min(chunks, SLOTS)):
        fill(i)
    for i in range(chunks):
        events[i % SLOTS].synchronize()
        view(host, i, i * SLOT).copy_(view(ring, i, (i % SLOTS) * SLOT))
        if i + SLOTS < chunks:
            fill(i + SLOTS)
    stream.synchronize()


def measure(device, nbytes, rounds):
    import torch
    torch.cuda.set_device(device)
    cudart = torch.cuda.cudart()
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)  # advice only, as for vmstash's arenas
    except OSError:  # no transparent huge pages here
        pass
    host = torch.frombuffer(m, dtype=torch.uint8)  # a view of m (which stays open to the end)
    base = host.data_ptr()
    src = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    ring = torch.empty(SLOT * SLOTS, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream(device)
    events = [torch.cuda.Event() for _ in range(SLOTS)]
    starts = range(0, nbytes, PIECE)

    def register(at):
        err = cudart.cudaHostRegister(base + at, min(PIECE, nbytes - at), 1)  # cudaHostRegisterPortable
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {min(PIECE, nbytes - at)} bytes: {cudart.cudaGetErrorString(err)}")

    def unregister_all():
        for at in starts:
            err = cudart.cudaHostUnregister(base + at)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostUnregister: {cudart.cudaGetErrorString(err)}")

    def copy(at):
        with torch.cuda.stream(stream):
            host[at:at + PIECE].copy_(src[at:at + PIECE], non_blocking=True)

    def fault_in():
        try:
            m.madvise(MADV_POPULATE_WRITE)
        except OSError:  # kernels before 5.14
            host[::4096] = 1

    def inline():  # each piece registered, then its copy queued (it runs while the next registers)
        for at in starts:
            register(at)
            copy(at)
        stream.synchronize()

    def handed_back():
        """The life of a backup up to the next pause."""
        inline()
        unregister_all()
        m.madvise(mmap.MADV_FREE)
        fault_in()

    def staged():
        copy_staged(src, host, ring, events, stream)

    fault_in()
    best = {}
    for r in range(rounds):
        for k, (name, way) in enumerate((("inline", inline), ("staged", staged))):
            handed_back()
            value = (2 * r + k) % 253 + 2  # not 0 or 1 (a fresh or faulted-in page) nor the last value
            src.fill_(value)
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            way()
            seconds = time.perf_counter() - t0
            if name == "inline":
                unregister_all()
            if not bool((host[::4096] == value).all()):
                raise RuntimeError(f"the {name} copy did not arrive")
            best[name] = min(best.get(name, seconds), seconds)
    rates = {name: nbytes / s for name, s in best.items()}
    rates["rate"] = max(rates.values())
    return rates


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    nbytes = int(args.gib * (1 << 30)) // PIECE * PIECE
    if nbytes <= 0 or args.rounds < 1:
        print(json.dumps({"error": "--gib must be at least 64 MiB and --rounds at least 1"}))
        return 1
    try:
        out = measure(args.device, nbytes, args.rounds)
    except Exception as e:  # noqa: BLE001 - any failure is this process's answer, reported whole
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
