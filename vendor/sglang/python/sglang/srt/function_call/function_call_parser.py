import inspect
import logging
from typing import Dict, List, Literal, Optional, Set, Tuple, Type, Union

from sglang.srt.entrypoints.openai.protocol import (
    LegacyStructuralTagResponseFormat,
    StructuralTagResponseFormat,
    StructuresResponseFormat,
    Tool,
    ToolCallConstraint,
    ToolChoice,
)
from sglang.srt.environ import ToolStrictLevel, envs
from sglang.srt.function_call.apertus2509_detector import Apertus2509Detector
from sglang.srt.function_call.base_format_detector import BaseFormatDetector
from sglang.srt.function_call.beam_detector import BeamDetector
from sglang.srt.function_call.cohere_command4_detector import CohereCommand4Detector
from sglang.srt.function_call.core_types import ToolCallItem
from sglang.srt.function_call.deepseekv3_detector import DeepSeekV3Detector
from sglang.srt.function_call.deepseekv4_detector import DeepSeekV4Detector
from sglang.srt.function_call.deepseekv31_detector import DeepSeekV31Detector
from sglang.srt.function_call.deepseekv32_detector import DeepSeekV32Detector
from sglang.srt.function_call.deepseekv41_detector import DeepSeekV41Detector
from sglang.srt.function_call.dots_detector import DotsToolDetector
from sglang.srt.function_call.gemma4_detector import Gemma4Detector
from sglang.srt.function_call.gigachat3_detector import GigaChat3Detector
from sglang.srt.function_call.gigachat35_detector import GigaChat35Detector
from sglang.srt.function_call.glm4_moe_detector import (
    Glm4MoeDetector,
    GlmSpecialTokenConfig,
    generate_glm_grammar,
)
from sglang.srt.function_call.glm47_moe_detector import Glm47MoeDetector
from sglang.srt.function_call.gpt_oss_detector import GptOssDetector
from sglang.srt.function_call.hermes_detector import HermesDetector
from sglang.srt.function_call.hunyuan_detector import HunyuanDetector
from sglang.srt.function_call.inkling_detector import InklingDetector
from sglang.srt.function_call.internlm_detector import InternlmDetector
from sglang.srt.function_call.iquest_q1_detector import IQuestQ1Detector
from sglang.srt.function_call.k2_v3_detector import K2V3Detector
from sglang.srt.function_call.kimik2_detector import KimiK2Detector
from sglang.srt.function_call.kimik3_detector import KimiK3Detector
from sglang.srt.function_call.lfm2_detector import Lfm2Detector
from sglang.srt.function_call.ling3_detector import Ling3Detector
from sglang.srt.function_call.llama32_detector import Llama32Detector
from sglang.srt.function_call.mimo_detector import MiMoDetector
from sglang.srt.function_call.minicpm5_detector import MiniCPM5Detector
from sglang.srt.function_call.minimax_m2 import MinimaxM2Detector
from sglang.srt.function_call.minimax_m3 import MinimaxM3Detector
from sglang.srt.function_call.mistral_detector import MistralDetector
from sglang.srt.function_call.muse_glimmer_detector import MuseGlimmerDetector
from sglang.srt.function_call.poolside_v1_detector import PoolsideV1Detector
from sglang.srt.function_call.pythonic_detector import PythonicDetector
from sglang.srt.function_call.qwen3_coder_detector import Qwen3CoderDetector
from sglang.srt.function_call.qwen25_detector import Qwen25Detector
from sglang.srt.function_call.spark25_detector import Spark25Detector
from sglang.srt.function_call.step3_detector import Step3Detector
from sglang.srt.function_call.trinity_detector import TrinityDetector
from sglang.srt.function_call.utils import (
    _get_tool_schema_defs,
    get_json_schema_constraint,
)
from sglang.srt.parser.response_template import ResponseTemplateToolDetector

logger = logging.getLogger(__name__)


