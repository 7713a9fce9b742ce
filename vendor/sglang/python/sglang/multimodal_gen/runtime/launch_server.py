# Copied and adapted from: https://github.com/hao-ai-lab/FastVideo

import multiprocessing as mp
import os
import sys
import time
from contextlib import ExitStack
from multiprocessing.connection import wait

import uvicorn

from sglang.multimodal_gen.runtime.disaggregation.orchestrator import (
    DiffusionServer,
)
from sglang.multimodal_gen.runtime.disaggregation.roles import RoleType
from sglang.multimodal_gen.runtime.entrypoints.control_requests import ShutdownReq
from sglang.multimodal_gen.runtime.entrypoints.http_server import create_app
from sglang.multimodal_gen.runtime.managers.worker_bootstrap import (
    SchedulerProcessSpec,
    ServerArgsPayload,
    bootstrap_http_server_process,
    bootstrap_scheduler_process,
)
from sglang.multimodal_gen.runtime.observability.metrics import (
    configure_metrics,
    start_role_metrics_server,
)
from sglang.multimodal_gen.runtime.platforms.plugins import apply_plugin_hooks
from sglang.multimodal_gen.runtime.scheduler_client import SchedulerClient
from sglang.multimodal_gen.runtime.server_args import (
    ServerArgs,
    prepare_server_args,
    set_global_server_args,
)
from sglang.multimodal_gen.runtime.utils.common import is_port_available
from sglang.multimodal_gen.runtime.utils.logging_utils import configure_logger, logger
from sglang.multimodal_gen.runtime.utils.process import (
    kill_process_tree,
)
from sglang.multimodal_gen.runtime.utils.trace_wrapper import init_diffusion_tracing

_SCHEDULER_SHUTDOWN_TIMEOUT_MS = 5000
_WORKER_JOIN_TIMEOUT_S = 10
_WORKER_TERMINATE_TIMEOUT_S = 1
_WORKER_KILL_TIMEOUT_S = 1


def _find_available_port(
    start: int = 10000, avoid: set[int] | None = None, max_attempts: int = 100
) -> int:
    """Find an available port starting from *start*, skipping ports in *avoid*."""
    if avoid is None:
        avoid = set()
    port = max(1024, min(start, 65535))
    for _ in range(max_attempts):
        if port not in avoid and is_port_available(port):
            return port
        port += 1
        if port > 65535:
            port = 1024
    raise RuntimeError(
        f"No available port found after {max_attempts} attempts (start={start})"
    )


def _process_names(processes) -> str:
    return ", ".join(p.name for p in processes)


