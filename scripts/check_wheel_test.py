"""check_wheel.py on small wheels made here: a clean one passes; a library with a NEEDED
entry that is neither glibc/libstdc++ nor carried fails, naming it; a tag older than the
glibc a file needs fails; a carried dependency without DT_RPATH $ORIGIN fails. Needs a
C compiler (cc) and readelf."""
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_wheel  # noqa: E402
from wheel_writer import platform_tag, write_wheel  # noqa: E402


SIMPLE = "#include <string.h>\nint f(char* s) { return (int)strlen(s); }\n"
NEWER = "#define _GNU_SOURCE\n#include <sys/mman.h>\nint g(void) { return memfd_create(\"x\", 0); }\n"  # GLIBC_2.27


def compile_library(folder, name, *link, code=SIMPLE):
    source = os.path.join(folder, name + ".c")
    with open(source, "w") as f:
        f.write(code)
    path = os.path.join(folder, name)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", path, source, "-Wl,--no-as-needed", *link], check=True)
    return path


class CheckWheelTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def wheel(self, files, tag=None):
        entries = []
        for arcname, path in files:
            with open(path, "rb") as f:
                entries.append((arcname, f.read(), 0o755))
        tag = tag or platform_tag([p for _, p in files])
        return write_wheel(os.path.join(self.dir, "out"), "probe", "1.0", tag, entries, "probe", "probe")

    def problems(self, wheel):
        return check_wheel.check(wheel, check_wheel.carried_libraries([wheel]))[0]

    def test_a_library_needing_only_glibc_passes(self):
        lib = compile_library(self.dir, "libclean.so")
        self.assertEqual(self.problems(self.wheel([("probe/libclean.so", lib)])), [])

    def test_a_foreign_needed_entry_fails_with_its_name(self):
        lib = compile_library(self.dir, "libforeign.so", "/lib/x86_64-linux-gnu/libz.so.1")
        problems = self.problems(self.wheel([("probe/libforeign.so", lib)]))
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("NEEDED libz.so.1", problems[0])

    def test_a_tag_older_than_the_glibc_needed_fails(self):
        lib = compile_library(self.dir, "libnew.so", code=NEWER)
        self.assertEqual(platform_tag([lib]), "manylinux_2_27_x86_64")
        problems = self.problems(self.wheel([("probe/libnew.so", lib)], tag="manylinux_2_17_x86_64"))
        self.assertTrue(any("above the tag" in p for p in problems), problems)

    def test_a_carried_dependency_needs_rpath_origin(self):
        dep = compile_library(self.dir, "libdep.so", "-Wl,-soname,libdep.so")
        without = compile_library(self.dir, "libtop.so", dep)  # NEEDED libdep.so, no RPATH
        problems = self.problems(self.wheel([("probe/libdep.so", dep), ("probe/libtop.so", without)]))
        self.assertTrue(any("no DT_RPATH with $ORIGIN" in p for p in problems), problems)
        with_rpath = compile_library(self.dir, "libtop.so", dep, "-Wl,--disable-new-dtags,-rpath,$ORIGIN")
        self.assertEqual(self.problems(self.wheel([("probe/libdep.so", dep), ("probe/libtop.so", with_rpath)])), [])


if __name__ == "__main__":
    unittest.main()
