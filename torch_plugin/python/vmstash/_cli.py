"""The `vmstash` command: the wheel's console script runs the CLI binary shipped in the
package (vmstash/bin/vmstash_cli; tools/cli), with the same arguments.

    vmstash --help

VMSTASH_CLI overrides the binary (a built tools/cli/vmstash_cli, from a source tree). Tests
set VMSTASH_CLI to whatever they call, which may be this very console script; following it
would exec this script again forever, so the shim never follows VMSTASH_CLI to itself
(found on the H200: the CLI test hung with VMSTASH_CLI=<target>/bin/vmstash), and a
marker in the environment turns any other loop into an error.
"""
import os
import sys

_MARKER = "_VMSTASH_CLI_SHIM"


def _is_binary(path):
    """False for a Python console script (text starting with #!), which is what loops."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def cli_path():
    """VMSTASH_CLI when it names the CLI binary, else the package's own binary."""
    env = os.environ.get("VMSTASH_CLI")
    if env and _is_binary(env):
        return env
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "vmstash_cli")
    if os.path.exists(here):
        return here
    raise FileNotFoundError("the vmstash CLI binary is not in this package (it ships in the wheel: "
                            "scripts/build_wheel.sh); from a source tree set VMSTASH_CLI to a built "
                            "tools/cli/vmstash_cli")


def main():
    if os.environ.get(_MARKER):
        print("vmstash: the console script was started by itself (VMSTASH_CLI names a script, not "
              "the vmstash_cli binary)", file=sys.stderr)
        return 2
    try:
        path = cli_path()
    except FileNotFoundError as e:
        print(f"vmstash: {e}", file=sys.stderr)
        return 2
    os.environ[_MARKER] = "1"
    os.execv(path, [path] + sys.argv[1:])
