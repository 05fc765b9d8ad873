"""Templates: sandboxed Jinja2, compiled once per campaign, rendered per recipient.

The sandbox refuses attribute access to Python internals (``__class__``, ``__globals__``, ...),
and the environments have no loader, so a template cannot include or read files. Missing
variables are errors (StrictUndefined), never blanks in a sent mail.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from markupsafe import escape

from sendonce.errors import InvalidInput


class TemplateError(InvalidInput):
    """The template cannot be rendered."""


MAX_ITERATIONS = 100_000
"""Loop iterations one render may make, all loops together."""
MAX_OUTPUT = 2_000_000
"""Characters one render may produce."""
MAX_REPEAT = 100_000
"""Longest string or list a template may build with ``*``."""

_BUDGET: ContextVar[list[int]] = ContextVar("sendonce_template_budget")


def _budgeted(iterable: Any) -> Iterator[Any]:
    """Every template loop iterates through here: a template that loops too much is stopped."""
    budget = _BUDGET.get(None)
    for item in iterable:
        if budget is not None:
            budget[0] -= 1
            if budget[0] < 0:
                raise SecurityError(f"the template loops too much (over {MAX_ITERATIONS} iterations)")
        yield item


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with limits on work as well as on access: loops share an iteration budget per
    render, ``*`` and ``**`` cannot build huge values, and output is capped as it is produced."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals["_sendonce_iter"] = _budgeted

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.Name("_sendonce_iter", "load"), [loop.iter], [], None, None)
        return tree

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int | float) and abs(right) > 64:
            raise SecurityError("the template computes a power too large")
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(times, int) and len(seq) * times > MAX_REPEAT:
                    raise SecurityError(f"the template builds a value longer than {MAX_REPEAT}")
        return super().call_binop(context, operator, left, right)


_TEXT = _Sandbox(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True)
_HTML = _Sandbox(undefined=jinja2.StrictUndefined, autoescape=True, keep_trailing_newline=True)


@dataclass(frozen=True, slots=True)
class CompiledTemplate:
    source: str
    variables: frozenset[str]
    _template: jinja2.Template | None
    _static: str | None
    _globals: dict[str, Any] = field(default_factory=dict)
    """The template's globals, merged into a plain dict once (Jinja merges its ChainMap per render)."""
    _loops: bool = True
    """The template has a loop: a render sets up the iteration budget (a template without one never
    reads it)."""
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
        token = _BUDGET.set([MAX_ITERATIONS]) if self._loops else None
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
            if token is not None:
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


def compile_template(
    source: str, *, html: bool = False, field: str = "template", allowed: Iterable[str] | None = None
) -> CompiledTemplate:
    """Compile ``source``; raise TemplateError naming ``field`` on a syntax error or unknown variable."""
    env = _HTML if html else _TEXT
    try:
        parsed = env.parse(source)
        variables = frozenset(meta.find_undeclared_variables(parsed))
        template = env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"{field}: template syntax error on line {exc.lineno}: {exc.message}") from None
    except (RecursionError, SyntaxError):
        # Jinja parses recursively and compiles to Python, which caps nesting (blocks, parentheses)
        raise TemplateError(f"{field}: the template is nested too deeply") from None
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
    loops = next(parsed.find_all(nodes.For), None) is not None
    plan = Plan.of(parsed, html=html)
    return CompiledTemplate(source, variables, template, None, dict(template.globals), loops, plan)


def html_to_text(html: str) -> str:
    """A readable text part from an HTML template (links kept as ``[text](url)``); template tags survive."""
    import html2text

    converter = html2text.HTML2Text()
    converter.body_width = 0
    converter.ignore_images = True
    converter.unicode_snob = True
    return str(converter.handle(html)).strip() + "\n"


def inline_css(html: str) -> str:
    """Move <style> rules into style="" attributes (what mail clients honour). Template tags survive:
    css-inline leaves text nodes and attribute values alone; if it ever changed the variables a
    template uses, the original is kept."""
    import css_inline

    if "<style" not in html.lower():
        return html
    # Never fetch: a <link rel=stylesheet> pointing anywhere must not make sendonce download it.
    inliner = css_inline.CSSInliner(load_remote_stylesheets=False)
    try:
        inlined = str(inliner.inline(html))
    except Exception:  # css-inline refuses some inputs (an unreachable stylesheet...): keep the HTML
        return html
    try:
        before = meta.find_undeclared_variables(_HTML.parse(html))
        after = meta.find_undeclared_variables(_HTML.parse(inlined))
    except (jinja2.TemplateSyntaxError, RecursionError):
        return html
    return inlined if before == after else html


def attribute_keys(*sources: str | None) -> set[str]:
    """The subscriber attribute names templates read: ``attributes.x``, ``attributes['x']``,
    ``subscriber.attributes.x``."""
    from jinja2 import nodes

    keys: set[str] = set()
    for source in sources:
        if not source:
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
