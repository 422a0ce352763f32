"""Placement, routes: the AFD endpoints of vLLM's OpenAI API server, added through vLLM's
endpoint-plugin API (entry point ``vllm.endpoint_plugins`` ``afd``; opt-in, as vLLM makes every
endpoint plugin: ``VLLM_PLUGINS=afd``, which also names this package's general plugin).

``GET /afd/ready`` is readiness: 200 ``{"ready": true}`` while the engine is alive and every
FFN rank serves; 503 ``{"ready": false, "problems": [...]}`` while one does not, a rank being
replaced by failover included. ``/health`` is liveness (patch P4): it stays 200 while failover
heals (``health.py``). Unauthenticated, as ``/health`` is: it reads state and changes none
(vLLM's ``--api-key`` guards ``/v1``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from vllm_afd.placement.health import ffn_group_problems

router = APIRouter()
DEAD_ENGINE = "the engine is dead (its error is in the server log; /health answers 503)"


@router.get("/afd/ready")
async def ready(request: Request) -> JSONResponse:
    problems = [p.text for p in ffn_group_problems()]
    client = getattr(request.app.state, "engine_client", None)
    if not problems and client is not None:
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            await client.check_health()
        except EngineDeadError:
            problems = [DEAD_ENGINE]
    if problems:
        return JSONResponse({"ready": False, "problems": problems}, status_code=503)
    return JSONResponse({"ready": True})


class AFDEndpoints:
    """vLLM's ``EndpointPlugin`` protocol (``vllm/plugins/endpoint_plugins/interface.py``)."""

    name = "afd"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Nothing to keep: the routes read the FFN directory and ``app.state``."""
