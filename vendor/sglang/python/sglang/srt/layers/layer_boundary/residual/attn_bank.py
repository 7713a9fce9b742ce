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
"""A residual read that aggregates a bank of snapshots of itself."""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from sglang.srt.layers.attn_residual import AttnResidual
from sglang.srt.layers.layer_boundary import ops
from sglang.srt.layers.layer_boundary.contracts import ReadoutFusion
from sglang.srt.layers.layer_boundary.facts import residual_facts
from sglang.srt.layers.layer_boundary.layout import SumGroup
from sglang.srt.layers.layer_boundary.residual import LayerResidualOps
from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
from sglang.srt.runtime_context import get_parallel


class AttnBank:
    """The snapshot bank of one layer-stack invocation.

    Every layer's reads aggregate the same bank, so the bank outlives a layer
    while the reads that consume it are per-layer. The stack's entry opens one
    and the layers reach it through this holder; a pipeline rank that did not
    open the stack inherits the rows the previous rank banked.
    """

    __slots__ = ("current",)

    def __init__(self):
        self.current = None

    def open(self, hidden_states, block_num, inherited=None) -> AttnResidual:
        self.current = AttnResidual(hidden_states, block_num, inherited)
        return self.current

    def close(self) -> None:
        self.current = None

    def require(self) -> AttnResidual:
        if self.current is None:
            raise RuntimeError("open the attention-residual bank before a stage")
        return self.current


def _bank_rows(bank: AttnResidual, hidden_states) -> Optional[slice]:
    """The bank rows that go with ``hidden_states``: all of them, or this
    rank's contiguous attention-TP shard of them, the rows a reduce-scatter
    over attention TP leaves it."""
    total, rows = bank.block_residual.shape[0], hidden_states.shape[0]
    if rows == total:
        return None
    parallel = get_parallel()
    if rows * parallel.attn_tp_size != total:
        raise RuntimeError(
            f"{rows} rows are neither the bank's {total} rows nor an "
            f"attention-TP shard of them over {parallel.attn_tp_size} ranks"
        )
    rank = parallel.attn_tp_rank
    return slice(rank * rows, (rank + 1) * rows)


@dataclass
class AttnBankState:
    """One layer's pair of reads into the bank an `AttnBank` holds.

    A read aggregates the banked snapshots with the running residual and
    normalizes the result; the update that precedes it is an ordinary add, so
    both stages declare `PLAIN_ADD` and each read folds the pending add into
    its aggregation kernel. A read on this rank's attention-TP shard of the
    rows aggregates the matching shard of the bank. A write layer also
    snapshots the residual it just formed into the bank's next row, where it
    now lives: the running residual restarts empty, and the next contribution
    alone is the new head."""

    bank: AttnBank
    attn_score_proj: torch.nn.Module
    attn_score_norm: torch.nn.Module
    ffn_score_proj: torch.nn.Module
    ffn_score_norm: torch.nn.Module
    writes_block: bool = False
    # Kernels that complete the attention output's sum with the pending add
    # ahead of the FFN read.
    ffn_input_fusions: Tuple[ReadoutFusion, ...] = ()
    # A read on this rank's attention-TP slice first tries the bank's kernels
    # that also run the collective around it.
    fuses_slice_collectives: bool = False
    # The bank stays on each rank's attention-TP slice across layers;
    # otherwise every rank writes every row and the attention reads them all.
    reads_slices: bool = False

    def _aggregate(
        self, contribution, residual, norm, *, score_proj, score_norm, write
    ):
        bank = self.bank.require()
        return bank.forward(
            contribution,
            residual,
            score_proj,
            score_norm,
            norm,
            rows=_bank_rows(bank, contribution),
            write=write,
        )

    def read_attn_input(self, residual, norm):
        # No pending add: the residual alone is the head (the stack's input,
        # or the residual of a stream that was written).
        return self._attn_aggregate(residual, None, norm)

    def update_and_read_attn_input(self, contribution, residual, norm):
        return self._attn_aggregate(contribution, residual, norm)

    def _attn_aggregate(self, contribution, residual, norm):
        normed, residual = self._aggregate(
            contribution,
            residual,
            norm,
            score_proj=self.attn_score_proj,
            score_norm=self.attn_score_norm,
            write=self.writes_block,
        )
        return normed, None if self.writes_block else residual

    def update_and_read_ffn_input(self, contribution, residual, norm):
        return self._aggregate(
            contribution,
            residual,
            norm,
            score_proj=self.ffn_score_proj,
            score_norm=self.ffn_score_norm,
            write=False,
        )

    def reduce_scatter_and_read_ffn_input(
        self, hidden_states, residual, forward_batch, norm
    ):
        parallel = get_parallel()
        rows, rest = divmod(hidden_states.shape[0], parallel.attn_tp_size)
        if rows == 0 or rest:
            return None
        start = parallel.attn_tp_rank * rows
        return self.bank.require().forward_sp_reduce_scatter(
            hidden_states,
            residual,
            self.ffn_score_proj,
            self.ffn_score_norm,
            norm,
            rows=slice(start, start + rows),
        )

    def read_and_gather_attn_input(self, contribution, residual, norm):
        bank = self.bank.require()
        rows = _bank_rows(bank, contribution)
        if rows is None:
            return None
        read = bank.forward_sp_all_gather(
            contribution,
            residual,
            self.attn_score_proj,
            self.attn_score_norm,
            norm,
            rows=rows,
            write=self.writes_block,
        )
        if read is None:
            return None
        normed, residual = read
        return normed, None if self.writes_block else residual

    def residual_ops(self) -> LayerResidualOps:
        return LayerResidualOps(
            attn_readout=_AttnReadout(self),
            attn_update=PLAIN_ADD,
            ffn_readout=_FfnReadout(self),
            ffn_update=PLAIN_ADD,
        )

    @classmethod
    def facts(cls, *, reads_slices: bool = False) -> LayerResidualOps:
        """What residual_ops() declares (see facts_of) for a layer whose bank
        stays on each rank's attention-TP slice when ``reads_slices``. It does
        not depend on the bank or the layer's modules, so the stages of a
        layer that is not built declare it too."""
        state = cls(
            bank=None,
            attn_score_proj=None,
            attn_score_norm=None,
            ffn_score_proj=None,
            ffn_score_norm=None,
            reads_slices=reads_slices,
        )
        return residual_facts(state.residual_ops())


