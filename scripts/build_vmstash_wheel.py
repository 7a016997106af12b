#!/usr/bin/env python3
"""Packs the vmstash wheel from a CMake install tree (scripts/build_wheel.sh makes one).

    scripts/build_vmstash_wheel.py --stage DIR [--out DIR]

The wheel holds the Python package (torch_plugin/python/vmstash: the API, the
torch_memory_saver compatibility module, the paged stash, the RL demo as vmstash.demo),
vmstash/lib/ (libvmstash.so with the paged stash kernels, libvmstash_preload.so, the abseil
and fmt libraries they load through DT_RPATH $ORIGIN), vmstash/bin/vmstash_cli and vmstashd, with
the console commands `vmstash` (the CLI) and `vmstash-demo`. Its platform tag is the
manylinux tag of the newest glibc its ELF files need. Prints the wheel's path.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wheel_writer import ROOT, is_elf, platform_tag, run_cli, vmstash_version, write_wheel  # noqa: E402

PACKAGE = os.path.join(ROOT, "torch_plugin", "python", "vmstash")
REQUIRED = ("vmstash/lib/libvmstash.so", "vmstash/lib/libvmstash_preload.so", "vmstash/bin/vmstash_cli",
            "vmstash/bin/vmstashd")
# As pyproject.toml declares them (console commands; the vLLM plugin, vmstash/compat/vllm/plugin.py).
ENTRY_POINTS = ("[console_scripts]\nvmstash = vmstash._cli:main\nvmstash-demo = vmstash.demo.rl_phase_switch:main\n\n"
                "[vllm.general_plugins]\nvmstash = vmstash.compat.vllm.plugin:register\n")


def python_files():
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield "vmstash/" + os.path.relpath(path, PACKAGE), path


def binary_files(stage):
    """The install tree's binaries. A wheel holds no symlinks: a library installed as
    <soname> -> <real file> goes in once, under its soname (the name the loader asks for)."""
    for sub in ("lib", "bin"):
        folder = os.path.join(stage, "vmstash", sub)
        names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        targets = {os.readlink(os.path.join(folder, n)) for n in names if os.path.islink(os.path.join(folder, n))}
        for name in names:
            if name not in targets:
                yield f"vmstash/{sub}/{name}", os.path.realpath(os.path.join(folder, name))


def build(stage, out_dir):
    entries, elves = [], []
    for arcname, path in list(python_files()) + list(binary_files(stage)):
        with open(path, "rb") as f:
            data = f.read()
        executable = is_elf(data)
        if executable:
            elves.append(path)
        entries.append((arcname, data, 0o755 if executable else 0o644))
    missing = [r for r in REQUIRED if r not in {n for n, _, _ in entries}]
    if missing:
        raise SystemExit(f"build_vmstash_wheel: {', '.join(missing)} not in {stage} (run scripts/build_wheel.sh)")
    return write_wheel(out_dir, "vmstash", vmstash_version(), platform_tag(elves), entries,
                       "Pausable, tagged GPU memory for PyTorch on CUDA virtual memory", "vmstash",
                       entry_points=ENTRY_POINTS, generator="vmstash build_vmstash_wheel")


def main(argv):
    return run_cli(__doc__, argv, "--stage", "the CMake install prefix (cmake --install ... --prefix)", build)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
