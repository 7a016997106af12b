"""The node pool (docs/node.md): one pinned host pool, kept by the node daemon (vmstashd),
that the backups of every vmstash process on the node lease in turn, so a pause runs at
link speed whatever the other processes did to the host's memory, and the node holds the
largest phase's backups rather than the sum.

    import vmstash
    vmstash.node.connect()      # or VMSTASH_CONF=node:1 before the first allocation
    ...                          # pauses lease from the pool; resumes give it back
    vmstash.node.stats()        # the pool's figures and this process's

The torch_memory_saver drop-in and the vLLM backend use it with VMSTASH_CONF=node:1: no
code change. vmstash.node.switch pauses tags in some processes and resumes tags in others
as one transaction (Note [Node Switch] in node/node_switch.h). A pause the pool cannot serve (full, daemon gone) backs up in the process's
own memory and logs why; it never fails for want of the pool.
"""
import ctypes
import json

from . import _lib


def connect(start=True):
    """Connects this process's backups to the node pool. start=True starts vmstashd (with
    VMSTASH_CONF node_capacity, default half of the host's memory) when none serves.
    Raises vmstash.Error: UNAVAILABLE (no daemon and start=False, or it did not come up),
    NOT_FOUND (no vmstashd), FAILED_PRECONDITION (the runtime directory's trust rules, or a
    vmstashd of another release serving it: the message says how to replace it)."""
    _lib.check(_lib.lib().vmstash_node_connect(1 if start else 0), "vmstash.node.connect")


def stats():
    """The pool's figures (capacity_bytes, leased_bytes, peak_bytes, largest_free_bytes,
    leases, clients, refused) and this process's (process_leases, process_leased_bytes,
    process_registered_bytes, process_fallbacks, process_pinning: node_pin's background
    pinning is running), as a dict. Raises vmstash.Error
    (UNAVAILABLE) when not connected."""
    return _lib.json_call(_lib.lib().vmstash_node_stats_json, None, "vmstash.node.stats")


def _spec(pairs, what):
    entries = []
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"vmstash.node.switch: {what} takes (pid, tag) pairs, got {pair!r}")
        pid, tag = pair
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"vmstash.node.switch: {pid!r} is not a process id")
        if not isinstance(tag, str) or not tag or "," in tag:
            raise ValueError(f"vmstash.node.switch: {tag!r} is not a tag name (a non-empty str without ',')")
        entries.append(f"{pid}:{tag}")
    return ",".join(entries).encode()


def switch(pause=(), resume=(), device=None, timeout=60.0):
    """Pauses and resumes tags of several processes of this node as one transaction (the
    node daemon coordinates it; docs/node.md): `pause` and `resume` are (pid, tag) pairs,
    e.g. switch(pause=[(trainer, "train")], resume=[(rollout, "weights"),
    (rollout, "kv_cache")]). Every named process runs its part (an agreed switch: copies
    done before anyone commits); then all commit, or, on any failure, a process that
    exits or does not vote within `timeout` seconds, all roll back. Any process may call
    it, one taking part or not; each named process must use vmstash with its control
    endpoint on (the default). Returns the result: {"txn", "committed": True, "processes":
    [{"pid", "changed", ...}]}. Raises vmstash.Error: ABORTED when it rolled back (the
    message names the process and the reason; `.result` holds the per-process result),
    NOT_FOUND for a process without vmstash, INVALID_ARGUMENT for a bad request."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 24 * 3600:
        raise ValueError(f"vmstash.node.switch: timeout must be a number of seconds above 0, at most a day; "
                         f"got {timeout!r}")
    raw = ctypes.c_void_p()
    dev = -1 if device is None else int(device)
    code = _lib.lib().vmstash_node_switch(_spec(pause, "pause"), _spec(resume, "resume"), dev,
                                          max(1, int(timeout * 1000)), ctypes.byref(raw))
    result = None
    if raw.value:
        try:
            result = json.loads(ctypes.string_at(raw.value).decode())
        finally:
            _lib.lib().vmstash_string_free(raw.value)
    if code != _lib.OK:
        err = _lib.error(f"vmstash.node.switch: {_lib.last_error()}", code)
        err.result = result
        raise err
    return result
