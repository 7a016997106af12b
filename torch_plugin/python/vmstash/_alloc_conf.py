"""PyTorch's expandable segments, as the preload library's whole-process mode sees them.

With expandable_segments on, PyTorch's own pools grow through cuMemCreate / cuMemMap (the
driver's virtual memory calls, resolved through cudaGetDriverEntryPoint), never through
cudaMalloc: the preload library, which routes cudaMalloc, never sees that memory, so a
whole-process pause (TMS_INIT_ENABLE=1, VMSTASH_PRELOAD_ALL) would leave it on the
device. Tags' own pools are not concerned: PyTorch turns expandable segments off for a
MemPool with a custom allocator (vmstash's regions, cuda_graph, the vLLM backend).

The setting reaches PyTorch three ways, all seen here:
  * PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF (PyTorch 2.11 reads the first one set,
    an empty one included);
  * at run time (torch._C._accelerator_setAllocatorSettings,
    torch.cuda.memory._set_allocator_settings), as frameworks do around their training
    step: only the memory itself shows it, so a pause looks at PyTorch's segments.
"""

ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
KEY = "expandable_segments"


def env_setting(environ):
    """(variable, on) for the variable PyTorch reads (the first of ENV_VARS set, even empty:
    PyTorch 2.11's allocator config takes a set PYTORCH_ALLOC_CONF over the other), on:
    whether it turns expandable segments on; (None, False) when none is set."""
    for name in ENV_VARS:
        conf = environ.get(name)
        if conf is not None:
            return name, flag(conf)
    return None, False


def flag(conf):
    """Whether an allocator config string sets expandable_segments to true (the last
    occurrence wins, as PyTorch's parser applies them in order)."""
    on = False
    for field in conf.split(","):
        key, _, value = field.partition(":")
        if key.strip() == KEY:
            on = value.strip().lower() in ("true", "1")
    return on


def expandable_bytes(segments):
    """(allocated, reserved) bytes of the expandable segments in a PyTorch memory snapshot's
    segment list (torch.cuda.memory_snapshot())."""
    allocated = reserved = 0
    for s in segments:
        if s.get("is_expandable"):
            allocated += int(s.get("allocated_size", 0))
            reserved += int(s.get("total_size", 0))
    return allocated, reserved


def whole_process_refusal(environ):
    """The error message for a whole-process start with the setting on, else None."""
    name, on = env_setting(environ)
    if not on:
        return None
    return (f"torch_memory_saver on vmstash: whole-process mode (TMS_INIT_ENABLE=1) cannot pause PyTorch's expandable "
            f"segments ({name} sets expandable_segments:True): PyTorch grows them through cuMemCreate, which the "
            f"preload library does not route, so a pause would leave them on the device. Turn it off "
            f"(expandable_segments:False in {name}), or keep whole-process mode off and allocate what must pause "
            f"inside region() (tags' pools never use expandable segments)")


def pause_refusal(segments):
    """The error message for a whole-process pause while PyTorch's expandable segments hold
    live tensors (the setting turned on at run time), else None."""
    allocated, reserved = expandable_bytes(segments)
    if allocated == 0:
        return None
    mib = 1 << 20
    return (f"torch_memory_saver on vmstash: pause refused: PyTorch's expandable segments hold {allocated / mib:.0f} "
            f"MiB of live tensors ({reserved / mib:.0f} MiB reserved) that whole-process mode cannot pause (they grow "
            f"through cuMemCreate, which the preload library does not route). expandable_segments was turned on "
            f"at run time (torch._C._accelerator_setAllocatorSettings or torch.cuda.memory._set_allocator_settings) "
            f"or in PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF: turn it off before these tensors are made, or free "
            f"them before the pause. Nothing was paused")
