"""Errors a client caused. The API server maps them to HTTP 400 with `param` set."""


class InvalidRequestError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PrefillElsewhere(Exception):
    """A decode instance declines to prefill a prompt itself (conditional disaggregation):
    more of it is uncached than the proxy's ``max_local_prefill_tokens``. Nothing was queued.
    The API server answers 409 with error type ``prefill_remotely``."""

    def __init__(self, num_uncached_tokens: int, limit: int) -> None:
        super().__init__(f"{num_uncached_tokens} prompt tokens are not in this instance's prefix cache (more than "
                         f"kv_transfer_params.max_local_prefill_tokens={limit}): prefill them on a prefill instance")
        self.num_uncached_tokens = num_uncached_tokens


# A request ended by a peer's fault (its KV never came, under --kv-load-failure-policy fail):
# the API answers 502, which clients retry, not 500.
KV_LOAD_FAILED = "KV cache load failed"


def error_status(error: str) -> int:
    """The HTTP status of a request the engine ended with ``error``."""
    return 502 if error.startswith(KV_LOAD_FAILED) else 500
