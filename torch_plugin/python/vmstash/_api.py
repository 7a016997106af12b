"""The control calls of vmstash that need no torch: tags, pause/resume, stats.

pause/resume act on one tag or (tag=None) on every tag declared in this process (the
runtime's tag registry: this package keeps no copy), on one device or (device=None) on
every device the allocator uses. When PyTorch MemPools
cache tensors inside our segments (vmstash.region), pause asks PyTorch which of their
blocks are in use so that free cached blocks are not copied (see _torch.live_ranges), and
hands every device's hint to the library in one call (vmstash.h, Note [Liveness Hints]).
"""
import contextlib
import ctypes
import os

from . import _lib

_POLICIES = ("discard", "backup")

# Set by vmstash._torch when torch is in use: (tag, device) -> the tag's liveness hint on the
# device, a list of (address, size) (vmstash.h, Note [Liveness Hints]).
live_ranges_provider = None
# Set by vmstash._torch: devices that have a MemPool of `tag`.
pool_devices_provider = None
# Set by vmstash._torch: a context manager over (tag, device) pairs inside which a pause
# takes their hints and makes its C call; it yields the pairs whose hints may be taken
# (_torch.py, Note [Hints and Routing]).
hint_session_provider = None


def init(options=None):
    """Initializes the library with a VMSTASH_CONF-style string (None: the environment).
    Optional: the first allocation initializes from VMSTASH_CONF. Raises on bad options or
    when already initialized with different ones."""
    _lib.check(_lib.lib().vmstash_init(None if options is None else _lib.encode(options, "options")), "vmstash.init")


def version():
    return _lib.lib().vmstash_version().decode()


def create_tag(tag, policy="discard"):
    """Declares `tag` with `policy` ("discard" or "backup"). Idempotent for the same policy;
    a different policy for an existing tag raises (FAILED_PRECONDITION)."""
    if policy not in _POLICIES:
        raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
    _lib.check(_lib.lib().vmstash_create_tag(_lib.encode(tag), policy.encode()), f"create_tag({tag!r}, {policy!r})")


def tags():
    """Tags declared in this process (through this package or the C ABI), in declaration
    order: {tag: policy}."""
    return _lib.json_call(_lib.lib().vmstash_tags_json, None, "tags")


def policy_of(tag):
    """The policy of a declared tag, or None. Raises vmstash.Error with the library's code
    for anything else (a malformed name: INVALID_ARGUMENT; after shutdown:
    FAILED_PRECONDITION)."""
    l = _lib.lib()
    policy = l.vmstash_tag_policy(_lib.encode(tag))
    if policy is None:
        if l.vmstash_last_error_code() == _lib.NOT_FOUND:
            return None
        raise _lib.last_failure(f"policy_of({tag!r})")
    return policy.decode()


def bind_tag_slot(tag):
    """The allocation slot bound to `tag` (vmstash_bind_tag_slot): the N of the tag's own
    entry point vmstash_malloc_slot<N>. Raises vmstash.Error with the library's code
    (RESOURCE_EXHAUSTED: every slot is bound, as vmstash.OutOfMemoryError)."""
    slot = _lib.lib().vmstash_bind_tag_slot(_lib.encode(tag))
    if slot < 0:
        raise _lib.last_failure(f"bind_tag_slot({tag!r})")
    return slot


def set_current_tag(tag):
    """Routes this thread's allocations through vmstash_malloc (global mode, install()) to `tag`."""
    _lib.check(_lib.lib().vmstash_set_current_tag(_lib.encode(tag)), f"set_current_tag({tag!r})")


def current_tag():
    return _lib.lib().vmstash_get_current_tag().decode()


def _targets(tag):
    if tag is not None:
        return [tag]
    return list(tags())


def _device_arg(device):
    if device is None:
        return -1
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    index = getattr(device, "index", None) if hasattr(device, "type") else None  # torch.device
    if not isinstance(index, int):
        raise ValueError(f"device must be an int or a torch.device with an index, got {device!r}")
    return index


