from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import (
    List,
    Tuple,
)

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.constants import MIS_DELIMITER_TOKEN_ID
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.io_struct import build_flat_top_logprobs_arrays
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.runtime_context import get_exec

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, frozen=True)
class SchedulerLogprobResultProcessor:
    model_config: ModelConfig

    def _process_input_token_logprobs(
        self, req: Req, input_token_logprobs: List
    ) -> None:
        """Process input token logprobs values and indices."""
        uses_scoring_positions = self._uses_scoring_positions(req)

        # Process logprob values - handle position-based scoring vs regular requests
        if uses_scoring_positions:
            # Position-based scoring: use all logprobs as-is
            req.logprob.input_token_logprobs_val = input_token_logprobs
        else:
            # Regular request: add None at start, remove last (sampling token)
            req.logprob.input_token_logprobs_val = [None] + input_token_logprobs[:-1]

        # Process logprob indices based on scoring type
        if uses_scoring_positions:
            # Position-based scores come from input_token_ids_logprobs, not input_token_logprobs.
            # But the shared pipeline requires input_token_logprobs_idx to be the same
            # length as input_token_logprobs_val (validated at line 816). We fill with
            # MIS_DELIMITER_TOKEN_ID as a dummy — score_request() ignores this field.
            position_count = len(self._scoring_positions(req))
            input_token_logprobs_idx = [MIS_DELIMITER_TOKEN_ID] * position_count
        else:
            # Regular request: include all tokens from logprob_start_len onwards
            input_token_logprobs_idx = req.origin_input_ids[req.logprob_start_len :]

        # Clip padded hash values from image tokens to prevent detokenization errors
        req.logprob.input_token_logprobs_idx = [
            x if x < self.model_config.vocab_size - 1 else 0
            for x in input_token_logprobs_idx
        ]

    def _process_input_top_logprobs(self, req: Req) -> None:
        """Process input top logprobs."""
        if req.logprob.top_logprobs_num <= 0:
            return

        uses_scoring_positions = self._uses_scoring_positions(req)

        # Initialize arrays - position-based scoring starts empty, others start with None
        req.logprob.input_top_logprobs_val = [] if uses_scoring_positions else [None]
        req.logprob.input_top_logprobs_idx = [] if uses_scoring_positions else [None]

        # Extend arrays with temp values
        for val, idx in zip(
            req.temp_input_top_logprobs_val,
            req.temp_input_top_logprobs_idx,
            strict=True,
        ):
            req.logprob.input_top_logprobs_val.extend(val)
            req.logprob.input_top_logprobs_idx.extend(idx)

        # Remove last token (sampling token) for non position-based scoring requests
        if not uses_scoring_positions:
            req.logprob.input_top_logprobs_val.pop()
            req.logprob.input_top_logprobs_idx.pop()

        # Clean up temp storage
        req.temp_input_top_logprobs_idx = None
        req.temp_input_top_logprobs_val = None

    def _flatten_input_top_logprobs(self, req: Req) -> None:
        """Replace the nested input top logprob rows with flat arrays for
        requests that opted into return_flat_raw_top_logprobs, so the batch
        output ships two ndarrays instead of num_positions * k python lists.
        """
        if req.logprob.top_logprobs_num <= 0:
            return
        try:
            (
                req.logprob.input_top_logprobs_val_flat,
                req.logprob.input_top_logprobs_idx_flat,
                req.logprob.input_top_logprobs_flat_null_prefix,
            ) = build_flat_top_logprobs_arrays(
                req.logprob.input_top_logprobs_val,
                req.logprob.input_top_logprobs_idx,
                req.logprob.top_logprobs_num,
            )
        except ValueError as e:
            # Unrepresentable rows (e.g. multi-item scoring): keep the nested
            # format, mirroring the tokenizer manager fallback.
            logger.warning(
                "Falling back to nested input top logprobs for rid=%s: %s",
                req.rid,
                e,
            )
            return
        req.logprob.input_top_logprobs_val = []
        req.logprob.input_top_logprobs_idx = []

    def _process_input_token_ids_logprobs(self, req: Req) -> None:
        """Process input token IDs logprobs."""
        if req.logprob.token_ids_logprob is None:
            return

        uses_scoring_positions = self._uses_scoring_positions(req)

        # Initialize arrays - position-based scoring starts empty, others start with None
        req.logprob.input_token_ids_logprobs_val = (
            [] if uses_scoring_positions else [None]
        )
        req.logprob.input_token_ids_logprobs_idx = (
            [] if uses_scoring_positions else [None]
        )

        # Process temp values - convert tensors to lists and extend arrays
        for val, idx in zip(
            req.temp_input_token_ids_logprobs_val,
            req.temp_input_token_ids_logprobs_idx,
            strict=True,
        ):
            val_list = val.tolist() if isinstance(val, torch.Tensor) else val
            req.logprob.input_token_ids_logprobs_val.extend(
                val_list if isinstance(val_list, list) else [val_list]
            )
            req.logprob.input_token_ids_logprobs_idx.extend(idx)

        # Remove last token (sampling token) for non position-based scoring requests
        if not uses_scoring_positions:
            req.logprob.input_token_ids_logprobs_val.pop()
            req.logprob.input_token_ids_logprobs_idx.pop()

        # Clean up temp storage
        req.temp_input_token_ids_logprobs_idx = None
        req.temp_input_token_ids_logprobs_val = None

    def _calculate_relevant_tokens_len(self, req: Req) -> int:
        """Calculate the expected length of logprob arrays based on whether position-based scoring is used.

        For position-based scoring (MIS delimiters or setwise anchors), only those
        positions have logprobs. For regular requests, all positions from
        logprob_start_len onwards have logprobs.
        """
        positions = self._scoring_positions(req)

        if positions is not None:
            return len(positions)
        else:
            return len(req.origin_input_ids[req.logprob_start_len :])

    def calculate_num_input_logprobs(
        self,
        req: Req,
        extend_input_len: int,
        extend_logprob_start_len: int,
    ) -> int:
        """Calculate the number of input logprobs based on whether position-based scoring is used.

        For position-based scoring (MIS delimiters or setwise anchors), only those
        positions have logprobs. For regular requests, all positions in the range
        have logprobs.
        """
        positions = self._scoring_positions(req)

        if positions is not None:
            # Count pre-computed scoring positions within the extend range
            return sum(
                1
                for idx in positions
                if extend_logprob_start_len <= idx < extend_input_len
            )
        else:
            # Regular request: all tokens in the range
            return extend_input_len - extend_logprob_start_len

    def _scoring_positions(self, req: Req):
        """Position-based scoring readout indices for a prefill-only request, else None.

        Both MIS (delimiter positions, --enable-mis) and setwise scoring
        (token_indices_to_pool, per-anchor readout) compute label-token logprobs
        at a fixed set of positions instead of at every input token; the logprob
        bookkeeping below is identical for the two.
        """
        if not req.is_prefill_only:
            return None
        # Setwise anchors take precedence over MIS delimiters: a fused setwise
        # request carries both, and its logprobs are read at the anchors.
        if req.token_indices_to_pool is not None:
            return req.token_indices_to_pool
        if (
            get_exec().features.enable_mis
            and req.multi_item_delimiter_indices is not None
        ):
            return req.multi_item_delimiter_indices
        return None

    def _uses_scoring_positions(self, req: Req) -> bool:
        """Whether the request uses position-based scoring (MIS or setwise).

        In this mode only the scoring positions receive logprobs, so the shared
        logprob pipeline skips the None prefix and last-token pop.
        """
        return self._scoring_positions(req) is not None

    def add_input_logprob_return_values(
        self,
        i: int,
        req: Req,
        output: LogitsProcessorOutput,
        logprob_pt: int,
        num_input_logprobs: int,
        last_prefill_chunk: bool,  # If True, it means prefill is finished.
    ):
        """Incrementally add input logprobs to `req`.

        Args:
            i: The request index in a batch.
            req: The request. Input logprobs inside req are modified as a
                consequence of the API
            logprob_pt: Pointer into the prefill ids processed.
            output: Logit processor output that's used to compute input logprobs
            last_prefill_chunk: True if it is the last prefill (when chunked).
                Some of input logprob operation should only happen at the last
                prefill (e.g., computing input token logprobs).
        """
        assert output.input_token_logprobs is not None
        if req.input_token_logprobs is None:
            req.input_token_logprobs = []
        if req.temp_input_top_logprobs_val is None:
            req.temp_input_top_logprobs_val = []
        if req.temp_input_top_logprobs_idx is None:
            req.temp_input_top_logprobs_idx = []
        if req.temp_input_token_ids_logprobs_val is None:
            req.temp_input_token_ids_logprobs_val = []
        if req.temp_input_token_ids_logprobs_idx is None:
            req.temp_input_token_ids_logprobs_idx = []

        if req.logprob.input_token_logprobs_val is not None:
            # The input logprob has been already computed. It only happens
            # upon retract.
            if req.logprob.top_logprobs_num > 0:
                assert req.logprob.input_token_logprobs_val is not None
            return

        # Important for the performance.
        assert isinstance(output.input_token_logprobs, tuple)
        input_token_logprobs: Tuple[int] = output.input_token_logprobs
        input_token_logprobs = input_token_logprobs[
            logprob_pt : logprob_pt + num_input_logprobs
        ]
        req.input_token_logprobs.extend(input_token_logprobs)

        if req.logprob.top_logprobs_num > 0:
            req.temp_input_top_logprobs_val.append(output.input_top_logprobs_val[i])
            req.temp_input_top_logprobs_idx.append(output.input_top_logprobs_idx[i])

        if req.logprob.token_ids_logprob is not None:
            req.temp_input_token_ids_logprobs_val.append(
                output.input_token_ids_logprobs_val[i]
            )
            req.temp_input_token_ids_logprobs_idx.append(
                output.input_token_ids_logprobs_idx[i]
            )

        if last_prefill_chunk:
            input_token_logprobs = req.input_token_logprobs
            req.input_token_logprobs = None
            assert req.logprob.input_token_logprobs_val is None
            assert req.logprob.input_token_logprobs_idx is None
            assert req.logprob.input_top_logprobs_val is None
            assert req.logprob.input_top_logprobs_idx is None

            # Process all input logprob types using helper functions
            self._process_input_token_logprobs(req, input_token_logprobs)
            self._process_input_top_logprobs(req)

            self._process_input_token_ids_logprobs(req)

            if req.return_logprob:
                relevant_tokens_len = self._calculate_relevant_tokens_len(req)
                assert len(req.logprob.input_token_logprobs_val) == relevant_tokens_len
                assert len(req.logprob.input_token_logprobs_idx) == relevant_tokens_len
                if req.logprob.top_logprobs_num > 0:
                    assert (
                        len(req.logprob.input_top_logprobs_val) == relevant_tokens_len
                    )
                    assert (
                        len(req.logprob.input_top_logprobs_idx) == relevant_tokens_len
                    )
                if req.logprob.token_ids_logprob is not None:
                    assert (
                        len(req.logprob.input_token_ids_logprobs_val)
                        == relevant_tokens_len
                    )
                    assert (
                        len(req.logprob.input_token_ids_logprobs_idx)
                        == relevant_tokens_len
                    )

            # After the length checks: the flat arrays replace the nested rows.
            if req.return_flat_raw_top_logprobs:
                self._flatten_input_top_logprobs(req)

    def add_logprob_return_values(
        self,
        i: int,
        req: Req,
        pt: int,
        next_token_ids: List[int],
        num_input_logprobs: int,
        output: LogitsProcessorOutput,
    ):
        """Attach logprobs to the return values."""
        if output.next_token_logprobs is not None:
            req.logprob.output_token_logprobs_val.append(output.next_token_logprobs[i])
            req.logprob.output_token_logprobs_idx.append(next_token_ids[i])

        # Only add input logprobs if there are input tokens to process
        # Note: For prefill-only requests with default logprob_start_len, this will be 0,
        # meaning we only compute output logprobs (which is the intended behavior)
        if num_input_logprobs > 0:
            self.add_input_logprob_return_values(
                i,
                req,
                output,
                pt,
                num_input_logprobs,
                last_prefill_chunk=True,
            )
        else:
            self._initialize_empty_logprob_containers(req)

        if (
            req.logprob.top_logprobs_num > 0
            and output.next_token_top_logprobs_val is not None
        ):
            # Guarded like next_token_logprobs above: a backend may leave the
            # top-logprob fields unset even for a request that asked for them
            # (indexing None raises TypeError).
            req.logprob.output_top_logprobs_val.append(
                output.next_token_top_logprobs_val[i]
            )
            req.logprob.output_top_logprobs_idx.append(
                output.next_token_top_logprobs_idx[i]
            )

        if (
            req.logprob.token_ids_logprob is not None
            and output.next_token_token_ids_logprobs_val is not None
        ):
            # Convert GPU tensor to list if needed
            logprobs_val = output.next_token_token_ids_logprobs_val[i]
            if isinstance(logprobs_val, torch.Tensor):
                logprobs_val = logprobs_val.tolist()
            req.logprob.output_token_ids_logprobs_val.append(logprobs_val)
            req.logprob.output_token_ids_logprobs_idx.append(
                output.next_token_token_ids_logprobs_idx[i]
            )

        return num_input_logprobs

    def _initialize_empty_logprob_containers(self, req: Req) -> None:
        """
        Initialize logprob fields to empty lists if unset.

        This is needed for prefill-only requests where the normal initialization
        flow might be bypassed, but downstream code expects these fields to be lists.
        """
        if req.logprob.input_token_logprobs_val is None:
            req.logprob.input_token_logprobs_val = []
        if req.logprob.input_token_logprobs_idx is None:
            req.logprob.input_token_logprobs_idx = []
        if req.logprob.input_top_logprobs_val is None:
            req.logprob.input_top_logprobs_val = []
        if req.logprob.input_top_logprobs_idx is None:
            req.logprob.input_top_logprobs_idx = []
        if req.logprob.input_token_ids_logprobs_val is None:
            req.logprob.input_token_ids_logprobs_val = []
        if req.logprob.input_token_ids_logprobs_idx is None:
            req.logprob.input_token_ids_logprobs_idx = []
