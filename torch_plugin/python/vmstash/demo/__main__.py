"""python3 -m vmstash.demo [--cycles 10] [--plot memory.svg] [--json out.json] [--peer MODULE] [--judge-peer]"""
import sys

from vmstash.demo.rl_phase_switch import main

sys.exit(main())
