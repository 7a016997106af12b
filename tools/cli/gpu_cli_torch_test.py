"""The `vmstash` CLI against a PyTorch process (label gpu): the process keeps tensors in
vmstash regions; the CLI lists it, pauses and resumes its `weights` tag remotely (the
process sees its free memory rise and its data intact), and writes a torch-format
snapshot that PyTorch's memory_viz loads.

Env: VMSTASH_CLI (the vmstash binary), VMSTASH_LIBRARY / PYTHONPATH for the package.
"""
import os
import select
import subprocess
import sys
import tempfile

STEP_TIMEOUT_S = 120

CHILD = r"""
import sys, torch, vmstash
with vmstash.region("weights", policy="backup"):
    w = torch.randn(64 << 20, device="cuda")          # 256 MiB
with vmstash.region("kv_cache"):
    kv = torch.zeros(128 << 20, device="cuda")        # 512 MiB
ref = w.cpu()
torch.cuda.synchronize()
print("READY", flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "free":
        torch.cuda.synchronize()
        print(torch.cuda.mem_get_info()[0], flush=True)
    elif cmd == "check":
        print("OK" if torch.equal(w.cpu(), ref) else "BAD", flush=True)
    elif cmd == "quit":
        break
"""


def main():
    cli = os.environ["VMSTASH_CLI"]
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(cmd):
        child.stdin.write(cmd + "\n")
        child.stdin.flush()
        return read_line(f"the child's answer to {cmd!r}")

    def read_line(what):
        # A bounded wait: a stuck child fails the test, naming the step, instead of hanging it.
        ready, _, _ = select.select([child.stdout], [], [], STEP_TIMEOUT_S)
        assert ready, f"no {what} within {STEP_TIMEOUT_S} s"
        return child.stdout.readline().strip()

    def run(*args):
        try:
            r = subprocess.run([cli, *args], capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"`vmstash {' '.join(args)}` did not finish within {STEP_TIMEOUT_S} s; "
                                 f"output so far: {e.stdout!r} {e.stderr!r}") from None
        assert r.returncode == 0, (args, r.stdout, r.stderr)
        return r.stdout

    try:
        assert read_line("READY from the child") == "READY"
        pid = str(child.pid)
        ps = run("ps")
        assert pid in ps, ps
        print(ps, end="")
        free0 = int(ask("free"))
        print(run("pause", pid, "weights"), end="")
        free1 = int(ask("free"))
        assert free1 - free0 >= 250 << 20, (free0, free1)
        print(run("show", pid), end="")
        print(run("resume", pid, "weights"), end="")
        assert ask("check") == "OK"
        with tempfile.TemporaryDirectory() as d:
            pickle_path = os.path.join(d, "snap.pickle")
            run("pause", pid, "kv_cache")
            print(run("snapshot", pid, "-o", pickle_path, "--format=torch"), end="")
            run("resume", pid, "kv_cache")
            viz = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", pickle_path],
                                 capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
            assert viz.returncode == 0, viz.stderr
            print("memory_viz stats:\n" + "\n".join(viz.stdout.splitlines()[-6:]))
            # (`segments` fetches flamegraph.pl from the internet; segment_plot works offline.)
            html = os.path.join(d, "segments.html")
            plot = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "segment_plot", pickle_path, "-o",
                                   html], capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
            assert plot.returncode == 0 and os.path.getsize(html) > 0, plot.stderr
        print(f"cli against PyTorch process {pid}: remote pause freed {(free1 - free0) / (1 << 20):.0f} MiB, "
              "resume kept the weights, memory_viz loaded the snapshot: OK")
    finally:
        try:
            child.stdin.write("quit\n")
            child.stdin.flush()
            child.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            child.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
