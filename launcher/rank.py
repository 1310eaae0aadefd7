"""One rank, whatever started it (in-process for world size 1, torch elastic, torchrun,
mpirun, deepspeed): join the world, load this rank's shard, then either drive (rank 0:
scheduler, frontend, step loop) or follow the driver's plans."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from typing import Protocol

import torch

from meshserve.comm.control import DriverChannel, WorkerChannel, broadcast_text
from meshserve.comm.endpoints import ipc_dir_fits
from meshserve.comm.failure import FailureSignal
from meshserve.comm.heartbeat import HeartbeatMonitor
from meshserve.configs.cpu_features import cpu_features
from meshserve.configs.memory import MemoryPlan, stage_layers
from meshserve.configs.model_info import ModelInfo
from meshserve.configs.schema import Config
from meshserve.engine.build import attach_kv_transfer, build_engine, build_runner
from meshserve.engine.engine import Engine
from meshserve.engine.executor import DistributedExecutor, LocalExecutor
from meshserve.engine.model_runner import ModelRunner
from meshserve.engine.tokenizer import Tokenizer
from meshserve.engine.worker import worker_loop
from meshserve.layers.backend import kernel_summary
from meshserve.launcher.env import CpuPlacement, RankEnv, bind_to_cores, cpu_placement
from meshserve.launcher.failure_report import report_failure
from meshserve.launcher.network import interface_address
from meshserve.launcher.startup import start_world
from meshserve.parallel.process_groups import destroy_process_groups
from meshserve.parallel.topology import Groups

log = logging.getLogger("meshserve")

RESULT_TIMEOUT_S = 600.0
EXIT_RANK_FAILURE = 1
DRIVER_EXIT_BACKSTOP_S = 5.0
"""After a failure the driver exits within this, whatever its mode is doing (serving
answers its clients and exits sooner)."""


class DriverMode(Protocol):
    """What the driver does with the engine: serve clients, or run a batch offline."""

    def prepare(self, config: Config, tokenizer: Tokenizer, info: ModelInfo, memory: MemoryPlan) -> None:
        """Before the model loads (e.g. bind sockets, so a taken address fails fast)."""

    def run(self, engine: Engine) -> int: ...


def shm_slot_bytes(config: Config, info: ModelInfo) -> int:
    """Largest TP collective of a step, in float32: the activations of a full token budget,
    or the logits slices of a full batch."""
    hidden = config.scheduler.max_batched_tokens * info.hidden_size
    logits = config.scheduler.max_num_seqs * -(-info.vocab_size // config.parallel.tensor)
    return 4 * max(hidden, logits)


def _device(config: Config, env: RankEnv) -> str:
    return f"cuda:{env.local_rank}" if config.device.type == "cuda" else "cpu"


def run_rank(config: Config, info: ModelInfo, memory: MemoryPlan, env: RankEnv, mode: DriverMode) -> int:
    """Join the launcher's world (checked against the config on every rank), then work."""
    if config.device.type == "cpu":
        place_on_cpu(config, env)
    try:
        if env.world_size > 1:
            log.info("rank %d: joining the world of %d ranks (%s; waits for every rank)", env.global_rank,
                     env.world_size, env.launcher)
        start = time.perf_counter()
        groups = start_world(config, env, shm_slot_bytes=shm_slot_bytes(config, info))
        if env.world_size > 1:
            log.info("rank %d: all %d ranks joined in %.1f s", env.global_rank, env.world_size,
                     time.perf_counter() - start)
        return run_in_world(config, info, memory, env, mode, groups)
    finally:
        destroy_process_groups()


def place_on_cpu(config: Config, env: RankEnv) -> CpuPlacement:
    """Bind this rank to its cores and set its intra-op threads (launcher/env.py:
    cpu_placement), saying so in one line."""
    placement = cpu_placement(config.device, env.local_rank, env.local_world_size)
    if placement.capped:
        log.warning("rank %d: %s", env.global_rank, placement.capped)
    if placement.cores is not None:
        bind_to_cores(placement.cores)
    torch.set_num_threads(placement.threads)
    where = f"cores {','.join(map(str, placement.cores))}" if placement.cores is not None else "unbound"
    log.info("rank %d: %d intra-op thread%s, %s (local rank %d of %d)", env.global_rank, placement.threads,
             "s" if placement.threads > 1 else "", where, env.local_rank, env.local_world_size)
    return placement


