import types
from typing import List, Union

from sglang.srt.managers.schedule_batch import MultimodalProcessorOutput
from sglang.srt.models.sarashina2_vision import Sarashina2VisionForCausalLM
from sglang.srt.multimodal.processors.base_processor import (
    BaseMultimodalProcessor,
    MultimodalSpecialTokens,
)

# Sarashina2Vision's remote-code `_preprocess` takes a narrow kwarg set, while
# transformers' `preprocess` forwards its full one, so the extras have to be
# dropped.
_PREPROCESS_PARAMS = frozenset(
    {
        "do_resize",
        "resample",
        "do_rescale",
        "rescale_factor",
        "do_normalize",
        "image_mean",
        "image_std",
        "do_convert_rgb",
        "data_format",
        "input_data_format",
    }
)


def _install_preprocess_kwarg_filter(image_processor) -> None:
    """Drop the kwargs Sarashina2Vision's `_preprocess` cannot accept.

    Bound with `types.MethodType` rather than closing over `image_processor`, so
    that a preprocessing worker's `copy.deepcopy` rebinds `__self__` to its own
    clone instead of routing every thread back into this one.
    """
    unfiltered_preprocess = type(image_processor)._preprocess

    def _preprocess(self, *args, **kwargs):
        return unfiltered_preprocess(
            self,
            *args,
            **{k: v for k, v in kwargs.items() if k in _PREPROCESS_PARAMS},
        )

    image_processor._preprocess = types.MethodType(_preprocess, image_processor)


class Sarashina2VisionProcessor(BaseMultimodalProcessor):
    models = [Sarashina2VisionForCausalLM]

    def __init__(self, hf_config, server_args, _processor, *args, **kwargs):
        super().__init__(hf_config, server_args, _processor, *args, **kwargs)

        # Sarashina2Vision specific tokens (default is <|file|>)
        self.IMAGE_TOKEN = "<|file|>"
        self.IM_TOKEN_ID = getattr(hf_config, "image_token_index", 14)
        self.IM_START_ID = getattr(hf_config, "start_image_token_index", 102397)
        self.IM_END_ID = getattr(hf_config, "end_image_token_index", 102398)

        self.mm_tokens = MultimodalSpecialTokens(
            image_token=self.IMAGE_TOKEN,
            image_token_id=self.IM_TOKEN_ID,
        ).build(_processor)

        if hasattr(_processor, "image_processor") and hasattr(
            type(_processor.image_processor), "_preprocess"
        ):
            _install_preprocess_kwarg_filter(_processor.image_processor)

    async def process_mm_data_async(
        self,
        image_data: List[Union[str, bytes]],
        input_text,
        request_obj,
        *args,
        **kwargs,
    ):
        """Process image data for Sarashina2Vision model using standard SGLang pattern."""
        base_output = await self.load_mm_data(
            prompt=input_text,
            image_data=image_data,
            multimodal_tokens=self.mm_tokens,
        )

        mm_items, input_ids, ret = await self.process_and_combine_mm_data_async(
            base_output=base_output,
            mm_tokens=self.mm_tokens,
        )

        return MultimodalProcessorOutput(
            mm_items=mm_items,
            input_ids=input_ids.tolist(),
            im_token_id=self.mm_tokens.image_token_id,
            im_start_id=self.IM_START_ID,
            im_end_id=self.IM_END_ID,
        )
