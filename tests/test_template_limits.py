"""A hostile chat template (llmscratch.text.chat_template) ends in a one-line ValueError that names the template and
the limit it hit, and leaves the process and the next render as they were (issue 50, item 3): loops within loops,
huge strings and lists however they are made, a macro that calls itself, a text too long to keep."""

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
from processes import run

from llmscratch.text import chat_template
from llmscratch.text.chat_template import ChatTemplate

pytestmark = [pytest.mark.timeout(180)]

GOOD = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "hi"}]
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
HOSTILE = [  # (the template, what the message says)
    (LOOPS, "ran past its time limit of 2 s"),
    ("{{ 'x' * 10**10 }}", "more than its 1024 MiB of memory"),
    ("{{ range(10**9) | list }}", "Range too big"),  # the sandbox's own bound on range
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed or nested too deeply"),
    # held out: other ways to a huge value, another loop, another recursion
    ("{{ 'x' | center(10**10) }}", "of memory"),
    ("{{ '%*s' % (10**10, 'x') }}", "of memory"),
    ("{{ '{:>10000000000}'.format('x') }}", "of memory"),
    ("{{ 'x'.ljust(10**10) ~ 'y'.zfill(10**10) }}", "of memory"),
    ("{{ [messages] * 10**10 }}", "of memory"),
    ("{% set r = range(99999) %}{{ r | join(r | join(',')) }}", "of memory"),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{{ messages }}{% endfor %}{% endfor %}",
     "wrote more than 16,777,216 characters"),
    (("{% set ns = namespace(n=0) %}{% for i in range(99999) %}{% for j in range(99999) %}{% set ns.n = ns.n + 1 %}"
      "{% endfor %}{% endfor %}{{ ns.n }}"), "ran past its time limit"),
    ("{% macro a(n) %}{{ b(n) }}{% endmacro %}{% macro b(n) %}{{ a(n) }}{% endmacro %}{{ a(1) }}", "recursed"),
]


def template_in(folder, source: str, where: str) -> ChatTemplate:
    """``source`` as a Hugging Face folder keeps it: chat_template.jinja, or tokenizer_config.json's field."""
    if where == "jinja":
        (folder / "chat_template.jinja").write_text(source, encoding="utf-8")
    else:
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}), encoding="utf-8")
    template = ChatTemplate.from_hf(folder)
    template.seconds = 2.0
    return template


@pytest.mark.parametrize("source, message", HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_template_hits_a_limit_named_with_its_file(tmp_path, source, message):
    where = "jinja" if len(source) % 2 else "config"
    template = template_in(tmp_path, source, where)
    file = tmp_path / ("chat_template.jinja" if where == "jinja" else "tokenizer_config.json")
    with pytest.raises(ValueError, match=message) as caught:
        template.render(MESSAGES)
    assert str(caught.value).startswith(f"{file}: the chat template ") and "\n" not in str(caught.value)
    assert ChatTemplate(GOOD).render(MESSAGES) == "<user>hi"  # the next render is served as before


def test_renders_from_many_threads_while_one_template_runs_away():
    """The server renders from worker threads at once: each gets its own answer, a runaway template holds up
    only its own request."""
    good, runaway = ChatTemplate(GOOD), ChatTemplate(LOOPS, seconds=3.0)
    results, errors = {}, []

    def chat(index: int) -> None:
        for turn in range(30):
            messages = [{"role": "user", "content": f"{index}-{turn}"}]
            results[index, turn] = good.render(messages)

    def run_away() -> None:
        try:
            runaway.render(MESSAGES)
        except ValueError as err:
            errors.append(str(err))

    threads = [threading.Thread(target=run_away)] + [threading.Thread(target=chat, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert results == {(i, turn): f"<user>{i}-{turn}" for i in range(6) for turn in range(30)}
    assert errors == ["the chat template ran past its time limit of 3 s"]


def test_a_worker_does_not_outlive_its_process(tmp_path):
    """A process killed in the middle of a runaway render takes its worker with it."""
    script = tmp_path / "render.py"
    script.write_text(f"""
import threading, time
from llmscratch.text import chat_template
template = chat_template.ChatTemplate({LOOPS!r}, seconds=600)
threading.Thread(target=template.render, args=([],), daemon=True).start()
while not chat_template._WORKERS._busy:
    time.sleep(0.05)
print(next(iter(chat_template._WORKERS._busy)).process.pid, flush=True)
time.sleep(600)
""", encoding="utf-8")
    with subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True) as parent:
        try:
            worker = int(parent.stdout.readline())
            parent.send_signal(signal.SIGKILL)
        finally:
            parent.kill()
    deadline = time.monotonic() + 30
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie is gone, its parent not yet told
    except FileNotFoundError:
        return False


def test_a_conversation_that_is_not_json_is_named():
    with pytest.raises(ValueError, match="^the conversation is not JSON data"):
        ChatTemplate(GOOD).render([{"role": "user", "content": object()}])


def test_the_worker_runs_with_the_standard_library_and_jinja2_alone():
    """The worker is this module run as a script in isolated mode: it imports no torch, numpy or llmscratch."""
    from llmscratch.text import chat_template

    code = (f"import runpy, sys; runpy.run_path({chat_template.__file__!r}); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'llmscratch', 'regex'}))")
    result = run([sys.executable, "-I", "-c", code], timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_forked_child_renders_with_workers_of_its_own():
    """A DataLoader's worker is a fork: were it to write to its parent's worker pipes, the two would read each
    other's answers. Parent, child and parent again each get their own conversation back."""
    import multiprocessing

    template = ChatTemplate(GOOD)
    assert template.render(MESSAGES) == "<user>hi"  # the parent now holds an idle worker
    parents = {worker.process.pid for worker in chat_template._WORKERS._idle}

    def child(queue):
        text = template.render([{"role": "user", "content": "from the child"}])
        queue.put((text, {worker.process.pid for worker in chat_template._WORKERS._idle}))

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    process = context.Process(target=child, args=(queue,))
    process.start()
    try:
        text, childs = queue.get(timeout=60)
        assert text == "<user>from the child" and childs and not childs & parents
    finally:
        process.join(60)
        if process.is_alive():
            process.kill()
    assert process.exitcode == 0
    assert template.render([{"role": "user", "content": "again"}]) == "<user>again"


def test_a_template_file_that_is_not_utf8_is_named(tmp_path):
    (tmp_path / "chat_template.jinja").write_bytes(b"caf\xe9 {{ messages }}")
    with pytest.raises(ValueError, match=f"{tmp_path / 'chat_template.jinja'} is not UTF-8 text"):
        ChatTemplate.from_hf(tmp_path)


@pytest.mark.parametrize("source", ["{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
                                    "{% if 1 %}" * 3000 + "{% endif %}" * 3000,
                                    "{{ " + "[" * 5000 + "]" * 5000 + " }}"], ids=["brackets", "blocks", "lists"])
def test_a_template_nested_thousands_deep_is_refused_when_read(tmp_path, source):
    (tmp_path / "chat_template.jinja").write_text(source, encoding="utf-8")
    with pytest.raises(ValueError, match="recursed or nested too deeply") as caught:
        ChatTemplate.from_hf(tmp_path)
    assert str(caught.value).startswith(f"{tmp_path / 'chat_template.jinja'}: ")
