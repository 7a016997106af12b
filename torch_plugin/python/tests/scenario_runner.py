"""Runs the GPU scenario files' functions: every scenario in a fresh subprocess (CUDA state
does not leak between them), or the named ones in this process (how each subprocess runs)."""
import os
import subprocess
import sys


def run_fresh(path, name, env=None):
    return subprocess.run([sys.executable, os.path.abspath(path), name], env=env).returncode


def main(path, scenarios, names, env_for=None):
    by_name = {f.__name__: f for f in scenarios}
    if names:
        for n in names:
            by_name[n]()
        return 0
    failed = [f.__name__ for f in scenarios
              if run_fresh(path, f.__name__, env_for(f.__name__) if env_for else None) != 0]
    print(f"{len(scenarios) - len(failed)}/{len(scenarios)} scenarios passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


def pytest_cases(path, scenarios, env_for=None):
    """`test_<name>` functions for pytest, one per scenario, each in a fresh subprocess:
    `globals().update(pytest_cases(__file__, SCENARIOS))` in a scenario file."""
    def case(name):
        def test():
            assert run_fresh(path, name, env_for(name) if env_for else None) == 0
        test.__name__ = f"test_{name}"
        return test
    return {f"test_{f.__name__}": case(f.__name__) for f in scenarios}
