"""The package around the allocator, on the simulated driver: the version and its one place,
bad options, the CLI shim, and the PyTorch-only functions without torch."""
import os
import re
import sys

import pytest

import vmstash


def test_version_and_bad_options(sim):
    assert re.search(r"^\d+\.\d+\.\d+$", vmstash.version())
    with pytest.raises(vmstash.Error) as e:
        vmstash.init("no_such_key:1")
    assert e.value.code_name == "INVALID_ARGUMENT"
    assert "no_such_key" in str(e.value)


def test_dunder_version_is_the_library_version(sim):
    assert isinstance(vmstash.__version__, str)
    assert vmstash.__version__ == vmstash.version()
    assert re.search(r"^\d+\.\d+\.\d+([.+-][0-9A-Za-z.]+)?$", vmstash.__version__)
    assert getattr(vmstash, "no_such_attribute", None) is None
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    with open(os.path.join(root, "base", "version.h")) as f:  # the version's one place
        assert f'kVersion[] = "{vmstash.__version__}";' in f.read()


def test_cli_shim_never_execs_a_script_named_by_vmstash_cli():
    # VMSTASH_CLI naming the console script itself looped exec forever (hung on the H200).
    import subprocess
    import tempfile
    from vmstash import _cli
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "vmstash")
        with open(script, "w") as f:
            f.write("#!/usr/bin/env python3\nfrom vmstash._cli import main\nmain()\n")
        os.chmod(script, 0o755)
        env = dict(os.environ, VMSTASH_CLI=script)
        old = os.environ.get("VMSTASH_CLI")
        os.environ["VMSTASH_CLI"] = script
        try:
            try:
                path = _cli.cli_path()
                assert path != script  # the package's own binary, never the script
            except FileNotFoundError as e:
                assert "VMSTASH_CLI" in str(e)  # a source tree: no binary, a clear error
        finally:
            if old is None:
                del os.environ["VMSTASH_CLI"]
            else:
                os.environ["VMSTASH_CLI"] = old
        # Started by itself, the shim stops at once with a clear message instead of looping.
        env["_VMSTASH_CLI_SHIM"] = "1"
        r = subprocess.run([sys.executable, "-c", "import sys; from vmstash._cli import main; sys.exit(main())",
                            "ps"], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert "started by itself" in r.stderr


def test_torch_functions_without_torch_raise_clearly(sim):
    try:
        import torch  # noqa: F401
        pytest.skip("torch is importable here")
    except ImportError:
        pass
    with pytest.raises(vmstash.Error) as e:
        with vmstash.region("cpu_r"):
            pass
    assert "needs PyTorch" in str(e.value)


def test_a_library_that_does_not_match_the_package_is_a_clear_error():
    # VMSTASH_LIBRARY naming an older build (here: libc, which has no vmstash call at all).
    import ctypes.util
    import subprocess
    libc = ctypes.util.find_library("c")
    code = ("import vmstash\n"
            "try:\n    vmstash.version()\n"
            "except vmstash.Error as e:\n    print(e.code_name, e)\n")
    env = dict(os.environ, VMSTASH_LIBRARY=libc)
    env.pop("LD_PRELOAD", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("FAILED_PRECONDITION ")
    assert "lacks vmstash_init" in r.stdout and "does not match this Python package" in r.stdout
