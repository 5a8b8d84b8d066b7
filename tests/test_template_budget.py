"""A chat template is someone else's program: it renders within a budget of seconds and characters
(runtime/template.py), and going over it is one TextError naming the template and the limit — never a hang,
an allocation of gigabytes, or an internal error. Templates written for transformers render exactly as
jinja2's own sandbox renders them."""

import json
import shutil
import signal
import time
import tracemalloc

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

import porter
from porter.cli import main as porter_cli
from porter.errors import EXIT_BAD_INPUT
from runtime.template import TemplateBudget
from runtime.text import TextError, render_template

SMALL = TemplateBudget(seconds=0.3, chars=20_000)
SLACK_S = 2.0  # beyond the budget: the hook that notices, unwinding, and a busy 2-core CI machine
PEAK_BYTES = 16 << 20  # Python allocations while rendering within SMALL (a runaway one allocates gigabytes)

PREAMBLE = (
    "{% set ns = namespace(s='ab', n=3, a=[1]) %}{% set s = 'abc' %}"
    "{% macro tree(n) %}{% if n > 0 %}{{ tree(n - 1) }}{{ tree(n - 1) }}{% endif %}{% endmacro %}"
    "{% macro deep(n) %}{{ deep(n + 1) }}{% endmacro %}"
    "{% macro grow(t, n) %}{{ grow(t ~ t, n - 1) if n else t|length }}{% endmacro %}"
)
BIG = ["3", "1000", "100000", "10**9", "10**18"]
# Each hostile shape, with a size or count N to fill in: loops, recursion, growth, and every operation that
# builds far more than it is given.
PIECES = [
    "x",
    "{{ s }}",
    "{{ s ~ s ~ s }}",
    "{% set ns.s = ns.s ~ ns.s %}",
    "{% set ns.a = [ns.a, ns.a] %}{{ ns.a|length }}",
    "{% set ns.n = ns.n * ns.n %}",
    "{{ 'y' * N }}",
    "{{ [s] * N }}",
    "{{ 7 ** N }}",
    "{{ s|center(N) }}",
    "{{ s.ljust(N) }}",
    "{{ '%*d' % (N, 1) }}",
    "{{ '{:>{}}'.format(s, N) }}",
    "{{ (s * 1000)|replace('', s * 100) }}",
    "{{ ('a\\n' * 1000)|indent(N) }}",
    "{{ [1, 2]|tojson(indent=N) }}",
    "{{ range(N)|list|length }}",
    "{{ [1]|slice(N)|list|length }}",
    "{{ tree(N) }}",
    "{{ deep(0) }}",
    "{{ grow('x', 64) }}",
    "{{ ns.a|tojson }}",
    "{{ strftime_now('%0' ~ N ~ 'Y') }}",
]


def loops(body: str, counts: list) -> str:
    for n in counts:
        body = f"{{% for i in range({n}) %}}{body}{{% endfor %}}"
    return body


hostile = st.builds(
    lambda pieces, n, counts: PREAMBLE + loops("".join(p.replace("N", n) for p in pieces), counts),
    st.lists(st.sampled_from(PIECES), min_size=1, max_size=4),
    st.sampled_from(BIG),
    st.lists(st.sampled_from(BIG[:3]), max_size=3),
)


def render_measured(source: str, budget=SMALL, **context):
    """(rendered text or the TextError, seconds, peak bytes allocated)."""
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        out = render_template(source, origin="T.jinja", budget=budget, **context)
    except TextError as e:
        out = e
    seconds = time.monotonic() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return out, seconds, peak


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(source=hostile)
def test_hostile_templates_end_within_the_budget(source):
    out, seconds, peak = render_measured(source, messages=[{"role": "user", "content": "hi"}])
    assert seconds < SMALL.seconds + SLACK_S, source
    assert peak < PEAK_BYTES, (peak, source)
    if isinstance(out, TextError):
        msg = str(out)
        assert "\n" not in msg and msg.startswith("chat template (T.jinja): "), msg
    else:
        assert len(out) <= SMALL.chars, source


@pytest.mark.parametrize(
    "source, limit",
    [
        (
            "{% for i in range(10**9) %}x{% endfor %}",
            "range() of 1,000,000,000 items exceeds the sandbox's limit",
        ),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "rendering takes longer than its budget of 0.3 s",
        ),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "calls nest deeper than 100"),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "over the size budget of 20,000",
        ),
        ("{% for i in range(100000) %}xxxxxxxxxx{% endfor %}", "the rendered text: 20,010 characters"),
        ("{{ 'x' * 10**12 }}", "the result of '*': 1,000,000,000,000 characters"),
        ("{{ 10 ** (10 ** 10) }}", "an integer of up to 40,000,000,000 bits, over the limit of 65,536"),
        ("{{ 'x'|center(10**9) }}", "the center filter: 1,000,000,000 characters"),
        ("{{ '%0999999999d' % 1 }}", "the result of '%'"),
        ("{{ lipsum(10**6) }}", "'lipsum' is undefined"),
        ("{{ messages.__class__.__mro__ }}", "SecurityError"),
        ("{{ raise_exception('no system role') }}", "chat template (T.jinja): no system role"),
        ("{{ cycler.__init__.__globals__ }}", "SecurityError"),
    ],
)
def test_each_limit_is_named(source, limit):
    out, seconds, peak = render_measured(source, messages=[])
    assert isinstance(out, TextError), out
    assert limit in str(out) and "\n" not in str(out), str(out)
    assert seconds < SMALL.seconds + SLACK_S and peak < PEAK_BYTES


