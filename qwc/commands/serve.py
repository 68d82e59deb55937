"""`qwc serve`: the OpenAI-compatible HTTP server (one process, or replicas on Ray Serve)."""

from __future__ import annotations

import argparse

from qwc import progress
from qwc.errors import QwcError
from qwc.limits import MAX_LORA_RANK

from .options import (
    int_at_least,
    int_in,
    mmap_option,
    nonnegative,
    poll_option,
    positive,
    speculation_options,
    template_variables,
    thread_count,
)


def register(sub) -> None:
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching",
                        description="Serve an artifact over the OpenAI API (/v1/completions, /v1/chat/completions, "
                                    "/v1/embeddings, /v1/models; /health, /metrics). Needs the serve extra: pip install 'qwc[serve]'.")
    sv.add_argument("model", nargs="+", metavar="model",
                    help="model.qwc artifact folder; several (or a folder of them) serve each request's `model` "
                         "by its artifact (the folder's name without .qwc)")
    sv.add_argument("--models-max", type=positive, default=1, metavar="N",
                    help="with several models: at most N loaded at once, the least recently used idle one unloaded "
                         "for another (default 1)")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int_at_least(0), default=8080, help="port (default 8080; 0: any free one)")
    sv.add_argument("--max-batch", type=positive, default=8, help="sequences running at once (default 8)")
    sv.add_argument("--max-queue", type=nonnegative, default=64, help="requests waiting beyond those (default 64; "
                                                                  "more get 503)")
    sv.add_argument("--ctx", type=positive, default=None,
                    help="context per sequence in tokens (default: the model's trained context, capped so that "
                         "the sequences' KV caches take at most half the memory available at start)")
    sv.add_argument("--reuse-prefix", type=nonnegative, default=16, metavar="N",
                    help="a request takes the free slot whose cache shares the longest prefix with its prompt "
                         "(a system prompt, earlier turns), if at least N tokens, and prefills only the rest "
                         "(default 16; 0: never)")
    sv.add_argument("--no-mixed-steps", action="store_true",
                    help="run each prompt chunk in a call of its own while the running sequences wait; by "
                         "default their decode tokens ride in the chunk's call (artifacts compiled with "
                         "--max-batch >= 2), which reads the weights once for both")
    speculation_options(sv)
    mmap_option(sv)
    poll_option(sv)
    sv.add_argument("--spec-batch", type=positive, default=1, metavar="N",
                    help="speculate only while at most N sequences decode; more take the batched step, which "
                         "reads the weights once for all (default 1)")
    sv.add_argument("--threads", type=thread_count, default=None)
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    sv.add_argument("--no-webui", action="store_true",
                    help="do not serve the chat page at / (llama-server's flag; the API is unchanged)")
    sv.add_argument("--pooling", choices=("last", "mean", "cls"), default="last",
                    help="how /v1/embeddings pools an input's final hidden states into its vector (llama-server's "
                         "names): last token (default: a decoder LLM's, and Qwen3-Embedding's), mean of all, or the "
                         "first token; a request's `pooling` overrides it. Vectors are L2-normalized")
    sv.add_argument("--reasoning-format", choices=("auto", "deepseek", "none"), default="auto",
                    help="a thinking model's reasoning (Qwen3's <think> block): auto / deepseek (default) return it "
                         "apart as the message's reasoning_content; none leaves it in the content. A request's "
                         "reasoning_format overrides it")
    sv.add_argument("--chat-template-kwargs", type=template_variables, default={}, metavar="JSON",
                    help="default variables for the chat template, e.g. '{\"enable_thinking\": false}'; a request's "
                         "chat_template_kwargs add to them (llama-server's flag)")
    sv.add_argument("--model-name", help="the model id clients name (default: the artifact folder's name without .qwc)")
    sv.add_argument("--lora", action="append", default=[], metavar="NAME=PATH[:SCALE]",
                    help="serve a LoRA adapter (a PEFT directory or a llama.cpp GGUF adapter) unmerged beside the "
                         "base: a request whose model is NAME gets it; repeatable, and one batch mixes adapters "
                         "and the base. Needs an artifact compiled with --max-lora-rank")
    sv.add_argument("--max-lora-rank", type=int_in(1, MAX_LORA_RANK), metavar="R",
                    help="refuse adapters above rank R (default: the artifact's bound)")
    sv.add_argument("--replicas", type=positive, default=1, metavar="N",
                    help="N copies of the server behind one endpoint on Ray Serve, each its own process with its "
                         "own engine and scheduler; a request goes to the replica that saw its prompt's beginning "
                         "(default 1: one process, no Ray; needs the ray extra: pip install 'qwc[ray]')")
    sv.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                    help="run on Ray Serve: the cluster at ADDRESS (e.g. 10.0.0.1:6379 or auto), or without it a "
                         "local Ray on this machine")
    sv.add_argument("--replica-cpus", metavar="SETS",
                    help="with --replicas: the CPUs of each replica, ';'-separated sets in taskset's list form "
                         "(e.g. '0-63;64-127': one replica a die or NUMA node); replica i takes set i mod the count")
    sv.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    import socket
    from pathlib import Path

    from qwc.runtime.serving import serve_needs, server_parts

    serve_needs()
    from qwc.runtime.router import artifact_paths, holds_artifacts

    if len(args.model) > 1 or holds_artifacts(args.model[0]):
        paths = artifact_paths(args.model)
        if len(paths) > 1:
            return _serve_several(args, paths)
        args.model = [str(next(iter(paths.values())))]
    args.model = args.model[0]   # one artifact: its own checks, in the order they always ran
    if args.replica_cpus and args.ray is None and args.replicas == 1:
        raise QwcError("--replica-cpus pins replicas: give --replicas N (or --ray)")
    if args.ray is not None or args.replicas > 1:
        from qwc.runtime.replicas import serve_replicas

        return serve_replicas(args)
    import uvicorn

    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        raise QwcError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e})") from None
    eng, sched, app, name = server_parts(args)
    host, port = sock.getsockname()[:2]
    if eng.max_batch < args.max_batch:
        has = "no batched decode" if eng.max_batch == 1 else f"a batched decode of at most {eng.max_batch} sequences"
        progress.info(f"[qwc] note: {args.model} has {has}; steps with more decode one sequence after another "
                      f"(compile it with --max-batch {args.max_batch})")
    how = f"a draft model ({Path(args.draft).name})" if args.draft else "prompt lookup"
    spec = (f"; speculative decoding by {how}, drafts of up to {args.draft_max} tokens where at most "
            f"{args.spec_batch} sequence{'s' if args.spec_batch > 1 else ''} decode" if sched.speculate else "")
    progress.info(f"[qwc] serving {name!r} at http://{host}:{port}/v1 ({args.max_batch} sequences of up to "
                  f"{eng.ctx} tokens, {eng.threads} threads{', API key required' if args.api_key else ''}; "
                  f"{eng.kv_summary()}{spec})")
    if eng.adapters is not None and eng.adapters.names:
        progress.info(f"[qwc] {eng.adapters.describe()}")
    sched.start()
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)).run(sockets=[sock])
    finally:
        sched.stop()


