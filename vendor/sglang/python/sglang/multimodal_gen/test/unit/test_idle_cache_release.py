# SPDX-License-Identifier: Apache-2.0

import threading
from collections import deque
from types import SimpleNamespace
from unittest.mock import Mock

import pytest

from sglang.multimodal_gen.runtime.disaggregation.roles import RoleType
from sglang.multimodal_gen.runtime.managers import gpu_worker as gpu_worker_module
from sglang.multimodal_gen.runtime.managers.gpu_worker import GPUWorker
from sglang.multimodal_gen.runtime.managers.scheduler import Scheduler
from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import OutputBatch
from sglang.multimodal_gen.runtime.server_args import ServerArgs
from sglang.multimodal_gen.runtime.utils.argparse import FlexibleArgumentParser


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def worker(monkeypatch):
    releases = []
    clock = _Clock()
    monkeypatch.setattr(gpu_worker_module.time, "monotonic", clock)
    monkeypatch.setattr(
        gpu_worker_module.torch,
        "get_device_module",
        lambda: SimpleNamespace(empty_cache=lambda: releases.append(clock.now)),
    )
    monkeypatch.setattr(
        type(gpu_worker_module.current_platform), "is_cpu", lambda self: False
    )
    worker = GPUWorker.__new__(GPUWorker)
    worker.defer_cache_release = False
    worker._cache_release_due = None
    worker.is_output_rank = True
    worker._materialize_output_transport = lambda *args: None
    worker._record_output_peak_memory = lambda *args, **kwargs: None
    return worker, releases, clock


def _finish_request(worker, *, deferred=False):
    req = SimpleNamespace(
        request_id="request",
        perf_dump_path=None,
        is_warmup=False,
        suppress_logs=True,
        return_raw_frames=False,
    )
    worker._finalize_output_batch(
        output_batch=OutputBatch(),
        req=req,
        save_output_paths=lambda batch: None,
        output_metrics=[],
        deferred=deferred,
    )


@pytest.mark.parametrize("deferred", [False, True])
def test_cache_is_released_only_after_the_scheduler_idles(worker, deferred):
    worker, releases, clock = worker
    worker.defer_cache_release = True

    _finish_request(worker, deferred=deferred)
    worker.release_cache_if_idle()
    assert releases == []

    # a back-to-back request finishing before the delay pushes it out again
    clock.now += gpu_worker_module._IDLE_CACHE_RELEASE_S / 2
    _finish_request(worker, deferred=deferred)
    clock.now += gpu_worker_module._IDLE_CACHE_RELEASE_S / 2
    worker.release_cache_if_idle()
    assert releases == []

    clock.now += gpu_worker_module._IDLE_CACHE_RELEASE_S
    worker.release_cache_if_idle()
    worker.release_cache_if_idle()
    assert releases == [clock.now]


def test_without_an_idle_hook_each_request_still_releases(worker):
    worker, releases, clock = worker

    _finish_request(worker)
    assert releases == [clock.now]
    _finish_request(worker, deferred=True)
    assert releases == [clock.now]
    worker.release_cache_if_idle()
    assert releases == [clock.now]


@pytest.mark.parametrize(
    "cli_args,tp_size,should_sleep",
    [([], 1, False), (["--sleep-on-idle"], 1, True), (["--sleep-on-idle"], 2, False)],
)
def test_idle_scheduler_wait_policy(worker, cli_args, tp_size, should_sleep):
    worker, releases, clock = worker
    worker.defer_cache_release = True
    _finish_request(worker)
    due = clock.now + gpu_worker_module._IDLE_CACHE_RELEASE_S
    clock.now += gpu_worker_module._IDLE_CACHE_RELEASE_S / 2

    parser = FlexibleArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = parser.parse_args(["--model-path", "/fake", *cli_args])
    scheduler = Scheduler.__new__(Scheduler)
    scheduler.server_args = SimpleNamespace(
        sp_degree=1,
        tp_size=tp_size,
        enable_cfg_parallel=False,
        sleep_on_idle=parsed.sleep_on_idle,
    )
    scheduler.worker = worker
    scheduler._disagg_role = RoleType.MONOLITHIC
    scheduler._disagg_metrics = None
    scheduler.metrics = None
    scheduler.dp_replica = 0
    scheduler.receiver = Mock()
    scheduler.context = Mock()
    scheduler.waiting_queue = deque()
    scheduler._async_output_save = False
    scheduler._inflight_finalizes = deque()
    scheduler._socket_lock = threading.Lock()
    scheduler._running = True
    scheduler._log_batch_metrics_summary = Mock()
    scheduler._cleanup_disagg = Mock()
    scheduler.process_received_reqs_with_req_based_warmup = lambda reqs: reqs
    scheduler.get_next_batch_to_run = lambda: None
    loops = []

    def recv_reqs():
        loops.append(None)
        if not should_sleep:
            clock.now += gpu_worker_module._IDLE_CACHE_RELEASE_S / 2
        scheduler._running = len(loops) < 4
        return []

    timeouts = []

    def poll(timeout):
        timeouts.append(timeout)
        clock.now += timeout / 1000.0
        if len(timeouts) == 2:
            scheduler._running = False

    scheduler.recv_reqs = recv_reqs
    scheduler._poller = SimpleNamespace(poll=poll)
    scheduler.event_loop()
    expected = [gpu_worker_module._IDLE_CACHE_RELEASE_S * 500.0, 1000]
    assert timeouts == (expected if should_sleep else [])
    assert releases == [due]
