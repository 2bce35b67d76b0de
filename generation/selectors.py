"""Read queries of generation rows, used by the API, pages, commands and WebSocket snapshots."""

from typing import Any

from django.db.models import QuerySet

from generation.models import Generation
from mistudio.access import visible_row, visible_rows
from mistudio.events import register_group_kind


def generation_list(*, user) -> QuerySet[Generation]:
    """Generations the user may see: their own; every one for ``model:admin``."""
    return visible_rows(Generation.objects.select_related("model"), user, shareable=False)


def generation_get(*, user, generation_id: str) -> Generation:
    return visible_row(
        generation_list(user=user), generation_id, code="GENERATION_NOT_FOUND", what="generation"
    )


PREVIEW_CHARACTERS = 200  # of a prompt and an output, in the list of generations


def generation_state(generation: Generation, *, whole: bool = True) -> dict[str, Any]:
    """A generation's row as events, snapshots and ``GET /api/generations/{id}`` show it; the list
    (``whole=False``) shows the start of its prompt and output instead of them and their tokens."""
    if whole:
        content = {
            "prompt": generation.prompt,
            "messages": generation.messages,
            "output_text": generation.output_text,
            "output_token_ids": generation.output_token_ids,
            "input_token_ids": generation.input_token_ids,
        }
    else:
        prompt = generation.prompt or "\n".join(
            str(message.get("content", "")) for message in generation.messages
        )
        content = {
            "prompt_preview": prompt[:PREVIEW_CHARACTERS],
            "output_preview": generation.output_text[:PREVIEW_CHARACTERS],
        }
    return {
        "request_id": generation.id,
        "model_id": generation.model_id,
        "status": generation.status,
        "interface": generation.interface,
        **content,
        "parameters": generation.parameters,
        "capture_hooks": generation.capture_hooks,
        "effect": generation.effect or None,
        "sweep_coefficient": generation.sweep_coefficient,
        "finish_reason": generation.finish_reason,
        "usage": generation.usage,
        "timings": generation.timings,
        "cache_id": generation.cache_id,
        "error_code": generation.error_code,
        "error_message": generation.error_message,
        "created_at": generation.created_at.isoformat() if generation.created_at else None,
        "completed_at": generation.finished_at.isoformat() if generation.finished_at else None,
    }


def generation_snapshot(user, key: str | None) -> dict[str, Any] | None:
    generation = generation_list(user=user).filter(pk=key).first()
    return None if generation is None else generation_state(generation)


def generation_visible(user, key: str) -> bool:
    return generation_list(user=user).filter(pk=key).exists()


def register_event_groups() -> None:
    register_group_kind("generation", keyed=True, snapshot=generation_snapshot, visible=generation_visible)
