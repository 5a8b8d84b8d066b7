"""Chat templates rendered within a budget of time and size.

A checkpoint's chat template is a program someone else wrote. It renders in jinja2's immutable sandbox, which
refuses whatever could run code or change the caller's objects (SecurityError), and here within a
`TemplateBudget`: seconds of rendering, characters of output and of any value it builds, characters built in
all (`WORK_FACTOR` times the output budget), nesting of calls. Over any limit rendering stops with a
`TemplateLimit` naming it; `render` turns that into one `TextError` naming the template.

How the budget is kept, in any thread:
- every step a template takes passes through a hook: each loop iteration (every `for` iterable is wrapped),
  call (macros, methods, globals), filter and test, attribute or item lookup, arithmetic operator, `~`
  concatenation, namespace assignment and output chunk. Each hook checks the clock, so a template that loops
  or recurses without end stops at its deadline even though a Python loop cannot be interrupted from outside;
- what a hook is about to build is sized first: operands and arguments by their flattened size (what `str`,
  `tojson` or `join` would make of them, shared sub-lists counted each time they appear), and the operations
  that build far more than they are given have their result size computed before they run (`SIZERS`: `*`,
  `**`, `%` and format widths, padding, `replace`, `indent`, `tojson(indent=)`, ...). A single C-level call
  therefore never allocates beyond the budget;
- on the main thread, when nothing else uses it, a SIGALRM timer at the deadline interrupts time spent inside
  a library function's own Python loop, which no hook sees.
`range()` is limited to jinja2's MAX_RANGE items and `lipsum` (a generator of arbitrary amounts of text) is
not offered; no chat template written for transformers uses it.
"""

from __future__ import annotations

import functools
import json
import re
import signal
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Optional

WORK_FACTOR = 8  # characters built over a whole render, per character of the output budget
INT_BITS = 1 << 16  # the largest integer a template may build (about 20,000 digits)
MAX_ITEMS = 100_000  # range() length, slice()/batch() counts: jinja2's sandbox MAX_RANGE


@dataclass(frozen=True)
class TemplateBudget:
    """What rendering one chat template may spend."""

    seconds: float = 5.0
    chars: int = 1 << 24  # output, and any one value built (16 Mi characters)
    depth: int = 100  # calls (macros, recursive loops) nested in one another

    @property
    def work(self) -> int:
        return WORK_FACTOR * self.chars


class TemplateLimit(Exception):
    """A template went over its budget (the message names the limit)."""


# ---------------------------------------------------------------------------------------------- sizes
_CONTAINERS = (list, tuple, dict, set, frozenset)


def _scalar_size(v) -> int:
    if isinstance(v, (str, bytes, bytearray)):
        return len(v)
    if isinstance(v, bool) or v is None:
        return 5
    if isinstance(v, int):
        return v.bit_length() * 3 // 10 + 2  # decimal digits and sign
    if isinstance(v, float):
        return 24
    return 0  # macros, undefined values, functions: str() of them is short


def _children(v):
    return [x for kv in v.items() for x in kv] if isinstance(v, dict) else list(v)


class Sizes:
    """Flattened sizes of the values a render sees, memoized per object (kept alive here, so an id is never
    reused): a structure of shared sub-lists costs its distinct objects, however large it flattens."""

    def __init__(self, limit: int):
        self.limit = limit
        self.memo: dict = {}  # id -> (object, flat size, depth)

    def of(self, v) -> tuple[int, int]:
        """(characters v flattens to, nesting depth), the size capped just above the limit."""
        if not isinstance(v, _CONTAINERS):
            return _scalar_size(v), 0
        if id(v) in self.memo:
            return self.memo[id(v)][1:]
        stack, busy = [(v, False)], set()
        while stack:
            node, children_done = stack.pop()
            if id(node) in self.memo:
                continue
            kids = _children(node)
            if not children_done:
                if id(node) in busy:  # a caller's structure that contains itself: no finite flattening
                    raise TemplateLimit("a value contains itself")
                busy.add(id(node))
                stack.append((node, True))
                stack.extend(
                    (k, False) for k in kids if isinstance(k, _CONTAINERS) and id(k) not in self.memo
                )
                continue
            size, depth = 2, 0
            for k in kids:
                s, d = self.memo[id(k)][1:] if isinstance(k, _CONTAINERS) else (_scalar_size(k), 0)
                size, depth = min(size + s + 2, self.limit + 1), max(depth, d + 1)
            self.memo[id(node)] = (node, size, depth)
            busy.discard(id(node))
        return self.memo[id(v)][1:]

    def flat(self, v) -> int:
        return self.of(v)[0]


