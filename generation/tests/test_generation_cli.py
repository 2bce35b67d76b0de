"""``manage.py generate`` and ``manage.py play``, run as researchers run them, against a real worker.

One worker subprocess serves the whole module (starting one costs seconds); each test registers
and loads the tiny models it needs, since the transactional tests flush the rows after each
test. Transactional, because the commands commit their rows and queue them on commit, as they
do for a researcher: the worker must see them. The tiny Llama has a 4,096-token context, so a
reply can run long enough to be stopped.
"""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command

from features.tests.conftest import completed_sae_row
from generation.cli import InvalidSetting, steering_list
from generation.models import Generation, storable_text
from mistudio.access import OPERATOR
from models_app.models import LanguageModel
from models_app.services import model_load_request, model_register
from models_app.tests.live_stack import process_environment, wait_until
from saes.tests.conftest import write_planted_cache

pytestmark = pytest.mark.django_db(transaction=True)

HOOK = "blocks.0.hook_resid_post"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
STATS = re.compile(r"\((\d+) tokens, ([\d.]+|—) tokens/s\)")


@pytest.fixture(scope="module")
def worker(django_db_setup, tmp_path_factory):
    """The name of a worker subprocess on the test database (its log: ``worker.log``)."""
    name = f"gen-cli-{os.getpid()}"
    log = tmp_path_factory.mktemp("generation-cli") / "worker.log"
    with log.open("w") as log_file:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "worker", "--name", name],
            cwd=settings.BASE_DIR, env=process_environment(), stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            yield name
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def register(folder, name: str) -> LanguageModel:
    return model_register(source="local", identifier=str(folder), owner=None, name=name)


def loaded(folder, name: str, *, timeout: float = 120.0) -> LanguageModel:
    """Register the model in ``folder`` and load it in the worker."""
    model = register(folder, name)
    model_load_request(model_id=model.id, actor=OPERATOR)

    def ready() -> bool:
        model.refresh_from_db()
        assert model.status != LanguageModel.Status.FAILED, f"{model.name}: {model.error_message}"
        return model.status == LanguageModel.Status.READY

    wait_until(ready, timeout=timeout, interval=0.1, what=f"{name} to load")
    return model


