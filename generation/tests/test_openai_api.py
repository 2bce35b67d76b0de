"""The OpenAI-compatible ``/v1`` API, through the official ``openai`` client against a live stack.

The tiny models have random weights and no chat template (chat uses the plain fallback
rendering), so the tests check agreement — stream against whole, a rerun against the first run,
the response against the stored row — rather than any particular text.
"""

import json
import time

import httpx2 as httpx  # the HTTP client the openai package is built on
import openai
import pytest

from generation.models import Generation, storable_text
from models_app.models import LanguageModel
from models_app.services import model_register

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

MESSAGES = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Tell me about rivers and the sea."},
]
PROMPT = "The river runs down to the sea, and the"


@pytest.fixture
def api(live_stack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{live_stack.base_url}/v1", api_key=live_stack.token, max_retries=0, timeout=60
    )


def greedy_chat(api, live_stack, family: str = "gpt2", max_tokens: int = 12, **extra):
    return api.chat.completions.create(
        model=live_stack.models[family], messages=MESSAGES, temperature=0, max_tokens=max_tokens, **extra
    )


def greedy_completion(api, live_stack, family: str = "gpt2", prompt=PROMPT, max_tokens: int = 16, **extra):
    return api.completions.create(
        model=live_stack.models[family], prompt=prompt, temperature=0, max_tokens=max_tokens, **extra
    )


# --- Answered before anything is queued: in process, no worker --------------------------------