def pause(tag=None, device=None):
    """Pauses `tag` (None: every tag of this package) on `device` (None: all in use).
    Returns True if anything was paused, False if all were already paused. Raises
    vmstash.Error on failure; the failing tag is left as it was on every device (one call
    into the runtime per tag, with every device's MemPool hint: all or nothing across
    devices, Note [All-or-Nothing Transitions] in runtime/runtime.h)."""
    dev = _device_arg(device)
    changed = False
    for t in _targets(tag):
        changed |= _pause_one(t, dev)
    return changed


def _hint_keys(tag, dev):
    """The (tag, device) pairs, on `dev` or all (-1), where `tag` has a PyTorch MemPool that
    gives it a hint: none for a discard tag (only a backup pause copies) or without torch."""
    if live_ranges_provider is None or pool_devices_provider is None:
        return []
    devices = [d for d in pool_devices_provider(tag) if dev == -1 or d == dev]
    if not devices or policy_of(tag) != "backup":
        return []
    return [(tag, d) for d in devices]


def _live_hints(held):
    """(tag, device, starts, sizes, n) for each pair of `held`: the tag's liveness hint there
    (live_ranges_provider, computed from the pool's own segments by _torch.live_ranges), as
    ctypes arrays; n == 0 keeps nothing on that device. Devices without a hint pause
    without one."""
    for tag, d in held:
        ranges = live_ranges_provider(tag, d)
        if ranges is None:  # the pool went away meanwhile: no hint
            continue
        n = len(ranges)
        bad = [(a, s) for a, s in ranges if not (0 <= a < 1 << 64 and 0 <= s < 1 << 64)]
        if bad:  # ctypes would wrap them silently, and the hint would keep other bytes
            raise _lib.Error(f"pause({tag!r}): a live range {bad[0]} of device {d} is outside the 64-bit "
                             "address space", _lib.INVALID_ARGUMENT)
        starts = (ctypes.c_uint64 * max(n, 1))(*[a for a, _ in ranges])
        sizes = (ctypes.c_uint64 * max(n, 1))(*[s for _, s in ranges])
        yield tag, d, starts, sizes, n


@contextlib.contextmanager
def _hinted(tags_and_names, dev, empty=()):
    """Yields (live, n_live) for a C call made inside: the liveness hints of every (tag,
    encoded name) on `dev` (-1: all devices), and an empty hint for each (encoded name,
    device) of `empty`, as a ctypes array of vmstash_live_ranges and its length. The hints
    are taken and the call made in one hint session (_torch.py, Note [Hints and Routing]):
    no other thread's region can take a block of a hinted pool in between."""
    names = dict(tags_and_names)
    keys = [k for t, _ in tags_and_names for k in _hint_keys(t, dev)]
    session = hint_session_provider(keys) if hint_session_provider else contextlib.nullcontext(keys)
    with session as held:
        live, keep = [], []
        for t, d, starts, sizes, n in _live_hints(held):
            keep += [starts, sizes]
            live.append(_lib.LiveRanges(names[t], d, starts, sizes, n))
        for name, d in empty:
            live.append(_lib.LiveRanges(name, d, None, None, 0))
        keep.append([name for name, _ in empty])
        yield (_lib.LiveRanges * max(len(live), 1))(*live), len(live)
        del keep


def _pause_one(tag, dev):
    # One C call for every device, each with its own hint: all or nothing across devices
    # (Note [All-or-Nothing Transitions]); devices without a MemPool of the tag (global
    # mode, C++ users) pause without a hint.
    name = _lib.encode(tag)
    with _hinted([(tag, name)], dev) as (live_arr, n_live):
        return _lib.raise_for(_lib.lib().vmstash_pause_live_devices(name, dev, live_arr, n_live),
                              f"pause({tag!r})" if dev == -1 else f"pause({tag!r}, device={dev})")


def resume(tag=None, device=None):
    """Resumes `tag` (None: every tag of this package) at the same addresses. Returns True
    if anything was resumed. Out of memory raises vmstash.OutOfMemoryError and leaves the
    tag paused with its backup on every device; retry after freeing memory. An after-resume
    hook's failure raises too, with the tag resumed on every device (the message says so
    and names each device whose hook failed)."""
    dev = _device_arg(device)
    changed = False
    for t in _targets(tag):
        changed |= _lib.raise_for(_lib.lib().vmstash_resume(_lib.encode(t), dev), f"resume({t!r})")
    return changed


