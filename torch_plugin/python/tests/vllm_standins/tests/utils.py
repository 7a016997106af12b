"""Stand-in for vLLM's tests/utils.py: create_new_process_for_each_test runs the test in a
forked child (the parent has not initialized CUDA) and fails with the child's traceback."""
import functools
import os
import traceback


def create_new_process_for_each_test(method=None):
    def wrap(f):
        @functools.wraps(f)
        def run(*args, **kwargs):
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read)
                code = 0
                try:
                    f(*args, **kwargs)
                except BaseException:
                    os.write(write, traceback.format_exc().encode())
                    code = 1
                os.close(write)
                os._exit(code)
            os.close(write)
            with os.fdopen(read, "rb") as r:
                report = r.read().decode(errors="replace")
            _, status = os.waitpid(pid, 0)
            if status != 0:
                raise AssertionError(f"the test's child process failed (status {status}):\n{report}")
        return run
    return wrap


def requires_fp8(f):
    return f