def _join_processes_with_deadline(processes, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for process in processes:
        remaining_s = max(0.0, deadline - time.monotonic())
        process.join(timeout=remaining_s)


def _terminate_alive_processes(processes, timeout_s: float) -> list:
    alive = [p for p in processes if p.is_alive()]
    if not alive:
        return []

    logger.warning(
        "Terminating worker process(es): %s",
        _process_names(alive),
    )
    for process in alive:
        process.terminate()
    _join_processes_with_deadline(alive, timeout_s)
    return [p for p in alive if p.is_alive()]


def _kill_alive_processes(processes, timeout_s: float) -> None:
    alive = [p for p in processes if p.is_alive()]
    if not alive:
        return

    logger.warning(
        "Worker process(es) did not terminate in time; killing: %s",
        _process_names(alive),
    )
    for process in alive:
        process.kill()
    _join_processes_with_deadline(alive, timeout_s)


def _request_monolithic_scheduler_shutdown(server_args: ServerArgs) -> None:
    if server_args.disagg_role != RoleType.MONOLITHIC:
        return

    client = SchedulerClient()
    try:
        client.initialize(server_args)
        client.forward(ShutdownReq(), timeout_ms=_SCHEDULER_SHUTDOWN_TIMEOUT_MS)
    except Exception as e:
        logger.warning("Failed to request graceful scheduler shutdown: %s", e)
    finally:
        client.close()


def shutdown_scheduler_processes(
    server_args: ServerArgs | None,
    processes: list,
    *,
    request_shutdown: bool = True,
) -> None:
    if not processes:
        return

    if request_shutdown and server_args is not None:
        _request_monolithic_scheduler_shutdown(server_args)

    _join_processes_with_deadline(processes, _WORKER_JOIN_TIMEOUT_S)
    alive = _terminate_alive_processes(processes, _WORKER_TERMINATE_TIMEOUT_S)
    _kill_alive_processes(alive, _WORKER_KILL_TIMEOUT_S)


def _start_scheduler_processes(
    server_args: ServerArgsPayload,
    ranks: list[tuple[int, int]],
    name_prefix: str,
) -> list[mp.Process]:
    """Spawn a worker group, owning its pipes and children until all ranks are ready."""
    context = mp.get_context("spawn")
    processes = []
    pending = {}
    with ExitStack() as pipes:
        try:
            # all ranks must start before any waits for NCCL initialization
            for local_rank, rank in ranks:
                reader, writer = context.Pipe(duplex=False)
                pipes.enter_context(reader)
                pipes.enter_context(writer)
                spec = SchedulerProcessSpec(local_rank, rank, server_args, writer)
                process = context.Process(
                    target=bootstrap_scheduler_process,
                    args=(spec,),
                    name=f"{name_prefix}{rank}",
                    daemon=True,
                )
                process.start()
                processes.append(process)
                writer.close()
                pending[reader] = process

            # watch every child, including ready ranks, while its peers initialize
            sentinels = {p.sentinel: p for p in processes}
            while pending:
                ready = wait([*pending, *sentinels])
                for handle in ready:
                    if handle in sentinels:
                        process = sentinels[handle]
                        process.join()
                        raise RuntimeError(
                            f"{process.name} exited during initialization "
                            f"(exit code {process.exitcode}). Check the worker logs."
                        )
                for reader in ready:
                    process = pending.pop(reader)
                    try:
                        data = reader.recv()
                    except EOFError as error:
                        raise RuntimeError(
                            f"{process.name} closed its startup pipe before ready. "
                            "Check the worker logs."
                        ) from error
                    if data["status"] != "ready":
                        raise RuntimeError(
                            f"{process.name} failed to initialize: {data}"
                        )
                    reader.close()
        except BaseException:
            alive = _terminate_alive_processes(processes, _WORKER_TERMINATE_TIMEOUT_S)
            _kill_alive_processes(alive, _WORKER_KILL_TIMEOUT_S)
            raise
    return processes


def launch_server(server_args: ServerArgs, launch_http_server: bool = True):
    """
    Args:
        launch_http_server: False for offline local mode
    """
    apply_plugin_hooks()
    configure_logger(server_args)

    # Start a new server with multiple worker processes
    if server_args.enable_metrics:
        configure_metrics()
    logger.info("Starting server...")

    # num_gpus is the total world size across every node; each node runs
    # its own num_gpus // nnodes local workers, offset by node_rank into the
    # global rank space (mirrors srt's tp_size_per_node convention). With
    # nnodes == 1 this is exactly the prior single-node arithmetic.
    num_gpus = server_args.num_gpus
    nnodes = server_args.nnodes
    node_rank = server_args.node_rank
    local_num_gpus = num_gpus // nnodes
    rank_offset = node_rank * local_num_gpus
    server_args_payload = ServerArgsPayload.capture(server_args)
    processes = _start_scheduler_processes(
        server_args_payload,
        [(i, rank_offset + i) for i in range(local_num_gpus)],
        "sglang-diffusionWorker-",
    )

    logger.debug("All workers are ready")
    logger.info("[server-load] workers_ready_monotonic_ns=%d", time.monotonic_ns())

    if node_rank != 0:
        # The TokenizerManager / HTTP surface lives on the node that owns
        # global rank 0; this node only hosts local workers, which tear
        # down together with the distributed group on shutdown.
        logger.info(
            "Node %d ready with %d local worker(s); no local HTTP surface.",
            node_rank,
            local_num_gpus,
        )
        try:
            for p in processes:
                p.join()
        finally:
            shutdown_scheduler_processes(None, processes, request_shutdown=False)
        return processes

    if launch_http_server:
        if server_args.pipeline_config.supports_action_endpoint():
            logger.info(
                "Action generation endpoint ready: model=%s; per-request details are "
                "debug-only (use --log-level debug).",
                server_args.served_model_name,
            )
        logger.info("Starting FastAPI server.")
        if server_args.webui:
            logger.info("Launch FastAPI server in another process because of webui.")
            http_server_process = mp.get_context("spawn").Process(
                target=bootstrap_http_server_process,
                args=(server_args_payload, tuple(p.pid for p in processes)),
                name="sglang-diffusion-webui",
                daemon=True,
            )
            http_server_process.start()
        else:
            try:
                launch_http_server_only(
                    server_args, worker_pids=tuple(p.pid for p in processes)
                )
            finally:
                shutdown_scheduler_processes(server_args, processes)

    return processes


def launch_pool_disagg_server(
    server_args: ServerArgs,
    encoder_gpus: list[list[int]],
    denoiser_gpus: list[list[int]],
    decoder_gpus: list[list[int]],
    launch_http_server: bool = True,
):
    """Launch a pool-based disaggregated server with N:M:K independent role instances.

    DiffusionServer orchestrates the full pipeline, dispatching at every
    role transition (Encoder → Denoiser → Decoder).

    Args:
        server_args: Base server configuration
        encoder_gpus: List of GPU ID lists, one per encoder instance.
            e.g., [[0], [2]] for 2 encoder instances on GPUs 0 and 2.
        denoiser_gpus: List of GPU ID lists, one per denoiser instance.
            e.g., [[1], [3]] for 2 denoiser instances.
        decoder_gpus: List of GPU ID lists, one per decoder instance.
            e.g., [[0], [2]] for 2 decoder instances (can share with encoder).
        launch_http_server: Whether to launch the HTTP server.

    Example:
        launch_pool_disagg_server(server_args,
            encoder_gpus=[[0], [2]],
            denoiser_gpus=[[1], [3]],
            decoder_gpus=[[0], [2]],
        )
    """
    configure_logger(server_args)

    num_encoders = len(encoder_gpus)
    if server_args.enable_metrics:
        configure_metrics()
    num_denoisers = len(denoiser_gpus)
    num_decoders = len(decoder_gpus)
    logger.info(
        "Starting pool disagg server: %d encoder(s), %d denoiser(s), %d decoder(s)...",
        num_encoders,
        num_denoisers,
        num_decoders,
    )

    host = server_args.host or "127.0.0.1"

    def find_port(start):
        return _find_available_port(start)

    # Allocate endpoints
    port_cursor = server_args.scheduler_port + 3000

    # Per-instance work endpoints (instance binds PULL, DS connects PUSH)
    encoder_work_endpoints = []
    for i in range(num_encoders):
        p = find_port(port_cursor)
        encoder_work_endpoints.append(f"tcp://{host}:{p}")
        port_cursor = p + 1

    denoiser_work_endpoints = []
    for i in range(num_denoisers):
        p = find_port(port_cursor)
        denoiser_work_endpoints.append(f"tcp://{host}:{p}")
        port_cursor = p + 1

    decoder_work_endpoints = []
    for i in range(num_decoders):
        p = find_port(port_cursor)
        decoder_work_endpoints.append(f"tcp://{host}:{p}")
        port_cursor = p + 1

    # Per-role-type result endpoints (DS binds PULL, instances connect PUSH)
    # Use deterministic convention: scheduler_port + {1,2,3}
    base_port = server_args.scheduler_port
    encoder_result_ep = f"tcp://{host}:{base_port + 1}"
    denoiser_result_ep = f"tcp://{host}:{base_port + 2}"
    decoder_result_ep = f"tcp://{host}:{base_port + 3}"

    logger.info(
        "Pool endpoints allocated: %d work + 3 result endpoints",
        num_encoders + num_denoisers + num_decoders,
    )

    # Launch all role instances
    all_processes = []

    role_configs = [
        (RoleType.ENCODER, encoder_gpus, encoder_work_endpoints, encoder_result_ep),
        (
            RoleType.DENOISER,
            denoiser_gpus,
            denoiser_work_endpoints,
            denoiser_result_ep,
        ),
        (RoleType.DECODER, decoder_gpus, decoder_work_endpoints, decoder_result_ep),
    ]

    with ExitStack() as startup:
        startup.callback(_kill_alive_processes, all_processes, _WORKER_KILL_TIMEOUT_S)
        startup.callback(
            _terminate_alive_processes, all_processes, _WORKER_TERMINATE_TIMEOUT_S
        )
        for role_type, gpu_lists, work_eps, result_ep in role_configs:
            for inst_idx, gpu_ids in enumerate(gpu_lists):
                num_role_gpus = len(gpu_ids)

                role_args = server_args.for_disagg_role(
                    role_type,
                    pool_work_endpoint=work_eps[inst_idx],
                    pool_result_endpoint=result_ep,
                    num_gpus=num_role_gpus,
                    warmup_mode="request" if role_type == RoleType.ENCODER else "off",
                    scheduler_port=find_port(port_cursor),
                    master_port=find_port(port_cursor + 100),
                )
                port_cursor = role_args.master_port + 100
                role_args_payload = ServerArgsPayload.capture(role_args)

                # local_rank is a physical GPU id, independent of visible-device remapping
                all_processes.extend(
                    _start_scheduler_processes(
                        role_args_payload,
                        [(gpu_id, rank) for rank, gpu_id in enumerate(gpu_ids)],
                        f"sglang-pool-{role_type.value}-{inst_idx}-r",
                    )
                )

                logger.info(
                    "Pool %s[%d] ready on GPU(s) %s (work=%s)",
                    role_type.value.upper(),
                    inst_idx,
                    gpu_ids,
                    work_eps[inst_idx],
                )

        logger.info("All pool role instances ready")

        # Start DiffusionServer
        frontend_endpoint = f"tcp://{host}:{server_args.scheduler_port}"

        diffusion_server = DiffusionServer(
            frontend_endpoint=frontend_endpoint,
            encoder_work_endpoints=encoder_work_endpoints,
            denoiser_work_endpoints=denoiser_work_endpoints,
            decoder_work_endpoints=decoder_work_endpoints,
            encoder_result_endpoint=encoder_result_ep,
            denoiser_result_endpoint=denoiser_result_ep,
            decoder_result_endpoint=decoder_result_ep,
            dispatch_policy_name=server_args.disagg_dispatch_policy,
            timeout_s=float(server_args.disagg_timeout),
            server_args=server_args,
        )
        startup.callback(diffusion_server.stop)
        diffusion_server.start()

        if not diffusion_server.wait_ready(timeout=30.0):
            raise RuntimeError(
                "DiffusionServer failed to bind sockets within 30 seconds"
            )

        startup.pop_all()

    if launch_http_server:
        logger.info(
            "Starting FastAPI server (connected to DiffusionServer at port %d).",
            server_args.scheduler_port,
        )
        try:
            launch_http_server_only(
                server_args,
                worker_pids=tuple(p.pid for p in all_processes),
                disagg_server=diffusion_server,
            )
        finally:
            diffusion_server.stop()
            shutdown_scheduler_processes(
                server_args, all_processes, request_shutdown=False
            )

    return all_processes


def launch_http_server_only(
    server_args,
    *,
    worker_pids: tuple[int, ...] = (),
    disagg_server: DiffusionServer | None = None,
):
    init_diffusion_tracing(server_args, "DiffHTTPServer")

    # set for endpoints to access global_server_args
    set_global_server_args(server_args)
    app = create_app(server_args, worker_pids=worker_pids, disagg_server=disagg_server)
    uvicorn.run(
        app,
        use_colors=True,
        log_level=server_args.log_level,
        host=server_args.host,
        port=server_args.port,
        reload=False,
        ws_per_message_deflate=False,
        timeout_graceful_shutdown=server_args.http_graceful_shutdown_timeout,
    )


def parse_url_string(url_str: str | None) -> list[str]:
    """Parse a semicolon-separated URL string into a list.

    Example: "tcp://10.0.0.1:35000;tcp://10.0.0.2:35000" -> ["tcp://...", "tcp://..."]
    """
    return [u.strip() for u in (url_str or "").split(";") if u.strip()]


def launch_disagg_server(server_args: ServerArgs):
    """Launch DiffusionServer head node + HTTP server (--disagg-role server).

    No GPU workers are spawned. Connects to remote role instances
    specified by --encoder-urls, --denoiser-urls, --decoder-urls.

    Result endpoints use deterministic convention:
        encoder result: scheduler_port + 1
        denoiser result: scheduler_port + 2
        decoder result: scheduler_port + 3
    """
    configure_logger(server_args)
    set_global_server_args(server_args)

    if server_args.enable_metrics:
        configure_metrics()

    glm_distributed_mode_enabled = (
        type(server_args.pipeline_config).__name__ == "GlmImagePipelineConfig"
        and server_args.srt_encoder_url is not None
        and server_args.encoder_urls is None
        and server_args.decoder_urls is None
    )
    required_urls = [("--denoiser-urls", server_args.denoiser_urls)]
    split_encoding = bool(
        server_args.prompt_encoder_urls or server_args.image_encoder_urls
    )
    if split_encoding and server_args.encoder_urls is not None:
        raise ValueError(
            "Use either --encoder-urls or split --prompt-encoder-urls/--image-encoder-urls"
        )
    if not glm_distributed_mode_enabled:
        required_urls.append(("--decoder-urls", server_args.decoder_urls))
        if split_encoding:
            required_urls.extend(
                [
                    ("--prompt-encoder-urls", server_args.prompt_encoder_urls),
                    ("--image-encoder-urls", server_args.image_encoder_urls),
                ]
            )
        else:
            required_urls.append(("--encoder-urls", server_args.encoder_urls))
    for name, val in required_urls:
        if not parse_url_string(val):
            raise ValueError(f"{name} is required for --disagg-role server")

    host = server_args.host or "127.0.0.1"
    base_port = server_args.scheduler_port

    encoder_work_endpoints = parse_url_string(server_args.encoder_urls)
    denoiser_work_endpoints = parse_url_string(server_args.denoiser_urls)
    decoder_work_endpoints = parse_url_string(server_args.decoder_urls)

    encoder_result_ep = f"tcp://{host}:{base_port + 1}"
    denoiser_result_ep = f"tcp://{host}:{base_port + 2}"
    decoder_result_ep = f"tcp://{host}:{base_port + 3}"

    frontend_endpoint = f"tcp://{host}:{base_port}"

    logger.info("Starting DiffusionServer: frontend=%s", frontend_endpoint)
    for role, endpoints in (
        (RoleType.ENCODER, encoder_work_endpoints),
        (RoleType.PROMPT_ENCODER, parse_url_string(server_args.prompt_encoder_urls)),
        (RoleType.IMAGE_ENCODER, parse_url_string(server_args.image_encoder_urls)),
        (RoleType.DENOISER, denoiser_work_endpoints),
        (RoleType.DECODER, decoder_work_endpoints),
    ):
        if endpoints:
            offset = ServerArgs.DISAGG_RESULT_PORT_OFFSETS[role]
            logger.info(
                "  %s: work=%s result=tcp://%s:%d",
                role.value,
                endpoints,
                host,
                base_port + offset,
            )

    denoiser_options = (
        {"denoiser_capacity_per_worker": 1} if glm_distributed_mode_enabled else {}
    )
    diffusion_server = DiffusionServer(
        frontend_endpoint=frontend_endpoint,
        encoder_work_endpoints=encoder_work_endpoints,
        denoiser_work_endpoints=denoiser_work_endpoints,
        decoder_work_endpoints=decoder_work_endpoints,
        encoder_result_endpoint=encoder_result_ep,
        denoiser_result_endpoint=denoiser_result_ep,
        decoder_result_endpoint=decoder_result_ep,
        dispatch_policy_name=server_args.disagg_dispatch_policy,
        timeout_s=float(server_args.disagg_timeout),
        server_args=server_args,
        glm_distributed_mode_enabled=glm_distributed_mode_enabled,
        prompt_encoder_work_endpoints=parse_url_string(server_args.prompt_encoder_urls),
        image_encoder_work_endpoints=parse_url_string(server_args.image_encoder_urls),
        prompt_encoder_result_endpoint=f"tcp://{host}:{base_port + 4}",
        image_encoder_result_endpoint=f"tcp://{host}:{base_port + 5}",
        **denoiser_options,
    )
    diffusion_server.start()

    if not diffusion_server.wait_ready(timeout=30.0):
        raise RuntimeError("DiffusionServer failed to bind sockets within 30 seconds")

    logger.info(
        "Starting HTTP server (connected to DiffusionServer at port %d).",
        base_port,
    )
    try:
        launch_http_server_only(server_args, disagg_server=diffusion_server)
    finally:
        diffusion_server.stop()


def launch_disagg_role(server_args: ServerArgs):
    """Launch a standalone disaggregated role instance (--disagg-role encoder/denoising/decoder).

    The instance:
    1. Binds its work PULL socket on tcp://0.0.0.0:{scheduler_port}
    2. Connects its result PUSH socket to the DiffusionServer head node
       (derived from --disagg-server-addr + role offset)
    3. Spawns GPU worker processes for the assigned role.
    """
    configure_logger(server_args)

    role_type = server_args.disagg_role
    if server_args.enable_metrics:
        configure_metrics()
    if server_args.disagg_server_addr is None:
        raise ValueError(
            f"--disagg-server-addr is required for --disagg-role {role_type.value}"
        )

    # Derive endpoints
    work_endpoint = server_args.derive_pool_work_endpoint()
    result_endpoint = server_args.derive_pool_result_endpoint()

    logger.info(
        "Starting disagg role: %s, num_gpus=%d",
        role_type.value,
        server_args.num_gpus,
    )
    logger.info("  Work endpoint (bind): %s", work_endpoint)
    logger.info("  Result endpoint (connect): %s", result_endpoint)
    logger.info(
        "  P2P: hostname=%s, ib_device=%s, pool_size=%d",
        server_args.disagg_p2p_hostname,
        server_args.disagg_ib_device,
        server_args.disagg_transfer_pool_size,
    )

    # Build role-specific ServerArgs
    # Use a different port for the scheduler's internal ROUTER socket to avoid
    # conflicting with the pool work PULL socket (both bind on scheduler_port).
    internal_scheduler_port = _find_available_port(
        start=server_args.scheduler_port + 100, avoid={server_args.scheduler_port}
    )

    role_args = server_args.for_disagg_role(
        role_type,
        pool_work_endpoint=work_endpoint,
        pool_result_endpoint=result_endpoint,
        warmup_mode="request" if role_type.is_input_encoder else "off",
        scheduler_port=internal_scheduler_port,
    )
    role_args_payload = ServerArgsPayload.capture(role_args)

    num_gpus = server_args.num_gpus
    processes = _start_scheduler_processes(
        role_args_payload,
        [(server_args.base_gpu_id + rank, rank) for rank in range(num_gpus)],
        f"sglang-{role_type.value}-r",
    )

    logger.info(
        "Role %s ready (%d GPU(s), work=%s)",
        role_type.value.upper(),
        num_gpus,
        work_endpoint,
    )

    # Block until interrupted
    try:
        if server_args.enable_metrics:
            start_role_metrics_server(server_args)
        for p in processes:
            p.join()
    except KeyboardInterrupt:
        logger.info("Role %s shutting down.", role_type.value)
    finally:
        shutdown_scheduler_processes(role_args, processes, request_shutdown=False)


def dispatch_launch(server_args: ServerArgs):
    """Route to the correct launch function based on --disagg-role."""
    apply_plugin_hooks()

    if "NCCL_NVLS_ENABLE" not in os.environ or server_args.enable_nccl_nvls:
        os.environ["NCCL_NVLS_ENABLE"] = str(int(server_args.enable_nccl_nvls))

    role = server_args.disagg_role
    if role == RoleType.MONOLITHIC:
        launch_server(server_args)
    elif role == RoleType.SERVER:
        launch_disagg_server(server_args)
    elif role.is_input_encoder or role.is_transfer_receiver:
        launch_disagg_role(server_args)
    else:
        raise ValueError(f"Unknown disagg_role: {role}")


if __name__ == "__main__":
    apply_plugin_hooks()
    server_args = prepare_server_args(sys.argv[1:])

    try:
        dispatch_launch(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
