"""Stand-in for vllm.utils.system_utils."""


def find_loaded_library(lib_name):
    """The path of a shared library this process has mapped whose file name starts with
    `lib_name`, or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if path.rsplit("/", 1)[-1].startswith(lib_name):
                return path
    return None
