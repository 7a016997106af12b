#!/usr/bin/env python3
"""Builds vmstash's torch_memory_saver drop-in wheel.

    scripts/build_tms_dropin_wheel.py [--preload LIB] [--out DIR]

The wheel is named torch_memory_saver, version 0.0.10+vmstash.<vmstash version>, and holds:
  * the package torch_memory_saver (torch_plugin/python/tms_dropin), which imports
    vmstash.compat.torch_memory_saver (it requires the vmstash wheel of the same version);
  * vmstash's preload library under the names torch_memory_saver's own wheel uses at the
    top of site-packages (torch_memory_saver_hook_mode_preload_cu13.abi3.so and
    torch_memory_saver_hook_mode_preload.abi3.so), where slime looks for it; it finds the
    abseil/fmt libraries of the vmstash wheel through its DT_RPATH $ORIGIN/vmstash/lib.
Install: python3 -m pip install --no-deps DIR/torch_memory_saver-*.whl; uninstall:
python3 -m pip uninstall torch_memory_saver. LIB defaults to $VMSTASH_PRELOAD_LIBRARY,
else build/cmake/torch_plugin/libvmstash_preload.so.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wheel_writer import ROOT, platform_tag, run_cli, vmstash_version, write_wheel  # noqa: E402

PACKAGE_DIR = os.path.join(ROOT, "torch_plugin", "python", "tms_dropin")
UPSTREAM_VERSION = "0.0.10"  # the torch_memory_saver release whose behaviour it serves
PRELOAD_NAMES = ("torch_memory_saver_hook_mode_preload_cu13.abi3.so", "torch_memory_saver_hook_mode_preload.abi3.so")


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
    entries = []
    for arcname, path in package_files():
        with open(path, "rb") as f:
            entries.append((arcname, f.read(), 0o644))
    with open(preload, "rb") as f:
        library = f.read()
    entries += [(name, library, 0o755) for name in PRELOAD_NAMES]
    return write_wheel(out_dir, "torch_memory_saver", f"{UPSTREAM_VERSION}+vmstash.{vmstash_version()}",
                       platform_tag([preload]), entries,
                       "torch_memory_saver's API served by vmstash (drop-in; needs the vmstash package)",
                       "torch_memory_saver", generator="vmstash build_tms_dropin_wheel",
                       requires=[f"vmstash=={vmstash_version()}"])


def main(argv):
    return run_cli(__doc__, argv, "--preload", "libvmstash_preload.so to carry", build,
                   os.environ.get("VMSTASH_PRELOAD_LIBRARY") or
                   os.path.join(ROOT, "build", "cmake", "torch_plugin", "libvmstash_preload.so"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
