#!/usr/bin/env python3
"""Makes a folder that, first on PYTHONPATH, lets the GPU machine's Python (3.12, torch 2.11 +
CUDA 13, transformers 5) run vLLM 0.25.0's engine: the vLLM wheel (built for that torch and
CUDA) and the packages its engine imports that the machine lacks, every one pinned, trimmed to
what a dense model on a Hopper card loads. Made here (it needs the package index), then taken to
the GPU machine with scripts/stage_to_gpu.py (docs/usage.md §18):

    python3 scripts/vllm_engine_site.py [--out build/engine/vllm-0.25.0-site]
    python3 scripts/stage_to_gpu.py pack build/engine/vllm-0.25.0-site

Left out of the wheel (LEFT_OUT, each with its reason): FlashAttention 2 (Ampere; a Hopper card
runs FlashAttention 3, which stays), the Rust frontend binary, the MoE kernels (a dense model
never loads them: vLLM imports them under contextlib.suppress), Blackwell's attention headers
and DeepGEMM's builds for other Pythons. Left out of the dependencies: what the GPU machine has
(torch, transformers, numpy, triton, ...; the device tool's KINDS.md lists them) and the
kernel packages a dense model without those features does not import (flashinfer, tilelang,
cutlass-dsl, quack, humming, tokenspeed-mla, video codecs). `MANIFEST.json` in the folder
lists what it holds and what was left out.
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

VLLM = "vllm==0.25.0"
# What vLLM 0.25.0's engine imports beyond the GPU machine's packages, resolved once from its
# metadata (pip install --dry-run --report) and pinned. apache-tvm-ffi is xgrammar 0.2.9's
# (>= 0.1.11), not vLLM's pin for FlashInfer (0.1.9), which is not staged.
DEPENDENCIES = (
    "annotated-doc==0.0.7", "apache-tvm-ffi==0.1.15.post2", "annotated-types==0.8.0", "anthropic==2.14.0", "astor==0.8.1", "blake3==1.0.11",
    "cachetools==8.0.2", "cbor2==6.3.0", "compressed-tensors==0.17.0", "depyf==0.20.0", "dill==0.4.1",
    "diskcache==5.6.3", "docstring_parser==0.18.0", "fastapi==0.136.3", "httpcore2==2.16.2", "httpx2==2.16.2",
    "ijson==3.6.0", "jiter==0.19.0", "jmespath==1.1.0", "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1", "lark==1.2.2", "llguidance==1.7.6", "lm-format-enforcer==0.11.3",
    "mistral_common==1.13.1", "model-hosting-container-standards==0.1.16", "msgspec==0.23.0", "openai==3.57.0",
    "openai-harmony==0.0.8", "opentelemetry-api==1.45.2", "outlines_core==0.2.14",
    "partial-json-parser==0.2.1.1.post7", "prometheus-fastapi-instrumentator==8.1.0", "pybase64==1.5.1",
    "pydantic==2.14.4", "pydantic_core==2.50.5", "python-json-logger==4.2.0", "pyzmq==27.3.0",
    "referencing==0.37.0", "rpds-py==2026.9.1", "setproctitle==1.3.8", "sniffio==1.3.1", "starlette==1.10.0",
    "supervisor==4.3.0", "truststore==0.10.5", "typing_extensions==4.16.0", "typing-inspection==0.4.5",
    "watchfiles==1.3.0", "xgrammar==0.2.9",
)
LEFT_OUT = {
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "FlashAttention 2, for Ampere; Hopper runs FlashAttention 3",
    "vllm/vllm-rs": "the Rust frontend binary (VLLM_RUST_FRONTEND_PATH), not used by LLM()",
    "vllm/_moe_C_stable_libtorch.abi3.so": "MoE kernels, imported under contextlib.suppress; a dense model never calls them",
    "vllm/third_party/fmha_sm100": "Blackwell attention headers",
    "vllm/third_party/deep_gemm/_C.cpython-310-x86_64-linux-gnu.so": "DeepGEMM for Python 3.10",
    "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so": "DeepGEMM for Python 3.11",
    "vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so": "DeepGEMM for Python 3.13",
    "vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so": "DeepGEMM for Python 3.14",
    "bin": "console scripts made for this machine's interpreter",
}
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"] + [
    a for tag in ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
                  "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64", "any")
    for a in ("--platform", tag)]


def pip(*args):
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"vllm_engine_site: {' '.join(cmd[:6])} ... failed:\n{r.stderr[-3000:]}")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="build/engine/vllm-0.25.0-site")
    ap.add_argument("--wheels", help="a folder to download the wheels into and keep (else a temporary one, removed)")
    args = ap.parse_args(argv)
    if os.path.exists(args.out) and os.listdir(args.out):
        raise SystemExit(f"vllm_engine_site: {args.out} is not empty; remove it or name another folder")
    wheels = args.wheels or tempfile.mkdtemp(prefix="vllm_engine_wheels_")
    try:
        return make(args.out, wheels)
    finally:
        if not args.wheels:
            shutil.rmtree(wheels, ignore_errors=True)


def make(out, wheels):
    os.makedirs(wheels, exist_ok=True)
    print(f"vllm_engine_site: downloading {VLLM} and {len(DEPENDENCIES)} pinned packages into {wheels}",
          file=sys.stderr)
    pip("download", "--no-deps", *PLATFORM, "-d", wheels, VLLM, *DEPENDENCIES)
    files, missing = [], []
    for spec in (VLLM,) + DEPENDENCIES:  # the wheel of each pinned version (the folder may hold others)
        name, version = spec.split("==")
        found = glob.glob(os.path.join(wheels, f"{name.lower().replace('-', '_')}-{version}-*.whl"))
        if len(found) == 1:
            files.append(found[0])
        else:
            missing.append(spec)
    if missing:
        raise SystemExit(f"vllm_engine_site: no single wheel in {wheels} for {', '.join(missing)}")
    pip("install", "--no-deps", "--no-compile", "--no-index", *PLATFORM, "--target", out, *files)
    for rel in LEFT_OUT:
        path = os.path.join(out, rel)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    manifest = {"vllm": VLLM, "dependencies": list(DEPENDENCIES), "left_out": LEFT_OUT,
                "wheels": sorted(os.path.basename(f) for f in files)}
    with open(os.path.join(out, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(out) for n in ns)
    print(f"vllm_engine_site: {out}: {size / (1 << 20):.0f} MiB unpacked; next: "
          f"python3 scripts/stage_to_gpu.py pack {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
