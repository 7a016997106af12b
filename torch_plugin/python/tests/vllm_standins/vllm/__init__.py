"""Stand-in for the vllm package (see ../README.md): the engine does not run here."""


class _EngineNotHere:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("vLLM's engine is not available in this stand-in environment "
                           "(only vLLM's allocator files are loaded)")


class LLM(_EngineNotHere):
    pass


class AsyncLLMEngine(_EngineNotHere):
    pass


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class AsyncEngineArgs(SamplingParams):
    pass
