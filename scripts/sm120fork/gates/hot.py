"""Which lines of a module can hold an architecture gate: a cheap over-estimate.

Evaluating every expression of a module is slow, and almost none involve the
architecture. A name is *hot* when it can carry the architecture: a helper, a
capability / sm query, the platform, a name this module imports from another
module that exports an architecture-derived value, and (to a fixed point) a
name assigned from an expression through which a hot name flows, or a
zero-argument function whose body mentions one. A line is hot when it names
a hot name; only expressions on hot lines are evaluated. The evaluator gives
the same answers, sooner.
"""

from __future__ import annotations

import ast
import bisect
import re
import string
from collections.abc import Iterable
from dataclasses import dataclass

from sm120fork.gates import semantics
from sm120fork.gates.scopes import Binding, ModuleScopes, argument_for

_HELPERS = re.compile(r"is_(?:sm|blackwell|hopper|ampere_with)\w*")
_SEED_NAMES = frozenset(
    semantics.CAPABILITY_FUNCS
    | semantics.SM_FUNCS
    | semantics.HAS_CAPABILITY_FUNCS
    | semantics.PLATFORM_GETTERS
)
_WORD = frozenset(string.ascii_letters + string.digits + "_")
_PASS_ARGUMENTS = frozenset(("int", "str", "float", "tuple", "bool", "min", "max", "abs", "len"))
_MAX_ROUNDS = 8
# Expressions whose value is made of their parts' values.
_FLOWS_THROUGH = (
    ast.BoolOp,
    ast.Compare,
    ast.IfExp,
    ast.Subscript,
    ast.BinOp,
    ast.UnaryOp,
    ast.Tuple,
    ast.List,
    ast.Set,
    ast.Starred,
    ast.NamedExpr,
)


def flow_names(node: ast.AST | None) -> frozenset[str]:
    """Identifiers whose value can flow into `node`'s value.

    Arguments of a call do not flow into its result (the callee is opaque),
    except for the builtins the evaluator computes.
    """
    found: set[str] = set()
    stack = [node] if node is not None else []
    while stack:
        current = stack.pop()
        if isinstance(current, ast.Name):
            found.add(current.id)
        elif isinstance(current, ast.Attribute):
            if current.attr in semantics.PLATFORM_PROBES:
                continue  # get_platform().is_cuda: a platform fact, not the architecture
            found.add(current.attr)
            stack.append(current.value)
        elif isinstance(current, ast.Call):
            stack.append(current.func)
            func = current.func
            if (isinstance(func, ast.Name) and func.id in _PASS_ARGUMENTS) or any(
                isinstance(a, ast.Starred) for a in current.args
            ):
                stack.extend(current.args)
        elif isinstance(current, _FLOWS_THROUGH):
            stack.extend(ast.iter_child_nodes(current))
    return frozenset(found)


def _callable_without_arguments(node: ast.AST) -> bool:
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    if positional and positional[0].arg in ("self", "cls"):
        positional = positional[1:]
    return len(positional) <= len(args.defaults) and all(d is not None for d in args.kw_defaults)


def _all_bindings(scopes: ModuleScopes) -> Iterable[Binding]:
    for scope in (scopes.root, *scopes.of_node.values()):
        for bindings in scope.names.values():
            yield from bindings
        for bindings in scope.attrs.values():
            yield from bindings


class Lines:
    """Line numbers where identifiers occur, found with str.find and cached."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.starts = [0]
        self.starts.extend(m.end() for m in re.finditer("\n", text))
        self.cache: dict[str, set[int]] = {}

    def of(self, name: str) -> set[int]:
        cached = self.cache.get(name)
        if cached is not None:
            return cached
        text, lines, size = self.text, set(), len(name)
        pos = text.find(name)
        while pos >= 0:
            end = pos + size
            if (pos == 0 or text[pos - 1] not in _WORD) and (
                end >= len(text) or text[end] not in _WORD
            ):
                lines.add(bisect.bisect_right(self.starts, pos))
            pos = text.find(name, end)
        self.cache[name] = lines
        return lines


@dataclass(frozen=True)
class Hotness:
    lines: frozenset[int]  # where an architecture gate can be
    names: frozenset[str]  # what can carry the architecture (candidates for export)
    params: frozenset[tuple[str, str]]  # (function, parameter) a hot argument may reach
    finder: Lines


def hot_lines(
    text: str,
    scopes: ModuleScopes,
    names: Iterable[str] = (),
    params: Iterable[tuple[str, str]] = (),
) -> Hotness:
    """`names`: seeds from other modules; `params`: (function, parameter) pairs
    that calls from other modules pass something architectural."""
    lines = Lines(text)
    hot_names = set(_SEED_NAMES) | set(names)
    for match in _HELPERS.finditer(text):
        start = match.start()
        if start == 0 or text[start - 1] not in _WORD:
            hot_names.add(match.group())
    values: list[tuple[str, int, int, ast.AST]] = []
    functions: list[tuple[str, int, int]] = []
    parameters: dict[str, list[Binding]] = {}  # function name -> its parameters
    for binding in _all_bindings(scopes):
        if binding.kind == "import" and semantics.architectural(binding.target.partition(":")[2]):
            hot_names.add(binding.name)  # from ... import is_sm100_supported as on_b200
        node = binding.node
        if node is None:
            continue
        start = getattr(node, "lineno", 0)
        end = getattr(node, "end_lineno", start) or start
        if binding.kind == "value":
            values.append((binding.name, start, end, node))
        elif binding.kind == "param" and binding.name not in ("self", "cls"):
            parameters.setdefault(node.name, []).append(binding)  # type: ignore[attr-defined]
        elif (
            binding.kind == "def"
            and not binding.name.startswith("__")
            and _callable_without_arguments(node)
        ):
            functions.append((binding.name, start, end))
    hot: set[int] = set()
    for name in hot_names:
        hot |= lines.of(name)
    flows: dict[int, frozenset[str]] = {}
    hot_params = set(params)
    for _ in range(_MAX_ROUNDS):
        ordered = sorted(hot)
        new: set[str] = set()
        for name, start, end, node in values:
            if name in hot_names or name in new or not _touches(ordered, start, end):
                continue
            key = id(node)
            flow = flows.get(key)
            if flow is None:
                flow = flows[key] = flow_names(node)
            if flow & hot_names:
                new.add(name)
        for name, start, end in functions:
            if name not in hot_names and name not in new and _touches(ordered, start, end):
                new.add(name)
        for function, bindings in parameters.items():
            occurs = lines.of(function)
            if not occurs & hot:
                continue
            calls = [c for c, _ in scopes.calls_to(function, occurs) if c.lineno in hot]
            for binding in bindings:
                if (function, binding.name) in hot_params:
                    continue
                fn = binding.node
                for call in calls:
                    argument = argument_for(fn, binding, call)  # type: ignore[arg-type]
                    if argument is not None and flow_names(argument) & hot_names:
                        hot_params.add((function, binding.name))  # an argument is hot
                        if binding.name not in hot_names:
                            new.add(binding.name)
                        break
        new.discard("_")
        if not new:
            break
        hot_names |= new
        for name in new:
            hot |= lines.of(name)
    return Hotness(frozenset(hot), frozenset(hot_names), frozenset(hot_params), lines)


def _touches(ordered: list[int], start: int, end: int) -> bool:
    i = bisect.bisect_left(ordered, start)
    return i < len(ordered) and ordered[i] <= end