class _BankReadout:
    """A read that mixes the banked snapshots into the residual's norm, so it
    is not the residual's plain norm and no add+norm kernel may claim it. It
    reads this rank's own rows, which the bank holds, before any DP gather."""

    bind = None

    is_plain_norm = False
    reads_before_dp_gather = True
    completing_fusions = ()
    gathering_reads = ()

    def __init__(self, state: AttnBankState):
        self.state = state

    def init_residual(self, hidden_states):
        return hidden_states

    def _reject(self, update, quant_format):
        if quant_format:
            raise NotImplementedError(
                f"an attention-residual bank read in {quant_format=}"
            )
        if update is not None and not update.is_plain_add:
            # The read folds the pending add into its aggregation, which only
            # reproduces an ordinary add.
            raise NotImplementedError(
                f"an attention-residual bank read after {update=}"
            )


class _AttnReadout(_BankReadout):
    """The attention input: the bank aggregation and this layer's input norm.
    A write layer snapshots the residual this read forms. ``read`` rejects a
    ``post_residual_addition``; ``update_and_read`` does not apply one."""

    @property
    def reads_after_attn_tp_gather(self):
        return not self.state.reads_slices

    @property
    def gathering_reads(self):
        state = self.state
        return (
            (state.read_and_gather_attn_input,) if state.fuses_slice_collectives else ()
        )

    def read(self, residual, norm, quant_format="", post_residual_addition=None):
        self._reject(None, quant_format)
        if post_residual_addition is not None:
            raise NotImplementedError(
                "an attention-residual bank read with a separate addition"
            )
        return self.state.read_attn_input(residual, norm)

    def update_and_read(self, update, hidden_states, residual, norm, **kwargs):
        self._reject(update, kwargs.get("quant_format", ""))
        return self.state.update_and_read_attn_input(hidden_states, residual, norm)


class _FfnReadout(_BankReadout):
    """The FFN input: the attention output's add folded into the bank
    aggregation, and this layer's post-attention norm."""

    reads_after_attn_tp_gather = False

    @property
    def completing_fusions(self) -> Tuple[ReadoutFusion, ...]:
        state = self.state
        if not state.fuses_slice_collectives:
            return state.ffn_input_fusions
        reads = ReadoutFusion(
            SumGroup.ATTN_TP,
            state.reduce_scatter_and_read_ffn_input,
            scatters=True,
            reads=True,
        )
        return (reads, *state.ffn_input_fusions)

    def read(self, residual, norm, quant_format="", post_residual_addition=None):
        # The attention read of a write layer leaves the residual empty, so the
        # attention output alone is the head.
        self._reject(None, quant_format)
        return self.state.update_and_read_ffn_input(residual, None, norm)

    def update_and_read(self, update, hidden_states, residual, norm, **kwargs):
        self._reject(update, kwargs.get("quant_format", ""))
        return self.state.update_and_read_ffn_input(hidden_states, residual, norm)


class AttnBankOutputRead:
    """The layer stack's terminal read: the bank aggregation with the output
    side's scoring parameters, then the final norm. A callable final norm for
    `residual_batch.final_norm`.

    With ``reads_attn_tp_slices``, the stack may end on this rank's
    attention-TP slice of the rows: such a batch is read there, against the
    bank rows this rank wrote, and what it read is gathered: by the bank's
    kernel that does both when it takes the batch, else by ``attn_tp_gather``
    when that does, else over the attention-TP group. Otherwise the stack's
    last FFN brings its output to the attention's rows, in ``attn_tp_gather``
    when that takes the batch."""

    def __init__(
        self,
        bank: AttnBank,
        score_proj,
        score_norm,
        norm,
        attn_tp_gather=None,
        reads_attn_tp_slices=False,
    ):
        self.bank = bank
        self.score_proj = score_proj
        self.score_norm = score_norm
        self.norm = norm
        self.attn_tp_gather = attn_tp_gather
        self.reads_attn_tp_slices = reads_attn_tp_slices

    def __call__(self, hidden_states, residual=None):
        bank = self.bank.require()
        rows = _bank_rows(bank, hidden_states)
        read_args = (hidden_states, residual, self.score_proj, self.score_norm)
        read = (
            None
            if rows is None
            else bank.forward_sp_all_gather(*read_args, self.norm, rows=rows)
        )
        if read is None:
            read = bank.forward(*read_args, self.norm, rows=rows)
            if rows is not None:
                read = (self._gather(read[0]), read[1])
        normed, head = read
        return normed if residual is None else (normed, head)

    def _gather(self, normed):
        gathered = None if self.attn_tp_gather is None else self.attn_tp_gather(normed)
        # The output outlives the layer stack.
        return ops.attn_tp_gather(normed, owned=True) if gathered is None else gathered
