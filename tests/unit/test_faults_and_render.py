from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sendonce.chaos.processes import death_note
from sendonce.delivery.compose import CAMPAIGN_VARIABLES, compile_campaign
from sendonce.delivery.render import TemplateError, compile_template
from sendonce.faults import DEATH_NOTE, Faults


def test_faults_are_inert_unless_configured() -> None:
    faults = Faults(None)
    assert not faults.active
    for point in ("after_claim", "before_send", "after_accept", "after_record", "mid_build"):
        faults.hit(point)  # would kill this process if it were not inert


def test_fault_spec_is_validated() -> None:
    assert Faults("after_accept=0.5, after_claim").probabilities == {"after_accept": 0.5, "after_claim": 1.0}
    with pytest.raises(ValueError, match="unknown fault point"):
        Faults("before_lunch=0.1")
    with pytest.raises(ValueError, match="probability"):
        Faults("after_accept=2")


def test_templates_render_per_recipient_and_static_ones_once() -> None:
    static = compile_template("Hello all")
    assert static.render({}) == "Hello all"
    dynamic = compile_template("Hello {{ name }}")
    assert dynamic.render({"name": "Ann"}) == "Hello Ann"
    html = compile_template("<p>{{ name }}</p>", html=True)
    assert html.render({"name": "<script>"}) == "<p>&lt;script&gt;</p>"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{% for c in 'abc' %}{{ c }}{% endfor %}", "abc"),  # every loop goes through the budget global
        ("{{ range(3) | list }}", "[0, 1, 2]"),
        ("{% set ns = namespace(n=2) %}{{ ns.n }}", "2"),
    ],
)
def test_templates_see_the_environments_globals(source: str, expected: str) -> None:
    # With no recipient variable a template is rendered once at compile time, and with one it is
    # rendered per recipient: both must see the globals (loops, range, namespace).
    assert compile_template(source).render({}) == expected
    assert compile_template(source + "{{ name }}").render({"name": "!"}) == expected + "!"


_PLAIN_TEMPLATES = [
    "{{ name }}, your news",
    "Hi {{name}} <{{ email }}>\n{{ subscriber.id }} {{ subscriber.attributes.city }}\n",
    '<p>{{ name }} &amp; {{ subscriber.name }}</p><a href="u?s={{ subscriber.id }}">{{ attributes.items }}</a>',
    "{{- name -}}  \n {{ campaign.name }}{{ attributes.__class__ }}",
]
_VALUES = st.one_of(
    st.text(max_size=12), st.integers(), st.booleans(), st.none(), st.floats(allow_nan=False), st.just("<&'\">")
)


@given(
    source=st.sampled_from(_PLAIN_TEMPLATES),
    html=st.booleans(),
    name=_VALUES,
    city=_VALUES,
    subscriber_id=_VALUES,
    drop=st.sampled_from([None, "name", "subscriber", "city"]),
)
@settings(max_examples=300, deadline=None)
def test_templates_of_text_and_plain_variables_render_as_jinja_does(
    source: str, html: bool, name: object, city: object, subscriber_id: object, drop: str | None
) -> None:
    # Such templates are rendered without Jinja where their values allow; the result is Jinja's, and
    # where it cannot be (another type, a missing key, a dict method's name) Jinja renders them.
    attributes: dict[str, object] = {"city": city, "items": "an attribute called items"}
    context: dict[str, object] = {
        "name": name,
        "email": "ann@example.com",
        "attributes": attributes,
        "subscriber": {"id": subscriber_id, "name": name, "attributes": attributes},
        "campaign": {"id": 1, "name": "News <1>"},
    }
    if drop == "city":
        del attributes["city"]
    elif drop is not None:
        del context[drop]
    template = compile_template(source, html=html)
    assert template._plan is not None

    def outcome(render: object) -> object:
        try:
            return render(context)  # type: ignore[operator]
        except TemplateError as exc:
            return ("error", str(exc))

    assert outcome(template.render) == outcome(template._render_jinja)


