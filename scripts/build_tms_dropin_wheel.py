#!/usr/bin/env python3
"""Builds vmstash's torch_memory_saver drop-in wheel.

    scripts/build_tms_dropin_wheel.py [--preload LIB] [--out DIR]

The wheel is named torch_memory_saver, version 0.0.10+vmstash.<vmstash version>, and holds:
  * the package torch_memory_saver (torch_plugin/python/tms_dropin), which imports
    vmstash.compat.torch_memory_saver (vmstash itself must be importable);
  * vmstash's preload library under the names torch_memory_saver's own wheel uses at the
    top of site-packages (torch_memory_saver_hook_mode_preload_cu13.abi3.so and
    torch_memory_saver_hook_mode_preload.abi3.so), where slime looks for it.
Install: python3 -m pip install --no-deps DIR/torch_memory_saver-*.whl; uninstall:
python3 -m pip uninstall torch_memory_saver. LIB defaults to $VMSTASH_PRELOAD_LIBRARY,
else build/cmake/torch_plugin/libvmstash_preload.so.
"""
import argparse
import base64
import hashlib
import os
import re
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(ROOT, "torch_plugin", "python", "tms_dropin")
UPSTREAM_VERSION = "0.0.10"  # the torch_memory_saver release whose behaviour it serves
PRELOAD_NAMES = ("torch_memory_saver_hook_mode_preload_cu13.abi3.so", "torch_memory_saver_hook_mode_preload.abi3.so")
WHEEL_TAG = "py3-none-linux_x86_64"


def vmstash_version():
    with open(os.path.join(ROOT, "runtime", "version.h")) as f:
        match = re.search(r'kVersion\[\] = "([^"]+)"', f.read())
    if not match:
        raise SystemExit("build_tms_dropin_wheel: no kVersion in runtime/version.h")
    return match.group(1)


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def package_files():
    for folder, _, files in os.walk(os.path.join(PACKAGE_DIR, "torch_memory_saver")):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, PACKAGE_DIR), path


def build(preload, out_dir):
    if not os.path.isfile(preload):
        raise SystemExit(f"build_tms_dropin_wheel: preload library {preload!r} not found (build it: "
                         "cmake --build build/cmake --target vmstash_preload, or pass --preload)")
    version = f"{UPSTREAM_VERSION}+vmstash.{vmstash_version()}"
    dist_info = f"torch_memory_saver-{version}.dist-info"
    entries = []
    for arcname, path in package_files():
        with open(path, "rb") as f:
            entries.append((arcname, f.read(), 0o644))
    with open(preload, "rb") as f:
        library = f.read()
    entries += [(name, library, 0o755) for name in PRELOAD_NAMES]
    metadata = (f"Metadata-Version: 2.1\nName: torch_memory_saver\nVersion: {version}\n"
                "Summary: torch_memory_saver's API served by vmstash (drop-in; needs the vmstash package)\n")
    wheel = f"Wheel-Version: 1.0\nGenerator: vmstash build_tms_dropin_wheel\nRoot-Is-Purelib: false\nTag: {WHEEL_TAG}\n"
    entries += [(f"{dist_info}/METADATA", metadata.encode(), 0o644), (f"{dist_info}/WHEEL", wheel.encode(), 0o644),
                (f"{dist_info}/top_level.txt", b"torch_memory_saver\n", 0o644)]
    record = "\n".join([record_line(n, d) for n, d, _ in entries] + [f"{dist_info}/RECORD,,", ""])
    entries.append((f"{dist_info}/RECORD", record.encode(), 0o644))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"torch_memory_saver-{version}-{WHEEL_TAG}.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data, mode in entries:
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return path


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preload", default=os.environ.get("VMSTASH_PRELOAD_LIBRARY") or
                        os.path.join(ROOT, "build", "cmake", "torch_plugin", "libvmstash_preload.so"))
    parser.add_argument("--out", default=os.path.join(ROOT, "dist"))
    args = parser.parse_args(argv)
    print(build(args.preload, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