def run_in_world(config: Config, info: ModelInfo, memory: MemoryPlan, env: RankEnv, mode: DriverMode,
                 groups: Groups) -> int:
    """The rank's work once its process groups exist: drive, or follow the driver."""
    if groups.is_driver:
        return _drive(config, info, memory, env, mode, groups)
    _follow(config, info, memory, env, groups)
    return 0


def _drive(config, info, memory, env, mode: DriverMode, groups) -> int:
    log.info("loading the tokenizer")
    tokenizer = Tokenizer(info, config.model.tokenizer)
    mode.prepare(config, tokenizer, info, memory)
    failure = FailureSignal()
    ipc_dir = private_socket_dir() if groups.world_size > 1 and _on_one_node(config, env) else None
    if ipc_dir is not None:
        failure.on_failure(lambda _: shutil.rmtree(ipc_dir, ignore_errors=True))
    try:
        return _drive_world(config, info, memory, env, mode, groups, tokenizer, failure, ipc_dir)
    finally:
        if ipc_dir is not None:
            shutil.rmtree(ipc_dir, ignore_errors=True)


def _on_one_node(config: Config, env: RankEnv) -> bool:
    """Every rank on the driver's node (start_world checked the launcher's counts against
    cluster.nodes and cluster.ranks_per_node)."""
    return config.cluster.nodes == 1 and env.local_world_size == env.world_size


def private_socket_dir() -> str:
    """A fresh directory only this user can enter (mode 0700, made by mkdtemp) for the unix
    sockets of the control plane and heartbeats: under the system's temporary directory, or
    /tmp when that path is too long for unix socket paths."""
    base = tempfile.gettempdir()
    if not ipc_dir_fits(os.path.join(base, "meshserve-xxxxxxxx")):
        base = "/tmp"
    return tempfile.mkdtemp(prefix="meshserve-", dir=base)


def _drive_world(config, info, memory, env, mode: DriverMode, groups, tokenizer, failure: FailureSignal,
                 ipc_dir: str | None) -> int:
    channel = monitor = None
    if groups.world_size > 1:
        if ipc_dir is not None:
            where = {"ipc_dir": ipc_dir}
        else:
            # NOTE: across nodes the control plane faces the other nodes: it binds on
            # cluster.interface when set (clients reach the driver where server.zmq says, not here).
            host = interface_address(config.cluster.interface) if config.cluster.interface else env.master_addr
            where = {"host": socket.gethostbyname(host)}
        channel = DriverChannel(groups.world_size, config.server.secret, **where)
        monitor = _monitor(config, groups, channel.session, failure, **where)
        broadcast_text(f"{channel.addresses} {monitor.addresses}", src=0)
    log.info("building the model: %s", _model_line(config, info, groups))
    runner = build_runner(config, info, memory, groups, _device(config, env), tokenizer, show_progress=True)
    attach_kv_transfer(config, info, memory, groups, runner)
    _say_kernels(config, env, runner)
    if channel is None:
        executor = LocalExecutor(runner, failure)
    else:
        log.info("waiting for the other %d ranks to load their shards", groups.world_size - 1)
        channel.handshake(config.cluster.handshake_timeout)
        executor = DistributedExecutor(runner, channel, RESULT_TIMEOUT_S, failure)
        _watch(groups, failure, monitor)
        failure.on_failure(monitor.abort)
    failure.on_failure(_exit_after(DRIVER_EXIT_BACKSTOP_S))
    engine = build_engine(config, info, memory, executor, tokenizer)
    try:
        return mode.run(engine)
    finally:
        engine.shutdown()
        if monitor is not None:
            monitor.stop()


