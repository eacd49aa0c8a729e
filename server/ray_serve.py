"""specserve on Ray Serve: one engine per replica, for more than one machine (DESIGN.md §9).

    specserve serve --ray --replicas 2 [--max-replicas 8]    # a local Ray, or RAY_ADDRESS's cluster

`EngineReplica` runs the whole specserve server of one engine (the aiohttp app on an engine
thread) on a loopback port inside its replica, and forwards each request to it, streaming
the response back in the chunks it was written: the SSE bytes are specserve's own, byte for
byte. `Ingress` takes the OpenAI routes at Ray Serve's HTTP proxy and calls a replica through
a deployment handle whose request router (`PrefixAffinityRouter`) prefers the replica that
served the longest prefix of the request's prompt, unless it has `slack` more requests in
flight than the least loaded one, and otherwise the least loaded (ties in turn); Ray falls
back to every replica when that one's queue is full. Ray Serve replaces a replica that
dies; its requests in flight end with an error event and [DONE]. With --max-replicas the
replicas scale between the two counts on requests in flight per replica (Ray Serve's
target_ongoing_requests). SIGTERM drains at the Ingress (new requests 503, those in flight
finish within the shutdown timeout) before the deployment is shut down.

Ray is an optional extra: `pip install -e ".[ray]"`.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections import OrderedDict

logger = logging.getLogger("specserve.ray")

_CHUNK_CHARS = 64          # prefix affinity hashes the prompt text in chunks of this many characters
_REMEMBERED_CHUNKS = 1 << 16
_CHOICE_TTL_S = 30.0       # a choice Ray never routed stops counting as load after this long


def prompt_text(path: str, body: bytes) -> str:
    """The text a request's prompt starts with: a completion's prompt, or a chat's messages."""
    try:
        req = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(req, dict):
        return ""
    if path.endswith("/chat/completions"):
        parts = []
        for m in req.get("messages") or []:
            if isinstance(m, dict):
                content = m.get("content")
                parts.append(f"{m.get('role')}\n{content if isinstance(content, str) else json.dumps(content)}\n")
        return "".join(parts)
    prompt = req.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def prefix_keys(text: str) -> list[int]:
    """A hash per whole chunk of the text, each covering everything before it too."""
    keys, h = [], 0
    for start in range(0, len(text) - _CHUNK_CHARS + 1, _CHUNK_CHARS):
        h = hash((h, text[start:start + _CHUNK_CHARS]))
        keys.append(h)
    return keys


def _request_id(pending_request) -> object:
    metadata = getattr(pending_request, "metadata", None)
    return getattr(metadata, "internal_request_id", None) or id(pending_request)


def _make_router_class():
    from ray.serve.request_router import RequestRouter

    class PrefixAffinityRouter(RequestRouter):
        """The replica that served the longest prefix of the prompt, unless it is `slack`
        requests busier than the least loaded; else the least loaded, ties to the one chosen
        least recently. Load is this router's own count of requests in flight plus those it
        chose a replica for that Ray has not yet routed: Ray's probed queue lengths are
        cached, and a burst of requests, all chosen before any is routed, would otherwise
        all see the same replica as the least queued (and ties go to the first listed)."""

        def initialize_state(self, slack: int = 4, **kwargs):
            self.slack = slack
            self.owner: OrderedDict[int, object] = OrderedDict()   # prefix key -> replica id
            self.inflight: dict[object, int] = {}
            self.routed: dict[object, object] = {}                 # request id -> replica id, while in flight
            self.choosing: dict[str, tuple[object, float]] = {}    # request id -> (replica id, when chosen)
            self.last_chosen: dict[object, int] = {}
            self.choices = 0

        def _load(self, now: float) -> dict[object, int]:
            load = dict(self.inflight)
            for rid, (replica, when) in list(self.choosing.items()):
                if now - when > _CHOICE_TTL_S:   # never routed (cancelled while queued)
                    del self.choosing[rid]
                else:
                    load[replica] = load.get(replica, 0) + 1
            return load

        async def choose_replicas(self, candidate_replicas, pending_request=None):
            if pending_request is None or not candidate_replicas or not pending_request.args:
                return [candidate_replicas]
            path, body = pending_request.args[0], pending_request.args[1]
            by_id = {r.replica_id: r for r in candidate_replicas}
            now = time.monotonic()
            self.choosing.pop(_request_id(pending_request), None)   # a retry chooses again
            load = self._load(now)
            least = min(load.get(i, 0) for i in by_id)
            chosen = None
            for key in reversed(prefix_keys(prompt_text(path, body))):
                owner = self.owner.get(key)
                if owner is not None and owner in by_id:   # one no longer a candidate: a shorter prefix's may be
                    if load.get(owner, 0) <= least + self.slack:
                        chosen = owner
                    break
            if chosen is None:
                chosen = min((i for i in by_id if load.get(i, 0) == least), key=lambda i: self.last_chosen.get(i, -1))
            self.choices += 1
            self.last_chosen[chosen] = self.choices
            self.choosing[_request_id(pending_request)] = (chosen, now)
            return [[by_id[chosen]], candidate_replicas]

        def on_request_routed(self, pending_request, replica_id, result):
            self.choosing.pop(_request_id(pending_request), None)
            self.routed[_request_id(pending_request)] = replica_id
            self.inflight[replica_id] = self.inflight.get(replica_id, 0) + 1
            if pending_request is not None and len(pending_request.args) >= 2:
                for key in prefix_keys(prompt_text(pending_request.args[0], pending_request.args[1])):
                    self.owner[key] = replica_id
                    self.owner.move_to_end(key)
                while len(self.owner) > _REMEMBERED_CHUNKS:
                    self.owner.popitem(last=False)

        def on_request_completed(self, replica_id, internal_request_id):
            # Ray calls this for a request a replica refused too (never routed there), and after
            # the replica died: only a request routed to a replica still known stops counting.
            self.choosing.pop(internal_request_id, None)
            if self.routed.pop(internal_request_id, None) == replica_id and replica_id in self.inflight:
                self.inflight[replica_id] = max(0, self.inflight[replica_id] - 1)

        def on_replica_actor_died(self, replica_id):
            super().on_replica_actor_died(replica_id)
            self._forget(replica_id)

        def _forget(self, replica_id):
            self.inflight.pop(replica_id, None)
            self.last_chosen.pop(replica_id, None)
            self.routed = {rid: r for rid, r in self.routed.items() if r != replica_id}
            self.choosing = {rid: c for rid, c in self.choosing.items() if c[0] != replica_id}
            for key in [k for k, v in self.owner.items() if v == replica_id]:
                del self.owner[key]

        def update_replicas(self, replicas):
            """The controller's replicas changed (scaled down, replaced): forget those gone."""
            super().update_replicas(replicas)
            if not hasattr(self, "owner"):   # before initialize_state
                return
            live = {r.replica_id for r in replicas}
            for gone in (set(self.inflight) | set(self.last_chosen) | set(self.owner.values())) - live:
                self._forget(gone)

    return PrefixAffinityRouter


