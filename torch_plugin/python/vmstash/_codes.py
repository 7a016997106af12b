"""The status codes of the C ABI: Python's copy of VMSTASH_STATUS_CODES in
torch_plugin/include/vmstash/vmstash.h (Note [Status Codes]), the absl::StatusCode names
and numbers. tests/test_status_codes.py reads that header and checks this table against
it, so the two cannot drift. Numbers never change; a new code goes at the end.

Which exception a code raises is vmstash._lib's (error()): RESOURCE_EXHAUSTED raises
vmstash.OutOfMemoryError, every other code vmstash.Error, each with `code` and `code_name`.
"""

OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
ALREADY_EXISTS = 6
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
FAILED_PRECONDITION = 9
ABORTED = 10
OUT_OF_RANGE = 11
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
DATA_LOSS = 15
UNAUTHENTICATED = 16

# VMSTASH_NOOP: not a status code; a transition that changed nothing.
NOOP = -1

# (name, number) in the header's order.
CODES = tuple((name, globals()[name]) for name in (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
    "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"))

_NAMES = {number: name for name, number in CODES}


def name_of(code):
    """The name of a code ("ABORTED"), or its number as a string when it is not in the table."""
    return _NAMES.get(code, str(code))