def _follow(config, info, memory, env, groups) -> None:
    # NOTE: a follower ignores SIGTERM/SIGINT: the driver drains in-flight requests and then
    # publishes Shutdown; if the driver is gone, the heartbeats tell (and the launcher kills
    # what is left after its own timeout).
    signal.signal(signal.SIGTERM, lambda *_: log.info("rank %d: signal received; waiting for the driver", env.global_rank))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    addresses = broadcast_text(None, src=0).split()
    channel = WorkerChannel(" ".join(addresses[:2]), env.global_rank, secret=config.server.secret)
    log.info("rank %d: building the model: %s", env.global_rank, _model_line(config, info, groups))
    runner = build_runner(config, info, memory, groups, _device(config, env))
    attach_kv_transfer(config, info, memory, groups, runner)
    _say_kernels(config, env, runner)
    channel.handshake(config.cluster.handshake_timeout)
    failure = FailureSignal()
    # NOTE: on one node a follower removes the driver's socket directory too when the world
    # breaks: a SIGKILLed driver cannot.
    socket_dir = os.path.dirname(addresses[0].removeprefix("ipc://")) if addresses[0].startswith("ipc://") else None
    failure.on_failure(_exit_after(0.0, socket_dir))
    monitor = _monitor(config, groups, channel.session, failure, addresses=" ".join(addresses[2:]))
    _watch(groups, failure, monitor)
    try:
        worker_loop(runner, channel)
    except Exception:  # a collective with a dead rank raised: the world is broken
        if failure.trigger(f"rank {env.global_rank}: a step failed (this rank's log has the traceback)"):
            log.exception("rank %d: the step failed", env.global_rank)
        while True:
            time.sleep(3600)
    finally:
        monitor.stop()
        channel.close()


def _say_kernels(config: Config, env: RankEnv, runner: ModelRunner) -> None:
    cpu = f"CPU: {cpu_features().describe()}; " if config.device.type == "cpu" else ""
    log.info("rank %d: %s%s; %s", env.global_rank, cpu,
             kernel_summary(runner.model.backend, runner.model.matmuls, runner.info.head_dim, runner.dtype), runner.decode.describe())


def _model_line(config: Config, info: ModelInfo, groups: Groups) -> str:
    """What this rank loads, e.g. `30 layers of 30 (stage 1/1, tp rank 0/1), bfloat16 (as
    model.dtype says), quantization int4`."""
    counts = stage_layers(config, info)
    dtype, why = config.dtype_choice
    return (f"{counts[groups.pp.rank]} layers of {info.num_hidden_layers} (stage {groups.pp.rank + 1}/{groups.pp.size}, "
            f"tp rank {groups.tp.rank}/{groups.tp.size}), {dtype} ({why}), quantization "
            f"{config.model.quantization}")


def _monitor(config: Config, groups: Groups, session: str, failure: FailureSignal, **where) -> HeartbeatMonitor:
    cluster = config.cluster
    return HeartbeatMonitor(groups.global_rank, groups.world_size, session, cluster.heartbeat_interval,
                            cluster.failure_timeout, failure.trigger, secret=config.server.secret, **where)


def _watch(groups: Groups, failure: FailureSignal, monitor: HeartbeatMonitor) -> None:
    """Start the heartbeats; shared-memory collectives give up once the world is broken."""
    for group in (groups.tp, groups.pp, groups.cp):
        if group.shm is not None:
            group.shm.failure = failure
    monitor.start()


def _exit_after(delay: float, socket_dir: str | None = None):
    """A failure reaction: tell the launcher why (launcher/failure_report.py), remove
    `socket_dir` (the control plane's unix sockets), then end the process with
    EXIT_RANK_FAILURE after `delay` seconds (the driver's frontends answer in-flight
    requests first; nothing here waits on a dead peer)."""

    def exit_now(reason: str) -> None:
        report_failure(reason)
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)
        time.sleep(delay)
        log.error("exiting: %s", reason)
        logging.shutdown()
        os._exit(EXIT_RANK_FAILURE)

    return exit_now

