"""The vllm.general_plugins entry point: registers the "vmstash" backend and routes vLLM's
allocations to vmstash where a model selects it.

vLLM loads general plugins in every process (`register()` here may run more than once:
it is idempotent). What it changes in vLLM, where the names exist (vLLM 0.33):
  - SleepModeBackendFactory gets "vmstash" -> vmstash.compat.vllm.backend.VmstashSleepBackend.
  - vllm.device_allocator.get_mem_allocator_instance (and the name in the vLLM modules
    already imported) answers VmstashMemAllocator in a process whose model selected
    sleep_mode_backend "vmstash", else what it answered before. The process's choice comes
    from the current vLLM config when one is set, else from the config the worker was made
    with (WorkerBase.__init__ is wrapped to note it: vLLM's worker loads its model outside
    set_current_vllm_config), else from select().
  - VllmConfig.use_cumem_cudagraph_pool, which vLLM limits to its cumem backend, holds for
    "vmstash" too under the same conditions (sleep mode on, sleep_mode_offload_cudagraph,
    CUDA graphs on, a CUDA device), so graphs captured then allocate in tag "cudagraph".
  - With VMSTASH_VLLM_SLEEP_BACKEND=1 in the environment (inherited by every process of the
    tree: engine cores, workers), an engine with sleep mode on and vLLM's default backend
    ("cumem") uses "vmstash" instead — for frameworks that build the engine arguments
    themselves (OpenRLHF, verl's server mode). Its worker's model config is changed when the
    worker is made (WorkerBase.__init__) and again when a backend is made
    (SleepModeBackendFactory.create_backend), so everything after reads "vmstash"; an engine
    that names another backend keeps it (one that names "cumem" cannot be told from the
    default: it is switched too). Read once per process; where vmstash's backend cannot run
    (no CUDA device, its library missing) vLLM keeps its own, with one warning. 0 or unset:
    off.
"""
import functools
import logging
import os
import sys
import threading

logger = logging.getLogger("vmstash.compat.vllm")

BACKEND_NAME = "vmstash"
ENV_SWITCH = "VMSTASH_VLLM_SLEEP_BACKEND"
_lock = threading.Lock()
_choice = {"forced": None, "noted": None}  # select()'s choice; the worker's config's
_switch_state = {}  # "on": the switch as read once (register()); "usable": vmstash's backend can run here
_original = {}


def select(on=True):
    """This process's vLLM allocations go to vmstash (on=True) or not (on=False) whatever the
    config says; on=None gives the choice back to the config. For programs that drive vLLM's
    allocator themselves (tests, custom workers)."""
    if on is not None and not isinstance(on, bool):
        raise TypeError(f"select: on is True, False or None, got {on!r}")
    if on:
        _register(strict=True)  # the routing, where vLLM did not load the plugin (VLLM_PLUGINS)
    _choice["forced"] = on


def selected():
    """Whether get_mem_allocator_instance answers vmstash's allocator in this process."""
    if _choice["forced"] is not None:
        return _choice["forced"]
    config = sys.modules.get("vllm.config")
    get = getattr(config, "get_current_vllm_config_or_none", None)
    cfg = get() if get is not None else None
    if cfg is not None:
        return _selects(cfg)
    return bool(_choice["noted"])


def switched_on():
    """Whether VMSTASH_VLLM_SLEEP_BACKEND asks for vmstash in place of vLLM's default backend
    (1/true/yes/on; 0/false/no/off or unset: no). Another value is a ValueError naming it."""
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV_SWITCH}={os.environ.get(ENV_SWITCH)!r}: expected 1 (vmstash in place of vLLM's "
                     "default sleep-mode backend) or 0")


def _switch():
    """The switch as read once per process (a bad value counting as off: register() said
    why), and only where vmstash's backend can run here (else vLLM keeps its own, said
    once): the routing never raises, and never fails an engine that would work without it."""
    with _lock:
        if "on" not in _switch_state:
            try:
                _switch_state["on"] = switched_on()
            except ValueError:
                _switch_state["on"] = False
        if not _switch_state["on"]:
            return False
        if "usable" not in _switch_state:
            from .backend import VmstashSleepBackend
            _switch_state["usable"] = bool(VmstashSleepBackend.is_supported())
            if not _switch_state["usable"]:
                logger.warning("vmstash vLLM plugin: %s is on, but vmstash's backend cannot run in this process "
                               "(no CUDA device, or its library does not load); vLLM keeps its own backend",
                               ENV_SWITCH)
        return _switch_state["usable"]


def _backend_of(model_config):
    """The sleep-mode backend `model_config` gets: its own, or vmstash in place of "cumem"
    where the switch is on and sleep mode is."""
    name = getattr(model_config, "sleep_mode_backend", None)
    if name == "cumem" and getattr(model_config, "enable_sleep_mode", False) and _switch():
        return BACKEND_NAME
    return name


def _apply_switch(model_config):
    """Writes the backend the switch gives into `model_config` (a worker's copy; in an
    engine that runs its worker in the process, the engine's own config), so vLLM's code
    after it reads "vmstash" too."""
    if model_config is None or _backend_of(model_config) == getattr(model_config, "sleep_mode_backend", None):
        return
    try:
        model_config.sleep_mode_backend = BACKEND_NAME
    except Exception:  # noqa: BLE001 - a config that refuses it (frozen): the routing still follows the switch
        logger.warning("vmstash vLLM plugin: %s is on, but the model config refused sleep_mode_backend=\"vmstash\"",
                       ENV_SWITCH, exc_info=True)
        return
    logger.info("vmstash vLLM plugin: %s is on: sleep-mode backend \"vmstash\" in place of \"cumem\"", ENV_SWITCH)


