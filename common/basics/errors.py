"""The error model: a routing failure is a gRPC status with a message a person can act on."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

RETRY_AFTER_MS = "retry-after-ms"
# Trailer on a refusal for the tenant's own quota, naming the limit (``max_concurrent``,
# ``requests_per_s``, ``tokens_per_min``): every other child would refuse it too, so no
# tier fails it over (``common.request.forwarding``); load shed for capacity has none.
TENANT_QUOTA = "x-meridian-quota"


class RouteError(Exception):
    """A request cannot be served as asked; carries the gRPC status to return.

    ``trailers`` go out as trailing metadata (e.g. ``retry-after-ms`` with
    RESOURCE_EXHAUSTED).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        trailers: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailers = tuple(trailers)

    @classmethod
    def invalid(cls, message: str) -> RouteError:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, message)

    @classmethod
    def not_found(cls, message: str) -> RouteError:
        return cls(grpc.StatusCode.NOT_FOUND, message)

    @classmethod
    def unavailable(cls, message: str) -> RouteError:
        return cls(grpc.StatusCode.UNAVAILABLE, message)

    @classmethod
    def exhausted(cls, message: str, retry_after_ms: int) -> RouteError:
        return cls(
            grpc.StatusCode.RESOURCE_EXHAUSTED, message, ((RETRY_AFTER_MS, str(retry_after_ms)),)
        )

    @classmethod
    def over_quota(cls, message: str, retry_after_ms: int, limit: str) -> RouteError:
        """RESOURCE_EXHAUSTED for a tenant's own limit: carries ``TENANT_QUOTA``."""
        return cls(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            message,
            ((RETRY_AFTER_MS, str(retry_after_ms)), (TENANT_QUOTA, limit)),
        )

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"