PrefixAffinityRouter = None   # the class, once Ray is imported (build_app)


class EngineReplica:
    """One engine and its specserve server, inside a Ray Serve replica."""

    async def __init__(self, config_data: dict):
        from aiohttp import web

        from specserve import config as config_mod
        from specserve.engine import LLMEngine
        from specserve.server.app import create_app, make_runner

        cfg = config_mod.from_dict(config_data, source="ray replica")
        cfg.server.engine_process = False   # the replica's process is this engine's process
        cfg.server.api_key = None           # the ingress checks it
        app = create_app(LLMEngine(cfg, progress=False), cfg)
        self.runner = make_runner(app)
        await self.runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        import aiohttp
        from ray import serve

        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self.name = serve.get_replica_context().replica_id.unique_id
        logger.info("replica %s serves on port %d", self.name, self.port)

    async def __call__(self, path: str, body: bytes, method: str = "POST", headers: dict | None = None):
        """Yields (status, headers, replica) first, then the response body as written. `headers`:
        the client's request headers the server reads (_FORWARDED_IN)."""
        url = f"http://127.0.0.1:{self.port}{path}"
        async with self.http.request(method, url, data=body or None,
                                        headers={"Content-Type": "application/json", **(headers or {})}) as resp:
            yield resp.status, {k: v for k in _FORWARDED if (v := resp.headers.get(k)) is not None}, self.name
            async for chunk in resp.content.iter_any():
                yield chunk

    async def check_health(self):
        async with self.http.get(f"http://127.0.0.1:{self.port}/health") as resp:
            if resp.status != 200:
                raise RuntimeError(f"replica unhealthy: /health {resp.status}")


# The replica's response headers a client reads (the rest are the connection's own).
_FORWARDED = ("Content-Type", "Cache-Control", "Retry-After", "WWW-Authenticate", "Allow",
              "Access-Control-Allow-Origin", "Vary", "Access-Control-Allow-Methods",
              "Access-Control-Allow-Headers", "Access-Control-Max-Age")
# The client's request headers a specserve server reads (the key is checked at the ingress).
_FORWARDED_IN = ("X-Request-Id", "Origin", "Access-Control-Request-Method", "Access-Control-Request-Headers")


def _error(message: str, code: str, type: str = "service_unavailable") -> dict:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


