"""The OpenAI-compatible API under ``/v1``: models, completions and chat completions.

Any OpenAI client (the ``openai`` package, LangChain, curl) can talk to a loaded miStudio model:
point its base URL at ``https://<host>/v1`` and use a miStudio API token as the API key. The
views call the same services as ``POST /api/generate`` (one path per operation); they only
translate OpenAI's request fields in and OpenAI's response shapes out.

What differs from OpenAI, on purpose:

* ``model`` is a miStudio model id (``m_…``) or a unique model name; responses name the model
  by its id (the ``id`` that ``GET /v1/models`` lists). A model must be loaded first: otherwise
  409 ``MODEL_NOT_LOADED`` (generation never loads a model on its own).
* Fields we cannot honour are a 400 naming the field, never silently dropped: ``n`` > 1,
  non-zero ``presence_penalty``/``frequency_penalty``, a non-empty ``logit_bias``, ``tools``,
  ``tool_choice`` other than "none", ``response_format`` other than text, a streamed ``echo``,
  ``best_of`` > 1 and ``suffix``, and token-id prompts. Fields without effect here (``user``,
  ``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls``) are accepted and ignored; a
  field OpenAI does not define is a 400, as it is on OpenAI. ``null`` means "not given".
* Defaults: ``temperature`` 1 and ``top_p`` 1 (OpenAI's); ``max_tokens`` up to the model's
  context (at most 2,048) for chat, 16 for completions (OpenAI's). Greedy decoding is
  ``temperature: 0``.
* Extensions: ``top_k``, ``repetition_penalty``, ``ignore_eos`` and ``prompt_logprobs`` (vLLM's
  names; the last adds vLLM's ``prompt_logprobs`` and ``prompt_token_ids`` to the response) in the request;
  ``mistudio`` (``{"capture": [hook names], "store": true, "dtype": "float32"}``) captures the
  activations of prompt + completion, returned in a top-level ``activations`` object. Every
  response (a stream: its finish chunk) carries ``mistudio: {"request_id", "timings"}``;
  ``GET /api/generations/{request_id}`` reads the stored row.
* Chat prompts go through the tokenizer's chat template; a tokenizer without one gets a plain
  ``User: …\\nAssistant:`` rendering (see ``engine.generation.render_prompt``).
  Completions use the raw prompt.
* Logprobs are the raw model's (before temperature and penalties), one entry per generated
  token, the end-of-sequence token included. Completions' ``echo`` returns the prompt before
  the text, and with ``logprobs`` its tokens before the completion's (the first token's logprob
  null, as OpenAI's): a prompt's log-likelihood, the way lm-evaluation-harness asks for it (its
  ``tokenized_requests=False``). A token's text is its own decoding where the
  engine reports it (it is among the ``top_logprobs``), otherwise the text it released.
"""

from generation.openai_api.views import chat_completions, completions, list_models, not_found, retrieve_model

__all__ = ["chat_completions", "completions", "list_models", "not_found", "retrieve_model"]
