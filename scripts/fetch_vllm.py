#!/usr/bin/env python3
"""Fetches what the vLLM tests and benchmark need of vLLM 0.33.0 from PyPI (a machine with
network; the GPU machine has none: carry the folder), into a git-ignored folder:

    python3 scripts/fetch_vllm.py [DEST]          (default third_party/vllm)

  DEST/pkg/vllm/...   from the wheel: device_allocator/ (CuMemAllocator, the sleep-mode
                      backends), cumem_allocator.abi3.so, compilation/cudagraph_pool.py
  DEST/tests/...      from the source archive: tests/basic_correctness/memory/cumem/test_cumem.py
                      (vLLM's allocator tests, run unmodified by scripts/run_vllm_suite.sh)

vLLM's engine does not run under the GPU machine's PyTorch, so only these files are taken;
small stand-ins for the vLLM modules they import are in
torch_plugin/python/tests/vllm_standins (its assemble.py puts both together). Both archives are checked against their published SHA-256.
"""
import hashlib
import io
import os
import re
import sys
import tarfile
import urllib.request
import zipfile

VERSION = "0.33.0"
WHEEL = f"vllm-{VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
SDIST = f"vllm-{VERSION}.tar.gz"
FROM_WHEEL = ("vllm/device_allocator/__init__.py", "vllm/device_allocator/cumem.py",
              "vllm/device_allocator/alloc_conf.py", "vllm/device_allocator/sleep_mode_backend.py",
              "vllm/cumem_allocator.abi3.so", "vllm/compilation/cudagraph_pool.py")
FROM_SDIST = ("tests/basic_correctness/memory/cumem/test_cumem.py",)
INDEX = "https://pypi.org/simple/vllm/"


def links():
    with urllib.request.urlopen(INDEX, timeout=60) as r:
        page = r.read().decode()
    out = {}
    for url in re.findall(r'href="([^"]+)"', page):
        name = url.split("#")[0].rsplit("/", 1)[-1]
        digest = re.search(r"#sha256=([0-9a-f]{64})", url)
        out[name] = (url.split("#")[0], digest.group(1) if digest else None)
    return out


def download(name, found):
    if name not in found:
        raise SystemExit(f"fetch_vllm: {name} is not on {INDEX}")
    url, digest = found[name]
    print(f"fetch_vllm: downloading {name}", file=sys.stderr)
    with urllib.request.urlopen(url, timeout=600) as r:
        data = r.read()
    if digest and hashlib.sha256(data).hexdigest() != digest:
        raise SystemExit(f"fetch_vllm: {name}: SHA-256 differs from the index's")
    return data


def write(dest, rel, data, mode=0o644):
    path = os.path.join(dest, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def main(argv):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dest = argv[0] if argv else os.path.join(root, "third_party", "vllm")
    found = links()
    with zipfile.ZipFile(io.BytesIO(download(WHEEL, found))) as z:
        for rel in FROM_WHEEL:
            write(dest, os.path.join("pkg", rel), z.read(rel), 0o755 if rel.endswith(".so") else 0o644)
    with tarfile.open(fileobj=io.BytesIO(download(SDIST, found)), mode="r:gz") as t:
        for rel in FROM_SDIST:
            write(dest, rel, t.extractfile(f"vllm-{VERSION}/{rel}").read())
    with open(os.path.join(dest, "VERSION"), "w") as f:
        f.write(VERSION + "\n")
    print(f"fetch_vllm: vLLM {VERSION}'s files in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
