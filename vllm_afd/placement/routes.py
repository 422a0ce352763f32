"""Placement, routes: the AFD endpoints of vLLM's OpenAI API server, added through vLLM's
endpoint-plugin API (entry point ``vllm.endpoint_plugins`` ``afd``; opt-in, as vLLM makes every
endpoint plugin: ``VLLM_PLUGINS=afd``, which also names this package's general plugin).

``GET /afd/status``: the live FFN group as JSON: transport, attention and FFN rank counts, the
ratio, each FFN rank's state (``up``, ``recovering``, ``failed``), host, pid, incarnation and
failovers, what keeps it from serving, and the planner's recommended ratio for this
deployment's batch cap and context (or why there is none: on the CPU build the planner needs
``VLLM_AFD_PLAN_HARDWARE``).

``GET /afd/ready`` is readiness: 200 ``{"ready": true}`` while the engine is alive and every
FFN rank serves; 503 ``{"ready": false, "problems": [...]}`` while one does not, a rank being
replaced by failover included. ``/health`` is liveness (patch P4): it stays 200 while failover
heals (``health.py``). Unauthenticated, as ``/health`` is: it reads state and changes none
(vLLM's ``--api-key`` guards ``/v1``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from vllm_afd import envs
from vllm_afd.placement.health import ffn_group_problems
from vllm_afd.transport import TransportSpec, directory

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


@router.get("/afd/status")
async def status(request: Request) -> JSONResponse:
    runtime = envs.VLLM_AFD_RUNTIME
    if not runtime:
        return JSONResponse({"afd": False})
    spec = TransportSpec.from_json(runtime)
    entries = (
        directory.entries(spec.directory, spec.num_ffn_ranks)
        if spec.directory
        else [None] * spec.num_ffn_ranks
    )
    attention, ffn = spec.num_attention_ranks, spec.num_ffn_ranks
    common = math.gcd(attention, ffn)
    return JSONResponse(
        {
            "afd": True,
            "transport": spec.backend,
            "num_attention_ranks": attention,
            "num_ffn_ranks": ffn,
            "ratio": f"{attention // common}:{ffn // common}",
            "ffn_ranks": [
                {"rank": r, "state": "unknown"} if e is None else _rank(e)
                for r, e in enumerate(entries)
            ],
            "problems": [p.text for p in ffn_group_problems()],
            "recommendation": json.loads(envs.VLLM_AFD_FRONT_END or "{}").get("recommendation"),
        }
    )


def _rank(entry: directory.RankEntry) -> dict[str, Any]:
    keys = ("rank", "state", "host", "pid", "incarnation", "failovers", "recovery_s")
    return {k: v for k, v in dataclasses.asdict(entry).items() if k in keys}


class AFDEndpoints:
    """vLLM's ``EndpointPlugin`` protocol (``vllm/plugins/endpoint_plugins/interface.py``)."""

    name = "afd"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Nothing to keep: the routes read the FFN directory and the front-end's facts."""
