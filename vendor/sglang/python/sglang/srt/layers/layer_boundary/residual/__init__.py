# Copyright 2023-2024 SGLang Team
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""How a stage writes its output into the residual (its update) and how a
stage reads its input back from it (its read). The producer of a boundary
declares the update, the consumer the read; the boundary steps complete sums
and move tokens around the two."""

from typing import Callable, NamedTuple, Optional, Protocol, Tuple

import torch


class ResidualUpdate(Protocol):
    """Producer-owned operation writing a contribution into the residual.

    Fields:
        is_plain_add: Whether update is plain addition, permitting compatible
            add+norm fusion and adding the residual on one rank before a sum.
        applied_at_exit: Whether the producer writes the residual at its exit rather
            than leaving the operation for the next prepare.
        outlives_layer: Whether parameters/state remain valid after
            leaving the producer layer, including any offload or state reuse.
        writes_stream: Whether the producer computes the next stream itself
            and writes it at its exit, dropping the previous residual: what
            reaches its exit is already complete.
        quantized_sum: Whether the sum the contribution owes may be completed
            by a quantized all-reduce when quantized communication is enabled.
            This is a numerical policy, separate from being a plain add; full
            precision is always correct.

    An optional ``bind(forward_batch, context)`` returns an update owning this call's
    dynamic metadata. The stage binds it once before recording a contribution;
    every capability must match the declaration. Consumption releases the
    invocation update with its contribution.

    The shard conversion methods must move any update-associated state together
    with the residual. Nonlinear updates must not claim is_plain_add.
    """

    # None explicitly declares a stateless update. Bindings take (batch, context).
    bind: Optional[Callable] = None
    # An invocation may export its reusable producer declaration for graph replay.
    replay_update: Optional["ResidualUpdate"] = None

    # A plain add, which one rank may run before the sum it adds into
    # completes (the DP partial order, a residual that joins the attention
    # output's sum), and which a fused add + norm kernel may run.
    is_plain_add: bool
    # The stage writes its output into the residual itself at its end, instead
    # of leaving that to the next stage's read.
    applied_at_exit: bool
    # Its parameters and state remain valid after leaving the producer layer.
    # Stateful or offloaded implementations must not opt in without that guarantee.
    outlives_layer: bool
    # The producer builds the next stream itself and writes it at its exit, so
    # its exit has no sum left to complete and the previous residual is dropped.
    # Only an update applied at the exit can, and it is not a plain add.
    writes_stream: bool
    # The sum it owes may run as a quantized all-reduce.
    quantized_sum: bool

    def update(self, hidden_states, residual) -> torch.Tensor:
        """Write hidden_states, the producer contribution, into residual.

        Implementations define their residual representation and return the updated
        tensor. Boundary ordering may put a plain add before an eligible sum.
        This operation does not perform the consumer's normalization.
        """

    def slice_residual_attn_tp(self, residual) -> torch.Tensor:
        """This attention-TP rank's slice of the residual, with whatever the
        update reads along with it."""

    def gather_residual_attn_tp(self, residual) -> torch.Tensor:
        """The residual gathered from every attention-TP rank's slice."""


class ResidualReadout(Protocol):
    """Consumer-owned operation deriving compute input from the residual.

    Fields:
        is_plain_norm: Read is normalization/optional quantization without changing
            the residual, allowing compatible fused add+norm implementations.
        reads_before_dp_gather: Preserve this read on source rows before a DP gather.
        reads_after_attn_tp_gather: The read needs every row of the
            attention's, so it runs after any gather over attention TP: a
            producer that would leave its output on this rank's attention-TP
            slice returns it to the attention's rows instead. False lets it
            read that slice, its result gathered after it. Not derivable from
            the rows the stage computes on: a read on the slice followed by a
            gather and a read after the gather leave the same compute rows.
        completing_fusions: ReadoutFusion kernels that complete the sum the
            input owes with the residual add ahead of this read, tried before
            the boundary's own all-reduce or reduce-scatter. Empty when the
            read offers none: the boundary's own collective followed by
            update_and_read is correct for every read.
        gathering_reads: Callables ``(hidden_states, residual, norm)`` that
            read the input on this rank's attention-TP slice and gather it over
            attention TP, returning ``(input, residual)``, or None when they do
            not take the batch. Empty when the read offers none: it then runs
            on the slice and the boundary gathers what it read.

    init_residual initializes the stack residual. read consumes an
    already-written residual; update_and_read first applies the actual
    producer's update. Both reads return (compute_input, residual), preserving
    their kernel's rounding order rather than normalizing a separately rounded
    snapshot.
    """

    # bind(batch, context) may replace callback implementations, preserving the
    # order and capabilities of completing_fusions and the gathering_reads slots.
    # None explicitly declares a stateless consumer.
    bind: Optional[Callable] = None

    # The input is the residual's norm, in the quantization the call asks for,
    # and the residual is left as it is: what a fused add + norm kernel computes,
    # and what may run on the rows a sum completes onto.
    is_plain_norm: bool
    # Preserve the read on the source rows before a DP gather.
    reads_before_dp_gather: bool
    # The read needs every row of the attention's, not this rank's slice.
    reads_after_attn_tp_gather: bool
    # Kernels that complete the sum the input owes with the residual add
    # ahead of this read; empty when the read offers none.
    completing_fusions: Tuple
    # Reads that run on this rank's attention-TP slice and gather what they
    # read; empty when the read offers none.
    gathering_reads: Tuple

    def init_residual(self, hidden_states) -> torch.Tensor:
        """The residual the layer stack starts from, given its input."""

    def read(
        self,
        residual,
        norm,
        quant_format: str = "",
        post_residual_addition: Optional[torch.Tensor] = None,
    ) -> Tuple:
        """Read input from a residual that already includes the producer update.

        Args:
            residual: Updated residual tensor in this implementation's representation.
            norm: Consumer normalization module.
            quant_format: Requested input quantization format, or empty for the
                read's default format; supported values belong to the implementation.
            post_residual_addition: Kept for signature parity with update_and_read;
                current read implementations ignore or reject it.

        Returns:
            (compute_input, residual), potentially with a quantized input format.
        """

    def update_and_read(
        self,
        update: ResidualUpdate,
        hidden_states,
        residual,
        norm,
        quant_format: str = "",
        post_residual_addition: Optional[torch.Tensor] = None,
    ) -> Tuple:
        """Apply a producer update and read input while preserving kernel ordering.

        Args:
            update: Actual producer's ResidualUpdate, not a consumer-inferred operation.
            hidden_states: Producer contribution after required communication.
            residual: Previous residual, or None at entry where supported.
            norm: Consumer normalization module.
            quant_format: Requested input quantization format, as in read().
            post_residual_addition: Optional extra added after update, before norm.
                Each read documents where it applies, rejects or does not
                apply it. A stream that arrives already written is read with
                ``read``, which is not given it.

        Returns:
            (compute_input, residual). A fused implementation can preserve FP32
            accumulation through norm without materializing a rounded intermediate.
        """


