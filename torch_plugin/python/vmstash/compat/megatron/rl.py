"""Megatron-LM's RL loop with its training state offloaded through vmstash: one call.

    import vmstash.compat.megatron.rl as vm_rl
    vm_rl.install()       # before pretrain() builds the model and optimizer; nothing else changes
    # train_rl.py ... --rl-offload-optimizer-during-inference     (the flag Megatron-RL has)

Note [Megatron-RL Offload]
  With --rl-offload-optimizer-during-inference, Megatron-LM's RL loop (megatron/rl/rl_utils.py:
  get_environment_rollouts and megatron_rl_inference_mode, on megatron-core 0.19's classes)
  calls, before each rollout and each evaluation,
      model[0].offload_grad_buffers(); optimizer.offload_to_cpu()
  and after it
      model[0].restore_grad_buffers(); optimizer.restore_from_cpu()
  install() makes those calls pause and resume vmstash tags, for the models and optimizers
  whose state it placed:
  - get_megatron_optimizer (megatron.core.optimizer's, and the name megatron.training.training
    imported from it, which setup_model_and_optimizer calls) moves the DDP buffers of the
    model chunks it is given into tags first (megatron_training.py, Note [Megatron Training
    Tags]), builds the optimizer inside the optimizer tag's region and wraps its steps.
  - DistributedDataParallel.offload_grad_buffers pauses the gradient tag (policy discard: its
    device memory goes back at once, nothing copied, as Megatron's own frees the storage);
    restore_grad_buffers resumes it and zeroes the gradients, as Megatron's own does.
  - MegatronOptimizer.offload_to_cpu and ChainedOptimizer.offload_to_cpu pause the optimizer
    tag (policy backup: the fp32 main parameters and Adam's state go to pinned host memory at
    the link's speed); restore_from_cpu resumes it.
  What differs from Megatron's own methods, on purpose:
  - Every tensor keeps its address (Megatron's restore allocates the storage and the
    optimizer's tensors anew): views stay views (main parameters that alias the parameter
    buffer with the precision-aware optimizer), and CUDA graphs captured over the training
    state stay valid.
  - The gradients of every model chunk placed are paused, not those of model[0] only.
  - The optimizer's bytes move in one pinned transfer per device instead of a pageable
    .cpu() per tensor.
  Not paused: the parameters (the rollout's log-probability passes read them, and they are the
  weights Megatron's in-process inference uses) and the global memory buffer (in-process
  inference and tensor-parallel collectives use it, and captured graphs hold its address):
  both stay on the device as they do with Megatron's own offload. A switch of the user's own
  may still pause their tags (PARAMS_TAG, GMB_TAG).
  Objects not placed here keep Megatron's methods: those built before install(), and models
  whose buffers place_ddp_buffers refuses (NCCL memory pool, a shared MXFP8 buffer, fp32
  accumulation buffers), which get one warning each. uninstall() puts the methods back.
"""
import functools
import importlib
import logging
import threading
import weakref

from ... import _api
from .. import megatron_training as _mt

logger = logging.getLogger("vmstash.compat.megatron.rl")

GRADS_TAG, OPTIM_TAG = _mt.GRADS_TAG, _mt.OPTIM_TAG

__all__ = ["install", "uninstall", "installed", "placed", "GRADS_TAG", "OPTIM_TAG"]

_lock = threading.Lock()
_originals = {}  # (owner object, attribute name) -> (its own attribute or None: inherited, the original)
_placed_models = weakref.WeakSet()  # DDP modules whose buffers are in the tags
_placed_optimizers = weakref.WeakSet()  # optimizers built in the tag (and their chained children)


def installed():
    return bool(_originals)


def placed(obj):
    """Whether install() placed this DDP module's or optimizer's state in vmstash tags."""
    return obj in _placed_models or obj in _placed_optimizers


def _patch(owner, name, make):
    own = vars(owner).get(name)
    original = getattr(owner, name)
    _originals[(owner, name)] = (own, original)
    setattr(owner, name, make(original))


def _state(tag):
    stats = _api.tag_stats(tag)
    return stats.get("state") if stats else None


def _pause(tag):
    """Pauses `tag` where it is active (a second offload call, from model[1] or a chained
    optimizer's child, finds it paused: nothing to do)."""
    if _state(tag) == "active":
        _api.pause(tag)


def _resume(tag):
    """Resumes `tag` where it is paused; whether it did."""
    if _state(tag) == "paused":
        _api.resume(tag)
        return True
    return False


def _ddp_modules(model_chunks):
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return [c for c in chunks if _mt._buffers(c)]


