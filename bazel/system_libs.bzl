"""Repository rules that wrap libraries installed on the machine (offline builds).

`system_cc_library` turns Debian -dev packages into a Bazel repository: each target
links through the flags `pkg-config` prints (or given -l flags), and its headers come
from the system include path. A missing package fails the fetch with the Debian
package name to install, instead of a confusing compile error later.

`cuda_toolkit` finds the CUDA toolkit (CUDA_PATH, else the nvcc on PATH, else
/usr/local/cuda) and exposes its headers, the static runtime and the nvcc path.
"""

def _pkg_config_libs(ctx, modules):
    result = ctx.execute(["pkg-config", "--libs"] + modules)
    if result.return_code != 0:
        fail("pkg-config --libs {} failed: {}".format(" ".join(modules), result.stderr))
    return result.stdout.strip().split(" ")

def _system_cc_library_impl(ctx):
    header = ctx.attr.probe_header
    cc = ctx.os.environ.get("CC", "gcc")
    probe = ctx.execute(["sh", "-c", "echo '#include <{}>' | {} -x c++ -std=c++17 -fsyntax-only -".format(header, cc)])
    if probe.return_code != 0:
        fail("<{}> not found: install the Debian package(s) {} (the README's commands do this).\n{}".format(
            header,
            ctx.attr.install_hint,
            probe.stderr,
        ))
    lines = ["package(default_visibility = [\"//visibility:public\"])", ""]
    for target, spec in ctx.attr.targets.items():
        flags = []
        for item in spec.split(" "):
            if item.startswith("pkg:"):
                flags += _pkg_config_libs(ctx, [item[4:]])
            elif item:
                flags.append(item)
        lines.append("cc_library(name = {}, linkopts = {})".format(repr(target), repr(flags)))
    ctx.file("BUILD.bazel", "\n".join(lines) + "\n")
    ctx.file("WORKSPACE", "workspace(name = {})\n".format(repr(ctx.name)))

system_cc_library = repository_rule(
    implementation = _system_cc_library_impl,
    attrs = {
        # target name -> space-separated items: "pkg:<pkg-config module>" or a linker flag.
        "targets": attr.string_dict(mandatory = True),
        "probe_header": attr.string(mandatory = True),
        "install_hint": attr.string(mandatory = True),
    },
    environ = ["CC", "PKG_CONFIG_PATH"],
    local = True,
)

def _cuda_toolkit_impl(ctx):
    root = ctx.os.environ.get("CUDA_PATH", "")
    if not root:
        nvcc = ctx.which("nvcc")
        if nvcc:
            root = str(nvcc.dirname.dirname)
    if not root:
        root = "/usr/local/cuda"
    if not ctx.path(root + "/include/cuda.h").exists:
        fail("CUDA toolkit not found (looked in CUDA_PATH, the nvcc on PATH, /usr/local/cuda): " +
             "vmstash needs its headers and nvcc to build, not a GPU.")
    ctx.symlink(root + "/include", "include")
    ctx.symlink(root + "/lib64", "lib64")
    ctx.file("WORKSPACE", "workspace(name = {})\n".format(repr(ctx.name)))
    ctx.file("defs.bzl", "NVCC = {}\n".format(repr(root + "/bin/nvcc")))
    ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

# Headers only: nothing links libcuda; CudaDriver loads it at run time.
cc_library(
    name = "headers",
    hdrs = glob(["include/*.h", "include/crt/**"]),
    includes = ["include"],
)

# The static CUDA runtime, for targets built from .cu sources.
cc_library(
    name = "cudart_static",
    srcs = ["lib64/libcudart_static.a"],
    linkopts = ["-ldl", "-lrt", "-lpthread"],
    deps = [":headers"],
)
""")

cuda_toolkit = repository_rule(
    implementation = _cuda_toolkit_impl,
    environ = ["CUDA_PATH", "PATH"],
    local = True,
)
