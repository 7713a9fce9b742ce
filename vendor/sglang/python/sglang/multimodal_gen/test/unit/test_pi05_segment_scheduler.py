# SPDX-License-Identifier: Apache-2.0

from collections import deque
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

import sglang.multimodal_gen.runtime.managers.pi05_segment_scheduler as module
from sglang.multimodal_gen.configs.pipeline_configs.pi05 import Pi05PipelineConfig
from sglang.multimodal_gen.runtime.managers.pi05_segment_scheduler import (
    Pi05SegmentSchedulerMixin,
)
from sglang.multimodal_gen.runtime.managers.scheduler import (
    Scheduler as ProductionScheduler,
)
from sglang.multimodal_gen.runtime.observability.metrics import DiffusionMetrics
from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import (
    BatchMetricsWindow,
)


class Request:
    def __init__(self, name, steps=5, signature="a"):
        self.request_id = name
        self.num_inference_steps = steps
        self.extra = {"vla": {}}
        self.is_warmup = False
        self.signature = signature
        self.reject = False
        self.realtime_session_id = None
        self.session = None
        self.num_outputs_per_prompt = 1


class Scheduler(Pi05SegmentSchedulerMixin):
    def __init__(self, rows, rank=0):
        self.waiting_queue = deque((b"client", req, ts) for req, ts in rows)
        self._pi05_arrivals = {}
        self._pi05_sequence = 0
        self.server_args = SimpleNamespace(
            pipeline_config=Pi05PipelineConfig(enable_segmented_actions=True), tp_size=1
        )
        self.worker = SimpleNamespace(
            tp_group=SimpleNamespace(rank=rank, ranks=[0, 1]), tp_cpu_group=None
        )
        self._batching_max_size = 3
        self._batching_delay_s = 0.05
        self._batch_admission = SimpleNamespace(
            batch_is_full=lambda rs: False,
            reject_reason_for_candidate=lambda rs, r: "capacity" if r.reject else None,
            max_admissible_batch_size=lambda r: self._batching_max_size,
        )
        self.metrics = None
        self._batch_metrics_enabled = True
        self._batch_metrics_window = BatchMetricsWindow()

    _record_batch_dispatch_metrics = ProductionScheduler._record_batch_dispatch_metrics

    def _dynamic_batching_enabled(self):
        return True

    def _can_dynamic_batch(self, a, b):
        return a.signature == b.signature


@pytest.fixture(autouse=True)
def request_type(monkeypatch):
    monkeypatch.setattr(module, "Req", Request)
    monkeypatch.setattr(module.time, "monotonic", lambda: 10.0)


def test_original_arrival_beats_requeue_position_and_checks_admission():
    old, young, incompatible, rejected = [
        Request(n) for n in ["old", "young", "other", "reject"]
    ]
    old.extra["vla"]["pi05_flow"] = SimpleNamespace(remaining=2)
    incompatible.signature = "b"
    rejected.reject = True
    scheduler = Scheduler(
        [(young, 8.0), (incompatible, 9.0), (rejected, 9.1), (old, 1.0)]
    )
    scheduler._pi05_arrivals[id(old)] = (1.0, 0)
    scheduler._pi05_sequence = 1
    items = scheduler._get_next_pi05_segment_batch()
    assert [r.request_id for _, r in items] == ["old", "young"]
    assert [r.request_id for _, r, _ in scheduler.waiting_queue] == ["other", "reject"]
    assert scheduler._pi05_arrivals[id(old)] == (1.0, 0)


def test_fresh_wait_but_continuation_bypasses_batch_delay():
    req = Request("fresh")
    scheduler = Scheduler([(req, 9.99)])
    assert scheduler._get_next_pi05_segment_batch() is None
    req.extra["vla"]["pi05_flow"] = SimpleNamespace(remaining=2)
    assert scheduler._get_next_pi05_segment_batch() == [(b"client", req)]


@pytest.mark.parametrize("timestamps", [(1.0, 2.0, 3.0), (1.0, 1.0, 1.0)])
def test_control_is_a_batching_barrier(timestamps):
    old, new = Request("old"), Request("new")
    control = SimpleNamespace(request_id="update_weights")
    scheduler = Scheduler(list(zip((old, control, new), timestamps)))
    assert scheduler._get_next_pi05_segment_batch() == [(b"client", old)]
    assert scheduler._get_next_pi05_segment_batch() == [(b"client", control)]
    assert scheduler._get_next_pi05_segment_batch() == [(b"client", new)]
    assert id(control) not in scheduler._pi05_arrivals