def _in_tags(ddp):
    """Whether any gradient buffer of the DDP module was moved into a tag (place_ddp_buffers
    marks each one it moved)."""
    return any(getattr(b, "_vmstash_grads_tag", None) for b in _mt._buffers(ddp))


def _children(optimizer):
    attrs = getattr(optimizer, "__dict__", {})
    return list(attrs.get("chained_optimizers") or ())


def _make_get_megatron_optimizer(original):
    @functools.wraps(original)
    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        build = lambda: original(config, model_chunks, *args, **kwargs)  # noqa: E731
        ddps = [d for d in _ddp_modules(model_chunks) if d not in _placed_models]
        if not ddps:
            return build()
        try:
            _mt.check_layouts(ddps)
        except _mt.UnsupportedLayout as e:  # nothing moved: Megatron's own build and offload
            logger.warning("vmstash Megatron-RL: the training state stays Megatron's (its own offload runs): %s", e)
            return build()
        try:
            optimizer = _mt.place_training_state(ddps, build)
        except BaseException:
            # Raised to the caller (Megatron's own build failing included); buffers already in
            # the tags stay vmstash's, so that Megatron's offload never frees their storage.
            _placed_models.update(d for d in ddps if _in_tags(d))
            raise
        _placed_models.update(ddps)
        todo = [optimizer]
        while todo:
            o = todo.pop()
            _placed_optimizers.add(o)
            todo += _children(o)
        return optimizer
    return get_megatron_optimizer


def _make_offload_grads(original):
    @functools.wraps(original)
    def offload_grad_buffers(self, synchronize=True, empty_cache=True):
        if self not in _placed_models:
            return original(self, synchronize=synchronize, empty_cache=empty_cache)
        _pause(GRADS_TAG)  # synchronizes the device first
        if empty_cache:
            import torch
            torch.cuda.empty_cache()
    return offload_grad_buffers


def _make_restore_grads(original):
    @functools.wraps(original)
    def restore_grad_buffers(self, synchronize=True):
        if self not in _placed_models:
            return original(self, synchronize=synchronize)
        if _resume(GRADS_TAG):  # zeroed once, as Megatron's restore zeroes after an offload
            for ddp in list(_placed_models):  # the tag holds every placed model's gradients
                for b in _mt._buffers(ddp):
                    b.grad_data.zero_()
        if synchronize:
            import torch
            torch.cuda.synchronize()
    return restore_grad_buffers


def _make_optimizer_move(tag_call):
    def make(original):
        @functools.wraps(original)
        def move(self):
            if self not in _placed_optimizers:
                return original(self)
            tag_call(OPTIM_TAG)
        return move
    return make


def install():
    """Routes Megatron-RL's training-state offload through vmstash (Note [Megatron-RL
    Offload]). Idempotent. Raises ImportError when megatron-core is not importable."""
    with _lock:
        if _originals:
            return
        try:
            _install()
        except BaseException:
            _restore()  # nothing half-installed
            raise


def _install():
    import megatron.core.optimizer as core_optimizer
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer
    for tag, policy in ((GRADS_TAG, "discard"), (OPTIM_TAG, "backup")):
        _api.create_tag(tag, policy)
    owners = [core_optimizer]
    try:  # the name setup_model_and_optimizer calls (imported from megatron.core.optimizer)
        training = importlib.import_module("megatron.training.training")
        if getattr(training, "get_megatron_optimizer", None) is core_optimizer.get_megatron_optimizer:
            owners.append(training)
    except Exception as e:  # noqa: BLE001 - megatron.training is optional (megatron-core alone)
        logger.debug("vmstash Megatron-RL: megatron.training not importable (%s); megatron.core's "
                     "get_megatron_optimizer is wrapped", e)
    wrapped = _make_get_megatron_optimizer(core_optimizer.get_megatron_optimizer)
    for owner in owners:
        _originals[(owner, "get_megatron_optimizer")] = (owner.get_megatron_optimizer, None)
        owner.get_megatron_optimizer = wrapped
    _patch(DistributedDataParallel, "offload_grad_buffers", _make_offload_grads)
    _patch(DistributedDataParallel, "restore_grad_buffers", _make_restore_grads)
    for cls in (MegatronOptimizer, ChainedOptimizer):
        _patch(cls, "offload_to_cpu", _make_optimizer_move(_pause))
        _patch(cls, "restore_from_cpu", _make_optimizer_move(_resume))


def uninstall():
    """Puts Megatron's functions and methods back (placed state stays in its tags)."""
    with _lock:
        _restore()


def _restore():
    for (owner, name), (own, _) in reversed(list(_originals.items())):
        if own is None:
            delattr(owner, name)  # it was inherited: the base's shows again
        else:
            setattr(owner, name, own)
    _originals.clear()

