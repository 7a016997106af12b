"""The RL phase-switch demo from a source tree: the same as `python3 -m vmstash.demo` once
the package is installed (torch_plugin/python/vmstash/demo/rl_phase_switch.py).

    python3 examples/rl_phase_switch.py [--cycles 10] [--plot memory.svg] [--json out.json]
                                        [--peer MODULE] [--judge-peer]
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_plugin", "python"))

from vmstash.demo.rl_phase_switch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