class Ingress:
    """The OpenAI routes at Ray Serve's HTTP proxy, each request to one EngineReplica. It counts
    the responses it is sending, so that a shutdown can wait for them (`drain`)."""

    def __init__(self, engine, api_key: str | None = None):
        self.engine, self.api_key = engine, api_key
        self.streams: set = set()   # the replica streams of the responses being sent
        self.draining = False
        self.cut = False   # the drain's time ran out: what is left ends with an error event

    async def __call__(self, request):
        from starlette.responses import JSONResponse, StreamingResponse

        from specserve.server.protocol import api_key_refusal

        if self.draining:
            return JSONResponse(_error("the server is shutting down; retry on another", "shutting_down"),
                                status_code=503)
        path = request.url.path
        root = request.scope.get("root_path", "")   # the application's route prefix
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if request.method != "OPTIONS" and (  # a CORS preflight carries no key (as create_app's _auth)
                why := api_key_refusal(path, request.headers.get("authorization"), self.api_key)) is not None:
            return JSONResponse(_error(why, "invalid_api_key", "invalid_request_error"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        body = await request.body()
        forwarded = {k: v for k in _FORWARDED_IN if (v := request.headers.get(k)) is not None}
        stream = self.engine.options(stream=True).remote(path, body, request.method, forwarded)
        self.streams.add(stream)
        try:
            status, headers, replica = await stream.__anext__()
        except Exception as e:   # the replica died before answering
            self.streams.discard(stream)
            return JSONResponse(_error(f"the replica serving this request failed: {e}; retry", "replica_unavailable"),
                                status_code=503)

        async def chunks():
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as e:   # the replica died mid-stream, or the drain ran out of time
                error = (_error("the server shut down before this request finished", "shutting_down") if self.cut
                         else _error(f"the replica serving this request failed: {type(e).__name__}; retry",
                                     "replica_unavailable"))
                yield b"data: " + json.dumps(error, separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n"
            finally:
                self.streams.discard(stream)

        return StreamingResponse(chunks(), status_code=status, headers={**headers, "x-specserve-replica": str(replica)})

    async def drain(self, timeout_s: float) -> int:
        """Answer new requests 503 and wait up to `timeout_s` for the responses being sent; those
        still running then are cancelled and end with an error event and [DONE]. Returns how many
        were cancelled."""
        import asyncio
        import time

        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.streams)
        self.cut = bool(left)
        for stream in left:
            stream.cancel()
        while self.streams and time.monotonic() < deadline + 5.0:   # their error events go out
            await asyncio.sleep(0.05)
        return len(left)


def serve_on_ray(cfg, replicas: int, max_replicas: int | None = None) -> None:
    """`specserve serve --ray`: deploy on the Ray cluster of RAY_ADDRESS (else a local one)
    and run until SIGTERM/SIGINT; then drain (new requests 503, those in flight finish within
    server.shutdown_timeout_s, the rest end with an error event) and shut the deployment down."""
    import os
    import signal
    import threading

    import msgspec
    import ray
    from ray import serve

    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": cfg.server.host, "port": cfg.server.port})
    gpus = 1.0 if cfg.device == "cuda" or (cfg.device == "auto" and ray.cluster_resources().get("GPU")) else 0.0
    ingress = serve.run(build_app(msgspec.to_builtins(cfg), replicas, max_replicas, gpus_per_replica=gpus),
                        name="specserve", route_prefix="/")
    logger.info("serving on Ray: http://%s:%d, %d replicas%s", cfg.server.host, cfg.server.port, replicas,
                f" (up to {max_replicas})" if max_replicas else "")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    logger.info("shutting down: waiting up to %g s for the requests in flight", cfg.server.shutdown_timeout_s)
    try:
        cut = ingress.drain.remote(cfg.server.shutdown_timeout_s).result(timeout_s=cfg.server.shutdown_timeout_s + 30)
        if cut:
            logger.warning("%d requests were still running at the end of the drain; they ended with an error", cut)
    except Exception as e:   # the ingress is gone: nothing left to wait for
        logger.warning("could not drain the ingress: %s", e)
    serve.shutdown()
    ray.shutdown()


def build_app(config_data: dict, replicas: int, max_replicas: int | None = None, cpus_per_replica: float = 1.0,
              gpus_per_replica: float = 0.0, autoscaling: dict | None = None):
    """The Ray Serve application: an Ingress over `replicas` EngineReplicas, scaling up to
    `max_replicas` on requests in flight per replica (8 each; `autoscaling` sets any other
    field of Ray Serve's AutoscalingConfig)."""
    from ray import serve

    global PrefixAffinityRouter
    PrefixAffinityRouter = PrefixAffinityRouter or _make_router_class()
    scaling = ({"autoscaling_config": {"min_replicas": replicas, "max_replicas": max_replicas,
                                       "target_ongoing_requests": 8, **(autoscaling or {})}}
               if max_replicas and max_replicas > replicas else {"num_replicas": replicas})
    engine = serve.deployment(
        EngineReplica, name="specserve-engine", max_ongoing_requests=256, health_check_period_s=2.0,
        ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
        request_router_config={"request_router_class": PrefixAffinityRouter}, **scaling)
    ingress = serve.deployment(Ingress, name="specserve-ingress", num_replicas=1, max_ongoing_requests=4096,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(config_data), config_data.get("server", {}).get("api_key"))