def _selects(vllm_config):
    return _backend_of(getattr(vllm_config, "model_config", None)) == BACKEND_NAME


def _note_config(vllm_config):
    if vllm_config is not None:
        _apply_switch(getattr(vllm_config, "model_config", None))
        _choice["noted"] = _selects(vllm_config)


def register():
    """The entry point (vllm.general_plugins): see the module's docstring. It never raises:
    vLLM calls general plugins without a try, in every process it starts, so a plugin that
    raises takes its host down. On a vLLM without a sleep-mode backend registry (no
    vllm.device_allocator.sleep_mode_backend: vLLM 0.24 and earlier) it changes nothing and
    logs one line at debug level; anything else that fails is logged as a warning, and vLLM
    runs as it would without vmstash."""
    try:
        _register(strict=False)
    except Exception:  # noqa: BLE001 - a plugin must never take down its host
        logger.warning("vmstash vLLM plugin: not registered; vLLM runs without the vmstash backend", exc_info=True)
        return
    try:
        switched_on()
    except ValueError as e:  # said once per process; the switch counts as off
        logger.warning("vmstash vLLM plugin: %s; vLLM keeps its own backend", e)


def _register(strict):
    with _lock:
        factory = _backend_factory(strict)
        if factory is None:
            return False
        _register_backend(factory)
        _switch_created_backends(factory)
        _route_allocator()
        _wrap_worker_init()
        _extend_cudagraph_pool()
        return True


def _backend_factory(strict):
    """vLLM's SleepModeBackendFactory, or None (strict: ImportError) where this vLLM has none."""
    try:
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
        return SleepModeBackendFactory
    except ImportError as e:
        version = getattr(sys.modules.get("vllm"), "__version__", "of unknown version")
        why = (f"vLLM {version} has no sleep-mode backend registry "
               f"(vllm.device_allocator.sleep_mode_backend: {e}); the vmstash backend needs one (vLLM 0.25 or later)")
        if strict:
            raise ImportError(f"vmstash.compat.vllm: {why}") from e
        logger.debug("vmstash vLLM plugin: nothing registered: %s", why)
        return None


def _register_backend(factory):
    try:
        factory.register_backend(BACKEND_NAME, "vmstash.compat.vllm.backend", "VmstashSleepBackend")
    except ValueError:  # registered by an earlier load of the plugins
        pass


def _switch_created_backends(factory):
    create = factory.__dict__.get("create_backend")
    if create is None or getattr(create, "_vmstash_switch", False):
        return
    original = create.__func__ if isinstance(create, classmethod) else None
    if original is None:
        return

    @functools.wraps(original)
    def create_backend(cls, *args, **kwargs):
        _apply_switch(args[0] if args else kwargs.get("model_config"))
        return original(cls, *args, **kwargs)

    create_backend._vmstash_switch = True
    wrapped = classmethod(create_backend)
    wrapped._vmstash_switch = True  # seen on the class's __dict__ entry
    setattr(factory, "create_backend", wrapped)


def _route_allocator():
    import vllm.device_allocator as da
    current = da.get_mem_allocator_instance
    if getattr(current, "_vmstash_router", False):
        return
    original = _original.setdefault("get_mem_allocator_instance", current)

    @functools.wraps(original)
    def get_mem_allocator_instance():
        if selected():
            from .allocator import VmstashMemAllocator
            return VmstashMemAllocator.get_instance()
        return original()

    get_mem_allocator_instance._vmstash_router = True
    da.get_mem_allocator_instance = get_mem_allocator_instance
    for name, module in list(sys.modules.items()):  # modules that imported the name already
        if name.startswith("vllm.") and getattr(module, "get_mem_allocator_instance", None) is original:
            module.get_mem_allocator_instance = get_mem_allocator_instance


def _wrap_worker_init():
    # vLLM loads the plugins once per process, in a worker process from init_worker of this
    # module, but in an engine that runs its worker in process (LLM(...) beside a trainer)
    # before the module is imported: import it then.
    try:
        import vllm.v1.worker.worker_base as base
    except ImportError:
        logger.warning("vmstash vLLM plugin: vllm.v1.worker.worker_base cannot be imported; the worker's "
                       "sleep_mode_backend is read from the current vLLM config only")
        return
    cls = getattr(base, "WorkerBase", None)
    if cls is None or getattr(cls.__init__, "_vmstash_noted", False):
        return
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        _note_config(kwargs.get("vllm_config", args[0] if args else None))
        init(self, *args, **kwargs)

    __init__._vmstash_noted = True
    cls.__init__ = __init__


def _extend_cudagraph_pool():
    try:
        import vllm.config as config  # imported in every vLLM process already
    except ImportError:
        return
    cls = getattr(config, "VllmConfig", None)
    prop = getattr(cls, "use_cumem_cudagraph_pool", None) if cls is not None else None
    if not isinstance(prop, property) or getattr(prop.fget, "_vmstash_extended", False):
        return
    fget = prop.fget

    @functools.wraps(fget)
    def use_cumem_cudagraph_pool(self):
        if fget(self):
            return True
        mc = self.model_config
        if mc is None or _backend_of(mc) != BACKEND_NAME:
            return False
        if not (getattr(mc, "enable_sleep_mode", False) and getattr(mc, "sleep_mode_offload_cudagraph", False)):
            return False
        mode = getattr(getattr(self, "compilation_config", None), "cudagraph_mode", None)
        if mode is None or getattr(mode, "name", str(mode)) == "NONE":
            return False
        from vllm.platforms import current_platform
        return current_platform.is_cuda_alike()

    use_cumem_cudagraph_pool._vmstash_extended = True
    cls.use_cumem_cudagraph_pool = property(use_cumem_cudagraph_pool)
