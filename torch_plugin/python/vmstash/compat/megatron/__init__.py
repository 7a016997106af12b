"""Megatron-LM's MoE paged stash on vmstash arenas (megatron-core 0.19.x).

    import vmstash.compat.megatron as vm_megatron
    vm_megatron.install()          # before Megatron allocates its stash buffers

After `install()`, megatron-core's own code runs on vmstash:
  - `PagedStashBuffer(num_tokens, hidden_size, page_size, device, overflow, host_spill,
    dtype, num_tokens_host)` is a vmstash.stash.Arena of hidden_size x element-size rows,
    page_size rows per page, with the device pages Megatron would give it and a pinned
    host tier of num_tokens_host rows; Megatron keys its buffers by (dtype, hidden size)
    and so do these, since its manager still builds the dict.
  - The manager's one `overflow` and one `host_spill` int64 tensors are linked to every
    arena (vmstash_stash_link_flags): an overflow in any buffer sets the shared flag, and
    from then on every stash and every reload of every buffer is a no-op until Megatron's
    reset clears it, as in Megatron's kernels; a stash placed in the host tier sets
    host_spill.
  - `PagedTensor.offload_to_stash` / `reload_from_stash` stash and restore through the
    arena (row counts read on the device, capturable), MXFP8 columnwise scales included
    (rows = tokens // 32, as Megatron counts them).
  - Handles (device page tables) are made before a CUDA graph capture: the manager's
    `allocate_stash_buffers` reserves, per buffer, as many as the measuring iteration
    created paged tensors for that buffer; `reserve_handles()` does it by hand.
  - `release_stash_buffers()` pauses the arenas' tag (default "megatron_stash"; its
    memory goes back to the driver) instead of dropping the buffers: the addresses stay,
    so graphs captured before stay valid, and the buffers' next `reset()` resumes the tag.
Megatron's training state (DDP buffers, the distributed optimizer, the global memory
buffer) in tags of their own: place_training_state and the rest of megatron_training.py.
`uninstall()` puts Megatron's classes back. Buffers made before install stay Megatron's
and keep working with Megatron's kernels (the patched methods hand them through).
"""
import threading

import torch

from ... import _api
from ... import stash as _stash

from ..megatron_training import (GMB_TAG, GRADS_TAG, OPTIM_TAG, PARAMS_TAG, TRAINING_STATE_TAGS,  # noqa: E402,F401
                                TRAINING_TAGS, optimizer_region, place_ddp_buffers, place_training_state,
                                prepare_switch_out, tag_global_memory_buffer, wrap_optimizer_steps)

__all__ = ["install", "uninstall", "installed", "reserve_handles", "PagedStashBuffer", "SCALE_INV_BLOCK_SIZE",
           # Megatron's training state in tags (megatron_training.py)
           "TRAINING_TAGS", "TRAINING_STATE_TAGS", "PARAMS_TAG", "GRADS_TAG", "OPTIM_TAG", "GMB_TAG",
           "place_training_state", "place_ddp_buffers", "optimizer_region", "wrap_optimizer_steps",
           "tag_global_memory_buffer", "prepare_switch_out"]

SCALE_INV_BLOCK_SIZE = 32  # megatron.core.transformer.moe.paged_stash: MXFP8 scales per 32 tokens

_lock = threading.Lock()
_state = {"module": None, "saved": None, "tag": "megatron_stash", "released": False, "buffers": [],
          "counts": {}}


def _module():
    from megatron.core.transformer.moe import paged_stash
    return paged_stash


class _Shape:
    """What Megatron's log line reads of `cuda_buffer` / `host_buffer`: the shape and dtype
    of the pages (they live in the arena, not in a torch tensor)."""

    def __init__(self, shape, dtype, device):
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = device

    def __repr__(self):
        return f"<vmstash stash pages {tuple(self.shape)} {self.dtype} on {self.device}>"


