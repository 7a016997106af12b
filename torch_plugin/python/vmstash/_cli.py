"""The `vmstash` command: the wheel's console script runs the CLI binary shipped in the
package (vmstash/bin/vmstash_cli; tools/cli), with the same arguments.

    vmstash --help
"""
import os
import sys


def cli_path():
    """VMSTASH_CLI when set (a built tools/cli/vmstash_cli), else the package's own binary."""
    env = os.environ.get("VMSTASH_CLI")
    if env:
        return env
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "vmstash_cli")
    if os.path.exists(here):
        return here
    raise FileNotFoundError("the vmstash CLI binary is not in this package (it ships in the wheel: "
                            "scripts/build_wheel.sh); from a source tree set VMSTASH_CLI to a built "
                            "tools/cli/vmstash_cli")


def main():
    try:
        path = cli_path()
    except FileNotFoundError as e:
        print(f"vmstash: {e}", file=sys.stderr)
        return 2
    os.execv(path, [path] + sys.argv[1:])
