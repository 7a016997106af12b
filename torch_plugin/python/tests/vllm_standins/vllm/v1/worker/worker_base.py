"""Stand-in for vllm.v1.worker.worker_base: what vmstash's plugin wraps (WorkerBase.__init__
receives the worker's VllmConfig, under set_current_vllm_config in vLLM's init_worker)."""


class WorkerBase:
    def __init__(self, vllm_config, local_rank=0, rank=0, distributed_init_method=None, is_driver_worker=False):
        self.vllm_config = vllm_config
        self.local_rank, self.rank = local_rank, rank
