#!/usr/bin/env python3
"""Brings files larger than one device call carries (64 MiB) to the GPU machine, in parts.

A device call copies the working tree plus the ignored paths it is told to carry, at most
64 MiB in all; files it leaves in ignored folders there stay while the machine is warm (it
goes back after 30 s idle). So a large set of files (a wheel and its dependencies, a model)
goes over in consecutive calls, one part each, and a last call puts it together:

  here:       python3 scripts/stage_to_gpu.py pack FILE_OR_DIR... --out build/stage
                  -> build/stage/p0000 ... p00NN, each one part (at most --part-mib, default
                     56) with the manifest; prints the calls to make. The stream is gzipped
                     (--compress none leaves it as is): unpacked shared objects shrink by
                     a quarter to three quarters
  each call:  carry ["build/stage/p000K"], command
              python3 scripts/stage_to_gpu.py receive build/stage/p000K
                  -> the part checked against its SHA-256 and kept in build/staged/parts
  last call:  python3 scripts/stage_to_gpu.py assemble [--into build/staged]
                  -> every part present and checked, joined, the whole checked, unpacked
                     into build/staged/root (the inputs' base names at its top)

Every step checks what it was given and says what is missing or wrong; nothing is unpacked
from a stream whose hash differs from the manifest's. `status` lists the parts received.
Make the calls one after another within 30 s of each other, or the machine (and what it
kept) goes back. A parcel is known by its bytes' SHA-256: `receive` drops the parts kept of
another one.
Use in docs/usage.md §18.
"""
import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile

MANIFEST = "manifest.json"
MiB = 1 << 20


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 * MiB), b""):
            h.update(block)
    return h.hexdigest()


class _PartWriter(io.RawIOBase):
    """A write-only stream cut into files of at most `limit` bytes: out/p0000/part, ..."""

    def __init__(self, out, limit):
        self.out, self.limit = out, limit
        self.parts = []  # [name, bytes, sha256 object]
        self.total = hashlib.sha256()
        self._file = None

    def writable(self):
        return True

    def _next(self):
        if self._file is not None:
            self._file.close()
        name = f"p{len(self.parts):04d}"
        os.makedirs(os.path.join(self.out, name))
        self._file = open(os.path.join(self.out, name, "part"), "wb")
        self.parts.append([name, 0, hashlib.sha256()])

    def write(self, data):
        data = memoryview(data)
        done = 0
        while done < len(data):
            if self._file is None or self.parts[-1][1] == self.limit:
                self._next()
            take = min(len(data) - done, self.limit - self.parts[-1][1])
            chunk = data[done:done + take]
            self._file.write(chunk)
            self.parts[-1][1] += take
            self.parts[-1][2].update(chunk)
            self.total.update(chunk)
            done += take
        return len(data)

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()


COMPRESSIONS = ("gz", "none")