# ----------------------------------------------------------------------- result sizes computed first
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_FIELD = re.compile(r"\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}")


def _number(digits: str) -> int:
    return int(digits) if len(digits) < 19 else 1 << 62  # no int() of a 5,000-digit run


def format_size(fmt, args=(), kwargs=None) -> int:
    """Upper bound of the padding a format string asks for, %-style or {}-style: every field's literal
    width/precision, or for a width taken from the arguments ('%*d', '{:{}}') the largest integer given."""
    if not isinstance(fmt, str):
        return 0
    ints = [abs(a) for a in _flat_args(args, kwargs or {}) if isinstance(a, int) and not isinstance(a, bool)]
    widest_arg = max(ints, default=0)
    total = 0
    for m in _PERCENT_FIELD.finditer(fmt):
        total += sum(widest_arg if g == "*" else _number(g) for g in m.groups() if g)
    for m in _BRACE_FIELD.finditer(fmt):
        spec = m.group(0).partition(":")[2]
        total += sum(_number(d) for d in re.findall(r"\d+", spec)) + (widest_arg if "{" in spec else 0)
    return total


def _flat_args(args, kwargs) -> list:
    out = []
    for a in list(args) + list(kwargs.values()):
        out.extend(a if isinstance(a, (list, tuple)) else a.values() if isinstance(a, dict) else [a])
    return out


def _arg(args, kwargs, i, name, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _width(w) -> int:
    return len(w) if isinstance(w, str) else w if isinstance(w, int) and not isinstance(w, bool) else 0


def _replace_size(s, args, kwargs) -> int:
    old, new = _arg(args, kwargs, 0, "old", ""), _arg(args, kwargs, 1, "new", "")
    count = _arg(args, kwargs, 2, "count", -1)
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    n = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and count is not None and count >= 0:
        n = min(n, count)
    return len(s) + n * max(0, len(new) - len(old))


def _indent_size(sizes: Sizes, value, indent) -> int:
    """json.dumps / pprint with an indent: every item on its own line, indented to its depth."""
    flat, depth = sizes.of(value)
    return flat + flat * depth * _width(indent)


def _translate_size(s, args, kwargs) -> int:
    table = _arg(args, kwargs, 0, "table", {})
    widest = (
        max((len(v) for v in table.values() if isinstance(v, str)), default=1)
        if isinstance(table, dict)
        else 1
    )
    return len(s) * max(1, widest) if isinstance(s, str) else 0


# method name -> (receiver, args, kwargs, sizes) -> result size; for str and bytes receivers
METHOD_SIZERS = {
    "center": lambda s, a, k, z: max(len(s), _width(_arg(a, k, 0, "width", 0))),
    "ljust": lambda s, a, k, z: max(len(s), _width(_arg(a, k, 0, "width", 0))),
    "rjust": lambda s, a, k, z: max(len(s), _width(_arg(a, k, 0, "width", 0))),
    "zfill": lambda s, a, k, z: max(len(s), _width(_arg(a, k, 0, "width", 0))),
    "expandtabs": lambda s, a, k, z: (
        len(s) + s.count("\t" if isinstance(s, str) else b"\t") * _width(_arg(a, k, 0, "tabsize", 8))
    ),
    "replace": lambda s, a, k, z: _replace_size(s, a, k),
    "format": lambda s, a, k, z: len(s) + format_size(s, a, k) + sum(z.flat(x) for x in _flat_args(a, k)),
    "format_map": lambda s, a, k, z: len(s) + format_size(s, a, k) + sum(z.flat(x) for x in _flat_args(a, k)),
    "translate": lambda s, a, k, z: _translate_size(s, a, k),
    "join": lambda s, a, k, z: _join_size(z, s, _arg(a, k, 0, "iterable", ())),
}


def _lines(s, width=None) -> int:
    """Lines of a text, or for wrapping at `width` an upper bound of them (every word may start one)."""
    if not isinstance(s, str):
        return 1
    n = s.count("\n") + 1
    if width is not None:
        n += s.count(" ") + len(s) // max(_width(width), 1)
    return n


def _sum_size(sizes: Sizes, items) -> Optional[int]:
    """sum() of lists concatenates them one by one: every partial sum is a new list."""
    if not isinstance(items, (list, tuple)) or not any(isinstance(x, (list, tuple)) for x in items):
        return None
    return sizes.flat(items) * len(items) // 2


def _join_size(sizes: Sizes, sep, items) -> int:
    if not isinstance(items, (list, tuple)):
        return 0  # a generator: each item was built (and counted) by a hook
    return sum(sizes.flat(x) for x in items) + len(sep) * len(items)


# filter name -> (args after the value and any context argument, kwargs, sizes, value) -> result size
FILTER_SIZERS = {
    "center": lambda v, a, k, z: max(z.flat(v), _width(_arg(a, k, 0, "width", 80))),
    "indent": lambda v, a, k, z: z.flat(v) + _lines(v) * _width(_arg(a, k, 0, "width", 4)),
    "wordwrap": lambda v, a, k, z: (
        z.flat(v) + _lines(v, _arg(a, k, 0, "width", 79)) * _width(_arg(a, k, 2, "wrapstring", "\n"))
    ),
    "format": lambda v, a, k, z: z.flat(v) + format_size(v, a, k) + sum(z.flat(x) for x in _flat_args(a, k)),
    "replace": lambda v, a, k, z: _replace_size(v, a, k),
    "tojson": lambda v, a, k, z: _indent_size(z, v, _arg(a, k, 0, "indent", None)),
    "pprint": lambda v, a, k, z: _indent_size(z, v, 1),
    "join": lambda v, a, k, z: _join_size(z, _arg(a, k, 0, "d", ""), v),
    "sum": lambda v, a, k, z: _sum_size(z, v),
    # counts that drive the filter's own Python loop or the padding it adds
    "batch": lambda v, a, k, z: (
        _width(_arg(a, k, 0, "linecount", 0)) * (1 + z.flat(_arg(a, k, 1, "fill_with")))
    ),
    "slice": lambda v, a, k, z: _width(_arg(a, k, 0, "slices", 0)) * (1 + z.flat(_arg(a, k, 1, "fill_with"))),
}
COUNTED_FILTERS = {"batch": "linecount", "slice": "slices"}  # a count that is also a loop count: <= MAX_ITEMS


def int_bits(op: str, left, right) -> int:
    """Bits of the integer `left op right` builds (0 unless it is an integer product or power)."""
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (left, right)):
        return 0
    if op == "*":
        return abs(left).bit_length() + abs(right).bit_length()
    if op == "**" and right > 0 and abs(left) > 1:
        return abs(left).bit_length() * right
    return 0


