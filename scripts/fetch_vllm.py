#!/usr/bin/env python3
"""Fetches what the vLLM tests and benchmark need of a vLLM release from PyPI (a machine with
network; the GPU machine has none: carry the folder), into a git-ignored folder:

    python3 scripts/fetch_vllm.py [--version V] [DEST]
        V: 0.33.0 (the default; DEST default third_party/vllm) or an earlier release that
        frameworks pin, e.g. 0.24.0, 0.25.0, 0.27.1 (DEST default third_party/vllm-V)

  DEST/pkg/vllm/...   from the wheel: device_allocator/ (CuMemAllocator, the sleep-mode
                      backends where the release has them), cumem_allocator.abi3.so,
                      compilation/cudagraph_pool.py (0.33), plugins/__init__.py (the loader
                      of vllm.general_plugins, which runs vmstash's entry point)
  DEST/tests/...      from the source archive: vLLM's allocator tests (test_cumem.py, or
                      test_mem.py before 0.33) where the release keeps them (run unmodified by
                      scripts/run_vllm_suite.sh)

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

DEFAULT_VERSION = "0.33.0"
# Every release has the first two; the others are taken where the release has them.
NEEDED = ("vllm/device_allocator/__init__.py", "vllm/device_allocator/cumem.py", "vllm/cumem_allocator.abi3.so",
          "vllm/plugins/__init__.py")
OPTIONAL = ("vllm/device_allocator/alloc_conf.py", "vllm/device_allocator/sleep_mode_backend.py",
            "vllm/compilation/cudagraph_pool.py")
# vLLM's allocator tests: tests/basic_correctness/test_mem.py up to 0.27, then
# tests/basic_correctness/memory/cumem/test_cumem.py.
TEST_FILES = ("test_cumem.py", "test_mem.py")
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


def default_dest(root, version):
    name = "vllm" if version == DEFAULT_VERSION else f"vllm-{version}"
    return os.path.join(root, "third_party", name)


def main(argv):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default=DEFAULT_VERSION)
    ap.add_argument("dest", nargs="?")
    args = ap.parse_args(argv)
    version = args.version
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise SystemExit(f"fetch_vllm: --version wants a release such as 0.25.0, got {version!r}")
    dest = args.dest or default_dest(root, version)
    found = links()
    wheel = f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(io.BytesIO(download(wheel, found))) as z:
        names = set(z.namelist())
        for rel in NEEDED + tuple(r for r in OPTIONAL if r in names):
            write(dest, os.path.join("pkg", rel), z.read(rel), 0o755 if rel.endswith(".so") else 0o644)
    with tarfile.open(fileobj=io.BytesIO(download(f"vllm-{version}.tar.gz", found)), mode="r:gz") as t:
        prefix = f"vllm-{version}/"
        tests = [m.name for m in t.getmembers() if m.name.startswith(prefix + "tests/basic_correctness/")
                 and os.path.basename(m.name) in TEST_FILES]
        if len(tests) != 1:
            raise SystemExit(f"fetch_vllm: {len(tests)} of {TEST_FILES} under tests/basic_correctness of {version}'s "
                             f"archive")
        write(dest, tests[0][len(prefix):], t.extractfile(tests[0]).read())
    with open(os.path.join(dest, "VERSION"), "w") as f:
        f.write(version + "\n")
    print(f"fetch_vllm: vLLM {version}'s files in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
