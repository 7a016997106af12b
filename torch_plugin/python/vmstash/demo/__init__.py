"""The RL phase-switch demo (python3 -m vmstash.demo; see rl_phase_switch.py) and its peer
run (tms_peer.py). Importing this package imports nothing heavy; torch is imported when the
demo runs."""
