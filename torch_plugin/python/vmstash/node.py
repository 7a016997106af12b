"""The node pool (docs/node.md): one pinned host pool, kept by the node daemon (vmstashd),
that the backups of every vmstash process on the node lease in turn, so a pause runs at
link speed whatever the other processes did to the host's memory, and the node holds the
largest phase's backups rather than the sum.

    import vmstash
    vmstash.node.connect()      # or VMSTASH_CONF=node:1 before the first allocation
    ...                          # pauses lease from the pool; resumes give it back
    vmstash.node.stats()        # the pool's figures and this process's

The torch_memory_saver drop-in and the vLLM backend use it with VMSTASH_CONF=node:1: no
code change. A pause the pool cannot serve (full, daemon gone) backs up in the process's
own memory and logs why; it never fails for want of the pool.
"""
from . import _lib


def connect(start=True):
    """Connects this process's backups to the node pool. start=True starts vmstashd (with
    VMSTASH_CONF node_capacity, default half of the host's memory) when none serves.
    Raises vmstash.Error: UNAVAILABLE (no daemon and start=False, or it did not come up),
    NOT_FOUND (no vmstashd), FAILED_PRECONDITION (the runtime directory's trust rules)."""
    _lib.check(_lib.lib().vmstash_node_connect(1 if start else 0), "vmstash.node.connect")


def stats():
    """The pool's figures (capacity_bytes, leased_bytes, peak_bytes, largest_free_bytes,
    leases, clients, refused) and this process's (process_leases, process_leased_bytes,
    process_registered_bytes, process_fallbacks, process_pinning: node_pin's background
    pinning is running), as a dict. Raises vmstash.Error
    (UNAVAILABLE) when not connected."""
    return _lib.json_call(_lib.lib().vmstash_node_stats_json, None, "vmstash.node.stats")
