"""Templates: sandboxed Jinja2, compiled once per campaign, rendered per recipient.

The sandbox refuses attribute access to Python internals (``__class__``, ``__globals__``, ...),
and the environments have no loader, so a template cannot include or read files. Missing
variables are errors (StrictUndefined), never blanks in a sent mail.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, NoReturn

import jinja2
from jinja2 import meta, nodes, pass_eval_context
from jinja2.exceptions import SecurityError
from jinja2.nodes import EvalContext
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, generate_lorem_ipsum
from jinja2.visitor import NodeTransformer
from markupsafe import escape

from sendonce.errors import InvalidInput


class TemplateError(InvalidInput):
    """The template cannot be rendered."""


MAX_ITERATIONS = 100_000
"""Loop iterations one render may make, all loops together."""
MAX_OUTPUT = 2_000_000
"""Characters one render may produce, and the longest value (string, list) it may build."""
MAX_REPEAT = 100_000
"""Longest string or list a template may build with ``*``."""
MAX_WORK = 20 * MAX_OUTPUT
"""Characters one render may build in all, outputs and intermediate values together: a template
that builds a large value over and over (in a loop, in ``{% set %}`` blocks) is stopped."""
MAX_BITS = 10_000
"""Largest integer a template may compute, in bits (about 3,000 digits)."""
MAX_TOKENS = 20_000
"""Most lexical tokens one template may have (``{{ x }}`` is five, the text between two tags one;
a newsletter with 300 tags, conditions and filters has about 4,500). Parsing and compiling cost
grows with them, checked before either: 140,000 ``{{ x }}``, within the API's size limit, took
13.5 s and 1.4 GB to compile; at this limit a template compiles in about half a second."""
MAX_SECONDS = 1.0
"""CPU time one render may take (its thread's: another process's load does not count). The limits
above bound memory and most of the work; this bounds what they cannot count (a loop searching a
large value at every turn). A template a mail needs renders in well under a millisecond."""

_BUDGET: ContextVar[list[float]] = ContextVar("sendonce_template_budget")
"""Per render: [iterations left, characters left, deadline (time.thread_time()), steps to the next
look at the clock]."""
_CLOCK_EVERY = 32
"""Steps (loop turns, values built) between two looks at the clock, a system call."""


def _refuse(why: str) -> NoReturn:
    raise SecurityError(why)


def _spend(iterations: int = 0, characters: int = 0) -> None:
    budget = _BUDGET.get(None)
    if budget is None:  # outside a render: Jinja folding constants while it compiles
        return
    budget[0] -= iterations
    budget[1] -= characters
    if budget[0] < 0:
        _refuse(f"the template loops too much (over {MAX_ITERATIONS} iterations)")
    if budget[1] < 0:
        _refuse(f"the template builds too much (over {MAX_WORK} characters in all)")
    budget[3] -= 1
    if budget[3] <= 0 or characters > 10_000:
        budget[3] = _CLOCK_EVERY
        if time.thread_time() > budget[2]:
            _refuse(f"the template takes too long to render (over {MAX_SECONDS:g} s of CPU)")


def _budgeted(iterable: Any) -> Iterator[Any]:
    """Every template loop iterates through here: a template that loops too much is stopped."""
    for item in iterable:
        _spend(iterations=1)
        yield item


def _text_size(value: Any, limit: int = MAX_OUTPUT) -> int:
    """About how many characters ``str(value)`` has, counted no further than past ``limit``: a list
    that holds one large string 100,000 times is small, and its text is not."""
    if isinstance(value, str | bytes):
        return len(value)
    total = 0
    stack = [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str | bytes):
            total += len(item) + 4
        elif isinstance(item, int) and not isinstance(item, bool):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, Mapping):
            total += 2 + 4 * len(item)
            if total <= limit:
                stack.extend(item.keys())
                stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            total += 2 + 2 * len(item)
            if total <= limit:
                stack.extend(item)
        elif isinstance(item, Namespace):
            stack.append(item._Namespace__attrs)  # what its repr shows
        else:
            total += 32
    return total


def _built(value: Any) -> Any:
    """A value the template built: refused if it is too long (a list by what it holds: a list of one
    large list many times is large), counted against the render's work; an integer past its size."""
    if isinstance(value, str | bytes | list | tuple):
        size = len(value) if isinstance(value, str | bytes) else _text_size(value)
        if size > MAX_OUTPUT:
            _refuse(f"the template built a value longer than {MAX_OUTPUT}")
        _spend(characters=size)
    elif isinstance(value, int) and value.bit_length() > MAX_BITS:
        _refuse(f"the template computes an integer over {MAX_BITS} bits")
    return value


