"""The status codes: vmstash.h's table (Note [Status Codes]), the library's
(vmstash_code_name), Python's copy (vmstash._codes) and Python's exception mapping agree; the package raises with named codes only, and with
the library's own code where a C call fails (no code guessed by Python).

Run with pytest (or `python3 test_status_codes.py`). The library tests need
libvmstash.so: VMSTASH_LIBRARY (the Bazel and CTest runners set it), else a Bazel build's
bazel-bin/torch_plugin/libvmstash.so in this checkout. No GPU: the simulated driver.
"""
import ast
import ctypes
import os
import re
import subprocess
import sys

os.environ.setdefault("VMSTASH_CONF", "driver:sim,sim_devices:2,sim_capacity:1G,auto_prepare:0")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PACKAGE = os.path.join(ROOT, "torch_plugin", "python")
HEADER = os.path.join(ROOT, "torch_plugin", "include", "vmstash", "vmstash.h")
if "VMSTASH_LIBRARY" not in os.environ and os.path.exists(os.path.join(ROOT, "bazel-bin", "torch_plugin",
                                                                       "libvmstash.so")):
    os.environ["VMSTASH_LIBRARY"] = os.path.join(ROOT, "bazel-bin", "torch_plugin", "libvmstash.so")
try:
    import vmstash  # noqa: F401
except ImportError:  # run from the source tree
    sys.path.insert(0, PACKAGE)

import vmstash  # noqa: E402
from vmstash import _api, _codes, _lib  # noqa: E402


def header_table():
    """(name, number) of each X(NAME, N) line of VMSTASH_STATUS_CODES in vmstash.h, and the
    value of VMSTASH_NOOP."""
    with open(HEADER) as f:
        text = f.read()
    block = re.search(r"#define VMSTASH_STATUS_CODES\(X\)((?:[^\n]*\\\n)*[^\n]*\n)", text)
    assert block, "vmstash.h has no VMSTASH_STATUS_CODES table"
    lines = [line.strip().rstrip("\\").strip() for line in block.group(1).splitlines()]
    entries = [line for line in lines if line]
    table = []
    for entry in entries:
        m = re.fullmatch(r"X\(([A-Z_]+), (\d+)\)", entry)
        assert m, f"vmstash.h: not a table entry: {entry!r}"
        table.append((m.group(1), int(m.group(2))))
    noop = re.search(r"#define VMSTASH_NOOP \((-?\d+)\)", text)
    assert noop, "vmstash.h has no VMSTASH_NOOP"
    return tuple(table), int(noop.group(1))


def _skip(reason):
    try:
        import pytest
    except ImportError:
        print(f"skip: {reason}")
        return
    pytest.skip(reason)


def test_pythons_table_is_the_headers():
    if not os.path.exists(HEADER):  # a test runner's tree without the header (its data)
        _skip(f"{os.path.relpath(HEADER, ROOT)} is not in this tree; the library's table is checked instead")
        return
    table, noop = header_table()
    assert _codes.CODES == table
    assert _codes.NOOP == noop
    for name, number in table:
        assert getattr(_codes, name) == number, name
        assert _codes.name_of(number) == name
    # Dense from 0, in order (the absl numbers; c_abi_test checks absl's names too).
    assert [number for _, number in table] == list(range(len(table)))
    assert ("ABORTED", 10) in table  # a hook's veto
    assert _codes.name_of(99) == "99"


def test_pythons_table_is_the_librarys():
    # The table the library was built from (vmstash_code_name, made from the header's).
    for name, number in _codes.CODES:
        assert _lib.lib().vmstash_code_name(number) == name.encode(), name
    assert _lib.lib().vmstash_code_name(len(_codes.CODES)) is None  # nothing past the table
    assert _lib.lib().vmstash_code_name(_codes.NOOP) is None
    assert [number for _, number in _codes.CODES] == list(range(len(_codes.CODES)))


def test_lib_uses_the_table():
    for name in ("OK", "NOOP", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                 "ABORTED", "INTERNAL", "UNAVAILABLE", "UNIMPLEMENTED", "UNKNOWN"):
        assert getattr(_lib, name) == getattr(_codes, name), name


def test_every_code_maps_to_its_exception():
    for name, number in _codes.CODES:
        if number == _codes.OK:
            continue
        e = _lib.error(f"call: {name}", number, done=number == _codes.ABORTED)
        assert isinstance(e, vmstash.Error)
        assert e.code == number and e.code_name == name
        assert e.done == (number == _codes.ABORTED)
        assert isinstance(e, vmstash.OutOfMemoryError) == (number == _codes.RESOURCE_EXHAUSTED)
        assert str(e) == f"call: {name}"
    assert isinstance(_lib.error("oom", _codes.RESOURCE_EXHAUSTED), MemoryError) or "torch" in sys.modules
    assert vmstash.Error("no code").code_name == "UNKNOWN"


