"""Megatron-LM's training state in vmstash tags (megatron-core 0.19.x), without editing Megatron.

    import vmstash.compat.megatron as vm_megatron
    ddp = DistributedDataParallel(config, ddp_config, model)           # as usual
    opt = vm_megatron.place_training_state([ddp], lambda: get_megatron_optimizer(opt_config, [ddp]))
    ...                                                                 # train
    vmstash.switch(pause=vm_megatron.TRAINING_TAGS, resume=["weights", "kv_cache"])   # rollout
    vmstash.switch(pause=["weights", "kv_cache"], resume=vm_megatron.TRAINING_TAGS)   # train on

Where each part of the training state goes (Note [Megatron Training Tags]):
  megatron_params  backup   DDP's contiguous parameter buffers (`_ParamAndGradBuffer.param_data`)
  megatron_grads   discard  DDP's gradient buffers (`grad_data`): the next step zeroes them
  megatron_optim   backup   the distributed optimizer's fp32 main parameters and Adam's state
  megatron_gmb     discard  the global memory buffer (scratch: contents never read back)

Note [Megatron Training Tags]
  - DDP makes both buffers of a `_ParamAndGradBuffer` in one constructor. They are moved
    afterwards with Megatron's own `offload_to_cpu` / `reload_from_cpu`, the reload run
    inside the tag's region: the storage is allocated again in the tag and every view of
    it (parameters, `main_grad`, buckets) follows, since views share the storage. So this
    runs before the optimizer is built (it takes views of `param_data`) and before any
    graph capture; the addresses never change after it (vmstash keeps them across pauses),
    unlike Megatron's own `offload_grad_buffers`, which must not be used with this.
  - Without the distributed optimizer, DDP keeps each parameter's own storage
    (`param_data` is None): build the model inside `vmstash.region("megatron_params",
    policy="backup")` instead; the gradient buffer is moved all the same.
  - The optimizer is built inside the optimizer tag's region (its fp32 main parameters are
    made then) and each inner optimizer's `step` runs inside it, where Adam's state appears
    at the first step. Per-step temporaries of other code stay outside.
  - The global memory buffer allocates through the `mem_alloc_context` argument Megatron's
    `get_tensor` has; `tag_global_memory_buffer` passes the tag's region. Megatron drops
    the buffer in `destroy_model_parallel`: tag the new one after a re-initialization.
  - Before pausing the training tags: `prepare_switch_out` drops references into the
    gradient tag that outlive a step (`optimizer.zero_grad()`), finishes a parameter
    all-gather that `overlap_param_gather` would leave to the next forward (without the
    distributed optimizer it gathers through the gradient buffer, which the pause drops),
    and synchronizes.
  - The global memory buffer is the process's, not one model's: a rollout that runs
    Megatron's own inference (or a reference model's forward) in the same process uses it.
    Pause TRAINING_STATE_TAGS (without it) then; TRAINING_TAGS includes it.
  - Optimizer state made outside `step` stays where it was made: load an optimizer
    checkpoint (which makes Adam's state) inside `optimizer_region()`.
  - Refused, before anything moves: buffers in Megatron's NCCL memory pool (`nccl_ub`:
    memory registered with NCCL), one allocation shared by parameters and gradients
    (MXFP8), separate fp32 accumulation gradients.
"""
import functools

from .. import _api, _torch

PARAMS_TAG, GRADS_TAG, OPTIM_TAG, GMB_TAG = "megatron_params", "megatron_grads", "megatron_optim", "megatron_gmb"
TRAINING_STATE_TAGS = [PARAMS_TAG, GRADS_TAG, OPTIM_TAG]
TRAINING_TAGS = TRAINING_STATE_TAGS + [GMB_TAG]
_POLICY = {PARAMS_TAG: "backup", GRADS_TAG: "discard", OPTIM_TAG: "backup", GMB_TAG: "discard"}