def _will_build(size: int) -> None:
    """Before an operation that would build ``size`` characters (or items)."""
    if size > MAX_OUTPUT:
        _refuse(f"the template would build a value longer than {MAX_OUTPUT}")


def _as_text(value: Any) -> Any:
    """A value about to be written as text (``~``, ``%s``, ``{}``): checked by its text's size."""
    if not isinstance(value, str):
        _will_build(_text_size(value))
    return value


@pass_eval_context  # so that Jinja does not fold a constant's output while it compiles, uncounted
def _output(eval_ctx: EvalContext, value: Any) -> Any:
    """Each ``{{ … }}``'s value, before it is written: checked by its text's size and counted (a
    ``{% set %}`` block gathers what it writes without the render's output seeing it)."""
    size = _text_size(value)
    _will_build(size)
    _spend(characters=size)
    return value


_PERCENT_FLAGS = re.compile(r"[#0 +-]*(\*|[0-9]*)(?:\.(\*|[0-9]*))?")
_FORMATTER = string.Formatter()


def _percent_specs(template: str) -> Iterator[tuple[str, str]]:
    """The (width, precision) of each conversion of ``template % …``, read as CPython reads them: a
    ``%(key)`` may hold parentheses, nested."""
    at = template.find("%")
    while at != -1:
        at += 1
        if template.startswith("%", at):
            at = template.find("%", at + 1)
            continue
        if template.startswith("(", at):
            depth, at = 1, at + 1
            while at < len(template) and depth:
                depth += {"(": 1, ")": -1}.get(template[at], 0)
                at += 1
        spec = _PERCENT_FLAGS.match(template, at)
        assert spec is not None  # every part of the pattern may be empty
        yield spec[1], spec[2] or ""
        at = template.find("%", spec.end())


def _check_width(width: Any) -> None:
    if isinstance(width, int) and width > MAX_OUTPUT:
        _refuse(f"the template asks for a width over {MAX_OUTPUT}")


def _widths(numbers: Iterable[str]) -> int:
    total = 0
    for number in numbers:
        if number == "*":
            _refuse("the template formats with a width taken from its arguments")
        if number:
            if len(number) > 7:
                _refuse(f"the template asks for a width over {MAX_OUTPUT}")
            total += int(number)
    if total > MAX_OUTPUT:
        _refuse(f"the template asks for a width over {MAX_OUTPUT}")
    return total


def _check_formatted(template: str, fields: int, widths: int, args: Iterable[Any]) -> None:
    """What formatting ``template`` builds, at most: its text, its widths, and each field the largest
    argument's text (a field may name one argument many times)."""
    largest, left = 0, MAX_OUTPUT
    for arg in args:  # measured together: each walk stops where the arguments' total passes the limit
        size = _text_size(arg, left)
        largest, left = max(largest, size), left - size
        if left < 0:
            _refuse(f"the template formats arguments longer than {MAX_OUTPUT} in all")
    _will_build(len(template) + widths + fields * largest)


def _check_percent(template: str, args: Any) -> None:
    """``template % args``: no width or precision past the limit (nor one from the arguments)."""
    specs = list(_percent_specs(template))
    widths = _widths(number for spec in specs for number in spec)
    values = args.values() if isinstance(args, Mapping) else args if isinstance(args, tuple) else (args,)
    _check_formatted(template, len(specs), widths, values)


def _check_format(template: str, args: Iterable[Any]) -> None:
    """``template.format(*args)``: no width past the limit, nor one taken from the arguments."""
    try:
        fields = [spec or "" for _, name, spec, _ in _FORMATTER.parse(template) if name is not None]
    except ValueError:
        return  # str.format refuses it itself
    if any("{" in spec for spec in fields):
        _refuse("the template formats with a width taken from its arguments")
    widths = _widths(number for spec in fields for number in re.findall(r"[0-9]+", spec))
    _check_formatted(template, len(fields), widths, args)


def _replaced_size(text: str, old: Any, new: Any, count: Any) -> int:
    old, new = str(_as_text(old)), str(_as_text(new))  # the filter writes them as text too
    found = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return len(text) + found * max(len(new) - len(old), 0)


def _joined_size(items: list[Any], separator: Any) -> int:
    size = len(separator) * max(len(items) - 1, 0) if isinstance(separator, str) else 0
    for item in items:
        size += _text_size(item, MAX_OUTPUT - size)
        if size > MAX_OUTPUT:
            break
    return size