def binop_size(sizes: Sizes, op: str, left, right) -> Optional[int]:
    """The result size of `left op right` when it can be far larger than its operands, else None."""
    seq = (str, bytes, list, tuple)
    if op == "*":
        for a, n in ((left, right), (right, left)):
            if isinstance(a, seq) and isinstance(n, int) and not isinstance(n, bool):
                return sizes.flat(a) * max(n, 0)
    if op == "%" and isinstance(left, str):
        args = right if isinstance(right, tuple) else (right,)
        kwargs = right if isinstance(right, dict) else {}
        return len(left) + format_size(left, args, kwargs) + sum(sizes.flat(x) for x in args)
    return None


# ------------------------------------------------------------------------------------------ the sandbox
def _sandbox_class():
    """The budgeted sandbox class (built on first use: jinja2 is imported only by a chat render)."""
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace, pass_context

    class BudgetedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def __init__(self, budget: TemplateBudget):
            super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            self.budget = budget
            self.deadline = time.monotonic() + budget.seconds
            self.sizes = Sizes(budget.work)
            self.built = 0  # characters built so far
            self.depth = 0
            self.filters = {name: self._guard(name, f) for name, f in self.filters.items()}
            self.tests = {name: self._guard(None, f) for name, f in self.tests.items()}
            env = self

            class BudgetedNamespace(Namespace):
                def __setitem__(self, name, value):
                    env.spend(value)
                    super().__setitem__(name, value)

            self.globals.pop("lipsum", None)
            self.globals.update(range=self._range, namespace=BudgetedNamespace)
            for name, hook in (
                ("porter_loop", self._iterate),
                ("porter_out", self._out),
                ("porter_concat", self._concat),
            ):
                # a context filter is never run at compile time (constant folding), only by the render
                self.filters[name] = pass_context(lambda context, value, hook=hook: hook(value))
            self._loop_context = LoopContext

        # -- the checks every hook makes
        def tick(self) -> None:
            if time.monotonic() > self.deadline:
                raise TemplateLimit(f"rendering takes longer than its budget of {self.budget.seconds:g} s")

        def check_size(self, n: int, what: str) -> None:
            if n > self.budget.chars:
                raise TemplateLimit(
                    f"{what}: {n:,} characters, over the size budget of {self.budget.chars:,}"
                )

        def check_bits(self, bits: int) -> None:
            if bits > INT_BITS:
                raise TemplateLimit(f"an integer of up to {bits:,} bits, over the limit of {INT_BITS:,}")

        def check_args(self, args, kwargs) -> None:
            for a in list(args) + list(kwargs.values()):
                self.check_size(self.sizes.flat(a), "an argument")

        def spend(self, value):
            """Count a value a hook built (or is about to write) against the budget; return it."""
            self.tick()
            if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > INT_BITS:
                raise TemplateLimit(
                    f"an integer of {value.bit_length():,} bits exceeds the limit of {INT_BITS:,}"
                )
            n = self.sizes.flat(value)
            self.check_size(n, "a value")
            self.built += n
            if self.built > self.budget.work:
                raise TemplateLimit(
                    f"builds more than {self.budget.work:,} characters in all "
                    f"({WORK_FACTOR}x the size budget of {self.budget.chars:,})"
                )
            return value

        def check_result(self, n: Optional[int], what: str) -> None:
            """Before an operation runs: its result, of n characters, must fit the budgets."""
            if n is not None:
                self.check_size(n, what)
                if self.built + n > self.budget.work:
                    raise TemplateLimit(
                        f"builds more than {self.budget.work:,} characters in all "
                        f"({WORK_FACTOR}x the size budget of {self.budget.chars:,})"
                    )

        # -- hooks called by the compiled template
        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
            __self.tick()
            __self.check_args(args, kwargs)
            if isinstance(__obj, __self._loop_context) and args:  # a recursive loop's next level
                args = (__self._iterate(args[0]),) + args[1:]
            method = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
            receiver, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
            if isinstance(receiver, (str, bytes)) and name in METHOD_SIZERS:
                __self.check_result(
                    METHOD_SIZERS[name](receiver, args, kwargs, __self.sizes),
                    f"{type(receiver).__name__}.{name}()",
                )
            if isinstance(receiver, int) and name == "to_bytes":
                __self.check_result(_width(_arg(args, kwargs, 0, "length", 1)), "int.to_bytes()")
            __self.depth += 1
            try:
                if __self.depth > __self.budget.depth:
                    raise TemplateLimit(
                        f"calls nest deeper than {__self.budget.depth} (a macro recursing without end?)"
                    )
                return __self.spend(super().call(__context, __obj, *args, **kwargs))
            finally:
                __self.depth -= 1

        def call_binop(self, context, operator, left, right):
            self.tick()
            self.check_bits(int_bits(operator, left, right))
            self.check_result(binop_size(self.sizes, operator, left, right), f"the result of {operator!r}")
            return self.spend(super().call_binop(context, operator, left, right))

        def getattr(self, obj, attribute):
            self.tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            self.tick()
            value = super().getitem(obj, argument)
            return self.spend(value) if isinstance(argument, slice) else value  # a slice is a new value

        def _range(self, *args):
            r = range(*args)
            if len(r) > MAX_ITEMS:
                raise TemplateLimit(
                    f"range() of {len(r):,} items exceeds the sandbox's limit of {MAX_ITEMS:,}"
                )
            return r

        def _iterate(self, iterable):
            for item in iterable:
                self.tick()
                yield item

        def _out(self, value):
            self.check_size(self.sizes.flat(value), "an output")
            return self.spend(str(value))

        def _concat(self, parts):
            self.check_result(sum(self.sizes.flat(p) for p in parts), "a '~' concatenation")
            return self.spend("".join(map(str, parts)))

        def _guard(self, name, f):
            """A filter (or test, name None) that checks the clock, its arguments and, for the filters that can
            build far more than they are given, the result size before it runs."""
            from jinja2.utils import _PassArg

            skip = 0 if _PassArg.from_obj(f) is None else 1  # context / eval context / environment first

            @functools.wraps(f)
            def guarded(*args, **kwargs):
                self.tick()
                self.check_args(args[skip:], kwargs)
                if name in FILTER_SIZERS and len(args) > skip:
                    value, rest = args[skip], args[skip + 1 :]
                    count = _arg(rest, kwargs, 0, COUNTED_FILTERS.get(name, ""), 0)
                    if name in COUNTED_FILTERS and _width(count) > MAX_ITEMS:
                        raise TemplateLimit(
                            f"the {name} filter's count {count:,} exceeds the sandbox's limit of {MAX_ITEMS:,}"
                        )
                    self.check_result(
                        FILTER_SIZERS[name](value, rest, kwargs, self.sizes), f"the {name} filter"
                    )
                return f(*args, **kwargs) if name is None else self.spend(f(*args, **kwargs))

            return guarded

    return BudgetedSandbox


