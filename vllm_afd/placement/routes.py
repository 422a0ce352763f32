"""Placement, routes: the AFD endpoints of vLLM's OpenAI API server, added through vLLM's
endpoint-plugin API (entry point ``vllm.endpoint_plugins`` ``afd``; opt-in, as vLLM makes every
endpoint plugin: ``VLLM_PLUGINS=afd``, which also names this package's general plugin).

``GET /afd/status``: the live FFN group as JSON: transport, attention and FFN rank counts, the
ratio, each FFN rank's state (``up``, ``recovering``, ``failed``), host, pid, incarnation and
failovers, what keeps it from serving, the planner's recommended ratio for this
deployment's batch cap and context (or why there is none: on the CPU build the planner needs
``VLLM_AFD_PLAN_HARDWARE``), and as ``live`` the planner in the loop's latest advice
(``autoscale.py``: the measured window, the prediction per FFN rank count, the decision and
why; ``null`` before the first window). Without a credential (below) it answers only what a
readiness probe learns: ``{"afd": true, "ready": ...}``; host names, pids and the scale
history are for the operator.

``GET /afd/ready`` is readiness: 200 ``{"ready": true}`` while the engine is alive and every
FFN rank serves; 503 ``{"ready": false, "problems": [...]}`` while one does not, a rank being
replaced by failover included. ``/health`` is liveness (patch P4): it stays 200 while failover
heals (``health.py``). Unauthenticated, as ``/health`` is: they read state and change none
(vLLM's ``--api-key`` guards ``/v1``).

``POST /afd/scale`` with ``{"num_ffn_ranks": N}`` changes the FFN pool's size live
(``scaling.py``) and answers 200 with the scale once every attention rank serves on the new
pool; 400 for a body or count it refuses (the field named, and what is allowed), 409 when this
deployment cannot scale (another scale runs, a joined group, a backend without live scaling),
503/504 when it did not complete. Admin calls take a bearer token, with or without
``--api-key``, as vLLM's ``/v1`` takes its keys: the deployment's admin token, which only the
user who runs the server can read (``credentials.prepare_admin_token``), or the server's API
key; never a client's address alone (a sidecar, a proxy or a port-forward makes a remote
caller local). vLLM's own admin routes have no such guard without ``--api-key``; changing the
FFN pool is worth one.
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
from vllm_afd.placement.scaling import answer, in_progress
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
    problems = [p.text for p in ffn_group_problems()]
    if _admin_problem(request) is not None:  # what a readiness probe sees, no more
        return JSONResponse({"afd": True, "ready": not problems, "detail": _FULL_STATUS})
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
            "ready": not problems,
            "transport": spec.backend,
            "num_attention_ranks": spec.num_attention_ranks,
            "num_ffn_ranks": spec.num_ffn_ranks,
            "ratio": spec.ratio,
            "pool": pool.epoch if pool else 1,
            "scale_events": list(pool.events) if pool else [],
            "scaling": in_progress(),
            "ffn_ranks": [
                {"rank": r, "state": "unknown"} if e is None else _rank(e)
                for r, e in enumerate(entries)
            ],
            "problems": problems,
            "recommendation": json.loads(envs.VLLM_AFD_FRONT_END or "{}").get("recommendation"),
            "live": directory.read_advice(spec.directory),
        }
    )


@router.post("/afd/scale")
async def scale(request: Request) -> JSONResponse:
    refused = _admin_problem(request)
    if refused is not None:
        return JSONResponse({"error": refused}, status_code=401)
    body = await request.body()
    status, content = await asyncio.to_thread(answer, body)
    return JSONResponse(content, status_code=status)


_CREDENTIAL = (
    "the deployment's admin token (the file the server logs at start, "
    "VLLM_AFD_ADMIN_TOKEN_FILE) or the server's --api-key, as a bearer token"
)
_FULL_STATUS = f"the full status takes {_CREDENTIAL}"


def _admin_problem(request: Request) -> str | None:
    """Why ``request`` may not change or inspect the deployment (``None``: it may): it must
    carry a bearer token the server takes (vLLM's own check, the one that guards ``/v1``).
    Where it comes from proves nothing (a proxy or a port-forward makes a remote caller
    local)."""
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    tokens = getattr(request.app.state, "afd_admin_tokens", [])
    if tokens and AuthenticationMiddleware(None, tokens).verify_token(request.headers):
        return None
    return f"Unauthorized: give {_CREDENTIAL}"


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
        """The bearer tokens the admin routes take: the deployment's admin token
        (``credentials.prepare_admin_token``) and the server's API keys (as vLLM's ``/v1``
        takes them: ``--api-key`` before ``VLLM_API_KEY``); the rest is read from the FFN
        directory and the front-end's facts."""
        from vllm import envs as vllm_envs

        from vllm_afd.placement.credentials import read_admin_token

        keys = getattr(args, "api_key", None) or [vllm_envs.VLLM_API_KEY]
        admin = envs.VLLM_AFD_ADMIN_TOKEN_FILE
        state.afd_admin_tokens = [k for k in keys if k] + (
            [read_admin_token(admin)] if admin else []
        )