def _check_method(method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A call of a method of a built-in value whose result's size its arguments choose: refused past
    the limits. Returns the arguments to call it with (an iterable to join, read once)."""
    owner = getattr(method, "__self__", None)
    name = getattr(method, "__name__", "")
    if name in ("translate", "maketrans", "encode", "to_bytes"):
        # translate's table sets its result's size; bytes (encode, int.to_bytes) would need every
        # check again: a template makes none
        _refuse(f"the template calls {name}, which the sandbox does not allow")
    if isinstance(owner, str):
        if name in ("center", "ljust", "rjust", "zfill"):
            _check_width(args[0] if args else kwargs.get("width"))
        elif name == "expandtabs":
            tabsize = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(tabsize, int):
                _will_build(len(owner) + owner.count("\t") * tabsize)
        elif name == "replace" and len(args) >= 2:
            _will_build(_replaced_size(owner, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count")))
        elif name == "join" and args:
            items = list(args[0])
            _will_build(_joined_size(items, owner))
            return (items, *args[1:])
    return args


_SLOW_INPUT = 100_000
"""Longest text given to a filter written in Python that does much per character (``wordwrap``,
``urlize``): 100,000 characters take them about 0.1 s."""


def _guarded(name: str, filter_: Callable[..., Any]) -> Callable[..., Any]:
    """A built-in filter whose result is checked, and, where an argument sets its size, refused first.

    Outside a render (Jinja folding constants while it compiles a template) it refuses to run, so
    that its work is done, and counted, when the template is rendered."""
    signature = inspect.signature(filter_)
    first = next(iter(signature.parameters), None)
    if getattr(filter_, "jinja_pass_arg", None) is not None and first not in ("context", "eval_ctx", "environment"):
        # an async variant (slice, list) takes the context it is passed without naming it
        passed = inspect.Parameter("_passed", inspect.Parameter.POSITIONAL_ONLY)
        signature = signature.replace(parameters=[passed, *signature.parameters.values()])
    checks = _FILTER_CHECKS.get(name)

    @functools.wraps(filter_)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if _BUDGET.get(None) is None:
            _refuse("filters run only when the template is rendered")
        if checks is not None:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            replaced = checks(bound.arguments)
            if replaced is not None:  # an iterable read once, to measure it: the filter gets the list
                bound.arguments.update(replaced)
                args, kwargs = bound.args, bound.kwargs
        return _built(filter_(*args, **kwargs))

    return guarded


def _text_of(value: Any) -> str:
    return str(_as_text(value))


def _check_indent(a: dict[str, Any]) -> None:
    text, width = _text_of(a["s"]), a["width"]
    step = len(_text_of(width)) if not isinstance(width, int) else width
    _will_build(len(text) + (text.count("\n") + 1) * max(step, 0))


def _check_join(a: dict[str, Any]) -> dict[str, Any]:
    items = list(a["value"])
    _will_build(_joined_size(items, _text_of(a["d"])))
    return {"value": items}


def _check_wordwrap(a: dict[str, Any]) -> None:
    text, width = _text_of(a["s"]), a["width"]
    if len(text) > _SLOW_INPUT:
        _refuse(f"the template wraps a text longer than {_SLOW_INPUT}")
    wrap = _text_of(a["wrapstring"]) if a["wrapstring"] is not None else "\n"
    if isinstance(width, int):
        _will_build(len(text) + (len(text) // max(width, 1) + text.count("\n") + 1) * len(wrap))


def _check_urlize(a: dict[str, Any]) -> None:
    if len(_text_of(a["value"])) > _SLOW_INPUT:
        _refuse(f"the template urlizes a text longer than {_SLOW_INPUT}")


def _check_sum(a: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(a["start"], int | float):
        # lists or strings added one by one: quadratic work in one call the deadline cannot stop
        _refuse("the template sums something other than numbers")
    return {"iterable": list(a["iterable"])}


def _items(value: Any) -> list[Any]:
    """An iterable a filter makes one object per item of, read once: at most MAX_REPEAT items (one
    list per character of a long string is tens of bytes per character)."""
    items = list(itertools.islice(value, MAX_REPEAT + 1))
    if len(items) > MAX_REPEAT:
        _refuse(f"the template splits a value into more than {MAX_REPEAT} parts")
    _spend(characters=len(items))
    return items


def _check_batch(a: dict[str, Any]) -> dict[str, Any]:
    _check_width(a["linecount"])
    if a["fill_with"] is not None and isinstance(a["linecount"], int):
        _will_build(_text_size(a["fill_with"]) * a["linecount"])
    return {"value": _items(a["value"])}


def _check_slice(a: dict[str, Any]) -> dict[str, Any]:
    _check_width(a["slices"])
    return {"value": _items(a["value"])}


def _check_round(precision: Any) -> None:
    if isinstance(precision, int) and abs(precision) > 400:
        _refuse("the template rounds to more than 400 digits")


def _check_tojson(a: dict[str, Any]) -> None:
    if isinstance(a["indent"], int) and a["indent"] > 16:
        _refuse("the template indents JSON by more than 16")
    _as_text(a["value"])


def _check_text(a: dict[str, Any]) -> None:
    for value in a.values():
        _as_text(value)


_FILTER_CHECKS: dict[str, Callable[[dict[str, Any]], dict[str, Any] | None]] = {
    "center": lambda a: _check_width(a["width"]),
    "indent": _check_indent,
    "join": _check_join,
    "replace": lambda a: _will_build(_replaced_size(_text_of(a["s"]), a["old"], a["new"], a["count"])),
    "format": lambda a: _check_percent(_text_of(a["value"]), a["kwargs"] or tuple(a["args"])),
    "batch": _check_batch,
    "round": lambda a: _check_round(a["precision"]),
    "slice": _check_slice,
    "wordwrap": _check_wordwrap,
    "urlize": _check_urlize,
    "sum": _check_sum,
    "tojson": _check_tojson,
    **dict.fromkeys(("string", "urlencode", "xmlattr", "list", "unique", "dictsort", "sort"), _check_text),
}
"""Per filter, the check of its arguments before it runs (by name, defaults applied)."""


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    if n > 100 or max > 1000:
        _refuse("the template asks for more than 100 paragraphs of 1,000 words")
    return _built(generate_lorem_ipsum(n=n, html=html, min=min, max=max))  # type: ignore[no-any-return]


@pass_eval_context
def _concat(eval_ctx: EvalContext, *parts: Any) -> str:
    """``a ~ b``: Jinja's own joining, once the parts' text is known to fit."""
    size = 0
    for part in parts:
        size += _text_size(part, MAX_OUTPUT - size)
        _will_build(size)
    joined = markup_join(parts) if eval_ctx.autoescape else str_join(parts)
    return _built(joined)  # type: ignore[no-any-return]


class _Concats(NodeTransformer):
    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        call = nodes.Call(nodes.Name("_sendonce_concat", "load"), list(node.nodes), [], None, None)
        return call.set_lineno(node.lineno)


_RESERVED = "_sendonce"


def _literal_size(body: list[nodes.Node]) -> int:
    """Characters of template text in ``body``, but for the bodies of loops, macros and call blocks
    within it (each counts its own)."""
    size = 0
    stack: list[nodes.Node] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, nodes.TemplateData):
            size += len(node.data)
        elif isinstance(node, nodes.For | nodes.Macro | nodes.CallBlock):
            continue
        else:
            stack.extend(node.iter_child_nodes())
    return size


def _stepped(test: Callable[..., Any]) -> Callable[..., Any]:
    """A test: each call counted as a loop's turn (``select``, ``reject`` call it once per item), so
    that the budget and the deadline are seen between calls (``select("in", a_long_list)``)."""

    @functools.wraps(test)
    def stepped(*args: Any, **kwargs: Any) -> Any:
        _spend(iterations=1)
        return test(*args, **kwargs)

    return stepped


def _dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    """``dict(...)`` in a template, without the type: ``dict.update(campaign, …)`` changed the data."""
    return _built(dict(*args, **kwargs))  # type: ignore[no-any-return]


def _spend_text(size: int) -> str:
    _spend(characters=size)
    return ""


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with limits on work as well as on access: loops share an iteration budget per
    render; what a template builds (with ``*``, ``+``, ``~``, ``%``, filters, methods of strings
    and numbers, ``{% set %}`` blocks) is refused past a size, and counted against the render's
    work; integers cannot grow past a size; a render has a deadline; output is capped as it is
    produced. Each of these was a way for one account's template to take a worker's or the API's
    memory or time (``"a"|center(10**9)``, ``9**64**64**64``, a string doubled in a loop)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=_output, **options)
        self.globals["_sendonce_iter"] = _budgeted
        self.globals["_sendonce_concat"] = _concat
        self.globals["_sendonce_spend"] = _spend_text
        self.globals["lipsum"] = _lipsum
        self.globals["dict"] = _dict  # the builtin type's methods, called on a context's dicts, changed them
        # pprint walks nesting in quadratic time; it is for debugging, not mail
        self.filters = {name: _guarded(name, f) for name, f in self.filters.items() if name != "pprint"}
        self.tests = {name: _stepped(test) for name, test in self.tests.items()}  # type: ignore[arg-type]

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for node in tree.find_all((nodes.Name, nodes.Macro)):
            # the guards below are called by these names: a template's own (a macro, a variable)
            # would be called instead, and its loops and joins run unchecked
            if str(getattr(node, "name", "")).startswith(_RESERVED):
                raise jinja2.TemplateSyntaxError(f"names starting with {_RESERVED} are reserved", node.lineno)
        for loop in tree.find_all(nodes.For):
            if loop.recursive:  # loop(...) iterates outside the loops' budget
                raise jinja2.TemplateSyntaxError("recursive loops are not allowed", loop.lineno)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.Name("_sendonce_iter", "load"), [loop.iter], [], None, None)
        for repeated in tree.find_all((nodes.For, nodes.Macro, nodes.CallBlock)):
            # Its text is written at every turn or call, and into a {% set %} block's buffer, which the
            # output's cap does not see: counted against the render's work each time.
            size = _literal_size(repeated.body)  # type: ignore[attr-defined]
            if size:
                spend = nodes.Call(nodes.Name("_sendonce_spend", "load"), [nodes.Const(size)], [], None, None)
                repeated.body.insert(0, nodes.Output([spend]))  # type: ignore[attr-defined]
        _Concats().visit(tree)
        return tree

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**":
            if isinstance(right, int | float) and abs(right) > 64:
                _refuse("the template computes a power too large")
            if ints and right > 0 and left.bit_length() * right > MAX_BITS:
                _refuse(f"the template computes an integer over {MAX_BITS} bits")
        elif operator == "*":
            if ints and left.bit_length() + right.bit_length() > MAX_BITS:
                _refuse(f"the template computes an integer over {MAX_BITS} bits")
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(times, int):
                    if len(seq) * times > MAX_REPEAT:
                        _refuse(f"the template builds a value longer than {MAX_REPEAT}")
                    if isinstance(seq, list | tuple) and times > 0:
                        _will_build(_text_size(seq, MAX_OUTPUT // times) * times)
        elif operator == "+":
            if isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
                _will_build(len(left) + len(right))
        elif operator == "%" and isinstance(left, str):
            _check_percent(left, right)
        return _built(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``str.format`` and ``format_map``: Jinja's sandboxed formatting, its widths checked first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        template, by_name = value.__self__, value.__name__ == "format_map"

        @functools.wraps(wrapped)
        def checked(*args: Any, **kwargs: Any) -> str:
            values = (
                args[0].values() if by_name and args and isinstance(args[0], Mapping) else (*args, *kwargs.values())
            )
            _check_format(template, values)
            return _built(wrapped(*args, **kwargs))  # type: ignore[no-any-return]

        return checked

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        args = _check_method(obj, args, kwargs)
        return _built(super().call(context, obj, *args, **kwargs))


# Not optimized: Jinja's optimizer folds constants while it compiles, trying again at every node
# of every subexpression, so its work grows with the cube of an expression's depth: 390 tokens of
# "(email)-1-1-1…" took 2.9 s, ten of them 31 s. It would also compute on constants where no
# limit of the sandbox is checked. What it saves at a render is nothing a mail needs.
_TEXT = _Sandbox(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True, optimized=False)
_HTML = _Sandbox(undefined=jinja2.StrictUndefined, autoescape=True, keep_trailing_newline=True, optimized=False)


class _Variables(meta.TrackingCodeGenerator):
    """:func:`jinja2.meta.find_undeclared_variables` without the optimizer, which that function
    always runs, whatever the environment's setting (see above)."""

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self.optimizer = None


def _undeclared(parsed: nodes.Template) -> frozenset[str]:
    """The variables a parsed template reads from its context."""
    codegen = _Variables(parsed.environment)  # type: ignore[arg-type]
    codegen.visit(parsed)
    return frozenset(codegen.undeclared_identifiers)


@dataclass(frozen=True, slots=True)
class CompiledTemplate:
    source: str
    variables: frozenset[str]
    _template: jinja2.Template | None
    _static: str | None
    _globals: dict[str, Any] = field(default_factory=dict)
    """The template's globals, merged into a plain dict once (Jinja merges its ChainMap per render)."""
    _plan: Plan | None = None
    """The template is only text and plain variables: rendered without Jinja where the values allow."""

    @property
    def parts(self) -> tuple[_Part, ...] | None:
        """The template as text and plain variables (a variable is its path, ``("subscriber", "id")``),
        if it is only that (or static); None when only Jinja can render it."""
        if self._static is not None:
            return (self._static,)
        return self._plan.parts if self._plan is not None else None

    def render(self, context: Mapping[str, Any]) -> str:
        if self._static is not None:
            return self._static
        if self._plan is not None:
            fast = self._plan.render(context)
            if fast is not None:
                return fast
        return self._render_jinja(context)

    def _render_jinja(self, context: Mapping[str, Any]) -> str:
        assert self._template is not None
        token = _BUDGET.set([MAX_ITERATIONS, MAX_WORK, time.thread_time() + MAX_SECONDS, 1])
        try:
            parts: list[str] = []
            size = 0
            template = self._template
            # What Template.generate does, minus merging the globals again for every recipient (its
            # new_context walks the ChainMap of the globals to collect their names, once per render).
            environment = template.environment
            ctx = environment.context_class(
                environment, {**self._globals, **context}, template.name, template.blocks, globals=self._globals
            )
            for part in template.root_render_func(ctx):
                size += len(part)
                if size > MAX_OUTPUT:
                    raise SecurityError(f"the template produces more than {MAX_OUTPUT} characters")
                parts.append(part)
            return "".join(parts)
        except SecurityError as exc:
            raise TemplateError(f"the template tried something the sandbox forbids: {exc}") from None
        except jinja2.UndefinedError as exc:
            raise TemplateError(f"template variable missing: {exc}") from None
        except Exception as exc:  # a template is user code: any error is a template error
            raise TemplateError(f"the template failed: {type(exc).__name__}: {exc}") from None
        finally:
            _BUDGET.reset(token)


_Part = str | tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    """A template that is only text and plain variables (``{{ name }}``, ``{{ subscriber.id }}``), as
    its text and the paths of its variables: what a campaign's templates mostly are, rendered per
    recipient without building a Jinja context (a sixth of a worker's CPU per message went to Jinja).

    It renders only what it can render exactly as Jinja would: each variable a ``str`` or an ``int``
    (Jinja writes ``str(value)``, or ``escape(value)`` in HTML), each step of a path a key of a plain
    ``dict`` that is not also one of its methods (the sandbox's ``getattr`` looks for an attribute
    first). Anything else (a missing variable, another type, an output too long) returns None, and
    Jinja renders it, with its errors."""

    parts: tuple[_Part, ...]
    html: bool

    @staticmethod
    def of(tree: nodes.Template, *, html: bool) -> Plan | None:
        parts: list[_Part] = []
        for node in tree.body:
            if not isinstance(node, nodes.Output):
                return None
            for child in node.nodes:
                if isinstance(child, nodes.TemplateData):
                    parts.append(child.data)
                    continue
                attributes: list[str] = []
                while isinstance(child, nodes.Getattr):
                    attributes.append(child.attr)
                    child = child.node
                if not isinstance(child, nodes.Name) or child.ctx != "load":
                    return None
                parts.append((child.name, *reversed(attributes)))
        return Plan(tuple(parts), html)

    def render(self, context: Mapping[str, Any]) -> str | None:
        out: list[str] = []
        size = 0
        for part in self.parts:
            if isinstance(part, str):
                text = part
            else:
                value = plain_value(context, part)
                if value is None:
                    return None
                text = str(escape(value)) if self.html else str(value)
            size += len(text)
            out.append(text)
        return "".join(out) if size <= MAX_OUTPUT else None


_MISSING = object()


def plain_value(context: Mapping[str, Any], path: tuple[str, ...]) -> str | int | None:
    """The value of a plain variable (``name``, ``subscriber.id``) as Jinja would find it, if it is a
    ``str`` or an ``int`` reached through plain ``dict`` keys that are not also dict methods (the
    sandbox looks for an attribute first); None otherwise (Jinja must render it, errors included)."""
    value = context.get(path[0], _MISSING)
    for attribute in path[1:]:
        if type(value) is not dict or attribute not in value or hasattr(dict, attribute):
            return None
        value = value[attribute]
    kind = type(value)
    if kind is not str and kind is not int:
        return None
    return value  # type: ignore[no-any-return]


MAX_LOOP_NESTING = 10
"""Deepest nesting of ``{% for %}``, ``{% macro %}`` and ``{% call %}`` blocks, together. Jinja walks
such a block's whole body for each of them, so compiling grows with the cube of the nesting: 240
nested loops in 23 KB took 37 s before CPython refused them (it takes at most 20 nested blocks), 97
nested macros in 24 KB 6.8 s."""
MAX_LITERAL = 3_100
"""Longest number a template may write, in characters (MAX_BITS is about 3,011 decimal digits).
Jinja reads ``0x…`` without Python's 4,300-digit limit for decimals, and folds some operators on
constants while it compiles, where no limit is checked: ``0xff…f // 0xee…e`` of a megabyte, eleven
tokens, took 40 s of CPU in the API."""


_SCOPES = frozenset({"for", "macro", "call"})
_SCOPE_ENDS = frozenset({"endfor", "endmacro", "endcall"})
_LONG_NUMBER = re.compile(rf"(?<![0-9_])[0-9_]{{{MAX_LITERAL + 1},}}|0[xXoObB][0-9a-fA-F_]{{{MAX_LITERAL},}}")
"""Looked for before the lexer, whose number pattern takes hundreds of MB on a 2 MB run of digits.
Only from a run's start (the lookbehind): tried inside each run too, the search was quadratic in
its length (600 runs of 3,100 digits took 3.6 s)."""


def _token_problem(env: jinja2.Environment, source: str) -> str | None:
    """Why ``source`` is too big to parse (more than MAX_TOKENS tokens, counted by Jinja's own lexer
    up to the limit, or a number longer than MAX_LITERAL), or None. A lexing error is not a problem
    here: the parse reports it, with its line, after fewer tokens than counted here."""
    long_number = _LONG_NUMBER.search(source)
    if long_number is not None:
        return f"a number in the template is longer than {MAX_LITERAL:,} characters"
    count = loops = 0
    tag = False  # the token before was a tag's opening ({%), bar whitespace
    try:
        for _, kind, value in env.lexer.tokeniter(source, None):
            count += 1
            if kind == "whitespace":
                continue
            if tag and kind == "name":
                if value in _SCOPES:
                    loops += 1
                    if loops > MAX_LOOP_NESTING:
                        return f"the template nests loops, macros or calls more than {MAX_LOOP_NESTING} deep"
                elif value in _SCOPE_ENDS:
                    loops = max(loops - 1, 0)
            tag = kind == "block_begin"
            if count > MAX_TOKENS:
                return f"the template has more than {MAX_TOKENS:,} template tokens (tags, names, operators): use fewer"
            if (kind == "integer" or kind == "float") and len(value) > MAX_LITERAL:
                return f"a number in the template is longer than {MAX_LITERAL:,} characters"
    except jinja2.TemplateSyntaxError:
        pass
    return None


def compile_template(
    source: str, *, html: bool = False, field: str = "template", allowed: Iterable[str] | None = None
) -> CompiledTemplate:
    """Compile ``source``; raise TemplateError naming ``field`` on a syntax error or unknown variable."""
    env = _HTML if html else _TEXT
    problem = _token_problem(env, source)
    if problem is not None:
        raise TemplateError(f"{field}: {problem}")
    try:
        parsed = env.parse(source)
        variables = _undeclared(parsed)
        template = env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"{field}: template syntax error on line {exc.lineno}: {exc.message}") from None
    except (RecursionError, SyntaxError):
        # Jinja parses recursively and compiles to Python, which caps nesting (blocks, parentheses)
        raise TemplateError(f"{field}: the template is nested too deeply") from None
    except (ValueError, OverflowError, MemoryError) as exc:  # a number literal of 5,000 digits, say
        raise TemplateError(f"{field}: the template cannot be compiled: {type(exc).__name__}: {exc}") from None
    if allowed is not None:
        unknown = sorted(variables - set(allowed))
        if unknown:
            raise TemplateError(
                f"{field}: unknown template variable(s) {', '.join(unknown)}; available: {', '.join(sorted(allowed))}"
            )
    if not variables and "{%" not in source and "{{" not in source:
        return CompiledTemplate(source, variables, None, source)
    if not variables:
        # No per-recipient input: render once, now.
        once = CompiledTemplate(source, variables, template, None, dict(template.globals))
        return CompiledTemplate(source, variables, None, once.render({}))
    plan = Plan.of(parsed, html=html)
    return CompiledTemplate(source, variables, template, None, dict(template.globals), plan)