__all__ = ["TRAINING_TAGS", "TRAINING_STATE_TAGS", "PARAMS_TAG", "GRADS_TAG", "OPTIM_TAG", "GMB_TAG", "place_ddp_buffers",
           "check_layouts", "UnsupportedLayout",
           "optimizer_region", "wrap_optimizer_steps", "tag_global_memory_buffer", "place_training_state",
           "prepare_switch_out"]


class UnsupportedLayout(ValueError):
    """place_ddp_buffers refuses these buffers, before anything moved."""


def _buffers(ddp):
    """Megatron DDP's _ParamAndGradBuffers (an instance attribute: nn.Module's buffers() is a method)."""
    attrs = getattr(ddp, "__dict__", {})
    return list(attrs.get("buffers", [])) + list(attrs.get("expert_parallel_buffers", []))


def check_layouts(ddp_models):
    """The _ParamAndGradBuffers of `ddp_models`, checked as place_ddp_buffers needs them:
    ValueError without any; UnsupportedLayout for a layout it does not know (NCCL memory
    pools, shared MXFP8 buffers, separate fp32 accumulation buffers). Moves nothing."""
    buffers = [b for ddp in ddp_models for b in _buffers(ddp)]
    if not buffers:
        raise ValueError("place_ddp_buffers: no _ParamAndGradBuffer in these models (not Megatron DDP modules?)")
    for b in buffers:
        if getattr(b, "nccl_mem_pool", None) is not None:
            raise UnsupportedLayout("place_ddp_buffers: the buffers are in Megatron's NCCL memory pool (nccl_ub); "
                                    "memory registered with NCCL is not supported")
        if getattr(b, "shared_buffer", None) is not None:
            raise UnsupportedLayout("place_ddp_buffers: a buffer shares one allocation between parameters and "
                                    "gradients (MXFP8 with the distributed optimizer); not supported")
        if getattr(b, "extra_main_grads", None):
            raise UnsupportedLayout("place_ddp_buffers: a buffer has separate fp32 accumulation gradients "
                                    "(param_name_patterns_for_fp32_local_accumulation); not supported")
    return buffers


def place_ddp_buffers(ddp_models, params_tag=PARAMS_TAG, grads_tag=GRADS_TAG):
    """Moves the parameter and gradient buffers of each Megatron DistributedDataParallel in
    `ddp_models` into their tags (Note [Megatron Training Tags]). Returns the bytes moved
    per tag. Refuses what check_layouts refuses, before moving anything."""
    buffers = check_layouts(ddp_models)
    if _torch.open_regions():
        raise RuntimeError("place_ddp_buffers: a vmstash region is open; call it outside regions")
    moved = {params_tag: 0, grads_tag: 0}
    import torch
    torch.cuda.synchronize()
    for b in buffers:
        b.offload_to_cpu(move_params=False, move_grads=True)
        with _torch.region(grads_tag, "discard"):
            b.reload_from_cpu(move_params=False, move_grads=True)
        b._vmstash_grads_tag = grads_tag  # in the tag from here on (compat/megatron/rl.py reads it)
        moved[grads_tag] += b.grad_data.numel() * b.grad_data.element_size()
        if b.param_data is not None:
            b.offload_to_cpu(move_params=True, move_grads=False)
            with _torch.region(params_tag, "backup"):
                b.reload_from_cpu(move_params=True, move_grads=False)
            torch.cuda.synchronize()  # the copy from the pinned host copy is done: drop it
            b.param_data_cpu = None
            moved[params_tag] += b.param_data.numel() * b.param_data.element_size()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the old storages: back to PyTorch's pool, then to the driver
    _empty_host_cache()  # the pinned host copies: out of PyTorch's pinned cache
    return moved


def _empty_host_cache():
    import torch
    for fn in (getattr(getattr(torch, "accelerator", None), "memory", None), torch.cuda.memory):
        empty = getattr(fn, "empty_host_cache", None) if fn is not None else None
        if empty is not None:
            empty()
            return
    getattr(torch._C, "_host_emptyCache", lambda: None)()