class PagedStashBuffer:
    """Megatron's PagedStashBuffer interface over a vmstash.stash.Arena."""

    def __init__(self, num_tokens, hidden_size, page_size, device, overflow, host_spill, dtype, num_tokens_host=0):
        if page_size <= 0 or page_size & (page_size - 1):
            raise ValueError(f"vmstash.compat.megatron: page_size must be a power of two, got {page_size}")
        device = torch.device(device) if not isinstance(device, torch.device) else device
        if device.type != "cuda":
            raise ValueError(f"vmstash.compat.megatron: the stash needs a CUDA device, got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.hidden_size = hidden_size
        self.page_size = page_size
        self.device = torch.device("cuda", index)
        self.dtype = dtype
        self.overflow = overflow
        self.host_spill = host_spill
        self.num_cuda_pages = max(1, (num_tokens + page_size - 1) // page_size)
        self.total_cuda_tokens = self.num_cuda_pages * page_size
        self.num_host_pages = (num_tokens_host + page_size - 1) // page_size if num_tokens_host > 0 else 0
        self.total_host_tokens = self.num_host_pages * page_size
        row_bytes = hidden_size * torch.tensor([], dtype=dtype).element_size()
        _resume_if_released()
        self.arena = _stash.Arena(row_bytes=row_bytes, device_pages=self.num_cuda_pages, host_pages=self.num_host_pages,
                                  page_rows=page_size, tag=_state["tag"], device=index)
        self.arena.link_flags(overflow, host_spill)
        self.cuda_buffer = _Shape((self.total_cuda_tokens, hidden_size), dtype, self.device)
        self.host_buffer = _Shape((self.total_host_tokens, hidden_size), dtype, "cpu") if self.num_host_pages else None
        with _lock:
            _state["buffers"].append(self)

    def reset(self):
        """Forgets every stash (capturable); after release_stash_buffers() it first resumes
        the arenas' tag (not during a capture)."""
        _resume_if_released()
        self.arena.reset()

    def __repr__(self):
        return (f"PagedStashBuffer[vmstash](num_cuda_pages={self.num_cuda_pages}, num_host_pages={self.num_host_pages}, "
                f"page_size={self.page_size}, hidden_size={self.hidden_size}, device={self.device}, "
                f"dtype={self.dtype})")


def _resume_if_released():
    with _lock:
        if not _state["released"]:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("vmstash.compat.megatron: the stash buffers were released; reset them (which resumes "
                               "their memory) before capturing a CUDA graph")
        _api.resume(_state["tag"])
        _state["released"] = False


def _geometry(pt, buf):
    """(rows tensor, max rows) of a PagedTensor in `buf`'s rows, as Megatron counts them."""
    if pt.is_columnwise_scale_inv:
        return pt.num_tokens_tensor // SCALE_INV_BLOCK_SIZE, pt.max_num_tokens // SCALE_INV_BLOCK_SIZE
    return pt.num_tokens_tensor, pt.max_num_tokens


def _rows_view(t, buf, max_rows, what):
    flat = t.reshape(-1).view(buf.dtype) if t.dtype != buf.dtype else t.reshape(-1)
    if flat.numel() < max_rows * buf.hidden_size:
        raise ValueError(f"vmstash.compat.megatron: {what}: {flat.numel()} elements hold fewer than {max_rows} rows "
                         f"of hidden size {buf.hidden_size}")
    return flat[:max_rows * buf.hidden_size].view(max_rows, buf.hidden_size)


def _offload_to_stash(self, paged_stash_buffer, max_blocks=2048):
    if not isinstance(paged_stash_buffer, PagedStashBuffer):
        return _state["saved"]["offload_to_stash"](self, paged_stash_buffer, max_blocks)
    buf = paged_stash_buffer
    self._tensor = self._tensor.contiguous()
    if self.num_tokens_tensor.dim() == 0:
        self.num_tokens_tensor = self.num_tokens_tensor.reshape(1)
    rows, max_rows = _geometry(self, buf)
    self._vmstash = buf.arena.stash(_rows_view(self._tensor, buf, max_rows, "offload_to_stash"), rows=rows)
    self._original_tensor = self._tensor
    self._tensor = None


def _reload_from_stash(self, paged_stash_buffer, max_blocks=2048):
    if not isinstance(paged_stash_buffer, PagedStashBuffer):
        return _state["saved"]["reload_from_stash"](self, paged_stash_buffer, max_blocks)
    buf = paged_stash_buffer
    assert self._tensor is not None, "reload_from_stash expects _tensor pre-allocated on main"
    assert tuple(self._tensor.shape) == tuple(self.original_shape), (
        f"_tensor shape {tuple(self._tensor.shape)} != original_shape {tuple(self.original_shape)}")
    stashed = getattr(self, "_vmstash", None)
    if stashed is None:
        raise RuntimeError("vmstash.compat.megatron: reload_from_stash of a tensor that was not offloaded")
    _, max_rows = _geometry(self, buf)
    stashed.restore(out=_rows_view(self._tensor, buf, max_rows, "reload_from_stash"))
    self._vmstash = None


def _count_paged_tensor(init):
    def __init__(self, tensor, *args, **kwargs):
        init(self, tensor, *args, **kwargs)
        mgr = _state["module"].PagedStashManager.STASH_MGR
        if mgr is not None and mgr.status == "capture" and self.max_num_tokens is not None:
            dtype = self.dtype
            max_rows = self.max_num_tokens // SCALE_INV_BLOCK_SIZE if self.is_columnwise_scale_inv else \
                self.max_num_tokens
            key = (dtype, self.hidden_size, max_rows)
            with _lock:
                _state["counts"][key] = _state["counts"].get(key, 0) + 1
    return __init__


def _allocate_stash_buffers(original):
    def allocate_stash_buffers(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not self.stash_buffers:
            return
        with _lock:
            counts = dict(_state["counts"])
        for (dtype, hidden, max_rows), count in counts.items():
            buf = self.stash_buffers.get(dtype, {}).get(hidden)
            if isinstance(buf, PagedStashBuffer):
                buf.arena.reserve_handles(count, max_rows)
    return allocate_stash_buffers


def _release_stash_buffers(self):
    """Pauses the arenas' tag instead of dropping the buffers (same addresses later)."""
    release()


def release():
    """Gives the memory of every vmstash stash buffer back to the driver (the buffers'
    tag is paused; their addresses stay). Every stash is forgotten. The next reset() of
    a buffer resumes it."""
    with _lock:
        if _state["released"]:
            return
        buffers = list(_state["buffers"])
    torch.cuda.synchronize()
    for buf in buffers:
        buf.arena.reset()  # a tag with live pages refuses the pause
    torch.cuda.synchronize()
    _api.pause(_state["tag"])
    with _lock:
        _state["released"] = True


def reserve_handles(buffer, count, max_num_tokens, columnwise_scale_inv=False):
    """Makes `count` handles for paged tensors of up to max_num_tokens tokens in `buffer`
    ahead of a CUDA graph capture (the manager does this itself in allocate_stash_buffers)."""
    max_rows = max_num_tokens // SCALE_INV_BLOCK_SIZE if columnwise_scale_inv else max_num_tokens
    buffer.arena.reserve_handles(count, max_rows)


def installed():
    return _state["saved"] is not None


def install(tag="megatron_stash"):
    """Makes megatron-core's paged stash run on vmstash arenas under `tag` (policy discard).
    Idempotent. Call before Megatron allocates its stash buffers."""
    with _lock:
        if _state["saved"] is not None:
            if tag != _state["tag"]:
                raise ValueError(f"vmstash.compat.megatron: installed already with tag {_state['tag']!r}")
            return
        m = _module()
        _api.create_tag(tag, "discard")
        saved = {"PagedStashBuffer": m.PagedStashBuffer,
                 "offload_to_stash": m.PagedTensor.offload_to_stash,
                 "reload_from_stash": m.PagedTensor.reload_from_stash,
                 "__init__": m.PagedTensor.__init__,
                 "allocate_stash_buffers": m.PagedStashManager.allocate_stash_buffers,
                 "release_stash_buffers": m.PagedStashManager.release_stash_buffers}
        m.PagedStashBuffer = PagedStashBuffer
        m.PagedTensor.offload_to_stash = _offload_to_stash
        m.PagedTensor.reload_from_stash = _reload_from_stash
        m.PagedTensor.__init__ = _count_paged_tensor(saved["__init__"])
        m.PagedStashManager.allocate_stash_buffers = _allocate_stash_buffers(saved["allocate_stash_buffers"])
        m.PagedStashManager.release_stash_buffers = _release_stash_buffers
        _state.update(module=m, saved=saved, tag=tag)


def uninstall():
    """Puts Megatron's own classes back (buffers made meanwhile keep working: the methods
    of Megatron's PagedTensor no longer know them, so drop them first)."""
    with _lock:
        saved = _state["saved"]
        if saved is None:
            return
        m = _state["module"]
        m.PagedStashBuffer = saved["PagedStashBuffer"]
        m.PagedTensor.offload_to_stash = saved["offload_to_stash"]
        m.PagedTensor.reload_from_stash = saved["reload_from_stash"]
        m.PagedTensor.__init__ = saved["__init__"]
        m.PagedStashManager.allocate_stash_buffers = saved["allocate_stash_buffers"]
        m.PagedStashManager.release_stash_buffers = saved["release_stash_buffers"]
        _state.update(saved=None, counts={})