def _serve_several(args: argparse.Namespace, paths: dict) -> None:
    """Several artifacts behind one address (runtime/router.py), each loaded on first use."""
    import copy
    import socket

    import uvicorn

    from qwc.runtime.router import ModelRouter
    from qwc.runtime.server import chat_page
    from qwc.runtime.serving import server_parts

    for flag, given in (("--replicas", args.replicas > 1 or args.ray is not None), ("--lora", args.lora),
                        ("--draft", args.draft), ("--model-name", args.model_name)):
        if given:
            raise QwcError(f"{flag} serves one artifact; give one model (this command has {len(paths)})")
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        raise QwcError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e})") from None

    def load(name: str, path):
        one = copy.copy(args)
        one.model, one.model_name = str(path), name
        eng, sched, app, _ = server_parts(one)
        return eng, sched, app   # the router starts the scheduler

    router = ModelRouter(paths, load, args.models_max, None if args.no_webui else chat_page(), args.api_key)
    host, port = sock.getsockname()[:2]
    progress.info(f"[qwc] serving {len(paths)} models at http://{host}:{port}/v1 ({', '.join(map(repr, paths))}; "
                  f"at most {args.models_max} loaded, each on first use)")
    try:
        uvicorn.Server(uvicorn.Config(router, log_level="warning", timeout_graceful_shutdown=5)).run(sockets=[sock])
    finally:
        router.close()