def generate(*arguments: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("generate", *arguments, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def latest(model: LanguageModel) -> Generation | None:
    return Generation.objects.filter(model=model).order_by("-created_at").first()


# --- generate -----------------------------------------------------------------------------------


def test_generate_refuses_bad_options_and_a_model_that_is_not_loaded(tiny_gpt2_folder):
    model = register(tiny_gpt2_folder, "cold-gpt2")
    with pytest.raises(
        CommandError, match=r"MODEL_NOT_LOADED: cold-gpt2 is pending; .*load_model cold-gpt2.*--load"
    ):
        generate("cold-gpt2", "Hello")
    with pytest.raises(CommandError, match="temperature: Ensure this value is less than or equal to 2"):
        generate("cold-gpt2", "Hello", "--temperature", "5")
    with pytest.raises(CommandError, match=r"Unknown hook point: blocks\.9\.hook_nothing"):
        generate("cold-gpt2", "Hello", "--capture", "blocks.9.hook_nothing")
    with pytest.raises(CommandError, match="No model with id or name"):
        generate("no-such-model", "Hello")
    assert not Generation.objects.filter(model=model).exists()


@pytest.mark.slow
def test_generate_streams_the_text_the_generation_keeps(worker, tiny_gpt2_folder):
    gpt2 = loaded(tiny_gpt2_folder, "tiny-gpt2")
    out, err = generate(gpt2.name, "Once upon a time", "--max-tokens", "12", "--ignore-eos")
    row = latest(gpt2)
    assert row.status == "completed" and row.interface == "cli"
    assert storable_text(out) == row.output_text and row.completion_tokens == 12
    # The defaults are /api/generate's: sampling, not greedy.
    assert row.parameters["temperature"] == 0.7 and row.parameters["top_p"] == 0.95
    assert "\x1b" not in out + err  # no colours off a terminal
    assert re.search(r"^— 12 tokens · [\d.]+ tokens/s · prefill \d+ ms · finish: length$", err, re.M), err

    first, _ = generate(gpt2.name, "Once upon a time", "--greedy", "--max-tokens", "16")
    second, _ = generate(gpt2.name, "Once upon a time", "--greedy", "--max-tokens", "16")
    assert first == second and storable_text(first) == latest(gpt2).output_text
    assert latest(gpt2).parameters["temperature"] == 0

    out, err = generate(gpt2.name, "Once upon a time", "--max-tokens", "6", "--ignore-eos", "--json")
    result, row = json.loads(out), latest(gpt2)
    assert result["request_id"] == row.id and storable_text(result["output_text"]) == row.output_text
    assert result["usage"]["completion_tokens"] == 6 and result["finish_reason"] == "length"
    assert err == ""

    out, err = generate(gpt2.name, "Once upon a time", "--max-tokens", "4", "--capture", HOOK)
    row = latest(gpt2)
    assert row.cache_id and f"activations: {row.cache_id} ({HOOK} [" in err


def test_steering_arguments(tmp_path):
    file = tmp_path / "steer.json"
    file.write_text(json.dumps([{"type": "ablate", "hook": HOOK, "neurons": [1]}]))
    assert steering_list(["sae_ab12:7*-8.5", "sae_ab12:3", "sae_ab12:9=2e1", f"@{file}"]) == [
        {"type": "add", "sae": "sae_ab12", "feature": 7, "coefficient": -8.5},
        {"type": "add", "sae": "sae_ab12", "feature": 3, "coefficient": 1.0},
        {"type": "clamp_feature", "sae": "sae_ab12", "feature": 9, "value": 20.0},
        {"type": "ablate", "hook": HOOK, "neurons": [1]},
    ]
    assert steering_list('{"type": "replace", "hook": "x"}') == [{"type": "replace", "hook": "x"}]
    for bad, message in [
        ("sae_ab12", "give JSON"),
        ("sae_ab12:7*lots", "give JSON"),
        ("{not json", "not valid JSON"),
        (f"@{tmp_path / 'missing.json'}", "cannot read"),
    ]:
        with pytest.raises(InvalidSetting, match=message):
            steering_list(bad)


@pytest.mark.slow
def test_generate_steer_changes_the_text_and_keeps_the_request(worker, tiny_gpt2_folder):
    gpt2 = loaded(tiny_gpt2_folder, "tiny-gpt2")
    sae = completed_sae_row(gpt2, write_planted_cache(gpt2, None, samples=8), None)
    base = [gpt2.name, "Once upon a time", "--greedy", "--max-tokens", "12", "--ignore-eos"]
    plain, _ = generate(*base)
    steered, _ = generate(*base, "--steer", f"{sae.id}:7*12")
    assert steered != plain
    # The unit is raw: no analysis gives the feature a max activation.
    assert latest(gpt2).interventions == [
        {"type": "add", "sae": sae.id, "hook": HOOK, "positions": "all", "feature": 7,
         "unit": "raw", "unit_scale": 1.0, "coefficient": 12.0, "normalize": False}
    ]  # fmt: skip
    spelled_out = json.dumps({"type": "add", "sae": sae.id, "feature": 7, "coefficient": 12})
    same, _ = generate(*base, "--steer", spelled_out)
    assert same == steered
    with pytest.raises(CommandError, match="INVALID_INTERVENTION: Intervention 0: vector has 3 values"):
        generate(*base, "--steer", json.dumps({"type": "add", "hook": HOOK, "vector": [1, 2, 3]}))

    # --sweep: the baseline and each strength, one seed, the feature measured on each output; the
    # strongest row's text is the steered one at that (raw: no analysis) coefficient.
    table, err = generate(*base, "--steer", f"{sae.id}:7", "--sweep", "1,12", "--seed", "5")
    header, *lines = table.strip().splitlines()
    assert header.split()[:3] == ["coefficient", "raw", "feature"]
    assert [line.split()[0] for line in lines] == ["0", "1", "12"]
    assert json.loads(lines[2].split("  ")[-1]) == steered[:70]
    assert all(line.split()[2] != "-" for line in lines)  # each output measured
    assert "seed 5, coefficients raw" in err


@pytest.mark.slow
def test_a_sweep_longer_than_a_lease_is_not_withdrawn(worker, tiny_llama_folder, monkeypatch):
    """The sweep holds its rows' leases while it waits (it reads their streams): rows whose lease
    lapses are withdrawn as nobody's, and a sweep runs longer than a lease."""
    from generation import streams
    from mistudio import stream_hub

    llama = loaded(tiny_llama_folder, "tiny-llama")
    monkeypatch.setattr(streams, "LEASE_SECONDS", 1)
    monkeypatch.setattr(stream_hub, "LEASE_SECONDS", 1)
    monkeypatch.setattr(stream_hub, "LEASE_REFRESH_SECONDS", 0.2)
    steer = json.dumps({"type": "add", "hook": HOOK, "vector": [0.1] * llama.hidden_size})
    base = [llama.name, "Keep going", "--greedy", "--max-tokens", "2000", "--ignore-eos", "--steer", steer]
    started = time.monotonic()
    table, _ = generate(*base, "--sweep", "1,2")
    rows = Generation.objects.filter(model=llama)
    assert [(row.status, row.error_code) for row in rows] == [("completed", "")] * 3, table
    assert all(len(row.output_token_ids) == 2000 for row in rows)
    assert time.monotonic() - started > 1.5  # past a lease


@pytest.mark.slow
def test_generate_load_loads_a_model_that_is_not_loaded(worker, tiny_gpt2_folder):
    register(tiny_gpt2_folder, "cold-gpt2")
    with pytest.raises(
        CommandError, match=r"MODEL_NOT_LOADED: .* is pending; load it with `manage.py load_model"
    ):
        generate("cold-gpt2", "Hello")
    out, err = generate("cold-gpt2", "Hello", "--load", "--max-tokens", "3", "--ignore-eos")
    model = LanguageModel.objects.get(name="cold-gpt2")
    assert model.status == "ready" and model.host_worker == worker
    assert storable_text(out) == latest(model).output_text and "— 3 tokens" in err and "100%" in err


@pytest.mark.slow
def test_ctrl_c_stops_the_generation_and_exits_130(worker, tiny_llama_folder):
    llama = loaded(tiny_llama_folder, "tiny-llama")
    command = [sys.executable, "manage.py", "generate", llama.name, "Tell me everything"]
    # The worker writes the 2,000 tokens in about 3 s. Under CI's load the command once read them
    # after the worker had finished, so the Ctrl-C came after the end: a run whose generation
    # ended before the signal was sent is run again. A Ctrl-C that stops nothing fails every try.
    for _ in range(3):
        started = time.time()
        process = subprocess.Popen(
            [*command, "--max-tokens", "2000", "--temperature", "1", "--ignore-eos"],
            cwd=settings.BASE_DIR, env=process_environment(), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            process.stdout.read(1)  # the text streams: the generation runs
            signalled = time.time()
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=60)
        finally:
            process.kill()
        row = latest(llama)
        assert row.created_at.timestamp() >= started - 1
        if not (row.status == "completed" and row.finished_at.timestamp() < signalled):
            break
    assert process.returncode == 130, err
    assert row.status == "cancelled" and row.completion_tokens < 2000
    assert "finish: cancelled" in err and "Cancelled (Ctrl-C)" in err


# --- play ---------------------------------------------------------------------------------------


class Session:
    """``manage.py play`` in a pseudo-terminal, the way a researcher types into it."""

    PROMPT = ">>> "

    def __init__(self, child):
        self.child = child

    def expect(self, pattern) -> str:
        """Wait for ``pattern``; the text before it, without colours."""
        self.child.expect(pattern)
        return ANSI.sub("", self.child.before)

    def command(self, line: str) -> str:
        self.child.sendline(line)
        self.expect(re.escape(line))
        return self.expect(self.PROMPT).strip()

    def chat(self, text: str) -> tuple[int, str]:
        """Send a message; the completion tokens its stats line reports, and what came after it."""
        self.child.sendline(text)
        self.expect(STATS)
        tokens = int(self.child.match.group(1))
        return tokens, self.expect(self.PROMPT).strip()


@pytest.mark.slow
def test_play_chats_with_a_model(worker, tiny_gpt2_folder, tiny_llama_folder):
    import pexpect

    ready = loaded(tiny_gpt2_folder, "tiny-gpt2")
    cold = register(tiny_llama_folder, "tiny-llama")
    child = pexpect.spawn(
        sys.executable, ["manage.py", "play"], cwd=str(settings.BASE_DIR),
        env=process_environment(TERM="xterm"), encoding="utf-8", timeout=60, dimensions=(50, 250),
    )  # fmt: skip
    session = Session(child)
    try:
        # No model named: the ready ones are listed first and numbered, the others with their status.
        listing = session.expect(r"Model \[1-\d+, Enter: 1\]: ")
        ready_part, _, others = listing.partition("Not loaded:")
        assert f") {ready.name}" in ready_part and f") {cold.name}" in others and "pending" in others
        child.sendline(re.search(rf"(\d+)\) {re.escape(cold.name)}", listing).group(1))
        session.expect(r"is pending\. Load it now\? \[Y/n\] ")
        child.sendline("")
        banner = session.expect("/help")
        assert (
            "100%" in banner and cold.name in banner and "llama" in banner and "quantization none" in banner
        )
        session.expect(session.PROMPT)
        cold.refresh_from_db()
        assert cold.status == "ready"

        # A message streams a reply and its stats; the next turn sends the conversation so far.
        assert "max_tokens = 8" in session.command("/max 8")
        tokens, _ = session.chat("Hello there")
        first = latest(cold)
        assert first.status == "completed" and first.interface == "cli" and tokens == first.completion_tokens
        session.chat("And then?")
        second = latest(cold)
        assert [message["role"] for message in second.messages] == ["user", "assistant", "user"]
        assert second.messages[1]["content"] == first.output_text.strip()

        # Greedy: the same message after /reset gives the same reply.
        assert "temperature = 0.0" in session.command("/temp 0")
        replies = []
        for _ in range(2):
            assert "conversation cleared" in session.command("/reset")
            session.chat("Say it again")
            row = latest(cold)
            assert row.messages == [{"role": "user", "content": "Say it again"}]
            replies.append(row.output_text)
        assert replies[0] == replies[1]

        # /max limits the reply.
        session.command("/max 5")
        tokens, _ = session.chat("Be brief")
        row = latest(cold)
        assert row.parameters["max_tokens"] == 5 and row.completion_tokens == tokens <= 5

        # Invalid values: one line each, the settings unchanged, the REPL still answers.
        assert "temperature: A valid number is required." in session.command("/temp hot")
        assert "top_k: Ensure this value is greater than or equal to 0." in session.command("/top_k -1")
        assert "Unknown command /nonsense" in session.command("/nonsense")
        assert "system prompt: Answer briefly." in session.command("/system Answer briefly.")
        session.chat("Still there?")
        row = latest(cold)
        assert row.parameters["temperature"] == 0 and row.parameters["top_k"] == 0
        assert row.system_prompt == "Answer briefly."

        # /capture: each reply says where its activations went.
        assert f"capturing {HOOK}" in session.command(f"/capture {HOOK}")
        _, after = session.chat("Capture this")
        row = latest(cold)
        assert row.cache_id and re.search(
            rf"activations: {row.cache_id} \({re.escape(HOOK)} \[\d+, 64\]\)", after
        )
        session.command("/capture off")

        # /steer: every reply runs with the interventions; /unsteer drops them.
        sae = completed_sae_row(ready, write_planted_cache(ready, None, samples=8), None)
        listed = session.command(f"/steer {sae.id}:7=5")
        assert f"1) clamp {sae.id}#7 = 5 at {HOOK} (all)" in listed
        assert "INVALID_INTERVENTION: Intervention 1: feature must be" in session.command(
            f"/steer {sae.id}:100000"
        )
        session.chat("Steer this")
        row = latest(cold)
        assert row.status == "completed"
        assert row.interventions == [
            {
                "type": "clamp_feature",
                "sae": sae.id,
                "hook": HOOK,
                "positions": "all",
                "feature": 7,
                "unit": "raw",
                "unit_scale": 1.0,
                "value": 5.0,
            }
        ]
        assert "clamp" in session.command("/show")
        assert "interventions off" in session.command("/unsteer")
        session.chat("Plain again")
        assert latest(cold).interventions == []

        # Ctrl-C during a long reply stops it in the worker and returns to the prompt.
        for line in ("/max 2000", "/temp 1", "/ignore_eos on"):
            session.command(line)
        before = Generation.objects.filter(model=cold).count()
        child.sendline("Go on and on")
        running = wait_until(
            lambda: Generation.objects.filter(model=cold, status="running").first(),
            what="the long reply to run",
        )
        time.sleep(0.3)  # let some tokens stream first
        child.sendcontrol("c")
        session.expect("left out of the conversation")
        session.expect(session.PROMPT)
        running.refresh_from_db()
        assert running.status == "cancelled" and running.completion_tokens < 2000
        assert Generation.objects.filter(model=cold).count() == before + 1

        # Ctrl-C at the prompt drops the line; nothing is sent. As a person would, press it once the
        # typed text shows: a Ctrl-C that lands while GNU readline is still gathering the typed-ahead
        # keys is swallowed by it (it retries its read on EINTR; py-spy showed the REPL blocked in
        # rl_insert → rl_getc on a loaded machine), and the REPL would wait for more keys.
        time.sleep(0.5)
        child.send("half a thought")
        child.expect("half a thought")
        child.sendcontrol("c")
        session.expect(session.PROMPT)
        shown = session.command("/show")
        assert "history" in shown and "max_tokens   2000" in shown
        assert Generation.objects.filter(model=cold).count() == before + 1

        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
