"""``POST /api/generate`` and the generation read-back API, end to end on a real Daphne + worker."""

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx2 as httpx
import pytest
import torch

from activations.store import ActivationStore, verify
from generation.models import Generation, storable_text
from generation.tests.conftest import token_times
from mistudio.redis_client import get_redis
from mistudio.workers import WorkerIdentity, heartbeat_key, heartbeat_payload
from models_app.services import model_register
from models_app.tests.live_stack import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def post(stack, path: str, body: dict, *, timeout: float = 120.0) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{stack.api}/{path}", data=json.dumps(body).encode(), headers=stack.headers(), method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def get(stack, path: str) -> dict:
    request = urllib.request.Request(f"{stack.api}/{path}", headers=stack.headers())
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def greedy(stack, family: str, prompt, **extra) -> tuple[int, dict]:
    return post(
        stack, "generate", {"model_id": stack.models[family], "prompt": prompt, "temperature": 0, **extra}
    )


# --- Validation (no worker needed: these answer before anything is queued) ----------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 2049),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("repetition_penalty", 0),
        ("seed", -3),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("top_logprobs", 21),
        ("no_such_field", 1),
    ],
)
def test_out_of_range_values_are_a_400_naming_the_field(client, writer, field, value):
    client.force_login(writer)
    response = client.post(
        "/api/generate", {"model_id": "m_x", "prompt": "hi", field: value}, content_type="application/json"
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "VALIDATION_ERROR" and field in error["details"]["fields"]


def test_prompt_rules_and_bodies(client, writer, tiny_gpt2_folder):
    client.force_login(writer)
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="not-loaded", owner=writer)

    def generate(body, **kwargs):
        return client.post("/api/generate", body, content_type="application/json", **kwargs)

    assert generate({"model_id": model.id, "prompt": "   "}).json()["error"]["code"] == "EMPTY_PROMPT"
    too_long = generate({"model_id": model.id, "prompt": "x" * 12_001})
    assert too_long.status_code == 400 and "prompt" in too_long.json()["error"]["details"]["fields"]
    nul = generate({"model_id": model.id, "prompt": "a\x00b"})
    assert nul.status_code == 400 and "prompt" in nul.json()["error"]["details"]["fields"]
    both = generate({"model_id": model.id, "prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert both.status_code == 400 and "prompt" in both.json()["error"]["details"]["fields"]
    not_loaded = generate({"model_id": model.id, "prompt": "hello"})
    assert not_loaded.status_code == 409 and not_loaded.json()["error"]["code"] == "MODEL_NOT_LOADED"
    missing = generate({"model_id": "m_nosuchmodel", "prompt": "hello"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "MODEL_NOT_FOUND"
    malformed = client.post("/api/generate", "{not json", content_type="application/json")
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "MALFORMED_REQUEST"
    wrong_type = client.post("/api/generate", "prompt=hi", content_type="text/plain")
    assert wrong_type.status_code == 415
    assert Generation.objects.count() == 0  # nothing stored half-way


def test_authentication_and_roles(client, reader, client_for):
    anonymous = client.post(
        "/api/generate", {"model_id": "m_x", "prompt": "hi"}, content_type="application/json"
    )
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "UNAUTHENTICATED"
    bad_token = client.post(
        "/api/generate", {"model_id": "m_x", "prompt": "hi"}, content_type="application/json",
        HTTP_AUTHORIZATION="Bearer not-a-token",
    )  # fmt: skip
    assert bad_token.status_code == 401
    as_reader = client.post(
        "/api/generate", {"model_id": "m_x", "prompt": "hi"}, content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {reader.auth_token.key}",
    )  # fmt: skip
    assert as_reader.status_code == 403 and as_reader.json()["error"]["code"] == "PERMISSION_DENIED"


# --- End to end ----------------------------------------------------------------------------------


def test_greedy_generation_returns_the_documented_result(live_stack, tiny_gpt2_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    status, result = greedy(live_stack, "gpt2", "The function returns", max_tokens=16)
    assert status == 200, result
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_folder)
    assert result["input_token_ids"] == tokenizer("The function returns").input_ids
    assert 1 <= len(result["output_token_ids"]) <= 16
    assert result["finish_reason"] in ("stop", "length")
    assert result["usage"] == {
        "prompt_tokens": len(result["input_token_ids"]),
        "completion_tokens": len(result["output_token_ids"]),
        "total_tokens": len(result["input_token_ids"]) + len(result["output_token_ids"]),
    }
    assert result["timings"]["prefill_ms"] > 0
    # The worker's greedy tokens are what transformers' own greedy search gives.
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_folder)
    reference = model.generate(
        torch.tensor([result["input_token_ids"]]),
        max_new_tokens=len(result["output_token_ids"]),
        do_sample=False,
    )[0, len(result["input_token_ids"]) :].tolist()
    assert result["output_token_ids"] == reference
    eos = tokenizer.eos_token_id
    assert result["output_text"] == tokenizer.decode(
        [token for token in reference if token != eos], skip_special_tokens=True
    )
    row = get(live_stack, f"generations/{result['request_id']}")
    assert row["status"] == "completed" and row["output_text"] == storable_text(result["output_text"])


def test_a_prompt_longer_than_the_context_is_a_400(live_stack):
    status, body = greedy(live_stack, "gpt2", "word " * 400)  # the tiny GPT-2 has 128 positions
    assert status == 400 and body["error"]["code"] == "CONTEXT_LENGTH_EXCEEDED"
    status, body = greedy(live_stack, "gpt2", "word " * 20, max_tokens=2000)
    assert status == 400 and body["error"]["code"] == "CONTEXT_LENGTH_EXCEEDED"
    # Without an explicit max_tokens the default shrinks to fit.
    status, body = greedy(live_stack, "gpt2", "word " * 40, ignore_eos=True)  # about 80 tokens
    assert status == 200 and body["usage"]["total_tokens"] <= 128 and body["finish_reason"] == "length"


def test_a_batch_of_prompts_equals_each_prompt_alone(live_stack):
    prompts = ["Return the value", "A list of", "If the argument is not given, the default"]
    status, batch = greedy(live_stack, "llama", prompts, max_tokens=10, ignore_eos=True)
    assert status == 200
    results = batch["results"]
    assert [result["input_token_ids"] for result in results] == [
        greedy(live_stack, "llama", prompt, max_tokens=1)[1]["input_token_ids"] for prompt in prompts
    ]
    for prompt, result in zip(prompts, results, strict=True):
        alone = greedy(live_stack, "llama", prompt, max_tokens=10, ignore_eos=True)[1]
        assert result["output_token_ids"] == alone["output_token_ids"]


def test_concurrent_requests_never_mix(live_stack):
    prompts = [f"Request number {index} says" for index in range(6)]
    expected = {
        prompt: greedy(live_stack, "llama", prompt, max_tokens=24, ignore_eos=True)[1]["output_token_ids"]
        for prompt in prompts
    }
    answers: dict[str, list[int]] = {}

    def ask(prompt):
        status, body = greedy(live_stack, "llama", prompt, max_tokens=24, ignore_eos=True)
        answers[prompt] = body["output_token_ids"] if status == 200 else body

    threads = [threading.Thread(target=ask, args=(prompt,)) for prompt in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert answers == expected
    # The ones that arrived while another ran were decoded together in one batch.
    started = sorted(
        Generation.objects.filter(prompt__in=prompts)
        .order_by("-created_at")[: len(prompts)]
        .values_list("started_at", flat=True)
    )
    assert len({moment.replace(microsecond=0) for moment in started}) < len(prompts)


def test_capture_equals_a_teacher_forced_forward(live_stack, tiny_llama_folder):
    from transformers import AutoModelForCausalLM

    hooks = ["blocks.0.hook_resid_post", "blocks.1.mlp.hook_post"]
    status, result = greedy(
        live_stack,
        "llama",
        "Capture this prompt",
        max_tokens=12,
        ignore_eos=True,
        mistudio={"capture": hooks},
    )
    assert status == 200, result
    activations = result["activations"]
    tokens = result["input_token_ids"] + result["output_token_ids"]
    assert activations["hooks"] == hooks and activations["dtype"] == "float32"
    assert activations["shapes"]["blocks.0.hook_resid_post"] == [len(tokens), 64]
    detail = get(live_stack, f"activation-caches/{activations['cache_id']}")
    assert detail["source"] == "generation" and detail["status"] == "completed"

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_folder, dtype=torch.float32)
    mlp_inputs = []
    handle = model.model.layers[1].mlp.down_proj.register_forward_pre_hook(
        lambda module, args: mlp_inputs.append(args[0][0])
    )
    with torch.no_grad():
        output = model(torch.tensor([tokens]), output_hidden_states=True)
    handle.remove()
    from django.conf import settings

    directory = settings.ACTIVATION_CACHE_DIR / activations["cache_id"]
    assert verify(directory) == []  # every file present, checksums right
    store = ActivationStore.open(directory)
    table = store.tokens()
    assert table["token_ids"].tolist() == tokens
    assert table["generated"].tolist() == [0] * len(result["input_token_ids"]) + [1] * len(
        result["output_token_ids"]
    )
    torch.testing.assert_close(
        torch.from_numpy(store.get("blocks.0.hook_resid_post")),
        output.hidden_states[1][0],
        atol=1e-4,
        rtol=1e-4,
    )
    torch.testing.assert_close(
        torch.from_numpy(store.get("blocks.1.mlp.hook_post")), mlp_inputs[0], atol=1e-4, rtol=1e-4
    )


def test_cancel_and_disconnect_stop_a_generation(live_stack):
    outcome = {}

    def long_request():
        body = {
            "model_id": live_stack.models["llama"],
            "prompt": "Go on",
            "max_tokens": 2048,
            "ignore_eos": True,
        }
        outcome["response"] = post(live_stack, "generate", body)

    thread = threading.Thread(target=long_request)
    thread.start()

    def running():
        return Generation.objects.filter(prompt="Go on", status="running").order_by("-created_at").first()

    generation = None
    deadline = time.monotonic() + 30
    while generation is None and time.monotonic() < deadline:
        generation = running()
        time.sleep(0.05)
    assert generation is not None
    status, _ = post(live_stack, f"generate/{generation.id}/cancel", {})
    assert status == 202
    thread.join(timeout=30)
    status, result = outcome["response"]
    assert status == 200 and result["finish_reason"] == "cancelled"
    assert len(result["output_token_ids"]) < 2048
    generation.refresh_from_db()
    assert generation.status == "cancelled"

    # A client that goes away stops its generation too.
    import http.client

    connection = http.client.HTTPConnection(live_stack.base_url.removeprefix("http://"), timeout=10)
    connection.request(
        "POST", "/api/generate",
        body=json.dumps({"model_id": live_stack.models["llama"], "prompt": "Walk away", "max_tokens": 2048,
                         "ignore_eos": True}),
        headers=live_stack.headers(),
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not Generation.objects.filter(prompt="Walk away", status="running").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    connection.close()
    deadline = time.monotonic() + 30
    while (row := Generation.objects.get(prompt="Walk away")).status == "running":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert row.status == "cancelled" and row.completion_tokens < 2048


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_a_hundred_generations_without_an_error_or_memory_growth(live_stack):
    worker_pid = live_stack.processes[0].pid

    def one(index: int) -> None:
        status, body = post(
            live_stack,
            "generate",
            {
                "model_id": live_stack.models["gpt2"],
                "prompt": f"Run {index}:",
                "max_tokens": 16,
                "seed": index,
            },
        )
        assert status == 200, body
        assert body["usage"]["completion_tokens"] >= 1

    for index in range(20):  # warm-up: allocator pools, caches, first-time imports
        one(index)
    warm = resident_bytes(worker_pid)
    for index in range(100):
        one(index)
    grown = resident_bytes(worker_pid)
    assert grown <= 1.05 * warm, f"worker RSS grew from {warm / 2**20:.1f} to {grown / 2**20:.1f} MiB"
    assert Generation.objects.filter(status="completed").count() >= 120


# --- hostile load: bounded pools, work that dies with its request ----------------------


def blocked_readers(pid: int) -> int:
    """The process's connections blocked in a Redis read right now (``CLIENT LIST`` matched to the
    process's own sockets; on a unix socket, where they cannot be matched, its stream hub's)."""
    import psutil
    from django.conf import settings

    blocked = [c for c in get_redis().client_list() if c.get("cmd") in ("xread", "blpop", "brpop")]
    if settings.REDIS_URL.startswith("unix://"):
        return sum(1 for c in blocked if c.get("name") == f"mistudio-hub-{pid}")
    port = int(settings.REDIS_URL.rsplit(":", 1)[1].split("/")[0])
    mine = {
        connection.laddr.port
        for connection in psutil.Process(pid).net_connections(kind="inet")
        if connection.raddr and connection.raddr.port == port
    }
    return sum(1 for c in blocked if int(c["addr"].rsplit(":", 1)[1]) in mine)


@pytest.mark.slow
def test_concurrent_batches_are_answered_by_one_redis_reader(live_stack):
    """8 requests of 16 prompts at once: 128 waiters. Each waiter held a blocking Redis read of its
    own, and 2 of the 8 answered 500 (the web process's pool had 100 connections); now one reader
    follows them all."""

    web_pid = live_stack.processes[1].pid
    body = {
        "model_id": live_stack.models["gpt2"],
        "prompt": [f"Batch {i}" for i in range(16)],
        "max_tokens": 4,
    }
    answers: list = []

    def one():
        try:
            answers.append(post(live_stack, "generate", body))
        except Exception as error:
            answers.append((type(error).__name__, str(error)))

    threads = [threading.Thread(target=one) for _ in range(8)]
    sampled = []
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        sampled.append(blocked_readers(web_pid))
        time.sleep(0.05)
    assert [status for status, _ in answers] == [200] * 8, answers
    assert all(len(result["results"]) == 16 and "error" not in result["results"][0] for _, result in answers)
    assert max(sampled) <= 1, sampled  # the hub's one read, not one per waiter


@pytest.mark.slow
def test_a_client_that_leaves_a_batch_leaves_nothing_decoding(live_stack):
    """A 1,500-token batch of 8: the client gives up after a second; nothing is decoded after it
    left (beyond the step the worker was in), and no row is left queued or running."""
    body = {
        "model_id": live_stack.models["llama"], "prompt": [f"Prompt {index}" for index in range(8)],
        "max_tokens": 1500, "ignore_eos": True, "temperature": 0,
    }  # fmt: skip
    left = []

    def client():
        try:
            httpx.post(f"{live_stack.api}/generate", headers=live_stack.headers(), json=body, timeout=1.5)
        except httpx.TimeoutException:
            left.append(time.time())

    thread = threading.Thread(target=client)
    thread.start()
    thread.join(30)
    assert left, "the request answered before the client left"
    rows = Generation.objects.filter(prompt__startswith="Prompt ")
    assert rows.count() == 8
    wait_until(lambda: not rows.filter(status__in=Generation.ACTIVE).exists(), timeout=20, what="withdrawal")
    grace = 0.5  # the worker looks for a cancel every 50 ms, between two steps
    for row in rows:
        assert row.status == "cancelled" and row.completion_tokens < 1500
        assert [at for at in token_times(row.id) if at > left[0] + grace] == []


@pytest.mark.slow
def test_requests_waiting_for_a_worker_hold_no_database_connection(live_stack):
    """More requests wait for a worker than the web process's database pool holds (10): everyone
    else is still answered. Each waiting request held a pooled connection, and past ten the rest got
    503 DATABASE_UNAVAILABLE (on PostgreSQL, the pool's home)."""
    from models_app.models import LanguageModel

    # Moved to a worker that is alive (its heartbeat is written here) but runs nothing: the requests
    # wait, each holding its row, for as long as that heartbeat lasts.
    LanguageModel.objects.filter(pk=live_stack.models["gpt2"]).update(host_worker="idle-worker")
    idle = WorkerIdentity(name="idle-worker", device="cpu")
    get_redis().set(heartbeat_key(idle.name), json.dumps(heartbeat_payload(idle, time.time())), ex=300)
    answers: list = []
    body = {"model_id": live_stack.models["gpt2"], "prompt": "Wait", "max_tokens": 4}
    threads = [
        threading.Thread(target=lambda: answers.append(post(live_stack, "generate", body, timeout=120)))
        for _ in range(14)
    ]
    try:
        for thread in threads:
            thread.start()
        # All fourteen are accepted and wait at once, more than the pool's ten.
        asked = Generation.objects.filter(prompt="Wait", status=Generation.Status.QUEUED)
        wait_until(lambda: asked.count() == 14, timeout=90, what="fourteen waiting requests")
        assert get(live_stack, "models")  # answered while the requests wait
    finally:
        get_redis().delete(heartbeat_key(idle.name))  # the worker is gone: each wait ends
    for thread in threads:
        thread.join(60)
    # Each ends when its silence is checked (the worker is gone, or its model was unloaded for it);
    # none ran out of database connections.
    codes = [answer["error"]["code"] for _, answer in answers]
    assert len(codes) == 14 and set(codes) <= {"WORKER_LOST", "MODEL_NOT_LOADED"}, codes