def switch(pause=(), resume=(), device=None, *, keep_nothing=(), agree=None):
    """A phase switch: pauses the tags in `pause` and resumes those in `resume` in one
    transaction, on `device` (None: every device in use, all or nothing). The outgoing
    tags' live bytes go to host memory while the incoming tags' come back (both directions
    of the link at once), and the outgoing tags' physical memory is mapped into the incoming
    tags' address ranges where chunk sizes allow instead of being released and created
    again. Hooks run as for pause and resume. Returns True if anything changed, False when
    every tag already was in its requested state. On failure (vmstash.OutOfMemoryError when
    the incoming tags do not fit) every tag is as it was. `keep_nothing`: (tag, device)
    pairs of outgoing tags whose bytes are not kept there (an empty liveness hint, Note
    [Liveness Hints]; vmstash.compat.vllm drops a backup tag's bytes this way).
    `agree` (Note [Agreed Switch]; vmstash.distributed builds it): the switch as one of
    several processes' that all commit or all roll back, on one device of this process
    (`device`, or None: the one device holding these tags). It is called exactly once with
    this process's outcome (None: prepared, only the commit left; else the failure as a
    vmstash.Error) and returns None to commit, or a reason (str) to roll back: the switch
    then raises vmstash.Error (ABORTED) with it, every tag as it was. An exception in
    `agree` rolls back too and is raised, chained. `agree` may not call vmstash."""
    if isinstance(pause, str) or isinstance(resume, str):
        raise TypeError("switch: pause and resume are lists of tag names, not a string")
    pause, resume = list(pause), list(resume)
    dev = _device_arg(device)
    l = _lib.lib()
    names = [_lib.encode(t) for t in pause + resume]
    p_arr = (ctypes.c_char_p * max(len(pause), 1))(*names[:len(pause)])
    r_arr = (ctypes.c_char_p * max(len(resume), 1))(*names[len(pause):])
    dropped = {t for t, _ in keep_nothing}
    hinted = _hinted([(t, n) for t, n in zip(pause, names) if t not in dropped], dev,
                     [(_lib.encode(t), d) for t, d in keep_nothing])
    what = f"switch(pause={pause!r}, resume={resume!r})"
    if agree is None:
        with hinted as (live_arr, n_live):
            return _lib.raise_for(l.vmstash_switch(p_arr, len(pause), r_arr, len(resume), dev, live_arr, n_live),
                                  what)
    raised = []

    def vote(_ctx, code, message, reason, size):
        local = None if code == _lib.OK else _lib.error(f"{what}: {message.decode(errors='replace')}", code)
        try:
            answer = agree(local)
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the rollback
            raised.append(e)
            answer = f"the agreement raised {type(e).__name__}: {e}"
        if answer is None:
            return 0
        text = str(answer).encode(errors="replace")[: max(size - 1, 0)]
        ctypes.memmove(reason, text + b"\0", len(text) + 1)
        return 1

    callback = _lib.AGREE_FN(vote)
    with hinted as (live_arr, n_live):
        code = l.vmstash_switch_agreed(p_arr, len(pause), r_arr, len(resume), dev, live_arr, n_live, callback, None)
    try:
        return _lib.raise_for(code, what)
    except _lib.Error as e:
        if raised:
            raise e from raised[0]
        raise


def prepare(tag, device=None, nbytes=0):
    """Pins the backup arena of a `backup` tag ahead of its first pause (nbytes=0: the tag's
    current bytes). Done automatically in the background unless auto_prepare:0."""
    _lib.check(_lib.lib().vmstash_prepare(_lib.encode(tag), _device_arg(device), nbytes), f"prepare({tag!r})")


def release_backup(tag, device=None):
    """Gives the pinned host memory of a tag's backup arena back (not while paused)."""
    _lib.check(_lib.lib().vmstash_release_backup(_lib.encode(tag), _device_arg(device)), f"release_backup({tag!r})")


def set_prepare_ahead(tag, ahead=True):
    """Whether the declared tag's pinned backup is prepared ahead of its pauses in the
    background (the default, with auto_prepare on) or made by the pause that first needs
    it (ahead=False; an arena already made is kept), on every device."""
    _lib.check(_lib.lib().vmstash_set_prepare_ahead(_lib.encode(tag), int(bool(ahead))),
               f"set_prepare_ahead({tag!r})")