def post_v1(client, user, endpoint: str, body: dict, **headers):
    headers.setdefault("HTTP_AUTHORIZATION", f"Bearer {user.auth_token.key}")
    return client.post(f"/v1/{endpoint}", body, content_type="application/json", **headers)


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        ("chat/completions", {"temperature": 3}, "temperature"),
        ("chat/completions", {"n": 2}, "n"),
        ("chat/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
        ("chat/completions", {"logit_bias": {"50256": -100}}, "logit_bias"),
        ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("chat/completions", {"messages": []}, "messages"),
        ("chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0]"),
        ("chat/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
        ("chat/completions", {"no_such_field": 1}, "no_such_field"),
        ("chat/completions", {"mistudio": {"colour": 1}}, "mistudio.colour"),
        ("completions", {"echo": True, "stream": True}, "echo"),
        ("completions", {"echo": True, "prompt_logprobs": 2}, "prompt_logprobs"),
        ("chat/completions", {"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
        ("chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("completions", {"best_of": 3}, "best_of"),
        ("completions", {"logprobs": 6}, "logprobs"),
        ("completions", {"prompt": [1, 2, 3]}, "prompt"),
        ("completions", {"prompt": ["a", "b"], "stream": True}, "prompt"),
    ],
)  # fmt: skip
def test_unsupported_or_invalid_fields_are_a_400_naming_them(client, writer, endpoint, fields, param):
    body = {"model": "m_anything", "max_tokens": 4}
    body.update({"messages": MESSAGES} if endpoint.startswith("chat") else {"prompt": PROMPT})
    response = post_v1(client, writer, endpoint, {**body, **fields})

    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["code"] == "VALIDATION_ERROR" and error["message"].startswith(f"{param}: ")


def test_authentication_roles_and_unknown_paths(client, writer, reader):
    chat = {"model": "m_anything", "messages": MESSAGES}
    unauthenticated = post_v1(client, writer, "chat/completions", chat, HTTP_AUTHORIZATION="Bearer nope")
    assert unauthenticated.status_code == 401
    assert unauthenticated.json()["error"]["type"] == "authentication_error"
    assert client.get("/v1/models").status_code == 401
    # Sessions do not count: the API is for token clients (and needs no CSRF).
    client.force_login(writer)
    assert client.get("/v1/models").status_code == 401

    forbidden = post_v1(client, reader, "chat/completions", chat)
    assert forbidden.status_code == 403 and forbidden.json()["error"]["type"] == "permission_error"
    unknown = post_v1(client, writer, "chat/completions", chat)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"

    missing = client.get("/v1/embeddings", HTTP_AUTHORIZATION=f"Bearer {writer.auth_token.key}")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "NOT_FOUND"
    wrong_method = client.get("/v1/chat/completions", HTTP_AUTHORIZATION=f"Bearer {writer.auth_token.key}")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"
    not_json = client.post("/v1/completions", "x", content_type="text/plain",
                           HTTP_AUTHORIZATION=f"Bearer {writer.auth_token.key}")  # fmt: skip
    assert not_json.status_code == 415 and not_json.json()["error"]["code"] == "UNSUPPORTED_MEDIA_TYPE"


# --- End to end: a real Daphne + worker ----------------------------------------------------------


def test_models_and_errors_in_openai_shape(api, live_stack, tiny_gpt2_folder):
    listed = {model.id: model for model in api.models.list()}
    for model_id in live_stack.models.values():
        assert listed[model_id].object == "model" and listed[model_id].owned_by == "mistudio"
        assert listed[model_id].model_extra["status"] == "ready"
    by_name = api.models.retrieve(listed[live_stack.models["llama"]].model_extra["name"])
    assert by_name.id == live_stack.models["llama"]

    gpt2 = live_stack.models["gpt2"]
    stranger = openai.OpenAI(base_url=f"{live_stack.base_url}/v1", api_key="not-a-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        stranger.models.list()
    assert caught.value.body["type"] == "authentication_error"

    with pytest.raises(openai.NotFoundError) as caught:
        api.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert caught.value.body["code"] == "MODEL_NOT_FOUND" and caught.value.body["param"] == "model"

    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=gpt2, messages=MESSAGES, temperature=3)
    assert caught.value.body["param"] == "temperature" and "temperature" in caught.value.body["message"]
    assert caught.value.body["type"] == "invalid_request_error"

    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=gpt2, messages=MESSAGES, n=2)
    assert caught.value.body["param"] == "n"

    # A stream that fails before its first token is a plain HTTP error, not a broken stream.
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=gpt2, prompt="word " * 100, max_tokens=100, stream=True)
    assert caught.value.body["code"] == "CONTEXT_LENGTH_EXCEEDED"  # the tiny GPT-2 has 128 positions

    harmless = {"user": "u-1", "n": 1, "presence_penalty": 0, "frequency_penalty": 0, "stop": None}
    assert api.chat.completions.create(model=gpt2, messages=MESSAGES, max_tokens=2, **harmless).choices

    # Registered, never loaded (another quantization: the same folder cannot be registered twice).
    not_loaded = model_register(
        source="local", identifier=str(tiny_gpt2_folder), name="openai-not-loaded", owner=None,
        quantization="bf16",
    )  # fmt: skip
    assert not_loaded.status == LanguageModel.Status.PENDING
    with pytest.raises(openai.ConflictError) as caught:
        api.chat.completions.create(model="openai-not-loaded", messages=MESSAGES)
    assert caught.value.body["code"] == "MODEL_NOT_LOADED" and caught.value.body["param"] == "model"


def test_chat_is_deterministic_streams_the_same_reply_and_matches_the_stored_row(api, live_stack):
    first = greedy_chat(api, live_stack)

    choice = first.choices[0]
    assert first.object == "chat.completion" and first.model == live_stack.models["gpt2"]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("length", "stop") and choice.logprobs is None
    usage = first.usage
    assert 0 < usage.completion_tokens <= 12 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert greedy_chat(api, live_stack).choices[0].message.content == choice.message.content

    request_id = first.model_extra["mistudio"]["request_id"]
    assert first.id == f"chatcmpl-{request_id}"
    stored = httpx.get(f"{live_stack.api}/generations/{request_id}", headers=live_stack.headers()).json()
    assert stored["output_text"] == storable_text(choice.message.content)
    assert stored["interface"] == "openai_chat"
    assert stored["usage"] == usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})

    whole = first
    with greedy_chat(api, live_stack, stream=True, stream_options={"include_usage": True}) as stream:
        chunks = list(stream)

    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert content == whole.choices[0].message.content
    finish = chunks[-2]
    assert finish.choices[0].finish_reason == whole.choices[0].finish_reason
    assert finish.model_extra["mistudio"]["request_id"] and finish.usage is None
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert {chunk.id for chunk in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"


def test_completions_stream_batch_seed_and_stop(api, live_stack):
    whole = greedy_completion(api, live_stack)
    text = whole.choices[0].text
    assert whole.object == "text_completion" and len(text) >= 8

    streamed = list(greedy_completion(api, live_stack, stream=True))
    assert "".join(chunk.choices[0].text for chunk in streamed) == text
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason

    def sampled(seed: int) -> str:
        return (
            api.completions.create(
                model=live_stack.models["gpt2"], prompt=PROMPT, temperature=1.0, max_tokens=24, seed=seed
            )
            .choices[0]
            .text
        )

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)

    stop = text[len(text) // 2 :][:4]
    stopped = greedy_completion(api, live_stack, stop=[stop]).choices[0]
    assert stopped.text == text[: text.index(stop)] and stopped.finish_reason == "stop"

    # A list of prompts is a batch: one choice per prompt, each as that prompt alone.
    batch = greedy_completion(api, live_stack, prompt=[PROMPT, "Once upon a time"])
    assert [choice.index for choice in batch.choices] == [0, 1] and batch.choices[0].text == text
    alone = greedy_completion(api, live_stack, prompt="Once upon a time")
    assert batch.choices[1].text == alone.choices[0].text
    assert batch.usage.completion_tokens == whole.usage.completion_tokens + alone.usage.completion_tokens


def test_logprobs(api, live_stack):
    chat = greedy_chat(api, live_stack, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for token in content:
        top = token.top_logprobs
        assert len(top) == 3 and [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        # Greedy picks the most likely token; logprobs are the model's, before temperature.
        assert token.token == top[0].token and token.logprob == pytest.approx(top[0].logprob)
        assert token.bytes == list(token.token.encode())

    with greedy_chat(api, live_stack, logprobs=True, top_logprobs=3, stream=True) as stream:
        streamed = [t for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                    for t in chunk.choices[0].logprobs.content]  # fmt: skip
    assert [t.token for t in streamed] == [t.token for t in content]

    completion = greedy_completion(api, live_stack, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == completion.usage.completion_tokens
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    assert all(value <= 0 for value in logprobs.token_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_echo_returns_the_prompt_and_its_tokens_logprobs_as_the_model_computes_them(
    api, live_stack, tiny_llama_folder
):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = [PROMPT, "Once upon a time"]
    completion = greedy_completion(
        api, live_stack, family="llama", prompt=prompts, echo=True, logprobs=3, max_tokens=2
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_folder)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_folder)
    for prompt, choice in zip(prompts, completion.choices, strict=True):
        ids = tokenizer(prompt).input_ids
        with torch.no_grad():
            expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        logprobs = choice.logprobs
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
        assert len(logprobs.tokens) == len(ids) + 2  # the prompt's tokens, then the completion's
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        for position in range(1, len(ids)):
            assert logprobs.token_logprobs[position] == pytest.approx(
                expected[position - 1, ids[position]].item(), abs=1e-4
            )
            # {token: logprob}: of two ids that decode alike the likelier keeps the key.
            values, indices = expected[position - 1].topk(3)
            alternatives: dict[str, float] = {}
            for token_id, value in zip(indices.tolist(), values.tolist(), strict=True):
                alternatives.setdefault(tokenizer.decode([token_id]), value)
            assert logprobs.top_logprobs[position] == pytest.approx(alternatives, abs=1e-4)
        # The completion's first token is predicted where the prompt ends.
        assert logprobs.token_logprobs[len(ids)] == pytest.approx(expected[-1].max().item(), abs=1e-4)
        assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert completion.usage.prompt_tokens == sum(len(tokenizer(prompt).input_ids) for prompt in prompts)

    echoed = greedy_completion(api, live_stack, family="llama", prompt=PROMPT, echo=True, max_tokens=2)
    assert echoed.choices[0].text == completion.choices[0].text and echoed.choices[0].logprobs is None


def test_chat_prompt_logprobs_in_vllms_shape_are_the_models(api, live_stack, tiny_llama_folder):
    import torch
    from transformers import AutoModelForCausalLM

    chat = greedy_chat(api, live_stack, family="llama", max_tokens=1, extra_body={"prompt_logprobs": 4})
    ids, entries = chat.model_extra["prompt_token_ids"], chat.model_extra["prompt_logprobs"]
    assert len(ids) == len(entries) == chat.usage.prompt_tokens and entries[0] is None
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_folder)
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    for position in range(1, len(ids)):
        entry = entries[position]
        # The prompt's own token first, then the four most likely.
        assert next(iter(entry)) == str(ids[position])
        assert entry[str(ids[position])]["logprob"] == pytest.approx(
            expected[position - 1, ids[position]].item(), abs=1e-4
        )
        values, indices = expected[position - 1].topk(4)
        for rank, (token_id, value) in enumerate(
            zip(indices.tolist(), values.tolist(), strict=True), start=1
        ):
            assert entry[str(token_id)]["logprob"] == pytest.approx(value, abs=1e-4)
            assert entry[str(token_id)]["rank"] == rank
    # Without the field, none of it.
    assert "prompt_logprobs" not in greedy_chat(api, live_stack, family="llama", max_tokens=1).model_extra


def test_capture_through_the_mistudio_extension(api, live_stack):
    hook = "blocks.0.hook_resid_post"
    response = greedy_chat(api, live_stack, family="llama", extra_body={"mistudio": {"capture": [hook]}})

    activations = response.model_extra["activations"]
    hidden = LanguageModel.objects.get(pk=live_stack.models["llama"]).hidden_size
    tokens = response.usage.prompt_tokens + response.usage.completion_tokens
    assert activations["cache_id"] and activations["shapes"][hook] == [tokens, hidden]
    cache = httpx.get(
        f"{live_stack.api}/activation-caches/{activations['cache_id']}", headers=live_stack.headers()
    )
    assert cache.status_code == 200


def test_a_client_that_disconnects_stops_its_generation(live_stack):
    # ignore_eos (an extension) keeps the random model from ending early: left alone, 2,000 tokens
    # take seconds; a stop that works lands a few tokens after the client goes.
    body = {
        "model": live_stack.models["llama"], "messages": MESSAGES, "stream": True, "max_tokens": 2000,
        "temperature": 1, "stop": None, "ignore_eos": True,
    }  # fmt: skip
    data_lines = []
    with httpx.stream(
        "POST",
        f"{live_stack.base_url}/v1/chat/completions",
        headers=live_stack.headers(),
        json=body,
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert (
            response.headers["cache-control"] == "no-cache" and response.headers["x-accel-buffering"] == "no"
        )
        for line in response.iter_lines():
            if line.startswith("data: "):
                data_lines.append(json.loads(line.removeprefix("data: ")))
            if len(data_lines) == 2:
                break
    request_id = data_lines[0]["id"].removeprefix("chatcmpl-")

    deadline = time.monotonic() + 10
    generation = Generation.objects.get(pk=request_id)
    while generation.status in Generation.ACTIVE and time.monotonic() < deadline:
        time.sleep(0.1)
        generation.refresh_from_db()
    assert generation.status == Generation.Status.CANCELLED, (generation.status, generation.completion_tokens)
    assert generation.completion_tokens < 1000
