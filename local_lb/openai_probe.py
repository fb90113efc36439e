"""Health of a GPU that speaks OpenAI HTTP: ``/health``, then ``/v1/models``.

The local tier's ``BackendMonitor`` asks every GPU the same question,
``check_gpu(models, timeout_s) -> GpuCheck``; a V2 GPU answers it with
grpc.health.v1 and ModelReady (``common.request.health.HealthChecker``), an
OpenAI GPU with this class: ``GET /health`` must answer 200 (vLLM, SGLang, TGI and
llama.cpp's server all serve it; 503 while loading is the server's own "not yet"),
then ``GET /v1/models`` lists the served model ids, and the GPU is healthy with
the topology's models that it lists ready. A server's model list is fixed at its
launch (vLLM, SGLang), so once a check found the GPU healthy the list is read again
only every ``MODELS_EVERY`` checks, or at once after any check that did not find
it healthy (a restart fails ``/health`` first); ``/health`` is asked every time,
so a GPU that dies is caught as soon as before. Both within one timeout, and the
verdicts mean what ``GpuCheck`` says: an HTTP answer is the server's own word, a
refused or reset connection a failed call, a timeout slowness (no verdict).

Its load is read from its Prometheus ``/metrics`` as a V2 GPU's is
(``local_lb.load_book.parse_prometheus_load``: vLLM's and SGLang's names).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any

import aiohttp

from common.request.health import GpuCheck
from local_lb.openai_wire import error_detail

# Checks between two reads of a healthy server's model list (one in this many asks it).
MODELS_EVERY = 10


class OpenAIHealth:
    """The health of the OpenAI server at ``base_url``, over a session its owner holds.

    Caches the model list of the last check that found the server healthy (see the
    module docstring), for at most ``MODELS_EVERY`` checks."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self._listed: frozenset[str] | None = None
        self._reuses = 0

    async def check_gpu(self, models: Iterable[str], timeout_s: float) -> GpuCheck:
        """Healthy only if ``/health`` answers 200 and ``/v1/models`` lists one of ``models``."""
        wanted = sorted(models)
        check = await self._check(wanted, timeout_s)
        if not check.healthy:
            self._listed = None  # the next check reads the model list again
        return check

    async def _check(self, wanted: list[str], timeout_s: float) -> GpuCheck:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        listed = self._listed if self._reuses < MODELS_EVERY - 1 else None
        try:
            async with asyncio.timeout(timeout_s):
                status, body = await self._get("/health", timeout)
                if status != 200:
                    return GpuCheck(False, f"/health: HTTP {status}: {error_detail(body)}")
                if listed is None:
                    status, body = await self._get("/v1/models", timeout)
        except TimeoutError:
            return GpuCheck(False, "health check: timed out", answered=False, slow=True)
        except (aiohttp.ClientError, OSError) as exc:
            reason = f"health check: {type(exc).__name__}: {exc}"
            return GpuCheck(False, reason, answered=False)
        if listed is not None:
            self._reuses += 1
        else:
            if status != 200:
                return GpuCheck(False, f"/v1/models: HTTP {status}: {error_detail(body)}")
            listed = served_models(body)
            if listed is None:
                return GpuCheck(False, "/v1/models: not an OpenAI model list", answered=False)
            self._listed, self._reuses = listed, 0
        ready = frozenset(m for m in wanted if m in listed)
        if ready:
            return GpuCheck(True, f"SERVING, {len(ready)}/{len(wanted)} models ready", ready)
        shown = sorted(listed)[:8]
        return GpuCheck(False, f"SERVING but no model ready (it serves {shown}, not {wanted})")

    async def _get(self, path: str, timeout: aiohttp.ClientTimeout) -> tuple[int, bytes]:
        async with self.session.get(self.base_url + path, timeout=timeout) as response:
            return response.status, await response.read()


def served_models(body: bytes) -> frozenset[str] | None:
    """The model ids of a ``/v1/models`` answer (``{"data": [{"id": …}, …]}``); None when
    the body is not such a list."""
    try:
        doc: Any = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json's stack
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return None
    return frozenset(
        card["id"] for card in data if isinstance(card, dict) and isinstance(card.get("id"), str)
    )
