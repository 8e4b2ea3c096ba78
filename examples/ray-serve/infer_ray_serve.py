"""N replicas of ``infer serve`` behind one endpoint, with Ray Serve.

Each replica is a Ray actor that loads the model once (:func:`infer.serve.load_app`,
the options of ``infer serve``) and serves infer's own ASGI app: OpenAI's
``/v1/completions`` and ``/v1/chat/completions``, ``/health``, ``/metrics``.
Ray Serve's proxy is the one endpoint; it routes each request to a replica
(power of two choices over their queue lengths), and the replica's batch
engine batches what it is given with what it runs already.

Beyond infer's app, each replica answers ``GET /replica`` (its Serve replica id
and process id) and marks every response with an ``X-Infer-Replica`` header,
so that a client can see who served it. Ray's health check calls the app's own
``/health`` in process (503 once the engine thread is not running: the
replica is restarted). On shutdown Serve stops routing to the replica, waits
for its requests to finish (``graceful_shutdown_timeout_s``), then runs the
app's lifespan shutdown, which stops the engine thread.

From the command line (the builder takes ``key=value`` arguments, :class:`ReplicaArgs`)::

    serve run infer_ray_serve:build model=smollm2-135m num_replicas=2 num_cpus=1

From Python::

    from ray import serve
    import infer_ray_serve

    serve.run(infer_ray_serve.build(infer_ray_serve.ReplicaArgs(model="smollm2-135m", num_replicas=2)))
"""

# No ``from __future__ import annotations``: Ray Serve reads the builder's
# parameter annotation as a class (ReplicaArgs) to validate ``key=value`` arguments.

import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from infer.serve import load_app

__all__ = ["REPLICA_HEADER", "InferReplica", "ReplicaArgs", "build"]

log = logging.getLogger(__name__)

#: The response header that names the replica that answered.
REPLICA_HEADER = "x-infer-replica"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ReplicaArgs(BaseModel):
    """What :func:`build` deploys: the model and server options of every
    replica (those of ``infer serve``), and how many replicas of what size.

    ``serve run infer_ray_serve:build key=value ...`` passes strings; they
    are converted and checked here.
    """

    model_config = ConfigDict(extra="forbid")

    # -- each replica's server, as `infer serve`'s options --------------------------------------
    model: str = Field(description="catalog alias, model folder, .gguf file or org/name")
    backend: str | None = Field(None, description="numpy, torch:cuda, ... (default: the best available)")
    dtype: str | None = None
    quantize: str | None = None
    compile: bool = False
    model_name: str | None = Field(None, description="the id clients pass as model (default: the file's name)")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer KEY' (default $INFER_API_KEY)")
    kv_memory: int | None = Field(None, gt=0, description="bytes of keys and values per replica (default 256 MiB)")
    max_batch_tokens: int | None = Field(None, gt=0, description="most tokens one forward processes (default 512)")
    max_queue: int = Field(256, gt=0, description="requests waiting for admission in a replica before 429")

    # -- the deployment -----------------------------------------------------------------------------
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves per replica (fractions allowed)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica; 0.5 puts two replicas on one GPU")
    max_ongoing_requests: int = Field(64, ge=1, description="requests the proxy sends one replica at once; "
                                      "the rest wait in the proxy")
    name: str = Field("infer", description="the deployment's name")


@serve.deployment(
    ray_actor_options={"num_cpus": 1},
    # Serve's default (5) would starve continuous batching: a replica batches only what it is sent.
    max_ongoing_requests=64,
    health_check_period_s=10,
    health_check_timeout_s=30,
    # Draining: requests in flight may finish (a long generation takes a while) before the replica stops.
    graceful_shutdown_wait_loop_s=1,
    graceful_shutdown_timeout_s=60,
)
@serve.ingress()
class InferReplica:
    """One replica: the model, loaded once, and infer's ASGI app over it.

    Args:
        model: catalog alias, model folder, ``.gguf`` file or ``org/name``.
        options: :func:`infer.serve.load_app`'s (``backend``, ``dtype``,
            ``quantize``, ``compile``, ``kv_memory``, ``max_batch_tokens``,
            ``model_name``, ``api_key``, ``max_queue``, ``max_body_bytes``).
    """

    def __init__(self, model: str, **options: Any) -> None:
        context = serve.get_replica_context()
        self.replica_id: str = context.replica_tag
        self.deployment: str = context.deployment
        self.pid = os.getpid()
        self._app = load_app(model, **options)
        self._app.router.routes.append(Route("/replica", self._describe, methods=["GET"]))
        # Outermost, so that every answer (a 401 or a 429 too) names its replica.
        self._app.add_middleware(_ReplicaHeader, value=self.replica_id)
        log.info("replica %s (pid %d) serves %s (OMP_NUM_THREADS=%s)", self.replica_id, self.pid, model,
                 os.environ.get("OMP_NUM_THREADS"))

    def __serve_build_asgi_app__(self) -> Any:
        """Ray Serve calls this once after ``__init__`` and runs the app's
        lifespan startup (which starts the engine thread)."""
        return self._app

    async def check_health(self) -> None:
        """Ray's periodic health check: infer's own ``/health``, in process.
        Raising marks the replica unhealthy; Serve replaces it."""
        status = await _get_status(self._app, "/health")
        if status != 200:
            raise RuntimeError(f"replica {self.replica_id}: /health answered {status} (the engine thread is not "
                               "running)")

    async def _describe(self, request: Request) -> Response:
        return JSONResponse({"replica_id": self.replica_id, "deployment": self.deployment, "pid": self.pid,
                             "omp_num_threads": os.environ.get("OMP_NUM_THREADS")})


def build(args: ReplicaArgs) -> Application:
    """The application ``serve run infer_ray_serve:build model=... num_replicas=N`` deploys:
    ``args.num_replicas`` replicas of :class:`InferReplica`, each reserving
    ``args.num_cpus`` CPUs and ``args.num_gpus`` GPUs. Run it with
    ``serve.run(build(args))``."""
    deployment = {"num_replicas", "num_cpus", "num_gpus", "max_ongoing_requests", "name"}
    server = args.model_dump(exclude=deployment | {"model"}, exclude_none=True)
    if server.get("api_key") is None and os.environ.get("INFER_API_KEY"):
        server["api_key"] = os.environ["INFER_API_KEY"]
    actor: dict[str, Any] = {"num_cpus": args.num_cpus}
    if args.num_gpus:
        actor["num_gpus"] = args.num_gpus
    return InferReplica.options(
        name=args.name, num_replicas=args.num_replicas, max_ongoing_requests=args.max_ongoing_requests,
        ray_actor_options=actor,
    ).bind(args.model, **server)


class _ReplicaHeader:
    """ASGI middleware: ``X-Infer-Replica: <replica id>`` on every HTTP response."""

    def __init__(self, app: ASGIApp, value: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), value.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, marked)


async def _get_status(app: ASGIApp, path: str) -> int:
    """The status of ``GET path`` answered by ``app`` in process (no socket)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": [],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    status = 500

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status
