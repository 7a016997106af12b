"""vmstash: pausable, tagged GPU memory for PyTorch.

    import vmstash
    with vmstash.region("kv_cache"):                  # policy "discard"
        kv = torch.empty(n, device="cuda")
    with vmstash.region("weights", policy="backup"):
        model = Model().cuda()
    vmstash.pause("kv_cache"); vmstash.pause("weights")   # physical memory released
    ...                                                   # another phase uses the GPU
    vmstash.resume("weights"); vmstash.resume("kv_cache") # same addresses: graphs replay
    vmstash.switch(pause=["kv_cache", "weights"], resume=["optimizer"])  # one transaction,
                                                      # both copy directions at once

Errors raise vmstash.Error (OutOfMemoryError, also a torch.OutOfMemoryError, when memory
runs out); nothing in vmstash exits the process. See torch_plugin/README.md. The paged
stash tier for MoE activations is vmstash.stash (Arena, saved_tensors).

vmstash.__version__ is version(): the loaded library's version (base/version.h, its one
place), read on first use so that importing vmstash loads no library.
"""
from ._api import (backup_store, create_tag, current_tag, empty_cache, init, pause, prepare, read_backup,
                   release_backup, resume, set_backup_store, set_current_tag, set_memory_margin, set_prepare_ahead,
                   snapshot, stats,
                   switch, tag_stats, tags, version)
from ._lib import Error, OutOfMemoryError, library_path, preload_library_path, preloaded_library
from ._torch import cuda_graph, install, pool, region, warm_blas_workspaces
from . import stash  # noqa: F401  (vmstash.stash.Arena, the paged stash tier)
from . import node  # noqa: F401  (vmstash.node: the node pool)
from . import weights  # noqa: F401  (vmstash.weights: a tag mapped across processes)

__all__ = [
    "Error", "OutOfMemoryError", "backup_store", "create_tag", "cuda_graph", "current_tag", "empty_cache", "init", "install",
    "library_path", "pause", "preload_library_path", "preloaded_library", "pool", "prepare", "read_backup", "region", "release_backup", "resume",
    "set_backup_store", "set_current_tag", "set_memory_margin", "set_prepare_ahead",
    "node", "snapshot", "stash", "stats", "switch", "tag_stats", "tags", "version", "warm_blas_workspaces",
]


def __getattr__(name):
    # Module attributes looked up lazily (PEP 562): only __version__.
    if name == "__version__":
        try:
            value = version()
        except Error as e:
            raise AttributeError(f"vmstash.__version__: {e}") from e
        globals()["__version__"] = value
        return value
    raise AttributeError(f"module 'vmstash' has no attribute {name!r}")