def optimizer_region(tag=OPTIM_TAG):
    """Allocations inside (a context manager) go to the optimizer's tag: build the optimizer inside."""
    return _torch.region(tag, "backup")


def _inner_optimizers(optimizer):
    """The torch optimizers inside a Megatron optimizer (chains nest: LayerWiseDistributedOptimizer)."""
    attrs = getattr(optimizer, "__dict__", {})  # not the properties: ChainedOptimizer.optimizer asserts
    chained = attrs.get("chained_optimizers")
    if chained is not None:
        return [inner for o in chained for inner in _inner_optimizers(o)]
    inner = attrs.get("optimizer")
    if inner is not None and inner is not optimizer:
        return _inner_optimizers(inner)
    return [optimizer] if hasattr(optimizer, "step") else []


def wrap_optimizer_steps(optimizer, tag=OPTIM_TAG):
    """Each inner torch optimizer of a Megatron optimizer (ChainedOptimizer, DistributedOptimizer
    or a plain one) steps inside the tag's region, so the state it creates lazily (Adam's
    exp_avg, exp_avg_sq) lands there. Idempotent."""
    wrapped = 0
    for inner in _inner_optimizers(optimizer):
        step = inner.step
        if getattr(step, "_vmstash_tag", None) == tag:
            continue

        @functools.wraps(step)
        def in_tag(*args, _step=step, **kwargs):
            with _torch.region(tag, "backup"):
                return _step(*args, **kwargs)

        in_tag._vmstash_tag = tag
        inner.step = in_tag  # the instance attribute shadows the class's step; Megatron calls self.optimizer.step()
        wrapped += 1
    return wrapped


def tag_global_memory_buffer(tag=GMB_TAG):
    """Megatron's global memory buffer allocates in `tag` (policy discard) from now on (its
    existing tensors stay where they are: call it before the first forward). After
    destroy_model_parallel / initialize_model_parallel, call it again."""
    from megatron.core import parallel_state
    buf = parallel_state.get_global_memory_buffer()
    get = type(buf).get_tensor
    if getattr(buf.get_tensor, "_vmstash_tag", None) == tag:
        return buf

    def get_tensor(shape, dtype, name, mem_alloc_context=None):
        return get(buf, shape, dtype, name, mem_alloc_context=mem_alloc_context or (lambda: _torch.region(tag, "discard")))

    get_tensor._vmstash_tag = tag
    buf.get_tensor = get_tensor
    return buf


def place_training_state(ddp_models, make_optimizer=None, *, tags=None):
    """All of the above: the DDP buffers moved, the optimizer built by `make_optimizer()`
    inside its tag with its steps wrapped, the global memory buffer tagged. Returns the
    optimizer (None without make_optimizer). `tags`: {PARAMS_TAG: name, ...} to rename."""
    names = {t: t for t in TRAINING_TAGS}
    names.update(tags or {})
    for tag, policy in _POLICY.items():
        _api.create_tag(names[tag], policy)
    place_ddp_buffers(ddp_models, names[PARAMS_TAG], names[GRADS_TAG])
    optimizer = None
    if make_optimizer is not None:
        with optimizer_region(names[OPTIM_TAG]):
            optimizer = make_optimizer()
        wrap_optimizer_steps(optimizer, names[OPTIM_TAG])
    tag_global_memory_buffer(names[GMB_TAG])
    return optimizer


def prepare_switch_out(ddp_models, optimizer=None):
    """What must happen before the training tags are paused (Note [Megatron Training Tags]):
    gradients dropped, a deferred parameter all-gather finished, the device synchronized."""
    if optimizer is not None:
        optimizer.zero_grad()
    for ddp in ddp_models:
        config = getattr(ddp, "ddp_config", None)
        if getattr(config, "overlap_param_gather", False):
            ddp.start_param_sync(force_sync=True)
    import torch
    torch.cuda.synchronize()