def test_a_template_stops_at_its_deadline_in_any_thread():
    """No signal reaches a worker thread: there the hooks alone stop a template that never ends."""
    from concurrent.futures import ThreadPoolExecutor

    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
    with ThreadPoolExecutor(1) as pool:
        out, seconds, peak = pool.submit(render_measured, endless).result()
    assert isinstance(out, TextError) and "longer than its budget of 0.3 s" in str(out), out
    assert seconds < SMALL.seconds + SLACK_S and peak < PEAK_BYTES


def test_a_library_loop_is_interrupted_on_the_main_thread():
    """Time spent inside a function's own Python loop passes no hook: SIGALRM stops it at the deadline, and
    the handler and timer are as they were afterwards."""

    def spin():
        while True:
            pass

    before = signal.getsignal(signal.SIGALRM)
    out, seconds, _ = render_measured("{{ spin() }}", spin=spin)
    assert isinstance(out, TextError) and "longer than its budget of 0.3 s" in str(out), out
    assert seconds < SMALL.seconds + SLACK_S
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL)[0] == 0


# Templates of the shapes checkpoints ship (roles, system prompt, tools as JSON, namespace state, macros,
# loop variables, string tests and methods): rendered exactly as jinja2's sandbox renders them.
TRANSFORMERS_LIKE = """{%- macro render_content(c) -%}
{%- if c is string -%}{{ c | trim }}{%- else -%}{%- for part in c -%}{%- if part.type == 'text' -%}{{ part.text }}
{%- endif -%}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(system='', last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{{- bos_token -}}
{%- if messages and messages[0].role == 'system' -%}{%- set ns.system = render_content(messages[0].content) -%}
{%- endif -%}
{%- if tools -%}<tools>{%- for t in tools %}
{{ t | tojson }}{% endfor %}
</tools>{{ '\\n' }}{%- endif -%}
{%- if ns.system -%}<|system|>{{ ns.system }}{{ eos_token }}{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}{%- continue -%}{%- endif -%}
{%- if m.role not in ['user', 'assistant', 'tool'] -%}{{ raise_exception('unknown role ' ~ m.role) }}{%- endif -%}
<|{{ m.role }}|>{{ render_content(m.content) }}
{%- if m.role == 'assistant' and m.tool_calls is defined -%}{%- for call in m.tool_calls -%}
<call name="{{ call.name }}">{{ call.arguments | tojson }}</call>{%- endfor -%}{%- endif -%}
{%- if loop.index0 == ns.last_user %} (last user turn {{ '%d/%d' % (loop.index, loop.length) }}){%- endif -%}
{{ eos_token }}{{ '\\n' if not loop.last }}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{{ '{:>3}'.format(messages | length) }}{%- endif -%}"""

text = st.text(st.characters(blacklist_categories=["Cs"]), max_size=40)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "tool"]),
        "content": text
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=3),
    },
    optional={
        "tool_calls": st.lists(
            st.fixed_dictionaries({"name": text, "arguments": st.dictionaries(text, text, max_size=2)}),
            max_size=2,
        )
    },
)


def jinja2_oracle(source: str, **context) -> str:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(ValueError(m))
    return env.from_string(source).render(**context)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    system=st.none() | text,
    messages=st.lists(message, max_size=5),
    tools=st.lists(st.dictionaries(text, text | st.integers(), max_size=3), max_size=2),
    add_generation_prompt=st.booleans(),
)
def test_templates_render_as_jinja2_renders_them(system, messages, tools, add_generation_prompt):
    messages = ([{"role": "system", "content": system}] if system is not None else []) + messages
    context = dict(
        messages=messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        bos_token="<s>",
        eos_token="</s>",
    )
    assert render_template(TRANSFORMERS_LIKE, **context) == jinja2_oracle(TRANSFORMERS_LIKE, **context)


def test_a_long_conversation_fits_the_default_budget():
    """16 Mi characters of output by default: 2,000 turns of 2,000 characters (4 M) render, in time."""
    messages = [
        {"role": "user" if i % 2 else "assistant", "content": f"{i:04d}" + "w" * 1996} for i in range(2000)
    ]
    t0 = time.monotonic()
    out = render_template(
        TRANSFORMERS_LIKE, messages=messages, tools=[], add_generation_prompt=True, bos_token="", eos_token=""
    )
    assert time.monotonic() - t0 < TemplateBudget().seconds
    assert len(out) > 2000 * 2000 and out == jinja2_oracle(
        TRANSFORMERS_LIKE, messages=messages, tools=[], add_generation_prompt=True, bos_token="", eos_token=""
    )


@pytest.fixture(scope="module")
def artifact(tiny_vendor, tmp_path_factory):
    d = tmp_path_factory.mktemp("tb") / "art"
    porter.convert(tiny_vendor, d, progress=False)
    return d


@pytest.mark.parametrize(
    "template, limit",
    [
        ("{% for i in range(10**9) %}x{% endfor %}", "range() of 1,000,000,000 items"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "calls nest deeper than 100"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    ],
)
def test_generate_chat_exits_2_naming_the_template(artifact, tmp_path, template, limit):
    d = tmp_path / "art"
    shutil.copytree(artifact, d)
    (d / "chat_template.jinja").write_text(template)
    res = CliRunner().invoke(
        porter_cli, ["generate", str(d), "--chat", "--prompt", "hi", "--max-new-tokens", "1"]
    )
    assert res.exit_code == EXIT_BAD_INPUT, res.output
    line = res.output.strip().splitlines()[-1]
    assert (
        line.startswith(f"porter: error: chat template ({d / 'chat_template.jinja'}): ") and limit in line
    ), line
