"""Writing wheels without a build backend: the version (base/version.h, its one place),
an honest manylinux platform tag read from the ELF files a wheel carries, and the archive
with its dist-info and RECORD. Used by build_vmstash_wheel.py, build_tms_dropin_wheel.py
and check_wheel.py."""
import base64
import hashlib
import os
import re
import subprocess
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def vmstash_version():
    with open(os.path.join(ROOT, "base", "version.h")) as f:
        match = re.search(r'kVersion\[\] = "([^"]+)"', f.read())
    if not match:
        raise SystemExit("wheel_writer: no kVersion in base/version.h")
    return match.group(1)


def is_elf(data):
    return data[:4] == b"\x7fELF"


def glibc_versions(path):
    """The GLIBC_x.y symbol versions an ELF file needs, as (x, y) tuples."""
    out = subprocess.run(["readelf", "--version-info", "-W", path], check=True, capture_output=True,
                         text=True).stdout
    return {(int(a), int(b)) for a, b in re.findall(r"Name: GLIBC_(\d+)\.(\d+)", out)}


def platform_tag(elf_paths):
    """manylinux_<x>_<y>_x86_64 for the newest glibc any of the files needs (at least 2.17)."""
    newest = (2, 17)
    for path in elf_paths:
        newest = max([newest] + sorted(glibc_versions(path)))
    return f"manylinux_{newest[0]}_{newest[1]}_x86_64"


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write_wheel(out_dir, name, version, tag, entries, summary, top_level, entry_points=None, generator="vmstash",
                requires=()):
    """Writes <out_dir>/<name>-<version>-py3-none-<tag>.whl from `entries` [(arcname, bytes,
    mode)]; returns its path."""
    dist_info = f"{name}-{version}.dist-info"
    metadata = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: {summary}\n"
                "Requires-Python: >=3.9\n" + "".join(f"Requires-Dist: {r}\n" for r in requires))
    wheel = f"Wheel-Version: 1.0\nGenerator: {generator}\nRoot-Is-Purelib: false\nTag: py3-none-{tag}\n"
    entries = list(entries) + [(f"{dist_info}/METADATA", metadata.encode(), 0o644),
                               (f"{dist_info}/WHEEL", wheel.encode(), 0o644),
                               (f"{dist_info}/top_level.txt", (top_level + "\n").encode(), 0o644)]
    if entry_points:
        entries.append((f"{dist_info}/entry_points.txt", entry_points.encode(), 0o644))
    record = "\n".join([record_line(n, d) for n, d, _ in entries] + [f"{dist_info}/RECORD,,", ""])
    entries.append((f"{dist_info}/RECORD", record.encode(), 0o644))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}-{version}-py3-none-{tag}.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for arcname, data, mode in entries:
            info = zipfile.ZipInfo(arcname, date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return path


def run_cli(doc, argv, source_flag, source_help, build, source_default=None):
    """The wheel scripts' command line: one source (`source_flag`, required unless it has a
    default) and --out; prints the wheel built by build(source, out)."""
    import argparse
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(source_flag, required=source_default is None, default=source_default, help=source_help)
    parser.add_argument("--out", default=os.path.join(ROOT, "dist"))
    args = parser.parse_args(argv)
    print(build(getattr(args, source_flag.lstrip("-").replace("-", "_")), args.out))
    return 0
