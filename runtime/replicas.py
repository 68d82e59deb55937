"""`qwc serve --replicas N --ray [ADDRESS]`: N copies of `qwc serve` behind one OpenAI endpoint
on Ray Serve (the optional extra `qwc[ray]`).

    client -> Ray Serve's HTTP proxy -> Ingress (one replica: reads the body, names its prefix
    key) -> PrefixAffinityRouter (runtime/affinity.py: the key's home replica, or the least
    loaded) -> EngineReplica x N (each the `qwc serve` app, engine and scheduler, in its own
    process, on any node of the cluster)

- Each replica builds exactly what `qwc serve` runs (runtime/serving.py: server_parts) and answers the
  request through that FastAPI app in its own process (an in-process ASGI call): the same
  routes, errors, streaming and metrics. Its response travels back as (status, headers, first
  chunk), then chunks.
- The ingress answers /health (the replicas that answer, 503 with none) and /metrics (every
  replica's page, each sample labelled with its replica) itself.
- A replica that dies is restarted by Ray Serve. A request whose replica dies before the first
  byte of its reply (a whole JSON reply, or a stream's first chunk) is sent again, to another
  replica; a stream cut after that ends with an error event and `data: [DONE]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import threading
import time

from qwc import progress
from qwc.errors import QwcError

from .affinity import merge_metrics, prefix_key
from .server import ApiError, _sse

# Serve's controller gives a new HTTP proxy 5 s to answer its first ready check, counted from the
# check and so including the proxy's process start. On a busy node that start alone can take
# longer; the controller then kills the proxy and serve.start fails. Its own variable lets the
# controller wait as long as serve.start itself does (60 s). Ray's processes read it from the
# environment they start in: a Ray that qwc starts inherits it; a cluster given by --ray needs
# it set where its nodes start (a runtime_env would give the controller, and every actor it
# starts, workers of their own, each slower to start than Ray's pre-started ones).
PROXY_START_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}

APP = "qwc"
RETRIES = 3          # replicas a request is offered to before a 503
REPLICA_HEADER = "x-qwc-replica"   # which replica answered (its process id): for tests and logs


def _needs_ray():
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise QwcError("qwc serve --replicas / --ray needs the ray extra: pip install 'qwc[ray]'") from None


def cpu_sets(text: str | None) -> list[set[int]]:
    """--replica-cpus '0-3;4-7' -> [{0, 1, 2, 3}, {4, 5, 6, 7}]."""
    if not text:
        return []
    sets = []
    for part in text.split(";"):
        cpus: set[int] = set()
        for item in part.split(","):
            lo, _, hi = item.strip().partition("-")
            try:
                a, b = int(lo), int(hi or lo)
            except ValueError:
                raise QwcError(f"--replica-cpus {text!r}: {item.strip()!r} is not a CPU number or range") from None
            if a < 0 or b < a:
                raise QwcError(f"--replica-cpus {text!r}: {item.strip()!r} is not a CPU range")
            cpus.update(range(a, b + 1))
        sets.append(cpus)
    return sets


class EngineReplica:
    """One `qwc serve` inside a Ray Serve replica."""

    def __init__(self, options: dict):
        from ray import serve

        from .serving import server_parts

        args = argparse.Namespace(**options)
        # TVM pins its pool's threads to cores by their index: every replica on a machine would
        # take the same cores (two 1-thread replicas ran on CPU 0, each at half speed). The OS
        # places them instead, within the replica's --replica-cpus set where one is given.
        os.environ.setdefault("TVM_BIND_THREADS", "0")
        sets = cpu_sets(args.replica_cpus)
        if sets:   # replica i on its node takes set i (mod the count)
            rank = serve.get_replica_context().rank
            os.sched_setaffinity(0, sets[int(getattr(rank, "local_rank", 0) or 0) % len(sets)])
        self.engine, self.scheduler, self.app, _ = server_parts(args)
        self.scheduler.start()
        self.pid = os.getpid()

    def __del__(self):
        sched = getattr(self, "scheduler", None)
        if sched is not None:
            sched.stop()

    def info(self) -> dict:
        return {"pid": self.pid, "threads": self.engine.threads, "cpus": sorted(os.sched_getaffinity(0)),
                "running": self.scheduler.running, "queued": self.scheduler.queued}

    async def metrics(self) -> tuple[str, str]:
        """(this replica's label, its Prometheus page)."""
        parts = [part async for part in self.handle(None, "GET", "/metrics", b"", [], b"")]
        return str(self.pid), b"".join([parts[0][2], *parts[1:]]).decode()

    async def handle(self, key, method: str, path: str, query: bytes, headers: list, body: bytes):
        """The app's reply to one HTTP request: (status, headers, first chunk), then chunks.
        `key` is the router's (runtime/affinity.py)."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
                 "root_path": "", "headers": [(bytes(k), bytes(v)) for k, v in headers],
                 "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
        gone = asyncio.Event()
        given = False

        async def receive():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()   # the caller went away: tell the app, which cancels the request
            return {"type": "http.disconnect"}

        out: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self.app(scope, receive, out.put))
        task.add_done_callback(lambda _: out.put_nowait(None))
        start = None
        try:
            while (msg := await out.get()) is not None:
                if msg["type"] == "http.response.start":
                    start = (msg["status"], [(k.decode("latin-1"), v.decode("latin-1")) for k, v in msg["headers"]]
                             + [(REPLICA_HEADER, str(self.pid))])
                    continue
                chunk = msg.get("body", b"")
                if start is not None:   # the first chunk carries the status and headers
                    yield (start[0], start[1], chunk)
                    start = None
                elif chunk:
                    yield chunk
                if not msg.get("more_body", False):
                    break
            if task.done() and task.exception() is not None:
                raise task.exception()
        finally:
            gone.set()
            if not task.done():
                try:
                    await asyncio.wait_for(task, 5)
                except (asyncio.TimeoutError, Exception):
                    task.cancel()


def _error(status: int, message: str, code: str | None = None):
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return _json(ApiError(status, message, code=code, kind=kind).body(), status)


class Ingress:
    """The HTTP entry: forwards each request to an engine replica by the affinity router."""

    def __init__(self, engine, replicas: int):
        self.engine, self.replicas = engine, replicas

    async def _each(self, method: str) -> list:
        """Every live replica's answer to `method` (those that fail or take over 10 s left out)."""
        try:
            got = await asyncio.wait_for(self.engine.broadcast(method).results_async(return_exceptions=True), 10)
        except Exception:   # none answered in time (all starting, or all gone)
            return []
        return [g for g in got if not isinstance(g, BaseException)]

    async def __call__(self, request):
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
        from starlette.responses import PlainTextResponse, StreamingResponse

        path = request.url.path
        if path == "/health" and request.method == "GET":
            ready = await self._each("info")
            body = {"status": "ok" if ready else "unavailable", "replicas": len(ready), "of": self.replicas,
                    "pids": sorted(r["pid"] for r in ready), "each": sorted(ready, key=lambda r: r["pid"])}
            return _json(body, 200 if ready else 503)
        if path == "/metrics" and request.method == "GET":
            pages = await self._each("metrics")
            return PlainTextResponse(merge_metrics(sorted(pages)), media_type="text/plain; version=0.0.4")
        body = await request.body()
        key = prefix_key(path, body)
        lost = (RayActorError, ActorDiedError, ActorUnavailableError)
        for _ in range(RETRIES):
            gen = self.engine.options(stream=True).handle.remote(
                key, request.method, path, request.url.query.encode(), list(request.headers.raw), body)
            try:
                status, headers, first = await gen.__anext__()
            except lost:   # the replica died before answering: offer the request to another
                continue
            except StopAsyncIteration:
                return _error(500, "the replica ended the request without a reply")
            break
        else:
            return _error(503, f"no replica could take the request ({RETRIES} tried)", "replica_unavailable")
        headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
        sse = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in headers)

        async def rest():
            yield first
            try:
                async for chunk in gen:
                    yield chunk
            except lost:
                if sse:   # a clean end for the client instead of a cut connection
                    err = ApiError(500, "the replica serving this stream stopped", code="replica_lost",
                                   kind="server_error")
                    yield (_sse(err.body()) + "data: [DONE]\n\n").encode()
            finally:
                gen.cancel()   # the client went away, or the stream ended: nothing more to compute

        return StreamingResponse(rest(), status_code=status, headers=dict(headers),
                                 media_type=None)