def test_a_campaigns_templates_render_without_jinja(monkeypatch: pytest.MonkeyPatch) -> None:
    from sendonce.delivery.render import CompiledTemplate

    subject, text, html = compile_campaign(
        subject="{{ name }}, news", text="Hi {{ name }}, {{ subscriber.id }}", html="<p>{{ email }}</p>"
    )
    assert html is not None
    # not plain: a filter, a loop, an item, a constant
    for source in (
        "{{ name | upper }}",
        "{% for c in name %}{{ c }}{% endfor %}",
        "{{ attributes['x'] }}",
        "{{ 1 }}{{ name }}",
    ):
        assert compile_template(source)._plan is None
    monkeypatch.setattr(CompiledTemplate, "_render_jinja", lambda self, context: pytest.fail("Jinja rendered"))
    context = {"name": "Ann & Bo", "email": "a<b>@x", "subscriber": {"id": 7}}
    assert subject.render(context) == "Ann & Bo, news"
    assert text.render(context) == "Hi Ann & Bo, 7"
    assert html.render(context) == "<p>a&lt;b&gt;@x</p>"


def test_missing_variables_are_errors_not_blanks() -> None:
    template = compile_template("Hi {{ attributes.city }}")
    with pytest.raises(TemplateError, match="missing"):
        template.render({"attributes": {}})
    with pytest.raises(TemplateError, match="unknown template variable"):
        compile_campaign(subject="{{ nope }}", text="x", html=None)
    assert "email" in CAMPAIGN_VARIABLES


@pytest.mark.parametrize(
    "attack",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ lipsum.__globals__ }}",  # a real function's globals (a Jinja global: always defined)
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
        "{{ self._TemplateReference__context }}",
    ],
)
def test_sandbox_refuses_escapes(attack: str) -> None:
    # Refused when the template is compiled (campaign creation) or at the latest when rendered, and
    # refused by the sandbox itself: not by some other error on the way (a variable missing, say).
    with pytest.raises(TemplateError, match="the sandbox forbids"):
        compile_template(attack).render({"name": "x", "cycler": None})


def test_templates_have_no_loader_so_cannot_include_files() -> None:
    with pytest.raises(TemplateError, match="no loader"):
        compile_template("{% include '/etc/passwd' %}").render({})


def test_syntax_errors_name_the_field() -> None:
    with pytest.raises(TemplateError, match=r"subject: template syntax error"):
        compile_campaign(subject="{{ oops", text="x", html=None)


def test_concurrent_processes_agree_on_one_generated_secret(tmp_path: object) -> None:
    import multiprocessing
    from pathlib import Path

    home = Path(str(tmp_path)) / "home"
    with multiprocessing.get_context("spawn").Pool(6) as pool:
        secrets = pool.map(_secret_of, [str(home)] * 6)
    assert len(set(secrets)) == 1
    assert sorted(p.name for p in home.iterdir()) == ["secret"]


def _secret_of(home: str) -> bytes:
    from pathlib import Path

    from sendonce.runtime import keyring
    from sendonce.settings import load_settings

    return keyring(load_settings(home=Path(home))).current


def test_a_death_by_the_hook_leaves_a_note_of_what_the_worker_held() -> None:
    """The chaos suite counts what a hook kill left in flight from this note (see in_flight_bound)."""
    script = (
        "from sendonce.faults import Faults\n"
        "f = Faults('after_accept=1')\n"
        "f.witness = lambda: {'held': [['campaign:1:2', 1700000000.5, 1700000002.5, False],"
        " ['campaign:1:3', 1700000001.0, 1700000003.0, True]], 'connections': [[40001, 25, 1699999999.0]]}\n"
        "f.hit('after_claim')\n"  # not configured: nothing happens
        "f.hit('after_accept')\n"
        "print('still alive')\n"
    )
    before = time.time()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL
    assert "still alive" not in done.stdout
    note = death_note("some log line\n" + done.stderr)
    assert note is not None
    point, held = note
    assert point == "after_accept"
    assert held is not None
    assert before <= held.at <= time.time()
    assert held.held == [
        ("campaign:1:2", 1700000000.5, 1700000002.5, False),
        ("campaign:1:3", 1700000001.0, 1700000003.0, True),
    ]
    assert held.connections == {(40001, 25, 1699999999.0)}
    # a note without a witness (an API process) still names its point
    assert death_note(f"{DEATH_NOTE}api_after_commit\n") == ("api_after_commit", None)
    assert death_note("nothing here\n") is None