@functools.lru_cache(maxsize=1)
def _sandbox():
    return _sandbox_class()


def instrument(tree):
    """Route a parsed template through the hooks: every `for` iterable through `porter_loop`, every output
    expression through `porter_out`, every `~` through `porter_concat` (which sizes the parts first)."""
    from jinja2 import nodes

    def hooked(node, name):
        return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)

    parents = [tree, *tree.find_all(nodes.Node)]
    for parent in parents:
        for field in parent.fields:
            value = getattr(parent, field, None)
            if isinstance(value, nodes.Concat):
                setattr(parent, field, hooked(nodes.List(value.nodes, lineno=value.lineno), "porter_concat"))
            elif isinstance(value, list):  # in place: a List made from a Concat above shares this list
                value[:] = [
                    hooked(nodes.List(v.nodes, lineno=v.lineno), "porter_concat")
                    if isinstance(v, nodes.Concat)
                    else v
                    for v in value
                ]
    for node in tree.find_all(nodes.For):
        node.iter = hooked(node.iter, "porter_loop")
    for node in tree.find_all(nodes.Output):
        node.nodes = [n if isinstance(n, nodes.TemplateData) else hooked(n, "porter_out") for n in node.nodes]
    return tree


class _Alarm:
    """SIGALRM at the deadline on the main thread, when neither a handler nor a timer is set already: it
    interrupts a library function's own Python loop, which no hook sees."""

    def __init__(self, seconds: float, message: str):
        self.seconds, self.message, self.previous = seconds, message, None

    def _fire(self, signum, frame):
        raise TemplateLimit(self.message)

    def __enter__(self):
        usable = (
            hasattr(signal, "setitimer")
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None)
            and signal.getitimer(signal.ITIMER_REAL)[0] == 0
        )
        if usable:
            self.previous = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def disarm(self) -> None:
        if self.previous is not None:  # one-shot timer: once fired or stopped, no signal follows
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
            self.previous = None

    def __exit__(self, *exc):
        self.disarm()
        return False