MAX_INDENT = 50
"""Deepest nesting of lists and quotes an HTML part may have for a text part to be made from it:
html2text indents each line by its depth, so its text grows with the square of the nesting (96 KB
of nested lists made 144 MB of text in 27 s, which was then compiled as a template). Counted from
the parser's own tags: a count of the source's ``</ul>`` was fooled by one in a comment or an
attribute (296 KB made 64 MB in 15 s)."""
_INDENTING = frozenset({"ul", "ol", "dl", "blockquote"})


_WS_RUN = re.compile(r"\s{3,}")


def _short_run(match: re.Match[str]) -> str:
    """A run of whitespace as html2text sees it in the end: its first and last characters (which it
    looks at), a line end between if it had one (a line start, which its escaping looks at)."""
    run = match[0]
    return run[0] + ("\n" if "\n" in run[1:-1] else "") + run[-1]


class _TooMuchText(Exception):
    pass


def html_to_text(html: str) -> str:
    """A readable text part from an HTML template (links kept as ``[text](url)``); template tags survive."""
    import html2text

    class Converter(html2text.HTML2Text):
        depth = 0
        size = 0

        work = 0

        def handle_tag(self, tag: str, attrs: dict[str, str | None], start: bool) -> None:
            if tag == "abbr":
                # an <abbr title> left open gathers every later piece of text with +=: quadratic
                # (80 KB took 16.5 s); without it, only the *[abbr]: footnotes are missing
                return
            self._clock()
            if tag in _INDENTING:
                self.depth = self.depth + 1 if start else max(self.depth - 1, 0)
            super().handle_tag(tag, attrs, start)
            # html2text's own depths too: "</dl>" closes none of its lists (1,000-deep lists in 9 KB)
            if max(self.depth, len(self.list), self.blockquote) > MAX_INDENT:
                raise _TooMuchText(
                    f"html: lists or quotes nested more than {MAX_INDENT} deep (to make a text part from it): "
                    "give a text part"
                )

        deadline = time.thread_time() + 2.0

        def _clock(self) -> None:
            if time.thread_time() > self.deadline:
                raise _TooMuchText("html: making a text part from it takes too long: give a text part")

        def handle_data(self, data: str, entity_char: bool = False) -> None:
            self._clock()
            if not self.pre and not self.code:
                # html2text collapses whitespace outside <pre> anyway; its ^(\s*) regexes are quadratic on it
                data = _WS_RUN.sub(_short_run, data)
            super().handle_data(data, entity_char)

        def o(self, data: str, puredata: bool = False, force: bool | str = False) -> None:
            # every piece, written or dropped (inside <head> nothing is written, work is still done)
            self.work += len(data)
            if self.work > MAX_WORK:
                raise _TooMuchText("html: making a text part from it takes too much work: give a text part")
            super().o(data, puredata, force)

        def outtextf(self, s: str) -> None:  # every piece of the text, as it is made
            self.size += len(s)
            if self.size > MAX_OUTPUT:
                raise _TooMuchText(
                    f"html: the text part made from it would be longer than {MAX_OUTPUT:,} characters: give a text part"
                )
            super().outtextf(s)

    converter = Converter()
    converter.body_width = 0
    converter.ignore_images = True
    converter.unicode_snob = True
    try:
        return str(converter.handle(html)).strip() + "\n"
    except _TooMuchText as exc:
        raise TemplateError(str(exc)) from None
    except (ValueError, OverflowError, RecursionError) as exc:  # &#<5,000 digits>; in html.parser
        raise TemplateError(
            f"html: a text part cannot be made from it ({type(exc).__name__}): give a text part"
        ) from None


