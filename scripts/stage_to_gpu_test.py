"""stage_to_gpu.py without a GPU machine: files and folders packed into parts of a bound size,
each received (checked against the manifest) into a folder standing for the GPU machine's,
then assembled into the same bytes; a part that changed on the way, one missing, a parcel
packed again, a stream that would write outside the folder, and bad input, each refused with
a message that says what to do; gzip and plain streams alike."""
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stage_to_gpu as st  # noqa: E402

MiB = 1 << 20


class StageToGpuTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="stage_test_")
        self.src = os.path.join(self.dir, "src")
        os.makedirs(os.path.join(self.src, "pkg", "sub"))
        self.files = {}
        for rel, size in (("pkg/a.whl", 3 * MiB + 17), ("pkg/sub/b.bin", 2 * MiB), ("pkg/empty", 0)):
            data = os.urandom(size)
            with open(os.path.join(self.src, rel), "wb") as f:
                f.write(data)
            self.files[rel] = hashlib.sha256(data).hexdigest()
        self.single = os.path.join(self.src, "model.safetensors")
        with open(self.single, "wb") as f:
            f.write(os.urandom(MiB // 2))
        self.out = os.path.join(self.dir, "stage")
        self.into = os.path.join(self.dir, "gpu", "staged")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def pack(self):
        return st.pack([os.path.join(self.src, "pkg"), self.single], self.out, 1)

    def receive_all(self, manifest, skip=()):
        for part in manifest["parts"]:
            if part["name"] not in skip:
                st.receive(os.path.join(self.out, part["name"]), self.into)

    def test_parts_of_a_bounded_size_assemble_into_the_same_files(self):
        m = self.pack()
        self.assertGreaterEqual(len(m["parts"]), 6)
        for part in m["parts"]:
            folder = os.path.join(self.out, part["name"])
            self.assertLessEqual(os.path.getsize(os.path.join(folder, "part")), MiB)  # one part per call
            self.assertEqual(sorted(os.listdir(folder)), ["manifest.json", "part"])
        self.receive_all(m)
        self.assertEqual(st.status(self.into)["missing"], [])
        done = st.assemble(self.into)
        self.assertEqual(done["inputs"], ["model.safetensors", "pkg"])
        for rel, digest in self.files.items():
            with open(os.path.join(done["root"], rel), "rb") as f:
                self.assertEqual(hashlib.sha256(f.read()).hexdigest(), digest, rel)
        self.assertEqual(st.sha256_file(os.path.join(done["root"], "model.safetensors")), st.sha256_file(self.single))
        st.receive(os.path.join(self.out, m["parts"][0]["name"]), self.into)  # received twice: harmless
        st.assemble(self.into)

    def test_both_compressions_give_back_the_same_bytes_and_gzip_shrinks_what_compresses(self):
        text = os.path.join(self.src, "pkg", "sub", "lib.so")
        with open(text, "wb") as f:
            f.write(b"\x00" * (3 * MiB) + os.urandom(1024))
        digest = st.sha256_file(text)
        for compress, most in (("none", None), ("gz", 6)):
            out = os.path.join(self.dir, "stage_" + compress)
            m = st.pack([os.path.join(self.src, "pkg")], out, 1, compress)
            self.assertEqual(m["compress"], compress)
            if most:
                self.assertLessEqual(len(m["parts"]), most)  # 3 MiB of zeros shrink to almost nothing
            into = os.path.join(self.dir, "gpu_" + compress)
            for part in m["parts"]:
                st.receive(os.path.join(out, part["name"]), into)
            root = st.assemble(into)["root"]
            self.assertEqual(st.sha256_file(os.path.join(root, "pkg", "sub", "lib.so")), digest)
            self.assertEqual(st.sha256_file(os.path.join(root, "pkg", "a.whl")), self.files["pkg/a.whl"])
        with self.assertRaisesRegex(SystemExit, "--compress must be one of gz, none"):
            st.pack([self.single], os.path.join(self.dir, "stage_xz"), 1, "xz")

    def test_a_part_changed_on_the_way_is_refused(self):
        m = self.pack()
        part = os.path.join(self.out, m["parts"][1]["name"], "part")
        with open(part, "r+b") as f:
            f.seek(100)
            f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
        with self.assertRaisesRegex(SystemExit, "differs from the manifest.*carry it again"):
            st.receive(os.path.dirname(part), self.into)

    def test_a_missing_part_is_named_and_a_part_changed_after_receipt_is_found(self):
        m = self.pack()
        self.receive_all(m, skip=(m["parts"][2]["name"],))
        self.assertEqual(st.status(self.into)["missing"], [m["parts"][2]["name"]])
        with self.assertRaisesRegex(SystemExit, "parts missing: " + m["parts"][2]["name"]):
            st.assemble(self.into)
        st.receive(os.path.join(self.out, m["parts"][2]["name"]), self.into)
        with open(os.path.join(self.into, "parts", m["parts"][0]["name"]), "r+b") as f:
            f.write(b"XX")
        with self.assertRaisesRegex(SystemExit, "changed since it was received"):
            st.assemble(self.into)

    def test_a_parcel_packed_again_drops_the_parts_of_the_earlier_one(self):
        first = self.pack()
        st.receive(os.path.join(self.out, first["parts"][0]["name"]), self.into)
        shutil.rmtree(self.out)
        with open(self.single, "ab") as f:
            f.write(b"more")
        second = self.pack()
        st.receive(os.path.join(self.out, second["parts"][1]["name"]), self.into)
        self.assertEqual(st.status(self.into)["received"], [second["parts"][1]["name"]])

    def test_bad_input_is_refused_before_anything_is_written(self):
        with self.assertRaisesRegex(SystemExit, "does not exist"):
            st.pack([os.path.join(self.dir, "nothing")], self.out, 1)
        other = os.path.join(self.dir, "other")
        os.makedirs(os.path.join(other, "pkg"))
        with self.assertRaisesRegex(SystemExit, "two inputs are named 'pkg'"):
            st.pack([os.path.join(self.src, "pkg"), os.path.join(other, "pkg")], self.out, 1)
        with self.assertRaisesRegex(SystemExit, "part-mib must be 1..60"):
            st.pack([self.single], self.out, 64)
        self.assertFalse(os.path.exists(self.out))
        self.pack()
        with self.assertRaisesRegex(SystemExit, "is not empty"):
            self.pack()
        with self.assertRaisesRegex(SystemExit, "no manifest.json"):
            st.receive(self.src, self.into)

    def test_a_stream_that_would_write_outside_the_folder_is_refused(self):
        # A parcel made by hand, whose one member climbs out of the folder.
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as tar:
            info = tarfile.TarInfo("../escaped")
            info.size = 3
            tar.addfile(info, io.BytesIO(b"bad"))
        data = raw.getvalue()
        digest = hashlib.sha256(data).hexdigest()
        manifest = {"id": "x", "inputs": ["escaped"], "sha256": digest, "bytes": len(data),
                    "parts": [{"name": "p0000", "bytes": len(data), "sha256": digest}]}
        folder = os.path.join(self.out, "p0000")
        os.makedirs(folder)
        with open(os.path.join(folder, "part"), "wb") as f:
            f.write(data)
        with open(os.path.join(folder, "manifest.json"), "w") as f:
            json.dump(manifest, f)
        st.receive(folder, self.into)
        with self.assertRaisesRegex(SystemExit, "refusing '../escaped'"):
            st.assemble(self.into)
        self.assertFalse(os.path.exists(os.path.join(self.into, "escaped")))

    def test_the_command_line(self):
        self.assertEqual(st.main(["pack", self.single, "--out", self.out, "--part-mib", "1"]), 0)
        self.assertEqual(st.main(["receive", os.path.join(self.out, "p0000"), "--into", self.into]), 0)
        self.assertEqual(st.main(["status", "--into", self.into]), 0)
        self.assertEqual(st.main(["assemble", "--into", self.into]), 0)
        self.assertTrue(os.path.isfile(os.path.join(self.into, "root", "model.safetensors")))


if __name__ == "__main__":
    unittest.main()
