"""The fake API server's errors: ``ApiError`` is answered as a Kubernetes ``Status`` object."""

from __future__ import annotations

FAIL_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 410: "Expired",
                429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}


class ApiError(Exception):
    """An error the fake answers with a ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> dict:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            body["details"] = self.details
        return body


def _not_found(kind: str, name: str, group: str = "") -> ApiError:
    resource = f"{kind}.{group}" if group else kind
    return ApiError(404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": kind})


def _conflict(kind: str, name: str, group: str = "") -> ApiError:
    resource = f"{kind}.{group}" if group else kind
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {resource} "{name}": the object '
                    "has been modified; please apply your changes to the latest version and try again",
                    {"name": name, "kind": kind})


def _invalid(kind: str, name: str, causes: list[str]) -> ApiError:
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: ' + "; ".join(causes),
                    {"name": name, "kind": kind,
                     "causes": [{"reason": "FieldValueInvalid", "message": c} for c in causes]})