def set_backup_store(tag, store, directory=None):
    """Where the later pauses of a declared `backup` tag put its bytes, on every device:
    "pinned" (pinned host memory; link speed; the default unless VMSTASH_CONF's backup key
    says otherwise), "pageable" (anonymous mmap, given back to the OS after each resume) or
    "disk" with `directory` (an existing directory; a file there, unlinked at creation,
    holds the paused bytes instead of host memory), or "disk_files" with `directory`
    (torch_memory_saver's layout: while paused, one visible file per backed-up allocation,
    removed at the resume; backup_arena.h, Note [Disk Backup Files]). Not while the tag is
    paused; a different store drops the tag's present backup arena."""
    if store not in ("pinned", "pageable", "disk", "disk_files"):
        raise ValueError(f"store must be 'pinned', 'pageable', 'disk' or 'disk_files', got {store!r}")
    if store.startswith("disk") != (directory is not None):
        raise ValueError("a directory is given for the disk stores and only for them")
    d = None if directory is None else _lib.encode(os.fspath(directory), "directory")
    _lib.check(_lib.lib().vmstash_set_backup_store(_lib.encode(tag), store.encode(), d),
               f"set_backup_store({tag!r}, {store!r})")


def backup_store(tag):
    """The store of a tag's backups: "pinned", "pageable", "disk:<directory>" or
    "disk_files:<directory>"."""
    return _lib.string_call(_lib.lib().vmstash_backup_store, _lib.encode(tag), f"backup_store({tag!r})")


def empty_cache(device=None, tag=None):
    """Returns cached free chunks of vmstash to the driver (all tags, or one)."""
    _lib.check(_lib.lib().vmstash_empty_cache(_device_arg(device), None if tag is None else _lib.encode(tag)),
               "empty_cache")


def stats(device=None):
    """Per-tag and total statistics (allocator/stats.h) as a dict; device=None: a list with
    one dict per device in use."""
    l = _lib.lib()
    return _lib.json_call(l.vmstash_stats_json, _device_arg(device), "stats")


def snapshot(device=None):
    """Segments, chunks and blocks (allocator/snapshot.h) as a dict; device=None: a list."""
    l = _lib.lib()
    return _lib.json_call(l.vmstash_snapshot_json, _device_arg(device), "snapshot")


def tag_stats(tag, device=None):
    """The stats dict of one tag on `device`, or None when it has no memory there.
    device=None: on the one device in use where the tag has memory (the first such device
    when it has memory on several: pass `device` there); a process that uses one GPU, as
    each rank of a job, need not say which (a query never starts using a device)."""
    per_device = [stats(device)] if device is not None else stats(None)
    found = [t for d in per_device for t in d["tags"] if t["name"] == tag]
    holding = [t for t in found if t["state"] != "active" or t["reserved_bytes"]["current"] or t["backed_up_bytes"]]
    return (holding or found or [None])[0]


def read_backup(address, nbytes, dst_address, device=None):
    """Copies `nbytes` at device `address` from the backup of a paused `backup` tag into
    host memory at `dst_address` (`device` None: the device whose tag holds the address).
    Raises vmstash.Error (NOT_FOUND) when no paused backup holds those bytes; ValueError for
    a negative size or address or a null destination."""
    for name, value in (("address", address), ("nbytes", nbytes), ("dst_address", dst_address)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"read_backup: {name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"read_backup: {name} must be >= 0, got {value}")
    if nbytes > 0 and dst_address == 0:
        raise ValueError("read_backup: dst_address is null")
    _lib.check(_lib.lib().vmstash_read_backup(address, nbytes, _device_arg(device), dst_address), "read_backup")


def set_memory_margin(nbytes):
    """Refuse to map new device memory when free memory would drop below `nbytes` (0: off).
    The refused allocation fails like an out-of-memory (PyTorch then frees its cache and
    retries)."""
    if nbytes < 0:
        raise ValueError("memory margin must be >= 0")
    _lib.check(_lib.lib().vmstash_set_memory_margin(nbytes), "set_memory_margin")