def pack(inputs, out, part_mib, compress="gz"):
    if part_mib <= 0 or part_mib > 60:
        raise SystemExit("stage_to_gpu: --part-mib must be 1..60 (a device call carries 64 MiB with the tree)")
    if compress not in COMPRESSIONS:
        raise SystemExit(f"stage_to_gpu: --compress must be one of {', '.join(COMPRESSIONS)}, not {compress!r}")
    names = set()
    for path in inputs:
        if not os.path.exists(path):
            raise SystemExit(f"stage_to_gpu: {path} does not exist")
        base = os.path.basename(os.path.normpath(path))
        if base in names:
            raise SystemExit(f"stage_to_gpu: two inputs are named {base!r}; stage them separately")
        names.add(base)
    if os.path.exists(out) and os.listdir(out):
        raise SystemExit(f"stage_to_gpu: {out} is not empty; remove it or name another folder")
    os.makedirs(out, exist_ok=True)
    writer = _PartWriter(out, part_mib * MiB)
    with tarfile.open(fileobj=writer, mode="w|" + ("" if compress == "none" else compress)) as tar:
        for path in inputs:
            tar.add(path, arcname=os.path.basename(os.path.normpath(path)))
    writer.close()
    manifest = {"id": writer.total.hexdigest(), "inputs": sorted(names), "sha256": writer.total.hexdigest(),
                "compress": compress,
                "bytes": sum(p[1] for p in writer.parts),
                "parts": [{"name": n, "bytes": b, "sha256": h.hexdigest()} for n, b, h in writer.parts]}
    for name, _, _ in writer.parts:  # each part folder carries the manifest: receive checks against it
        with open(os.path.join(out, name, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
    return manifest


def _read_manifest(folder):
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise SystemExit(f"stage_to_gpu: no {MANIFEST} in {folder} (not a part made by `pack`)")
    with open(path) as f:
        return json.load(f)


def receive(part_dir, into):
    manifest = _read_manifest(part_dir)
    name = os.path.basename(os.path.normpath(part_dir))
    entry = next((p for p in manifest["parts"] if p["name"] == name), None)
    if entry is None:
        raise SystemExit(f"stage_to_gpu: {part_dir} is not one of the manifest's parts")
    src = os.path.join(part_dir, "part")
    if not os.path.isfile(src) or os.path.getsize(src) != entry["bytes"] or sha256_file(src) != entry["sha256"]:
        raise SystemExit(f"stage_to_gpu: {part_dir}/part differs from the manifest (size or SHA-256): carry it again")
    parts = os.path.join(into, "parts")
    kept = os.path.join(into, MANIFEST)
    if os.path.isfile(kept) and _read_manifest(into)["id"] != manifest["id"]:
        shutil.rmtree(parts, ignore_errors=True)  # parts of an earlier parcel: dropped
    os.makedirs(parts, exist_ok=True)
    with open(kept, "w") as f:
        json.dump(manifest, f, indent=1)
    tmp = os.path.join(parts, name + ".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, os.path.join(parts, name))
    return status(into)


def status(into):
    manifest = _read_manifest(into)
    parts = os.path.join(into, "parts")
    have = [p["name"] for p in manifest["parts"] if os.path.isfile(os.path.join(parts, p["name"]))]
    missing = [p["name"] for p in manifest["parts"] if p["name"] not in have]
    return {"id": manifest["id"], "received": have, "missing": missing}


def assemble(into):
    manifest = _read_manifest(into)
    st = status(into)
    if st["missing"]:
        raise SystemExit(f"stage_to_gpu: parts missing: {' '.join(st['missing'])} (receive them, then assemble)")
    whole = hashlib.sha256()
    for p in manifest["parts"]:
        path = os.path.join(into, "parts", p["name"])
        if sha256_file(path) != p["sha256"]:
            raise SystemExit(f"stage_to_gpu: part {p['name']} changed since it was received: receive it again")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(8 * MiB), b""):
                whole.update(block)
    if whole.hexdigest() != manifest["sha256"]:
        raise SystemExit("stage_to_gpu: the joined parts differ from the manifest's SHA-256")
    root = os.path.join(into, "root")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)

    class Joined(io.RawIOBase):
        def __init__(self):
            self.files = [open(os.path.join(into, "parts", p["name"]), "rb") for p in manifest["parts"]]

        def readable(self):
            return True

        def readinto(self, buf):
            while self.files:
                n = self.files[0].readinto(buf)
                if n:
                    return n
                self.files.pop(0).close()
            return 0

    compress = manifest.get("compress", "none")
    if compress not in COMPRESSIONS:
        raise SystemExit(f"stage_to_gpu: the manifest names an unknown compression {compress!r}")
    with tarfile.open(fileobj=Joined(), mode="r|" + ("" if compress == "none" else compress)) as tar:
        for member in tar:
            target = os.path.realpath(os.path.join(root, member.name))
            if not target.startswith(os.path.realpath(root) + os.sep) or member.issym() or member.islnk():
                raise SystemExit(f"stage_to_gpu: refusing {member.name!r} (outside the folder, or a link)")
            if hasattr(tarfile, "data_filter"):
                tar.extract(member, root, filter="data")
            else:
                tar.extract(member, root)
    return {"root": root, "inputs": manifest["inputs"], "bytes": manifest["bytes"]}


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--out", default="build/stage")
    p.add_argument("--part-mib", type=int, default=56)
    p.add_argument("--compress", choices=COMPRESSIONS, default="gz")
    r = sub.add_parser("receive")
    r.add_argument("part")
    r.add_argument("--into", default="build/staged")
    for name in ("assemble", "status"):
        s = sub.add_parser(name)
        s.add_argument("--into", default="build/staged")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        m = pack(args.inputs, args.out, args.part_mib, args.compress)
        print(f"stage_to_gpu: {m['bytes'] / MiB:.1f} MiB in {len(m['parts'])} parts under {args.out}; one device "
              f"call each (carry the part's folder), then one that assembles:")
        for part in m["parts"]:
            print(f"  carry [\"{os.path.join(args.out, part['name'])}\"]: python3 scripts/stage_to_gpu.py receive "
                  f"{os.path.join(args.out, part['name'])}")
        print("  then: python3 scripts/stage_to_gpu.py assemble")
    elif args.cmd == "receive":
        print(json.dumps(receive(args.part, args.into)))
    elif args.cmd == "status":
        print(json.dumps(status(args.into)))
    else:
        print(json.dumps(assemble(args.into)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
