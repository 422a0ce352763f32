"""Placement, routes: the AFD endpoints of vLLM's OpenAI API server, added through vLLM's
endpoint-plugin API (entry point ``vllm.endpoint_plugins`` ``afd``; opt-in, as vLLM makes every
endpoint plugin: ``VLLM_PLUGINS=afd``, which also names this package's general plugin).

``GET /afd/status``: the live FFN group as JSON: transport, attention and FFN rank counts, the
ratio, each FFN rank's state (``up``, ``recovering``, ``failed``), host, pid, incarnation and
failovers, what keeps it from serving, the planner's recommended ratio for this
deployment's batch cap and context (or why there is none: on the CPU build the planner needs
``VLLM_AFD_PLAN_HARDWARE``), and as ``live`` the planner in the loop's latest advice
(``autoscale.py``: the measured window, the prediction per FFN rank count, the decision and
why; ``null`` before the first window).

``GET /afd/ready`` is readiness: 200 ``{"ready": true}`` while the engine is alive and every
FFN rank serves; 503 ``{"ready": false, "problems": [...]}`` while one does not, a rank being
replaced by failover included. ``/health`` is liveness (patch P4): it stays 200 while failover
heals (``health.py``). Unauthenticated, as ``/health`` is: they read state and change none
(vLLM's ``--api-key`` guards ``/v1``).

``POST /afd/scale`` with ``{"num_ffn_ranks": N}`` changes the FFN pool's size live
(``scaling.py``) and answers 200 with the scale once every attention rank serves on the new
pool; 400 for a count the model's experts cannot split into, 409 when this deployment cannot
scale (another scale runs, a joined group, a collective backend), 503/504 when it did not
complete. It changes state, so it is guarded more than vLLM guards its own admin routes: with
``--api-key`` (or ``VLLM_API_KEY``) it takes that bearer token; without, only a client on
loopback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
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
    spec = TransportSpec.from_json(directory.live_runtime(runtime))
    pool = directory.read_pool(spec.directory) if spec.directory else None
    entries = (
        directory.entries(spec.directory, spec.num_ffn_ranks)
        if spec.directory
        else [None] * spec.num_ffn_ranks
    )
    return JSONResponse(
        {
            "afd": True,
            "transport": spec.backend,
            "num_attention_ranks": spec.num_attention_ranks,
            "num_ffn_ranks": spec.num_ffn_ranks,
            "ratio": spec.ratio,
            "pool": pool.epoch if pool else 1,
            "scale_events": list(pool.events) if pool else [],
            "ffn_ranks": [
                {"rank": r, "state": "unknown"} if e is None else _rank(e)
                for r, e in enumerate(entries)
            ],
            "problems": [p.text for p in ffn_group_problems()],
            "recommendation": json.loads(envs.VLLM_AFD_FRONT_END or "{}").get("recommendation"),
            "live": directory.read_advice(spec.directory),
        }
    )


@router.post("/afd/scale")
async def scale(request: Request) -> JSONResponse:
    refused = _admin_problem(request)
    if refused is not None:
        return JSONResponse({"error": refused}, status_code=401)
    try:
        body = await request.json()
    except ValueError:
        body = None
    from vllm_afd.placement.scaling import answer

    status, content = await asyncio.to_thread(answer, body)
    return JSONResponse(content, status_code=status)


def _admin_problem(request: Request) -> str | None:
    """Why ``request`` may not change the deployment (``None``: it may)."""
    tokens = getattr(request.app.state, "afd_api_keys", [])
    if tokens:
        # vLLM's own check of its bearer tokens (the middleware that guards /v1)
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        ok = AuthenticationMiddleware(None, tokens).verify_token(request.headers)
        return None if ok else "Unauthorized: give the server's --api-key as a bearer token"
    client = request.client.host if request.client else ""
    if client in ("127.0.0.1", "::1", "localhost"):
        return None
    return f"Unauthorized: without --api-key only loopback may scale the FFN pool, not {client}"


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
        """The server's API keys (``POST /afd/scale`` takes them, as vLLM's ``/v1`` does:
        ``--api-key`` before ``VLLM_API_KEY``); the rest is read from the FFN directory and
        the front-end's facts."""
        from vllm import envs as vllm_envs

        keys = getattr(args, "api_key", None) or [vllm_envs.VLLM_API_KEY]
        state.afd_api_keys = [k for k in keys if k]