def test_tp_uses_rank_zero_packet_and_rejects_queue_mismatch(monkeypatch):
    packet = []

    def broadcast(value, rank, group, src):
        if rank == 0:
            packet[:] = [value]
        return packet[0]

    monkeypatch.setattr(module, "broadcast_pyobj", broadcast)
    a = Scheduler([(Request("a"), 1.0), (Request("b"), 2.0)], rank=0)
    b = Scheduler([(Request("a"), 99.0), (Request("b"), 100.0)], rank=1)
    a.server_args.tp_size = b.server_args.tp_size = 2
    ai, bi = a._get_next_pi05_segment_batch(), b._get_next_pi05_segment_batch()
    assert [r.request_id for _, r in ai] == [r.request_id for _, r in bi]
    assert [a._pi05_arrivals[id(r)] for _, r in ai] == [
        b._pi05_arrivals[id(r)] for _, r in bi
    ]
    bad = Scheduler([(Request("changed"), 1.0)], rank=1)
    bad.server_args.tp_size = 2
    with pytest.raises(RuntimeError, match="differs"):
        bad._get_next_pi05_segment_batch()


def test_retire_refill_and_only_return_completed_actions():
    a, b = Request("a", 3), Request("b", 5)
    scheduler = Scheduler([(a, 1.0), (b, 2.0)])
    items = scheduler._get_next_pi05_segment_batch()

    def dispatch(items):
        outputs = []
        for _, req in items:
            state = req.extra["vla"]
            flow = state.setdefault(
                "pi05_flow",
                SimpleNamespace(
                    num_steps=req.num_inference_steps,
                    steps_done=0,
                    remaining=req.num_inference_steps,
                ),
            )
            flow.steps_done += state["pi05_segment_length"]
            flow.remaining = flow.num_steps - flow.steps_done
            outputs.append(
                module.OutputBatch(output=[None if flow.remaining else "actions"])
            )
        return outputs

    scheduler._dispatch_items = dispatch
    completed = scheduler._run_pi05_segment(items)
    assert [r.request_id for (_, r), _ in completed] == ["a"]
    assert completed[0][1].output == ["actions"]
    assert "pi05_flow" not in a.extra["vla"]
    assert b.extra["vla"]["pi05_flow"].remaining == 2
    assert scheduler._pi05_arrivals[id(b)][0] == 2.0
    assert scheduler.waiting_queue[0][2] == 10.0
    c = Request("c", 4)
    scheduler.waiting_queue.append((b"client", c, 9.0))
    completed = scheduler._run_pi05_segment(scheduler._get_next_pi05_segment_batch())
    assert [r.request_id for (_, r), _ in completed] == ["b"]
    assert c.extra["vla"]["pi05_flow"].remaining == 2
    assert id(a) not in scheduler._pi05_arrivals
    assert id(b) not in scheduler._pi05_arrivals


def test_segment_batch_metrics_exclude_control_requests():
    """Opt-in scheduling must not bypass the normal dispatch observability."""
    a, b = Request("a", 3), Request("b", 5)
    scheduler = Scheduler([(a, 1.0), (b, 2.0), (object(), 3.0)])
    registry = CollectorRegistry()
    scheduler.metrics = DiffusionMetrics(
        role="monolithic", replica="0", registry=registry
    )
    scheduler._get_next_pi05_segment_batch()
    scheduler._get_next_pi05_segment_batch()
    window = scheduler._batch_metrics_window
    assert window.dispatches == window.merged_dispatches == 1
    assert window.total_requests == window.total_outputs == 2
    assert window.wait_times_ms == [9000.0]
    labels = {
        "role": "monolithic",
        "replica": "0",
        "stop_reason": "completion_boundary",
    }
    assert (
        registry.get_sample_value(
            "sglang:diffusion_generation_batch_size_count", labels
        )
        == 1
    )
    assert (
        registry.get_sample_value("sglang:diffusion_generation_batch_size_sum", labels)
        == 2
    )