def bind_read(read, forward_batch, context=None):
    """Bind a consumer invocation without changing its declared read capabilities."""
    if read.bind is None:
        return read
    bound = read.bind(forward_batch, context)
    for fact in (
        "is_plain_norm",
        "reads_before_dp_gather",
        "reads_after_attn_tp_gather",
    ):
        if getattr(bound, fact) != getattr(read, fact):
            raise ValueError("invocation read changed its declared capability")
    # Callback slots are selected when the edge is constructed. Binding
    # replaces their implementations, not their group or row capabilities.
    declared = read.completing_fusions
    actual = bound.completing_fusions
    if len(actual) != len(declared) or len(bound.gathering_reads) != len(
        read.gathering_reads
    ):
        raise ValueError("invocation read changed its declared callbacks")
    for spec, fused in zip(declared, actual):
        if (spec.completes, spec.scatters, spec.reads, spec.carried) != (
            fused.completes,
            fused.scatters,
            fused.reads,
            fused.carried,
        ) or (spec.accepts_update is None) != (fused.accepts_update is None):
            raise ValueError("invocation read changed its declared callbacks")
    return bound


def bind_update(update, forward_batch, context=None):
    """Bind optional per-invocation producer state before recording output.

    ``bind(batch, context)`` must preserve every declared update capability and return
    an update owning its invocation context with ``bind = None``. Stateless updates
    are unchanged.
    """
    if update.bind is None:
        return update
    actual = update.bind(forward_batch, context)
    for fact in (
        "is_plain_add",
        "applied_at_exit",
        "outlives_layer",
        "writes_stream",
        "quantized_sum",
    ):
        if getattr(actual, fact) != getattr(update, fact):
            raise ValueError("invocation update changed a declared capability")
    if actual.bind is not None:
        raise ValueError("invocation update must have bind = None")
    return actual


def takes_pending_update(read, update):
    """Whether a final read explicitly accepts this producer's update."""
    return isinstance(read, PendingUpdateRead) and read.accepts_pending_update(update)


class PendingUpdateRead:
    """Explicit consumer interface for a terminal pending producer update."""

    def accepts_pending_update(self, update: ResidualUpdate) -> bool:
        raise NotImplementedError


class FinalRead(Protocol):
    """The model's read of the layer stack's output, its final norm.

    Called with the output alone on a stream its producer already wrote, else
    with the output and the residual, returning ``(normed, residual)``: the
    residual add followed by the norm, so a pending update must be a plain add.

    A ResidualReadout can instead explicitly supply
    ``accepts_pending_update(update)`` and consume the pending producer update
    through residual_batch.read_output(output, batch, read, norm). Construction
    checks the declared update; execution checks the actual invocation. This
    does not change the ordinary two-input final norm contract.

    Optional, each read where it is used with the default given:
        attn_tp_gather: Its own gather over attention TP of rows the stack's
            last stage leaves on this rank's attention-TP slice, returning
            None when it does not take the batch. Without it the boundary's
            gather runs, which is always correct.
        reads_attn_tp_slices: It reads this rank's attention-TP slice of the
            rows and gathers what it read itself, so the stack's last FFN
            leaves its output on that slice. False by default: the last FFN
            returns its output on the attention's rows, which any final read
            takes.
        gemma_weight: The gamma a deferred MoE finalize normalizes with, when
            the model's final norm takes that handoff.
    """

    def __call__(self, hidden_states, residual=None, **read_kwargs):
        """The final norm of ``hidden_states``, after adding ``residual``."""


class LayerResidualOps(NamedTuple):
    """The reads and updates a decoder layer declares for its attention and
    its FFN."""

    attn_readout: ResidualReadout
    attn_update: ResidualUpdate
    ffn_readout: ResidualReadout
    ffn_update: ResidualUpdate
