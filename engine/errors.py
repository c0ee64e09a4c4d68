"""Errors a client caused. The API server maps them to HTTP 400 with `param` set."""


class InvalidRequestError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