def _numbered_raises(path):
    """Calls of *Error(...)/error(...) in a Python file that pass a code as a bare number."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        if not (name.endswith("Error") or name == "error"):
            continue
        args = list(node.args[1:]) + [k.value for k in node.keywords if k.arg == "code"]
        for a in args:
            if isinstance(a, ast.Constant) and isinstance(a.value, int) and not isinstance(a.value, bool):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
            elif isinstance(a, ast.UnaryOp) and isinstance(a.operand, ast.Constant):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    return found


def test_the_package_raises_with_named_codes_only():
    found = []
    for directory, _, files in os.walk(os.path.join(PACKAGE, "vmstash")):
        for f in sorted(files):
            if f.endswith(".py"):
                found += _numbered_raises(os.path.join(directory, f))
    assert found == [], f"raised with a bare number: {found}"


def test_the_checker_sees_bare_numbers():
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("raise _lib.Error('x', 9)\nraise Error('y', code=3)\nraise Error('z', NOT_FOUND)\n")
    try:
        assert [where.rsplit(":", 1)[1] for where in _numbered_raises(f.name)] == ["1", "2"]
    finally:
        os.unlink(f.name)


# --- Through the library (simulated driver) ----------------------------------------------

def test_a_hook_veto_raises_aborted():
    vmstash.create_tag("codes_veto", "backup")
    vmstash.set_current_tag("codes_veto")
    try:
        p = _lib.lib().vmstash_malloc(4096, 0, None)
    finally:
        vmstash.set_current_tag("default")
    assert p, _lib.last_error()
    hook_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p)
    veto = hook_type(lambda tag, device, user: 1)
    register = _lib.lib().vmstash_register_hooks
    register.restype, register.argtypes = ctypes.c_int, [ctypes.c_char_p, hook_type, hook_type, ctypes.c_void_p]
    assert register(b"codes_veto", veto, hook_type(), None) == _codes.OK
    try:
        vmstash.pause("codes_veto")
        raise AssertionError("the vetoed pause did not raise")
    except vmstash.Error as e:
        assert e.code == _codes.ABORTED and e.code_name == "ABORTED", e
        assert not e.done
        assert "before-pause hook" in str(e)
    assert vmstash.tag_stats("codes_veto", 0)["state"] == "active"
    _lib.lib().vmstash_free(p, 4096, 0, None)
    test_a_hook_veto_raises_aborted.keep = veto  # the C side holds the pointer


def _raises(fn, *args):
    try:
        fn(*args)
    except vmstash.Error as e:
        return e
    raise AssertionError(f"{fn.__name__}{args} did not raise")


def test_calls_without_a_code_report_the_librarys_code():
    # NULL or -1 from C: the code is vmstash_last_error_code's, not a guess.
    e = _raises(_api.bind_tag_slot, "bad tag")
    assert e.code_name == "INVALID_ARGUMENT" and "bad tag" in str(e), e  # was reported as out of memory
    assert not isinstance(e, vmstash.OutOfMemoryError)
    e = _raises(vmstash.stats, 9)
    assert e.code_name == "INVALID_ARGUMENT" and "device 9" in str(e), e  # was INTERNAL
    e = _raises(vmstash.backup_store, "codes_never_declared")
    assert e.code_name == "NOT_FOUND", e
    assert _api.policy_of("codes_never_declared") is None  # NOT_FOUND: None
    e = _raises(_api.policy_of, "bad tag")
    assert e.code_name == "INVALID_ARGUMENT", e
    slot = _api.bind_tag_slot("codes_slot")
    assert 0 <= slot and _api.bind_tag_slot("codes_slot") == slot


def _child(script, conf="driver:sim,sim_capacity:256M,auto_prepare:0"):
    env = dict(os.environ, VMSTASH_CONF=conf, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_policy_of_after_shutdown_and_full_slots_report_their_codes():
    out = _child(
        "import vmstash\n"
        "from vmstash import _api, _lib\n"
        "for i in range(40):\n"
        "    try:\n"
        "        _api.bind_tag_slot(f'slot{i}')\n"
        "    except vmstash.OutOfMemoryError as e:\n"
        "        assert e.code_name == 'RESOURCE_EXHAUSTED' and 'slots' in str(e), e\n"
        "        print('slots', i)\n"
        "        break\n"
        "vmstash.create_tag('late', 'backup')\n"
        "assert _lib.lib().vmstash_shutdown() == 0, _lib.last_error()\n"
        "try:\n"
        "    _api.policy_of('late')\n"
        "except vmstash.Error as e:\n"
        "    assert e.code_name == 'FAILED_PRECONDITION' and 'shut down' in str(e), e\n"
        "    print('after shutdown', e.code_name)\n")
    assert "slots 32" in out, out
    assert "after shutdown FAILED_PRECONDITION" in out, out


if __name__ == "__main__":
    import pytest
    sys.exit(pytest.main([__file__] + sys.argv[1:]))
