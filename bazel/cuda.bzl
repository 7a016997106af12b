"""`cuda_library`: compiles .cu sources with nvcc (one genrule per source) and wraps the
objects in a cc_library linked against the static CUDA runtime. Kept small on purpose:
Bazel 4.2.3 has no CUDA rules offline. Targets sm_90 (H100/H200) plus PTX for newer GPUs."""

load("@cuda//:defs.bzl", "NVCC")

NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-Xcompiler=-fPIC",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]

def cuda_library(name, srcs, hdrs = [], deps = [], nvcc_flags = [], **kwargs):
    objects = []
    for src in srcs:
        obj = "_{}_{}.o".format(name, src.replace("/", "_").replace(".cu", ""))
        native.genrule(
            name = obj + "_nvcc",
            srcs = [src] + hdrs,
            outs = [obj],
            cmd = "{} {} -I. -I$(GENDIR) -c $(location {}) -o $@".format(
                NVCC,
                " ".join(NVCC_FLAGS + nvcc_flags),
                src,
            ),
            testonly = kwargs.get("testonly", False),
        )
        objects.append(obj)
    native.cc_library(
        name = name,
        srcs = objects,
        hdrs = hdrs,
        deps = deps + ["@cuda//:cudart_static"],
        linkstatic = True,
        **kwargs
    )