def render(source: str, budget: TemplateBudget, globals_: dict, **context) -> str:
    """`source` rendered with `context` within `budget`; TemplateLimit over it, jinja2's TemplateError for a
    template that is wrong (SecurityError for one that reaches for code), any other exception the template
    raised itself."""
    env = _sandbox()(budget)
    env.filters["tojson"] = env._guard(
        "tojson",
        lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii),
    )

    def strftime_now(fmt):  # as transformers gives templates; a padding width in `fmt` is sized first
        env.check_result(format_size(fmt) + len(str(fmt)) * 4, "strftime_now()")
        return datetime.now().strftime(fmt)

    env.globals["strftime_now"] = strftime_now
    env.globals.update(globals_)
    if len(source) > budget.chars:
        raise TemplateLimit(
            f"its source of {len(source):,} characters exceeds the size budget of {budget.chars:,}"
        )
    alarm = _Alarm(budget.seconds, f"rendering takes longer than its budget of {budget.seconds:g} s")
    try:
        with alarm:
            template = env.from_string(instrument(env.parse(source)))
            out, n = [], 0
            for chunk in template.generate(**context):
                n += len(chunk)
                env.check_size(n, "the rendered text")
                out.append(chunk)
            return "".join(out)
    finally:
        alarm.disarm()  # again: a signal during __exit__ may have cut it short
