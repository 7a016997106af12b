"""Stand-in for vllm.distributed.device_communicators.pynccl_allocator: where graph
captures tell NCCL's allocator their pool."""
_graph_pool_id = None


def set_graph_pool_id(graph_pool_id):
    global _graph_pool_id
    _graph_pool_id = graph_pool_id
