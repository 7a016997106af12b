#!/usr/bin/env python3
"""Checks built wheels (scripts/build_wheel.sh runs it; so does the CI test command).

    scripts/check_wheel.py WHEEL...

For every ELF file in a wheel:
  * each NEEDED entry is glibc's (libc, libm, libdl, libpthread, librt, the loader), the
    C++ runtime's (libstdc++, libgcc_s) or a library one of the given wheels carries (the
    drop-in wheel's preload copies use the vmstash wheel's); nothing from CUDA
    (libcuda.so.1 is dlopen()ed at run time, the CUDA runtime is linked statically);
  * the glibc symbol versions it needs are covered by the wheel's manylinux tag;
  * an entry object (one no other file of the wheel needs: libvmstash.so, the preload
    library, the CLI) that needs a carried library has a DT_RPATH (not DT_RUNPATH) with
    $ORIGIN: the loader then searches it for the carried libraries' own dependencies too,
    so the bundled abseil/fmt libraries need no RPATH of their own.
For the vmstash wheel also: libvmstash.so carries the paged stash kernels for sm_80, sm_90
and sm_100 plus PTX (its .nv_fatbin entries), exports the vmstash_* and vmstash_stash_*
entry points and torch_memory_saver's tms_*, and the console commands are declared. Prints what it checked; exits 1
on the first wheel that fails, saying why.
"""
import os
import re
import struct
import subprocess
import sys
import tempfile
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wheel_writer import glibc_versions, is_elf  # noqa: E402

SYSTEM = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "ld-linux-x86-64.so.2",
          "libstdc++.so.6", "libgcc_s.so.1"}
KERNEL_ARCHS = {("elf", 80), ("elf", 90), ("elf", 100), ("ptx", 100)}
FATBIN_MAGIC = 0xBA55ED50


def readelf(*args):
    return subprocess.run(["readelf", *args], check=True, capture_output=True, text=True).stdout


def dynamic(path):
    """NEEDED entries and DT_RPATH entries (a DT_RUNPATH does not count: not transitive)."""
    out = readelf("-d", "-W", path)
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    rpath = re.findall(r"\(RPATH\)\s+Library rpath: \[([^\]]*)\]", out)
    return needed, rpath


def fatbin_entries(path):
    """(kind, arch) of every entry of the .nv_fatbin section: kind "elf" (SASS) or "ptx"."""
    sections = readelf("-S", "-W", path)
    match = re.search(r"\.nv_fatbin\s+PROGBITS\s+[0-9a-f]+\s+([0-9a-f]+)\s+([0-9a-f]+)", sections)
    if not match:
        return set()
    offset, size = int(match.group(1), 16), int(match.group(2), 16)
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    entries, pos = set(), 0
    while pos + 16 <= len(data):
        magic, _, header, fat = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            break
        entry = pos + header
        while entry < pos + header + fat:
            kind, _, entry_header, entry_size = struct.unpack_from("<HHIQ", data, entry)
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            entries.add(({1: "ptx", 2: "elf"}.get(kind, str(kind)), arch))
            entry += entry_header + entry_size
        pos = (pos + header + fat + 7) // 8 * 8
    return entries


def carried_libraries(wheels):
    """The file names of the shared libraries the wheels carry."""
    names = set()
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            names |= {os.path.basename(n) for n in z.namelist() if re.search(r"\.so(\.\d+)*$", n)}
    return names


def check(wheel, carried):
    """A list of problems (empty: the wheel passes) and a summary line."""
    problems = []
    tag = re.search(r"-py3-none-manylinux_(\d+)_(\d+)_x86_64\.whl$", os.path.basename(wheel))
    if not tag:
        return [f"{wheel}: not a py3-none-manylinux_X_Y_x86_64 wheel"], ""
    tag_glibc = (int(tag.group(1)), int(tag.group(2)))
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as z:
        z.extractall(tmp)
        names = z.namelist()
        elves = []
        for name in names:
            path = os.path.join(tmp, name)
            with open(path, "rb") as f:
                if is_elf(f.read(4)):
                    elves.append(name)
        linkage = {name: dynamic(os.path.join(tmp, name)) for name in elves}
        needed_here = {lib for needed, _ in linkage.values() for lib in needed}
        for name in elves:
            path = os.path.join(tmp, name)
            needed, rpath = linkage[name]
            entry = os.path.basename(name) not in needed_here
            for lib in needed:
                if lib in SYSTEM:
                    continue
                if lib not in carried:
                    problems.append(f"{name}: NEEDED {lib} is neither glibc/libstdc++ nor carried by the wheels")
                elif entry and not any("$ORIGIN" in r for r in rpath):
                    problems.append(f"{name}: needs the carried {lib} but has no DT_RPATH with $ORIGIN")
            newest = max(glibc_versions(path), default=(2, 17))
            if newest > tag_glibc:
                problems.append(f"{name}: needs GLIBC_{newest[0]}.{newest[1]}, above the tag's {tag_glibc}")
        summary = f"{os.path.basename(wheel)}: {len(elves)} ELF files, NEEDED only glibc/libstdc++/carried"
        if os.path.basename(wheel).startswith("vmstash-"):
            problems += check_vmstash(tmp, names)
            summary += "; paged stash kernels sm_80/sm_90/sm_100 + PTX; console commands"
    return problems, summary


def check_vmstash(tmp, names):
    problems = []
    lib = os.path.join(tmp, "vmstash", "lib", "libvmstash.so")
    if not os.path.exists(lib):
        return ["vmstash/lib/libvmstash.so is missing"]
    missing = KERNEL_ARCHS - fatbin_entries(lib)
    if missing:
        problems.append(f"libvmstash.so lacks paged stash kernels for {sorted(missing)}")
    symbols = readelf("--dyn-syms", "-W", lib)
    for symbol in ("vmstash_malloc", "vmstash_set_backup_store", "vmstash_stash_create", "tms_pause",
                   "tms_get_cpu_backup_pointer"):
        if not re.search(rf"\s{symbol}$", symbols, re.M):
            problems.append(f"libvmstash.so does not export {symbol}")
    for required in ("vmstash/lib/libvmstash_preload.so", "vmstash/bin/vmstash_cli", "vmstash/bin/vmstashd",
                     "vmstash/demo/__main__.py"):
        if required not in names:
            problems.append(f"{required} is missing")
    points = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = open(os.path.join(tmp, points[0])).read() if points else ""
    if "vmstash = vmstash._cli:main" not in text:
        problems.append("the console command `vmstash` is not declared")
    if "vmstash = vmstash.compat.vllm.plugin:register" not in text or "vmstash/compat/vllm/plugin.py" not in names:
        problems.append("the vLLM plugin (vllm.general_plugins: vmstash) is not declared or not shipped")
    return problems


def main(wheels):
    if not wheels:
        print(__doc__)
        return 2
    carried = carried_libraries(wheels)
    for wheel in wheels:
        problems, summary = check(wheel, carried)
        if problems:
            print(f"check_wheel: {wheel} FAILED:\n  " + "\n  ".join(problems))
            return 1
        print(f"check_wheel: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