@pytest.mark.parametrize(
    "failure", ["exception", "missing_output", "missing_state", "changed_budget"]
)
def test_error_terminates_request_and_releases_state(failure):
    req = Request("a", 3)
    scheduler = Scheduler([(req, 1.0)])
    items = scheduler._get_next_pi05_segment_batch()

    def dispatch(items):
        if failure == "exception":
            raise RuntimeError("device failed")
        if failure == "missing_output":
            return []
        if failure == "changed_budget":
            req.extra["vla"]["pi05_flow"] = SimpleNamespace(
                num_steps=4, steps_done=3, remaining=1
            )
        return [module.OutputBatch(output=[None])]

    scheduler._dispatch_items = dispatch
    completed = scheduler._run_pi05_segment(items)
    assert len(completed) == 1 and completed[0][1].error
    assert not scheduler.waiting_queue
    assert "pi05_flow" not in req.extra["vla"]
    assert "pi05_segment_length" not in req.extra["vla"]
    assert not scheduler._pi05_arrivals


def test_other_pipeline_is_disabled():
    scheduler = Scheduler([])
    scheduler.server_args.pipeline_config = SimpleNamespace()
    assert scheduler._pi05_segments_enabled() is False


def test_sampling_signature_changes_only_for_opted_in_pi05_requests():
    from dataclasses import dataclass

    from sglang.multimodal_gen.runtime.managers.scheduler import (
        Scheduler as ProductionScheduler,
    )

    @dataclass
    class Params:
        num_inference_steps: int
        action_horizon: int = 50

    scheduler = ProductionScheduler.__new__(ProductionScheduler)
    cfg = Pi05PipelineConfig(enable_segmented_actions=False)
    scheduler.server_args = SimpleNamespace(pipeline_config=cfg)
    a, b = Request("a", 3), Request("b", 5)
    a.sampling_params, b.sampling_params = Params(3), Params(5)
    signature = scheduler._sampling_param_signature_items
    assert signature(a) != signature(b)
    cfg.enable_segmented_actions = True
    assert signature(a) == signature(b)
    b.sampling_params.action_horizon = 25
    assert signature(a) != signature(b)
    a.is_warmup = True
    assert ("num_inference_steps", 3) in signature(a)


def test_disabled_scheduler_keeps_original_dispatch():
    from sglang.multimodal_gen.runtime.managers.scheduler import (
        Scheduler as ProductionScheduler,
    )

    scheduler = ProductionScheduler.__new__(ProductionScheduler)
    scheduler.server_args = SimpleNamespace(
        pipeline_config=SimpleNamespace(enable_segmented_actions=False)
    )
    req = Request("native")
    scheduler.waiting_queue = deque([(b"client", req, 1.0)])
    scheduler._dynamic_batching_enabled = lambda: False
    scheduler._record_batch_dispatch_metrics = lambda **kwargs: None
    assert scheduler.get_next_batch_to_run() == [(b"client", req)]
    assert not scheduler.waiting_queue


@pytest.mark.parametrize(
    "field,value",
    [
        ("realtime_session_id", "session"),
        ("session", object()),
        ("num_outputs_per_prompt", 2),
    ],
)
def test_unsupported_stateful_or_multioutput_requests_use_ordinary_path(field, value):
    scheduler = Scheduler([])
    req = Request("a")
    setattr(req, field, value)
    assert scheduler._is_pi05_segment_request(req) is False


def test_real_action_requests_can_reach_dynamic_batch_admission(monkeypatch):
    from sglang.multimodal_gen.configs.pipeline_configs.pi05 import Pi05PipelineConfig
    from sglang.multimodal_gen.configs.sample.pi05 import Pi05SamplingParams
    from sglang.multimodal_gen.runtime.managers.scheduler import (
        Scheduler as ProductionScheduler,
    )
    from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import Req

    monkeypatch.setattr(module, "Req", Req)
    scheduler = ProductionScheduler.__new__(ProductionScheduler)
    config = Pi05PipelineConfig()
    scheduler.server_args = SimpleNamespace(pipeline_config=config)
    a = Req(sampling_params=Pi05SamplingParams(prompt="a", num_inference_steps=3))
    b = Req(sampling_params=Pi05SamplingParams(prompt="b", num_inference_steps=5))
    a.extra["vla"] = {}
    b.extra["vla"] = {}
    assert scheduler._can_dynamic_batch(a, a)
    assert not scheduler._can_dynamic_batch(a, b)
    config.enable_segmented_actions = True
    for req in (a, b):
        req._dynamic_batch_sig = None
    assert scheduler._can_dynamic_batch(a, b)
    assert scheduler._has_unbatchable_image_conditioning(a, b) is False
    a.image_path = "image.png"
    assert scheduler._has_unbatchable_image_conditioning(a, b) is True
