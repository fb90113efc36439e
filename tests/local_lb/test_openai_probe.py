"""Health and load of OpenAI GPUs: /health and /v1/models (OpenAIHealth), SGLang's metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from common.basics.redis_embed import free_port
from local_lb.load_book import parse_prometheus_load
from local_lb.openai_probe import MODELS_EVERY, OpenAIHealth, served_models

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 3.0
sglang:num_queue_reqs{model_name="m"} 2.0
sglang:token_usage{model_name="m"} 0.42
sglang:gen_throughput{model_name="m"} 812.5
"""


def test_sglang_names_are_read_as_running_waiting_and_kv() -> None:
    assert parse_prometheus_load(SGLANG) == (3.0, 2.0, 0.42)


def test_vllm_names_win_where_both_are_present() -> None:
    text = SGLANG + 'vllm:num_requests_running{model_name="m"} 7\n'
    assert parse_prometheus_load(text) == (7.0, 2.0, 0.42)


def test_xpyd_sims_own_names_are_no_load() -> None:
    assert parse_prometheus_load("xpyd_sim_active_requests 3\n") is None


def test_served_models_reads_an_openai_model_list() -> None:
    body = b'{"object": "list", "data": [{"id": "a"}, {"id": "b"}, {"nope": 1}]}'
    assert served_models(body) == {"a", "b"}
    assert served_models(b"[]") is None and served_models(b"{x") is None


class Server:
    """A real HTTP server whose answers the test sets."""

    def __init__(self) -> None:
        self.health = 200
        self.models: list[str] = ["m"]
        self.hang = False
        self.listed = 0  # /v1/models answers given
        self.port = free_port()
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _health(self, request: web.Request) -> web.Response:
        if self.hang:
            await asyncio.sleep(10)
        return web.Response(status=self.health, text="loading" if self.health != 200 else "")

    async def _models(self, request: web.Request) -> web.Response:
        self.listed += 1
        return web.json_response({"data": [{"id": m} for m in self.models]})


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    s = Server()
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


@pytest.fixture
async def health(server: Server) -> AsyncIterator[OpenAIHealth]:
    async with aiohttp.ClientSession() as session:
        yield OpenAIHealth(session, f"http://127.0.0.1:{server.port}")


async def test_healthy_with_the_models_it_lists(server: Server, health: OpenAIHealth) -> None:
    server.models = ["m", "other"]
    check = await health.check_gpu(["m", "absent"], timeout_s=1.0)
    assert check.healthy and check.ready == {"m"}


async def test_a_server_still_loading_is_its_own_verdict(
    server: Server, health: OpenAIHealth
) -> None:
    server.health = 503
    check = await health.check_gpu(["m"], timeout_s=1.0)
    assert not check.healthy and check.answered and not check.slow
    assert "HTTP 503" in check.reason


async def test_a_server_without_the_model_is_not_ready(
    server: Server, health: OpenAIHealth
) -> None:
    server.models = ["llama-3"]
    check = await health.check_gpu(["m"], timeout_s=1.0)
    assert not check.healthy and check.answered and "llama-3" in check.reason


async def test_a_slow_server_is_slowness_not_a_verdict(
    server: Server, health: OpenAIHealth
) -> None:
    server.hang = True
    check = await health.check_gpu(["m"], timeout_s=0.2)
    assert not check.healthy and check.slow and not check.answered


async def test_a_server_gone_is_a_failed_call() -> None:
    async with aiohttp.ClientSession() as session:
        check = await OpenAIHealth(session, f"http://127.0.0.1:{free_port()}").check_gpu(
            ["m"], timeout_s=1.0
        )
    assert not check.healthy and not check.answered and not check.slow


async def test_a_healthy_servers_model_list_is_read_once_in_models_every_checks(
    server: Server, health: OpenAIHealth
) -> None:
    for _ in range(2 * MODELS_EVERY):
        assert (await health.check_gpu(["m"], timeout_s=1.0)).healthy
    assert server.listed == 2  # /health every time, the list in 1 of MODELS_EVERY


async def test_the_model_list_is_read_again_after_a_check_that_failed(
    server: Server, health: OpenAIHealth
) -> None:
    assert (await health.check_gpu(["m"], timeout_s=1.0)).healthy
    server.health = 503  # restarting: /health fails before the new list is served
    assert not (await health.check_gpu(["m"], timeout_s=1.0)).healthy
    server.health, server.models = 200, ["llama-3"]
    check = await health.check_gpu(["m"], timeout_s=1.0)
    assert not check.healthy and "llama-3" in check.reason and server.listed == 2


async def test_a_model_dropped_without_a_restart_is_seen_within_models_every_checks(
    server: Server, health: OpenAIHealth
) -> None:
    assert (await health.check_gpu(["m"], timeout_s=1.0)).healthy
    server.models = ["llama-3"]
    verdicts = [(await health.check_gpu(["m"], timeout_s=1.0)).healthy for _ in range(MODELS_EVERY)]
    assert verdicts[-1] is False and verdicts.count(False) == 1
