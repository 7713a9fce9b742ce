import json
import logging
import re
from enum import Enum
from functools import lru_cache
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from sglang.srt.entrypoints.openai.protocol import Tool, ToolChoice
from sglang.srt.function_call.base_format_detector import (
    BaseFormatDetector,
    StructuralTag,
    get_model_structural_tag,
)
from sglang.srt.function_call.core_types import (
    StreamingParseResult,
    ToolCallItem,
    _GetInfoFunc,
)
from sglang.srt.function_call.utils import safe_literal_eval

logger = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _glm47_native_structural_tag_available() -> bool:
    # "glm_4_7" is only registered in newer xgrammar, so the import can succeed
    # while the model name stays unknown. Probe once and fall back if absent.
    if get_model_structural_tag is None:
        return False
    try:
        get_model_structural_tag(
            model="glm_4_7", tools=[], tool_choice="auto", reasoning=False
        )
        return True
    except Exception:
        return False


class StreamState(str, Enum):
    """State machine states for XML to JSON streaming conversion."""

    INIT = "INIT"
    BETWEEN = "BETWEEN"
    IN_KEY = "IN_KEY"
    WAITING_VALUE = "WAITING_VALUE"
    IN_VALUE = "IN_VALUE"


_UNSET = object()


def _json_type(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return "integer"
    return {
        type(None): "null",
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }[type(value)]


def _json_equal(left: Any, right: Any) -> bool:
    if _json_type(left) != _json_type(right):
        return False
    if isinstance(left, dict):
        return left.keys() == right.keys() and all(
            _json_equal(value, right[key]) for key, value in left.items()
        )
    if isinstance(left, list):
        return len(left) == len(right) and all(
            _json_equal(a, b) for a, b in zip(left, right)
        )
    return left == right


def _matches_discriminators(schema: Any, root: Any, arguments: Dict[str, Any]) -> bool:
    for name, value in arguments.items():
        types = _argument_types(schema, root, name, value=value)
        if types is not None and _json_type(value) not in types:
            return False
    return True


def _argument_types(
    schema: Any,
    root: Any,
    key: Optional[str] = None,
    seen: frozenset[int] = frozenset(),
    arguments: Optional[Dict[str, Any]] = None,
    value: Any = _UNSET,
) -> Optional[set[str]]:
    """Keep every possible type until the argument value disambiguates a union."""
    if not isinstance(schema, dict) or id(schema) in seen:
        return None
    seen = seen | {id(schema)}
    constraints = []
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        target = root
        try:
            for part in ref[2:].split("/") if ref != "#" else []:
                part = part.replace("~1", "/").replace("~0", "~")
                target = target[int(part)] if isinstance(target, list) else target[part]
            types = _argument_types(target, root, key, seen, arguments, value)
            if types is not None:
                constraints.append(types)
        except (KeyError, IndexError, TypeError, ValueError):
            pass
    if key is not None:
        field = schema.get("properties", {}).get(key)
        types = _argument_types(field, root, seen=seen, value=value)
        if types is not None:
            constraints.append(types)
    else:
        types = schema.get("type")
        if isinstance(types, str):
            constraints.append({types, "integer"} if types == "number" else {types})
        elif isinstance(types, list):
            constraints.append(
                set(types) | ({"integer"} if "number" in types else set())
            )
        values = [schema["const"]] if "const" in schema else schema.get("enum")
        if isinstance(values, list):
            constraints.append(
                {
                    _json_type(allowed)
                    for allowed in values
                    if value is _UNSET or _json_equal(value, allowed)
                }
            )
    for keyword in ("anyOf", "oneOf"):
        if isinstance(schema.get(keyword), list):
            alternatives = [
                _argument_types(branch, root, key, seen, arguments, value)
                for branch in schema[keyword]
                if key is None or _matches_discriminators(branch, root, arguments or {})
            ]
            if alternatives and all(types is not None for types in alternatives):
                constraints.append(set().union(*alternatives))
    if isinstance(schema.get("allOf"), list):
        for branch in schema["allOf"]:
            types = _argument_types(branch, root, key, seen, arguments, value)
            if types is not None:
                constraints.append(types)
    return set.intersection(*constraints) if constraints else None


def _get_argument_types(
    func_name, arg_key, defined_tools, arguments=None, value=_UNSET
):
    for tool in defined_tools:
        if tool.function.name == func_name:
            schema = tool.function.parameters
            return _argument_types(
                schema, schema, arg_key, arguments=arguments, value=value
            )
    return None


def get_argument_type(
    func_name: str,
    arg_key: str,
    defined_tools: List[Tool],
    arguments: Optional[Dict[str, Any]] = None,
) -> Optional[str]:
    types = _get_argument_types(func_name, arg_key, defined_tools, arguments)
    if types == {"number", "integer"}:
        return "number"
    return next(iter(types)) if types and len(types) == 1 else None


def _needs_argument_context(schema: Any) -> bool:
    keys, seen = set(), set()
    has_union = False

    def visit(node):
        nonlocal has_union
        if not isinstance(node, dict) or id(node) in seen:
            return
        seen.add(id(node))
        keys.update(node.get("properties", {}))
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            target = schema
            try:
                for part in ref[2:].split("/") if ref != "#" else []:
                    part = part.replace("~1", "/").replace("~0", "~")
                    target = (
                        target[int(part)] if isinstance(target, list) else target[part]
                    )
                visit(target)
            except (KeyError, IndexError, TypeError, ValueError):
                pass
        for keyword in ("anyOf", "oneOf", "allOf"):
            branches = node.get(keyword)
            if isinstance(branches, list):
                has_union |= keyword != "allOf"
                for branch in branches:
                    visit(branch)

    visit(schema)
    for key in keys if has_union else ():
        types = _argument_types(schema, schema, key)
        if types is None or len(types) > 1 and types != {"number", "integer"}:
            return True
    return False


def _convert_to_number(value: str) -> Any:
    """Convert string to appropriate number type (int or float).

    Args:
        value: String value to convert

    Returns:
        Converted number or original string if conversion fails
    """
    try:
        if "." in value or "e" in value.lower():
            return float(value)
        else:
            return int(value)
    except (ValueError, AttributeError):
        return value


def _convert_to_integer(value: str) -> Any:
    try:
        return int(value)
    except (ValueError, AttributeError):
        return value


def _coerce_numeric_string(value: Any, arg_type: Optional[str]) -> Any:
    # A quoted value must not become a type its schema forbids: "1.5" may coerce
    # for number but never for integer.
    if isinstance(value, str):
        if arg_type == "integer":
            return _convert_to_integer(value)
        if arg_type == "number":
            return _convert_to_number(value)
    return value


def parse_arguments(
    json_value: str, arg_type: Optional[str] = None
) -> Tuple[Any, bool]:
    """Parse argument value with multiple fallback strategies.

    Args:
        json_value: Raw string value to parse
        arg_type: Expected type hint ('string', 'number', 'object', etc.)

    Returns:
        Tuple of (parsed_value, is_valid_json)
    """
    # Strategy 1: Direct JSON parsing
    try:
        return _coerce_numeric_string(json.loads(json_value), arg_type), True
    except (json.JSONDecodeError, ValueError):
        pass

    # Strategy 2: Unescape and parse
    try:
        wrapped = json.loads('{"tmp": "' + json_value + '"}')
        return _coerce_numeric_string(json.loads(wrapped["tmp"]), arg_type), True
    except (json.JSONDecodeError, ValueError, KeyError):
        pass

    # Strategy 2.5: string-typed values that are not valid JSON (S1/S2 failed) —
    # strip the wrapping quotes and keep the raw bytes, backslashes included.
    # Avoids ast.literal_eval so invalid escapes neither warn nor get reinterpreted.
    if arg_type == "string":
        if (
            len(json_value) >= 2
            and json_value[0] == json_value[-1]
            and json_value[0] in {'"', "'"}
        ):
            return json_value[1:-1], True
        return json_value, True

    # Strategy 3: ast.literal_eval
    try:
        parsed_value = safe_literal_eval(json_value)
        return parsed_value, True
    except (ValueError, SyntaxError):
        pass

    # Strategy 4: Treat as string
    try:
        quoted_value = json.dumps(str(json_value))
        return json.loads(quoted_value), True
    except (json.JSONDecodeError, ValueError):
        return json_value, False


class Glm47MoeDetector(BaseFormatDetector):
    """
    Detector for GLM-4.7 and GLM-5 models.
    Assumes function call format:
      <tool_call>get_weather<arg_key>city</arg_key><arg_value>北京</arg_value><arg_key>date</arg_key><arg_value>2024-06-27</arg_value></tool_call><tool_call>get_weather<arg_key>city</arg_key><arg_value>上海</arg_value><arg_key>date</arg_key><arg_value>2024-06-27</arg_value></tool_call>
    """

    _STREAMING_PARTIAL_PATTERN = re.compile(
        r"<tool_call>(.*?)(?:(<arg_key.*?))?(?:(</tool_call>)|$)", re.DOTALL
    )
    _TOOL_CALL_END_PATTERN = re.compile(r"</tool_call>|$")

    def __init__(self):
        super().__init__()
        self.use_full_assistant_constraint = False
        self.bot_token = "<tool_call>"
        self.eot_token = "</tool_call>"
        self.func_call_regex = r"<tool_call>.*?</tool_call>"
        self.func_detail_regex = re.compile(
            r"<tool_call>(.*?)(<arg_key>.*?)?</tool_call>", re.DOTALL
        )
        self.func_arg_regex = re.compile(
            r"<arg_key>(.*?)</arg_key>(?:\\n|\s)*<arg_value>(.*?)</arg_value>",
            re.DOTALL,
        )
        self._last_arguments = ""
        self.current_tool_id = -1
        self.current_tool_name_sent = False
        self._streamed_raw_length = 0
        self._tool_call_completed = False  # Track if tool call has been completed
        self._sent_empty_object = (
            False  # Track if empty object has been sent for no-arg functions
        )
        self._open_call: Optional[tuple[str, int]] = None
        self._end_scan_pos = 0
        self._reset_streaming_state()

    def _reset_streaming_state(self) -> None:
        """Reset the streaming state machine for a new tool call."""
        self._stream_state = StreamState.INIT
        self._current_key = ""
        self._current_value = ""
        self._xml_tag_buffer = ""
        self._is_first_param = True
        self._value_started = False
        self._cached_value_type: Optional[str] = (
            None  # Cache the value type for consistency
        )
        self._tool_call_completed = False  # Reset tool call completion status
        self._sent_empty_object = False  # Reset empty object sent status
        self._buffer_arguments = None

    def has_tool_call(self, text: str) -> bool:
        """Check if the text contains a glm-4.5 / glm-4.6 format tool call."""
        return self.bot_token in text

    def detect_and_parse(self, text: str, tools: List[Tool]) -> StreamingParseResult:
        """
        One-time parsing: Detects and parses tool calls in the provided text.

        :param text: The complete text to parse.
        :param tools: List of available tools.
        :return: ParseResult indicating success or failure, consumed text, leftover text, and parsed calls.
        """
        if self.bot_token not in text:
            return StreamingParseResult(normal_text=text, calls=[])

        # Extract all normal text (before, between, and after tool calls)
        normal_text_parts = []
        last_end = 0

        # Find all tool call matches
        for match in re.finditer(self.func_call_regex, text, re.DOTALL):
            # Add text before this tool call
            if match.start() > last_end:
                normal_text_parts.append(text[last_end : match.start()])
            last_end = match.end()

        # Add any remaining text after the last tool call
        if last_end < len(text):
            normal_text_parts.append(text[last_end:])

        # Combine all normal text parts
        normal_text = "".join(normal_text_parts).strip()

        # Parse tool calls
        match_result_list = re.findall(self.func_call_regex, text, re.DOTALL)
        calls = []
        try:
            for match_result in match_result_list:
                # Get function name
                func_detail = self.func_detail_regex.search(match_result)
                if func_detail is None:
                    continue
                func_name = func_detail.group(1) if func_detail.group(1) else ""
                func_args = func_detail.group(2) if func_detail.group(2) else ""
                arguments = {}
                if func_args:
                    pairs = self.func_arg_regex.findall(func_args)
                    # Parse arguments using shared method
                    arguments = self._parse_argument_pairs(pairs, func_name, tools)

                # construct match_result for parse_base_json
                match_result = {"name": func_name, "parameters": arguments}
                calls.extend(self.parse_base_json(match_result, tools))
            return StreamingParseResult(normal_text=normal_text, calls=calls)
        except Exception as e:
            logger.error(f"Error in detect_and_parse: {e}", exc_info=True)
            # return the normal text if parsing fails
            return StreamingParseResult(normal_text=text)

    def _get_value_type(self, func_name: str, key: str, tools: List[Tool]) -> str:
        return get_argument_type(func_name, key, tools) or "auto"

    def _format_value_complete(self, value: str, value_type: str) -> str:
        """Format a value that completed in one chunk; number/integer/auto never
        reach here (they are parsed at value close instead)."""
        if value_type == "string":
            return json.dumps(value, ensure_ascii=False)
        # object/array/boolean values arrive as JSON already
        return value

    def _process_xml_to_json_streaming(
        self, raw_increment: str, func_name: str, tools: List[Tool]
    ) -> str:
        """Convert XML increment to JSON streaming output using state machine.

        This method processes XML fragments character by character and converts them
        to JSON format incrementally. It maintains state across calls to handle
        partial XML tags and values.

        Args:
            raw_increment: New XML content to process
            func_name: Name of the function being called
            tools: List of available tools for type inference

        Returns:
            JSON string increment to append to the output
        """
        json_output = ""

        for char in raw_increment:
            self._xml_tag_buffer += char

            if self._stream_state in [StreamState.INIT, StreamState.BETWEEN]:
                if self._xml_tag_buffer.endswith("<arg_key>"):
                    self._stream_state = StreamState.IN_KEY
                    self._current_key = ""
                    self._xml_tag_buffer = ""
                    json_output += "{" if self._is_first_param else ", "
                    self._is_first_param = False

            elif self._stream_state == StreamState.IN_KEY:
                if self._xml_tag_buffer.endswith("</arg_key>"):
                    self._current_key = self._xml_tag_buffer[:-10].strip()
                    self._xml_tag_buffer = ""
                    self._stream_state = StreamState.WAITING_VALUE
                    json_output += (
                        json.dumps(self._current_key, ensure_ascii=False) + ": "
                    )

            elif self._stream_state == StreamState.WAITING_VALUE:
                if self._xml_tag_buffer.endswith("<arg_value>"):
                    self._stream_state = StreamState.IN_VALUE
                    self._current_value = ""
                    self._xml_tag_buffer = ""
                    self._value_started = False
                    self._cached_value_type = self._get_value_type(
                        func_name, self._current_key, tools
                    )

            elif self._stream_state == StreamState.IN_VALUE:
                if self._xml_tag_buffer.endswith("</arg_value>"):
                    final_value = self._xml_tag_buffer[:-12]
                    self._current_value += final_value

                    value_type = self._cached_value_type or "string"
                    if value_type in ("auto", "number", "integer"):
                        parsed = self._parse_argument_pairs(
                            [(self._current_key, self._current_value)], func_name, tools
                        )[self._current_key]
                        json_output += json.dumps(parsed, ensure_ascii=False)
                    elif self._value_started:
                        if final_value:
                            if value_type == "string":
                                json_output += json.dumps(
                                    final_value, ensure_ascii=False
                                )[1:-1]
                            else:
                                json_output += final_value
                        if value_type == "string":
                            json_output += '"'
                    else:
                        # Value never started: empty, or completed in one chunk.
                        json_output += self._format_value_complete(
                            self._current_value, value_type
                        )

                    self._xml_tag_buffer = ""
                    self._stream_state = StreamState.BETWEEN
                    self._current_value = ""
                    self._value_started = False
                    self._cached_value_type = None
                else:
                    closing_tag = "</arg_value>"
                    is_potential_closing = len(self._xml_tag_buffer) <= len(
                        closing_tag
                    ) and closing_tag.startswith(self._xml_tag_buffer)

                    if not is_potential_closing:
                        content = self._xml_tag_buffer
                        value_type = self._cached_value_type or "string"

                        if value_type in ("auto", "number", "integer"):
                            self._current_value += content
                            self._xml_tag_buffer = ""
                        elif value_type == "string":
                            if not self._value_started:
                                json_output += '"'
                                self._value_started = True
                            if content:
                                json_output += json.dumps(content, ensure_ascii=False)[
                                    1:-1
                                ]
                                self._current_value += content
                                self._xml_tag_buffer = ""
                        else:
                            # object/array/boolean values stream through verbatim
                            if content:
                                if not self._value_started:
                                    self._value_started = True
                                json_output += content
                                self._current_value += content
                                self._xml_tag_buffer = ""

        return json_output

    def _extract_match_groups(self, match: re.Match) -> tuple[str, str, str]:
        """Extract function name, arguments and end marker from regex match.

        Args:
            match: Regex match object

        Returns:
            (func_name, func_args_raw, is_tool_end)
        """
        func_name = match.group(1).strip()
        func_args_raw = match.group(2).strip() if match.group(2) else ""
        is_tool_end = match.group(3) or ""
        return func_name, func_args_raw, is_tool_end

    def _match_tool_call(self, text: str) -> Optional[tuple[str, str, str, int]]:
        """Same as `_extract_match_groups` plus end() on the streaming pattern.

        Once an open call reaches its args, text only grows at the end, so the
        name and args start stay put and only the new tail needs scanning for
        the closer. Rescanning the whole buffer every chunk is O(n^2) for a
        long arg.
        """
        if self._open_call is None:
            match = self._STREAMING_PARTIAL_PATTERN.search(text)
            if match is None:
                return None
            if match.group(2) is None or match.group(3):
                return *self._extract_match_groups(match), match.end()
            self._open_call = match.group(1).strip(), match.start(2)
            self._end_scan_pos = match.start(2)
        func_name, args_start = self._open_call
        end = self._TOOL_CALL_END_PATTERN.search(text, self._end_scan_pos)
        if end.group():
            self._open_call = None
        else:
            self._end_scan_pos = max(args_start, len(text) - len(self.eot_token) + 1)
        return func_name, text[args_start : end.start()].strip(), end.group(), end.end()

    def _send_tool_name_if_needed(
        self, func_name: str, has_arg_key: bool, is_tool_end: str
    ) -> Optional[ToolCallItem]:
        """Send tool name if needed.

        Args:
            func_name: Function name
            has_arg_key: Whether current text contains <arg_key
            is_tool_end: Whether end marker is encountered

        Returns:
            Tool call item or None
        """
        if self.current_tool_name_sent:
            return None

        # Function name completeness check
        is_func_name_complete = has_arg_key or is_tool_end == self.eot_token

        if not is_func_name_complete:
            return None

        if not func_name:
            logger.warning("Empty function name detected, skipping tool call")
            return None

        # Send tool name
        self.current_tool_name_sent = True
        self._streamed_raw_length = 0
        self._reset_streaming_state()

        # Record tool info
        self.prev_tool_call_arr[self.current_tool_id] = {
            "name": func_name,
            "arguments": {},
        }

        return ToolCallItem(
            tool_index=self.current_tool_id,
            name=func_name,
            parameters="",
        )

    def _process_arguments_streaming(
        self, func_name: str, func_args_raw: str, tools: List[Tool]
    ) -> Optional[ToolCallItem]:
        """Process streaming arguments.

        Args:
            func_name: Function name
            func_args_raw: Raw argument string
            tools: List of available tools

        Returns:
            Tool call item with parameter updates or None
        """
        current_raw_length = len(func_args_raw)

        if self._buffer_arguments is None:
            self._buffer_arguments = any(
                tool.function.name == func_name
                and _needs_argument_context(tool.function.parameters)
                for tool in tools
            )
        if self._buffer_arguments:
            return None

        if current_raw_length <= self._streamed_raw_length:
            return None

        raw_increment = func_args_raw[self._streamed_raw_length :]

        json_increment = self._process_xml_to_json_streaming(
            raw_increment, func_name, tools
        )

        # CRITICAL: Update streamed length BEFORE early return
        # Even if json_increment is empty, the input has been consumed by the state machine
        self._streamed_raw_length = current_raw_length

        if not json_increment:
            return None

        self._last_arguments += json_increment
        self.streamed_args_for_tool[self.current_tool_id] += json_increment

        return ToolCallItem(
            tool_index=self.current_tool_id,
            name=None,
            parameters=json_increment,
        )

    def _finalize_tool_call(
        self,
        func_name: str,
        func_args_raw: str,
        tools: List[Tool],
        match_end_pos: int,
        current_text: str,
    ) -> List[ToolCallItem]:
        """Complete tool call processing.

        Args:
            func_name: Function name
            func_args_raw: Raw argument string
            tools: List of available tools
            match_end_pos: Match end position
            current_text: Current text

        Returns:
            List of tool call items to add
        """
        calls = []

        if self._buffer_arguments:
            arguments = self._parse_argument_pairs(
                self.func_arg_regex.findall(func_args_raw), func_name, tools
            )
            serialized = json.dumps(arguments, ensure_ascii=False)
            calls.append(
                ToolCallItem(
                    tool_index=self.current_tool_id, name=None, parameters=serialized
                )
            )
            self._last_arguments += serialized
            self.streamed_args_for_tool[self.current_tool_id] += serialized
            self._sent_empty_object = True

        # Handle no-arg function or need to close braces
        if self._is_first_param and not self._sent_empty_object:
            calls.append(
                ToolCallItem(
                    tool_index=self.current_tool_id,
                    name=None,
                    parameters="{}",
                )
            )
            self._last_arguments += "{}"
            self.streamed_args_for_tool[self.current_tool_id] += "{}"
            self._sent_empty_object = True
        elif not self._is_first_param and not self._sent_empty_object:
            # The streamed outer `{` is only closed here; a trailing "}" in
            # _last_arguments may belong to a nested object value.
            calls.append(
                ToolCallItem(
                    tool_index=self.current_tool_id,
                    name=None,
                    parameters="}",
                )
            )
            self._last_arguments += "}"
            self.streamed_args_for_tool[self.current_tool_id] += "}"
            self._sent_empty_object = True

        if func_args_raw:
            try:
                pairs = self.func_arg_regex.findall(func_args_raw)
                if pairs:
                    arguments = self._parse_argument_pairs(pairs, func_name, tools)
                    self.prev_tool_call_arr[self.current_tool_id]["arguments"] = (
                        arguments
                    )
            except Exception as e:
                logger.debug(f"Failed to parse arguments: {e}", exc_info=True)

        self._buffer = current_text[match_end_pos:]

        # Reset state for next tool call
        self._tool_call_completed = True
        self.current_tool_id += 1
        self._last_arguments = ""
        self.current_tool_name_sent = False
        self._streamed_raw_length = 0
        self._reset_streaming_state()

        return calls

    def parse_streaming_increment(
        self, new_text: str, tools: List[Tool]
    ) -> StreamingParseResult:
        """
        Streaming incremental parsing tool calls for GLM-4.5 and GLM-4.6 format.
        Uses a state machine to convert XML to JSON incrementally for true character-by-character streaming.
        Outputs JSON increments immediately as XML data arrives.
        """
        self._buffer += new_text
        current_text = self._buffer

        # Check if we have a tool call
        has_tool_call = self.bot_token in current_text

        if not has_tool_call:
            # Check if buffer could be the start of a tool call
            # Keep buffer if it could be a partial match of bot_token
            is_potential_start = any(
                self.bot_token.startswith(current_text[-i:])
                for i in range(1, min(len(current_text), len(self.bot_token)) + 1)
            )

            if not is_potential_start:
                # Not a potential tool call, return as normal text
                # Must return the entire buffer (current_text), not just new_text,
                # because buffer may contain previously accumulated characters like '<'
                # that turned out not to be part of a tool call
                output_text = current_text
                self._buffer = ""
                if self.eot_token in output_text:
                    output_text = output_text.replace(self.eot_token, "")
                return StreamingParseResult(normal_text=output_text)
            else:
                # Could be start of tool call, keep buffering
                return StreamingParseResult(normal_text="", calls=[])

        # Extract any text before the first bot_token and return it as normal_text
        normal_text = ""
        first_bot_token_idx = current_text.find(self.bot_token)
        if first_bot_token_idx > 0:
            normal_text = current_text[:first_bot_token_idx]
            current_text = current_text[first_bot_token_idx:]
            # Update buffer to only include from the bot token onwards
            self._buffer = current_text

        if not hasattr(self, "_tool_indices"):
            self._tool_indices = self._get_tool_indices(tools)

        calls: list[ToolCallItem] = []
        try:
            # Try to match a partial or complete tool call
            # Use a single flexible regex pattern that handles all cases
            partial_match = self._match_tool_call(current_text)

            if not partial_match:
                return StreamingParseResult(normal_text=normal_text, calls=[])

            func_name, func_args_raw, is_tool_end, match_end = partial_match

            # Initialize tool call state if needed (keeping existing logic)
            if self.current_tool_id == -1:
                self.current_tool_id = 0
                self.prev_tool_call_arr = []
                self.streamed_args_for_tool = [""]
                self._streamed_raw_length = 0
                self.current_tool_name_sent = False  # Reset for new tool call
                self._reset_streaming_state()
            # Check if this is a continuation of an existing tool call or a new one
            elif not self.current_tool_name_sent:
                # Only increment tool_id if we're truly starting a NEW tool call
                # Don't increment if this is just the first time we're processing
                # a tool call that was received in the buffer
                # The key insight: only increment when we've COMPLETED a previous tool call
                # and now see another bot_token in new_text
                pass  # Remove the problematic auto-increment logic

            # Ensure tracking arrays are large enough (keeping existing logic)
            while len(self.prev_tool_call_arr) <= self.current_tool_id:
                self.prev_tool_call_arr.append({})
            while len(self.streamed_args_for_tool) <= self.current_tool_id:
                self.streamed_args_for_tool.append("")

            # Determine if function name is complete by checking for <arg_key> in the full text
            # This is important for streaming scenarios where args come in later chunks
            has_arg_key = "<arg_key" in current_text

            # Send tool name if needed
            tool_name_item = self._send_tool_name_if_needed(
                func_name, has_arg_key, is_tool_end
            )
            if tool_name_item:
                calls.append(tool_name_item)

            # Process streaming arguments if tool name has been sent
            if self.current_tool_name_sent:
                arg_item = self._process_arguments_streaming(
                    func_name, func_args_raw, tools
                )
                if arg_item:
                    calls.append(arg_item)

                # Finalize tool call if end token is encountered
                if is_tool_end == self.eot_token and not self._tool_call_completed:
                    finalize_calls = self._finalize_tool_call(
                        func_name,
                        func_args_raw,
                        tools,
                        match_end,
                        current_text,
                    )
                    calls.extend(finalize_calls)
                    return StreamingParseResult(normal_text=normal_text, calls=calls)

        except Exception as e:
            logger.error(f"Error in parse_streaming_increment: {e}", exc_info=True)
            return StreamingParseResult(normal_text=current_text)

        return StreamingParseResult(normal_text=normal_text, calls=calls)

    def _parse_argument_pairs(
        self, pairs: List[Tuple[str, str]], func_name: str, tools: List[Tool]
    ) -> Dict[str, Any]:
        """Parse argument key-value pairs with type coercion.

        Args:
            pairs: List of (key, value) tuples from regex matching
            func_name: Name of the function
            tools: List of available tools

        Returns:
            Dictionary of parsed arguments
        """
        arguments = {}
        known_arguments = {}
        # Values with a certain type are resolved first so completed sibling
        # discriminators (e.g. kind=const) can steer root-union branch selection.
        if len(pairs) > 1 and any(
            tool.function.name == func_name
            and _needs_argument_context(tool.function.parameters)
            for tool in tools
        ):
            for key, raw in pairs:
                key = key.strip()
                parsed = self._parse_argument_pairs([(key, raw)], func_name, tools)[key]
                native_types = _get_argument_types(func_name, key, tools, value=raw)
                if (
                    isinstance(parsed, str)
                    or native_types is None
                    or "string" not in native_types
                ):
                    known_arguments[key] = parsed
        for arg_key, arg_value in pairs:
            arg_key = arg_key.strip()
            arg_type = get_argument_type(func_name, arg_key, tools, known_arguments)
            parsed_value, is_good_json = parse_arguments(
                arg_value, arg_type or "string"
            )

            if arg_type == "string":
                if isinstance(parsed_value, str):
                    arguments[arg_key] = parsed_value
                else:
                    arguments[arg_key] = arg_value
            elif arg_type is None:
                # A value whose parsed JSON type is inadmissible stays the raw
                # string when the schema allows a string (e.g. enum ["7", 8]).
                allowed = _get_argument_types(
                    func_name, arg_key, tools, known_arguments, parsed_value
                )
                native = _get_argument_types(
                    func_name, arg_key, tools, known_arguments, arg_value
                )
                if (
                    allowed is not None
                    and _json_type(parsed_value) not in allowed
                    and native is not None
                    and "string" in native
                ):
                    parsed_value = arg_value
                arguments[arg_key] = parsed_value if is_good_json else arg_value
            else:
                arguments[arg_key] = parsed_value if is_good_json else arg_value
            known_arguments[arg_key] = arguments[arg_key]

        return arguments

    def parses_required_natively(self) -> bool:
        return self.use_full_assistant_constraint

    def supports_structural_tag(self) -> bool:
        return _glm47_native_structural_tag_available()

    def get_structural_tag(
        self,
        tools: Union[List[Tool], None] = None,
        tool_choice: Union[ToolChoice, Literal["auto", "required"]] = "auto",
        thinking_mode: bool = False,
        parallel_tool_calls: bool = True,
    ) -> Optional[StructuralTag]:
        if not self.supports_structural_tag():
            return None
        return super().get_structural_tag(
            tools=tools,
            tool_choice=tool_choice,
            thinking_mode=thinking_mode,
            parallel_tool_calls=parallel_tool_calls,
        )

    def structure_info(self) -> _GetInfoFunc:
        raise NotImplementedError

    def get_structural_tag_name(self) -> str:
        return "glm_4_7"