class FunctionCallParser:
    """
    Parser for function/tool calls in model outputs.

    This class handles both streaming and non-streaming parsing of function calls using a detector.
    In streaming scenarios, each time new_text is received, it calls detector.parse_streaming_increment
    and returns the resulting normal_text and calls to the upper layer (or SSE).
    """

    ToolCallParserEnum: Dict[str, Type[BaseFormatDetector]] = {
        "apertus2509": Apertus2509Detector,
        "beam": BeamDetector,
        "cohere_command4": CohereCommand4Detector,
        "deepseekv3": DeepSeekV3Detector,
        "deepseekv31": DeepSeekV31Detector,
        "deepseekv32": DeepSeekV32Detector,
        "deepseekv4": DeepSeekV4Detector,
        "deepseekv41": DeepSeekV41Detector,
        "dots": DotsToolDetector,
        "glm": Glm4MoeDetector,
        "glm45": Glm4MoeDetector,
        "glm47": Glm47MoeDetector,
        "gpt-oss": GptOssDetector,
        "k2_horizon": K2V3Detector,
        "kimi_k2": KimiK2Detector,
        "kimi_k3": KimiK3Detector,
        "lfm2": Lfm2Detector,
        "ling3": Ling3Detector,
        "llama3": Llama32Detector,
        "mimo": MiMoDetector,
        "minicpm5": MiniCPM5Detector,
        "mistral": MistralDetector,
        "muse": MuseGlimmerDetector,
        "poolside_v1": PoolsideV1Detector,
        "pythonic": PythonicDetector,
        "qwen": Qwen25Detector,
        "qwen25": Qwen25Detector,
        "qwen3_coder": Qwen3CoderDetector,
        "spark25": Spark25Detector,
        "step3": Step3Detector,
        "step3p5": Qwen3CoderDetector,
        "minimax-m2": MinimaxM2Detector,
        "minimax-m3": MinimaxM3Detector,
        "nanbeige": Qwen3CoderDetector,
        "trinity": TrinityDetector,
        "interns1": InternlmDetector,
        "hermes": HermesDetector,
        "hunyuan": HunyuanDetector,
        "gigachat3": GigaChat3Detector,
        "gigachat35": GigaChat35Detector,
        "gemma4": Gemma4Detector,
        "inkling": InklingDetector,
        "iquest_q1": IQuestQ1Detector,
        "response_template": ResponseTemplateToolDetector,
    }

    def __init__(
        self,
        tools: List[Tool],
        tool_call_parser: str,
        tokenizer=None,
        tool_choice=None,
        prefix: str = "",
        constrained: bool = False,
    ):
        self.tools = tools
        self.tool_strict_level = envs.SGLANG_TOOL_STRICT_LEVEL.get()
        detector_class = self.ToolCallParserEnum.get(tool_call_parser)
        if detector_class:
            kwargs = {}
            if tokenizer is not None:
                sig = inspect.signature(detector_class)
                if "tokenizer" in sig.parameters:
                    kwargs["tokenizer"] = tokenizer
            if issubclass(detector_class, ResponseTemplateToolDetector):
                if prefix:
                    kwargs["prefix"] = prefix
                kwargs["constrained"] = constrained
                # Forced calls are parsed in the format of the tag for these tools.
                kwargs["tools"] = self.structural_tag_tools()
            detector = detector_class(**kwargs)
        else:
            raise ValueError(f"Unsupported tool_call_parser: {tool_call_parser}")

        if isinstance(detector, Glm47MoeDetector):
            detector.use_full_assistant_constraint = not any(
                tool.function.strict for tool in tools
            )
        if isinstance(tool_choice, dict):
            tool_choice = ToolChoice(function={"name": tool_choice["name"]})
        self._required_tool_parser = detector.get_required_tool_parser(tool_choice)
        self.detector = self._required_tool_parser or detector

    def owns_tool_format(self) -> bool:
        return (
            self._required_tool_parser is not None
            or self.detector.supports_structural_tag()
            or self.detector.parses_required_natively()
        )

    def has_tool_call(self, text: str) -> bool:
        """
        Check if the given text contains a tool call in the format supported by this parser.
        This delegates to the detector's implementation.

        Args:
            text: The text to check for tool calls

        Returns:
            True if the text contains a tool call, False otherwise
        """
        if not self.tools and not self.detector.parses_without_tools():
            return False
        return self.detector.has_tool_call(text)

    def parse_non_stream(
        self, full_text: str, *, preserve_incomplete: bool = False
    ) -> Tuple[str, list[ToolCallItem]]:
        """
        One-time parsing of the full text to extract tool calls.

        Args:
            full_text: The complete text to parse
            preserve_incomplete: Keep a call that a response-template parser
                recognized but the text cut off, as streaming does

        Returns:
            A tuple containing:
            - The remaining text after parsing that was not consumed by the detector (can be treated as normal text)
            - A list of tool calls parsed from the text
        """
        if not self.tools and not self.detector.parses_without_tools():
            return full_text, []
        if preserve_incomplete and isinstance(
            self.detector, ResponseTemplateToolDetector
        ):
            normal_text, streamed = self.parse_stream_chunk(full_text)
            end_text, end_calls = self.parse_stream_end()
            calls: dict[int, ToolCallItem] = {}
            for call in [*streamed, *end_calls]:
                if call.tool_index not in calls:
                    calls[call.tool_index] = call.model_copy()
                else:
                    merged = calls[call.tool_index]
                    merged.name = call.name or merged.name
                    merged.parameters += call.parameters
            return normal_text + end_text, list(calls.values())
        has_tool_call = self.detector.has_tool_call(full_text)
        parsed_result = self.detector.detect_and_parse(full_text, self.tools)
        tool_call_list = parsed_result.calls
        if tool_call_list or has_tool_call:
            return parsed_result.normal_text, tool_call_list
        else:
            return full_text, []

    def parse_stream_chunk(self, chunk_text: str) -> Tuple[str, list[ToolCallItem]]:
        """
        Streaming incremental parsing of chunks of text as they arrive.

        Args:
            chunk_text: The new chunk of text to parse

        Returns:
            A tuple containing:
            - The normal text that should be displayed to the user
            - A list of tool calls parsed from the chunk
        """
        if not self.tools and not self.detector.parses_without_tools():
            return chunk_text, []
        final_normal_text = ""
        final_calls = []

        sp_result = self.detector.parse_streaming_increment(chunk_text, self.tools)
        if sp_result.normal_text:
            final_normal_text = sp_result.normal_text
        if sp_result.calls:
            final_calls.extend(sp_result.calls)
            final_normal_text = sp_result.normal_text

        return final_normal_text, final_calls

    def parse_stream_end(self) -> Tuple[str, list[ToolCallItem]]:
        """Flush detector state once the stream ends.

        Text a detector held back waiting for a marker (which can no longer
        arrive) is released as normal text; see BaseFormatDetector.finish().
        """
        if not self.tools and not self.detector.parses_without_tools():
            return "", []
        sp_result = self.detector.finish(self.tools)
        return sp_result.normal_text, sp_result.calls

    def get_legacy_structural_tag(
        self, at_least_one: bool = False
    ) -> StructuralTagResponseFormat:
        """
        Generate a structural tag response format for all available tools.

        This creates the necessary structural tags that guide the model's output format.

        Args:
            at_least_one: If True, the grammar forces at least one tool call
                (no free text allowed). Used for required/named tool_choice.

        Raises:
            ValueError: If tools have conflicting $defs schemas.
        """
        # Validate $defs consistency before building structural tags
        _get_tool_schema_defs(self.tools)

        tool_structures: List[StructuresResponseFormat] = list()
        tool_trigger_set: Set[str] = set()

        get_structure_info = self.detector.structure_info()
        for tool in self.tools:
            function = tool.function
            name = function.name
            assert name is not None
            info = get_structure_info(name)

            # accept all if not strict, otherwise only accept the schema
            is_strict = (
                function.strict or self.tool_strict_level >= ToolStrictLevel.PARAMETER
            )
            schema = function.parameters if is_strict else {}

            tool_structures.append(
                StructuresResponseFormat(
                    begin=info.begin,
                    schema=schema or {},  # type: ignore
                    end=info.end,
                )
            )
            tool_trigger_set.add(info.trigger)

        # TODO(dark): move this into new structural tag format
        # This requires all grammar backend support the new format
        return LegacyStructuralTagResponseFormat(
            type="structural_tag",
            structures=tool_structures,
            triggers=list(tool_trigger_set),
            at_least_one=at_least_one,
        )

    def structural_tag_tools(self) -> List[Tool]:
        """The tools as structural tags constrain them: all strict at the
        PARAMETER strict level."""
        if self.tool_strict_level < ToolStrictLevel.PARAMETER or not self.tools:
            return self.tools
        return [
            tool.model_copy(
                update={"function": tool.function.model_copy(update={"strict": True})}
            )
            for tool in self.tools
        ]

    def get_structure_constraint(
        self,
        tool_choice: Union[ToolChoice, Literal["auto", "required"]],
        parallel_tool_calls: bool = True,
        thinking_mode: bool = False,
    ) -> Optional[ToolCallConstraint]:
        """
        Returns the appropriate structure constraint for tool calls based on the tool_choice.
        The constraint is used to guide the model's output format.

        Args:
            tool_choice: The tool choice setting from the request

        Returns:
            A tuple of (constraint_type, constraint_value) to be added to sampling parameters,
            or None if no constraint applies.
        """
        is_required = tool_choice == "required" or isinstance(tool_choice, ToolChoice)
        should_constrain_auto = tool_choice == "auto" and (
            any(tool.function.strict for tool in self.tools)
            or self.tool_strict_level >= ToolStrictLevel.FUNCTION
        )
        structural_tag_tools = self.structural_tag_tools()
        if isinstance(self.detector, ResponseTemplateToolDetector):
            structural_tag = self.detector.validate_structure_constraint_request(
                tool_choice,
                parallel_tool_calls,
                should_constrain_auto,
                tools=structural_tag_tools,
                thinking_mode=thinking_mode,
            )
            if structural_tag is not None:
                return ("structural_tag", structural_tag)
            should_constrain_auto = False

        try:
            if (
                isinstance(self.detector, Glm47MoeDetector)
                and self.detector.parses_required_natively()
            ):
                functions = (
                    [
                        tool.function
                        for tool in self.tools
                        if not isinstance(tool_choice, ToolChoice)
                        or tool.function.name == tool_choice.function.name
                    ]
                    if self.tools and tool_choice != "none"
                    else None
                )
                return (
                    "full_assistant_ebnf",
                    generate_glm_grammar(
                        enable_thinking=thinking_mode,
                        functions=functions,
                        special_tokens=GlmSpecialTokenConfig(),
                        chat_template_version="glm47",
                        accommodate_chat_template=True,
                        allow_multiple_assistant_turns=False,
                        required=is_required,
                        parallel_tool_calls=parallel_tool_calls,
                    ),
                )
            # Highest priority: model-native structural_tag when available.
            if tool_choice == "auto" and not should_constrain_auto:
                structural_tag = self.detector.get_auto_tool_call_structural_tag(
                    tools=self.tools,
                    thinking_mode=thinking_mode,
                    parallel_tool_calls=parallel_tool_calls,
                )
                if structural_tag is not None:
                    return ("structural_tag", structural_tag)

            if is_required or should_constrain_auto:
                structural_tag = self.detector.get_structural_tag(
                    tools=structural_tag_tools,
                    thinking_mode=thinking_mode,
                    tool_choice=tool_choice,
                    parallel_tool_calls=parallel_tool_calls,
                )
                if structural_tag is not None:
                    return ("structural_tag", structural_tag)

                # Fallback to legacy structural tag if model-native tag is not supported.
                if self.detector.supports_structural_tag():
                    # For "required"/named: always use structural_tag to preserve the
                    # model's native tool call format. Schema is only included when
                    # strict=True, per OpenAI protocol semantics.
                    # For "auto": only constrain when strict is enabled.
                    tag = self.get_legacy_structural_tag(at_least_one=is_required)
                    return ("structural_tag", tag)

            if (
                tool_choice == "required" or isinstance(tool_choice, ToolChoice)
            ) and not self.detector.parses_required_natively():
                required_parser = self.detector.get_required_tool_parser(tool_choice)
                if required_parser is not None:
                    return (
                        "json_schema",
                        required_parser.get_json_schema_constraint(
                            self.tools, tool_choice, parallel_tool_calls
                        ),
                    )
                json_schema = get_json_schema_constraint(
                    self.tools, tool_choice, parallel_tool_calls=parallel_tool_calls
                )
                return ("json_schema", json_schema)
        except Exception as e:
            logger.error(f"Error getting structure constraint: {e}")
            return None