_STYLE = re.compile(r"<style[^>]*>(.*?)(?:</style|$)", re.I | re.S)
_ELEMENT = re.compile(r"<[A-Za-z]")


def inline_css(html: str) -> str:
    """Move <style> rules into style="" attributes (what mail clients honour). Template tags survive:
    css-inline leaves text nodes and attribute values alone; if it ever changed the variables a
    template uses, the original is kept."""
    import css_inline

    if "<style" not in html.lower() or _token_problem(_HTML, html) is not None:  # compiling refuses it
        return html
    css = "".join(_STYLE.findall(html))
    declarations, selectors = css.count(":") + 1, css.count(",") + css.count("{") + 1
    elements = len(_ELEMENT.findall(html)) + 1
    if selectors * elements > 20_000_000 or declarations * declarations * elements > 300_000_000:
        return html  # css-inline matches every selector at every element and merges declarations quadratically
    # Never fetch: a <link rel=stylesheet> pointing anywhere must not make sendonce download it.
    inliner = css_inline.CSSInliner(load_remote_stylesheets=False)
    try:
        inlined = str(inliner.inline(html))
    except Exception:  # css-inline refuses some inputs (an unreachable stylesheet...): keep the HTML
        return html
    # A rule with template tags is copied into every element it matches: 40 KB of source became
    # 2.2 MB and 250,000 tokens, whose parse took 9 s. Such a result (or one larger than a message
    # can be) is not used; the HTML is sent as it was written.
    if len(inlined) > MAX_OUTPUT or _token_problem(_HTML, inlined) is not None:
        return html
    try:
        before = _undeclared(_HTML.parse(html))
        after = _undeclared(_HTML.parse(inlined))
    except (jinja2.TemplateSyntaxError, RecursionError):
        return html
    return inlined if before == after else html


def attribute_keys(*sources: str | None) -> set[str]:
    """The subscriber attribute names templates read: ``attributes.x``, ``attributes['x']``,
    ``subscriber.attributes.x``."""
    from jinja2 import nodes

    keys: set[str] = set()
    for source in sources:
        if not source or _token_problem(_TEXT, source) is not None:  # compiling refuses it
            continue
        try:
            tree = _TEXT.parse(source)
        except (jinja2.TemplateSyntaxError, RecursionError):
            continue
        for node in tree.find_all((nodes.Getattr, nodes.Getitem)):
            assert isinstance(node, nodes.Getattr | nodes.Getitem)
            target = node.node
            is_attributes = (isinstance(target, nodes.Name) and target.name == "attributes") or (
                isinstance(target, nodes.Getattr)
                and target.attr == "attributes"
                and isinstance(target.node, nodes.Name)
                and target.node.name == "subscriber"
            )
            if not is_attributes:
                continue
            if isinstance(node, nodes.Getattr):
                keys.add(node.attr)
            elif isinstance(node, nodes.Getitem):
                arg = node.arg
                if isinstance(arg, nodes.Const) and isinstance(arg.value, str):
                    keys.add(arg.value)
    return keys
