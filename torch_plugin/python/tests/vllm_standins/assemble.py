#!/usr/bin/env python3
"""Puts vLLM's allocator files (scripts/fetch_vllm.py: third_party/vllm for 0.33, or
third_party/vllm-V for an earlier release V) and the stand-ins of this folder together:

    python3 assemble.py DEST [--vllm DIR]      (DIR default: <repo>/third_party/vllm)

DEST/vllm: the stand-in package with vLLM's own files over it; DEST/tests: vLLM's test files
with the stand-in tests/utils.py. Put DEST first on sys.path. Prints DEST. Fails, saying
what to fetch, when the vLLM files are missing. declare_entry_point() declares vmstash's
plugin as the wheel does, for vLLM's own loader.
"""
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(HERE))))


def vllm_dir(given=None):
    return given or os.environ.get("VMSTASH_VLLM_DIR") or os.path.join(ROOT, "third_party", "vllm")


def missing(src):
    """Why the vLLM files cannot be used (None when they can)."""
    if not os.path.isfile(os.path.join(src, "pkg", "vllm", "device_allocator", "cumem.py")):
        return (f"vLLM's files are not in {src}: run `python3 scripts/fetch_vllm.py [--version V]` on a machine "
                "with network and carry third_party/vllm (or third_party/vllm-V; or set VMSTASH_VLLM_DIR)")
    return None


def assemble(dest, src=None):
    src = vllm_dir(src)
    why = missing(src)
    if why:
        raise FileNotFoundError(why)
    for part in ("vllm", "tests"):
        shutil.rmtree(os.path.join(dest, part), ignore_errors=True)
        shutil.copytree(os.path.join(HERE, part), os.path.join(dest, part),
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(src, "pkg", "vllm"), os.path.join(dest, "vllm"), dirs_exist_ok=True)
    shutil.copytree(os.path.join(src, "tests"), os.path.join(dest, "tests"), dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for folder, _, files in os.walk(os.path.join(dest, "tests")):  # vLLM's tests are packages
        if "__init__.py" not in files:
            open(os.path.join(folder, "__init__.py"), "w").close()
    return dest


def declare_entry_point(dest, version="0+test"):
    """A dist-info in `dest` declaring vmstash's vllm.general_plugins entry point as the wheel
    does (pyproject.toml), so that vLLM's plugin loader finds it with `dest` on sys.path."""
    info = os.path.join(dest, f"vmstash-{version}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vmstash\nVersion: {version}\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nvmstash = vmstash.compat.vllm.plugin:register\n")
    return dest


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 2
    src = argv[argv.index("--vllm") + 1] if "--vllm" in argv else None
    try:
        print(assemble(argv[0], src))
    except FileNotFoundError as e:
        print(f"assemble: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
