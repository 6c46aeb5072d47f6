"""``meshtron serve``: a checkpoint's model behind an OpenAI-style HTTP API, on one process or
one tp x pp model replica.

Start-up refuses what it can before anything heavy happens, each with one line: FastAPI or
uvicorn missing, the checkpoint and its tokenizer, the layout (generate's checks), and the
address, bound before the model loads (a port in use is said at once, not after a minute of
loading). With ``--nproc N`` the ranks start through the same launcher as ``generate``; under
torchrun each rank is started already. Rank 0 serves HTTP and runs the batching engine; the
other ranks follow its broadcasts (:func:`meshtron.inference.engine.follow`). Ctrl-C or SIGTERM
stops uvicorn gracefully, the engine finishes its batch and tells the other ranks to stop, and
every rank exits.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
from pathlib import Path

from meshtron.checkpoint.loading import InferenceCheckpoint, load_model, open_for_inference
from meshtron.data.chat_template import ChatTemplate, find_chat_template
from meshtron.errors import MeshtronError
from meshtron.inference.engine import Engine, follow
from meshtron.inference.generate_command import generation_config
from meshtron.inference.sampling_defaults import choose_sampling, end_ids
from meshtron.models.generation import Generator, Sampling
from meshtron.parallel.mesh import ParallelMesh
from meshtron.parallel.mesh.process import ProcessInfo, process_info
from meshtron.plan import RunPlan, plan_generation

GRACEFUL_SHUTDOWN_S = 30
"""How long a stopping server waits for the responses under way before it cuts them."""


def run_serve(args: argparse.Namespace, overrides: list[str]) -> int:
    """The ``serve`` command, after the CLI has parsed its arguments."""
    try:  # the optional web stack (the serve extra)
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise MeshtronError(f"`meshtron serve` needs FastAPI and uvicorn ({err}): "
                            "pip install meshtron[serve]") from None
    for name, value, low in (("--nproc", args.nproc, 1), ("--max-batch", args.max_batch, 1),
                             ("--port", args.port, 0)):
        if value < low:
            raise MeshtronError(f"{name} must be at least {low}, got {value}")
    if args.port > 65535:
        raise MeshtronError(f"--port must be at most 65535, got {args.port}")
    info = process_info()
    launching = args.nproc > 1 and not info.distributed
    try:  # before any process group: every rank sees the same files, rank 0 says it
        ckpt = open_for_inference(Path(args.checkpoint))
        cfg = generation_config(ckpt, overrides)
        plan = plan_generation(cfg, args.nproc if launching else info.world_size)
    except MeshtronError:
        if info.distributed and info.rank != 0:
            return 2
        raise
    name = args.model_name or Path(args.checkpoint).resolve().name
    listener = bind(args.host, args.port) if info.rank == 0 else None
    if launching:
        from meshtron.parallel.mesh.launch import launch_local

        assert listener is not None
        listener.close()  # rank 0 binds it again, before its model loads
        return launch_local(args.nproc, forwarded(args, ckpt.path, name, overrides),
                            command="serve")
    return _serve_on_rank(args, info, ckpt, plan, name, listener)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free port), or one line saying why
    not."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise MeshtronError(f"--host {host!r} is not an address of this machine "
                            f"({err.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a just-stopped server's port
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise MeshtronError(f"port {port} on {host} is in use (another server?): stop it or "
                                "choose another --port") from None
        if err.errno == errno.EACCES:
            raise MeshtronError(f"port {port} on {host} needs privileges to bind: choose "
                                "--port above 1023") from None
        raise MeshtronError(f"cannot listen on {host}:{port} ({err.strerror})") from None
    return sock


def forwarded(args: argparse.Namespace, checkpoint: Path, name: str,
              overrides: list[str]) -> list[str]:
    """The arguments every launched rank gets: this command's, pinned to the checkpoint the
    launcher checked and to the model name it chose."""
    out = ["--checkpoint", str(checkpoint), f"--host={args.host}", f"--port={args.port}",
           f"--max-batch={args.max_batch}", f"--model-name={name}"]
    given = {"temperature": args.temperature, "top-k": args.top_k, "top-p": args.top_p}
    out += [f"--{flag}={value!r}" for flag, value in given.items() if value is not None]
    return out + (["--access-log"] if args.access_log else []) + overrides


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _serve_on_rank(args: argparse.Namespace, info: ProcessInfo, ckpt: InferenceCheckpoint,
                   plan: RunPlan, name: str, listener: socket.socket | None) -> int:
    from meshtron.parallel.mesh.process import device_for, die_with_launcher, init_process_group
    from meshtron.precision.policy import cpu_low_precision_note

    cfg = plan.config
    if info.distributed:
        die_with_launcher()
        init_process_group(info, cfg.run.timeout_s)
    mesh = ParallelMesh(plan.layout, info.rank)
    device = device_for(info)
    generator = Generator(load_model(ckpt, plan, mesh, cfg.precision.dtype, device), mesh)
    broadcast = _broadcast if info.distributed else None
    if listener is None:
        assert broadcast is not None
        return follow(generator, ckpt.tokenizer, broadcast)
    print(f"checkpoint: {ckpt.path}", file=sys.stderr)
    slow = cpu_low_precision_note(cfg.precision.dtype, device)
    if slow:
        print(f"warning: {slow}", file=sys.stderr)
    choice = choose_sampling(ckpt.config.generation, args.temperature, args.top_k, args.top_p)
    print(f"{choice.line}; a request's temperature, top_k and top_p win", file=sys.stderr)
    engine = Engine(generator, ckpt.tokenizer, args.max_batch, broadcast,
                    keepalive_s=min(60.0, cfg.run.timeout_s / 4),
                    ends=end_ids(ckpt.config.generation, ckpt.tokenizer.eos_id))
    return _run_server(args, engine, ckpt, name, listener, mesh, choice.sampling)


def _run_server(args: argparse.Namespace, engine: Engine, ckpt: InferenceCheckpoint, name: str,
                listener: socket.socket, mesh: ParallelMesh, defaults: Sampling) -> int:
    import uvicorn

    from meshtron.inference.server import build_app

    layout = mesh.layout
    where = f" on tp={layout.tp} x pp={layout.pp}" if layout.world_size > 1 else ""

    def ready() -> None:
        print(f"meshtron: serving {name}{where} at {url(listener)} (POST /v1/completions, "
              f"POST /v1/chat/completions, GET /health; batches of up to {args.max_batch}; "
              "Ctrl-C stops)", flush=True)

    template = chat_template_of(ckpt)
    print(f"chat: template from {template.where}" if template else "chat: the model has no "
          "chat template; POST /v1/chat/completions answers 404", file=sys.stderr)
    app = build_app(engine, ckpt.tokenizer, name, on_ready=ready, defaults=defaults,
                    chat_template=template)
    server = uvicorn.Server(uvicorn.Config(
        app, log_level="info" if args.access_log else "warning", access_log=args.access_log,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))

    def stop_serving() -> None:
        server.should_exit = True

    engine.start(on_fatal=stop_serving)
    try:
        server.run(sockets=[listener])
    finally:
        engine.close()
    if engine.error is not None:
        raise engine.error
    return 0


def chat_template_of(ckpt: InferenceCheckpoint) -> ChatTemplate | None:
    """The chat template chat requests are rendered with: the training data's
    (``data.chat.template``), else the one beside the checkpoint's tokenizer, else the one
    beside the tokenizer the run trained with (``data.tokenizer``); None if there is none or
    it is not valid jinja (said on stderr)."""
    data = ckpt.config.data
    places = [Path(ckpt.tokenizer.path)]
    if data.tokenizer:
        given = Path(data.tokenizer).expanduser()
        places.append(given / "tokenizer.json" if given.is_dir() else given)
    for place in places:
        try:
            template = find_chat_template(place, data.chat.template)
        except MeshtronError:
            continue
        try:
            _ = template.compiled
        except MeshtronError as err:  # not jinja: said once, completions still served
            print(f"warning: {err}; POST /v1/chat/completions answers 404", file=sys.stderr)
            return None
        return template
    return None


def _broadcast(message: object) -> object:
    """Rank 0's ``message`` on every rank (the default group is the replica)."""
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]
