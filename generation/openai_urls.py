"""The OpenAI-compatible API, mounted at ``/v1/`` (see ``openai_api``)."""

from django.urls import path

from generation import openai_api

urlpatterns = [
    path("models", openai_api.list_models, name="openai-models"),
    path("models/<path:model_ref>", openai_api.retrieve_model, name="openai-model"),
    path("chat/completions", openai_api.chat_completions, name="openai-chat-completions"),
    path("completions", openai_api.completions, name="openai-completions"),
    path("", openai_api.not_found),
    path("<path:unmatched>", openai_api.not_found),
]
