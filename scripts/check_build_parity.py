#!/usr/bin/env python3
"""Fails when Bazel and CMake disagree on what is built or tested.

Compares, between `bazel query` and a CMake configuration of the same tree:
  - the project's compiled sources (.cc/.cu in some Bazel target; in CMake's
    compile_commands.json), each file compiled once in CMake;
  - the test names (Bazel test rules, gpu/manual ones included; `ctest` tests).
A file or test present in only one of them is an error, except the entries of CMAKE_ONLY
below, each with the reason it cannot exist under Bazel (the one list of exceptions).

Usage: scripts/check_build_parity.py [--cmake-build DIR]   (configures DIR if needed)
"""
import argparse
import collections
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What only CMake builds, and why Bazel cannot.
CMAKE_ONLY = {
    # Compiled against an installed PyTorch (VMSTASH_TORCH_DIR); Bazel has no torch.
    "torch_plugin/libtorch/vmstash_libtorch.cc": "needs a torch install",
    "torch_plugin/libtorch/libtorch_example.cc": "needs a torch install",
    "bench/torch_side.cc": "needs a torch install",
}


def run(cmd, **kw):
    return subprocess.run(cmd, cwd=ROOT, check=True, text=True, capture_output=True, **kw).stdout


def bazel_sources():
    out = run(["bazel", "query", "--noshow_progress",
               'kind("source file", deps(kind("cc_.* rule|cuda_library", //...)))', "--output=label"])
    files = set()
    for label in out.split():
        if not label.startswith("//") or not label.endswith((".cc", ".cu")):
            continue
        pkg, name = label[2:].split(":")
        files.add(f"{pkg}/{name}" if pkg else name)
    return files


def bazel_tests():
    out = run(["bazel", "query", "--noshow_progress", 'tests(//...)', "--output=label"])
    return {label.split(":")[1] for label in out.split()}


def cmake_configure(build):
    # Every time (it is incremental): a folder configured before a CMakeLists.txt changed
    # would compare the old lists.
    subprocess.run(["cmake", "-S", ROOT, "-B", build, "-G", "Ninja", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
                    "-DCMAKE_CUDA_ARCHITECTURES=90"], check=True, stdout=subprocess.DEVNULL)


def cmake_sources(build):
    with open(os.path.join(build, "compile_commands.json")) as f:
        entries = json.load(f)
    counts = collections.Counter()
    for e in entries:
        path = os.path.relpath(os.path.join(e["directory"], e["file"]), ROOT)
        if path.startswith("..") or not path.endswith((".cc", ".cu")):
            continue
        counts[path] += 1
    return counts


def cmake_tests(build):
    out = subprocess.run(["ctest", "--show-only=json-v1"], cwd=build, check=True, text=True,
                         capture_output=True).stdout
    return {t["name"] for t in json.loads(out)["tests"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cmake-build", default=os.path.join(ROOT, "build", "parity"))
    args = ap.parse_args()
    cmake_configure(args.cmake_build)
    errors = []
    b_src, c_src = bazel_sources(), cmake_sources(args.cmake_build)
    for f in sorted(b_src - set(c_src)):
        errors.append(f"source built by Bazel only: {f}")
    for f in sorted(set(c_src) - b_src - set(CMAKE_ONLY)):
        errors.append(f"source built by CMake only: {f}")
    for f, n in sorted(c_src.items()):
        if n > 1:
            errors.append(f"source compiled {n} times by CMake: {f}")
    b_tests, c_tests = bazel_tests(), cmake_tests(args.cmake_build)
    for t in sorted(b_tests - c_tests):
        errors.append(f"test in Bazel only: {t}")
    for t in sorted(c_tests - b_tests):
        errors.append(f"test in CMake only: {t}")
    for e in errors:
        print(f"build parity: {e}", file=sys.stderr)
    if errors:
        print(f"build parity: {len(errors)} difference(s) between BUILD.bazel and CMakeLists.txt", file=sys.stderr)
        return 1
    print(f"build parity: OK ({len(b_src)} sources, {len(b_tests)} tests in both builds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