def _json(body: dict, status: int):
    from starlette.responses import JSONResponse

    return JSONResponse(body, status_code=status)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_replicas(args: argparse.Namespace) -> None:
    """Run `qwc serve` as args.replicas Ray Serve replicas until interrupted."""
    _needs_ray()
    from pathlib import Path

    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from qwc.manifest import read_manifest

    from .affinity_router import PrefixAffinityRouter  # imports ray
    from .serving import chosen_context

    # what can be checked here is, before Ray starts: a replica's failure would be retried
    sets = cpu_sets(args.replica_cpus)
    if not os.path.isdir(args.model):
        raise QwcError(f"{args.model}: no such artifact folder")
    read_manifest(Path(args.model))
    started = args.ray in (None, "local")
    if started and (missing := set().union(*sets) - os.sched_getaffinity(0)):
        raise QwcError(f"--replica-cpus {args.replica_cpus!r}: CPU {min(missing)} is not one this process may use")
    cores = len(os.sched_getaffinity(0))
    threads = args.threads or max(1, cores // args.replicas)
    options = {k: v for k, v in vars(args).items() if k != "func"}
    options["model"] = os.path.abspath(args.model)
    options["lora"] = [f"{n}={os.path.abspath(p)}" for n, _, p in (s.partition("=") for s in args.lora)]
    options["threads"] = threads
    # chosen once for all replicas, whose caches share this machine's memory (one replica's
    # choice made after another had committed its caches would be smaller)
    options["ctx"], said = chosen_context(args, sequences=args.max_batch * args.replicas)
    if said:
        progress.info(said)
    port = args.port or _free_port(args.host)
    try:
        if started:
            # Ray runs its workers at nice 15 by default; here they are the server's engines
            os.environ.setdefault("RAY_worker_niceness", "0")
            for k, v in PROXY_START_ENV.items():
                os.environ.setdefault(k, v)
            ray.init(num_cpus=max(cores, threads * args.replicas), include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=args.ray, log_to_driver=False, configure_logging=False)
    except Exception as e:
        raise QwcError(f"cannot start or reach Ray ({str(e).splitlines()[0][:200]})") from None
    try:
        serve.start(http_options={"host": args.host, "port": port}, logging_config={"log_level": "WARNING"})
        engine = serve.deployment(EngineReplica, name="engine").options(
            num_replicas=args.replicas, max_ongoing_requests=args.max_batch + args.max_queue,
            ray_actor_options={"num_cpus": threads},
            request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter),
            health_check_period_s=2, health_check_timeout_s=30)
        ingress = serve.deployment(Ingress, name="ingress").options(
            num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
        progress.info(f"[qwc] starting {args.replicas} replicas of {os.path.basename(options['model'])} on Ray "
                      f"({'local' if started else args.ray}), {threads} threads each ...")
        t0 = time.perf_counter()
        try:
            serve.run(ingress.bind(engine.bind(options), args.replicas), name=APP, route_prefix="/", blocking=False)
        except Exception as e:   # a replica's constructor failed (Serve's message ends with the cause)
            lines = [x for x in str(e).splitlines() if x.strip()]
            raise QwcError(f"the replicas did not start ({lines[-1].strip()[:300] if lines else type(e).__name__})") from None
        name = args.model_name or os.path.basename(options["model"]).removesuffix(".qwc")
        progress.info(f"[qwc] serving {name!r} at http://{args.host}:{port}/v1 ({args.replicas} replicas of "
                      f"{args.max_batch} sequences, {threads} threads each; ready in {time.perf_counter() - t0:.1f}s)")
        stop = threading.Event()

        def on_signal(*_):
            if stop.is_set():   # a second Ctrl-C: do not wait for Ray's shutdown
                os._exit(130)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        stop.wait()
    finally:
        progress.info("[qwc] stopping the replicas ...")
        # Serve's teardown waits on the cluster, which may be what went away: bounded
        done = threading.Thread(target=_teardown, args=(serve, started), daemon=True)
        done.start()
        done.join(STOP_SECONDS)
        ray.shutdown()


STOP_SECONDS = 30   # for Serve's own teardown before Ray is shut down under it


def _teardown(serve, started: bool) -> None:
    try:
        serve.delete(APP)
        if started:
            serve.shutdown()
    except Exception:   # the cluster went first: nothing left to delete
        pass
