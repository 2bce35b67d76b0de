"""mistudio-client: a miStudio server from Python (a notebook on a laptop, the server on a GPU)."""

from mistudio_client.arrays import Cache, HookArray
from mistudio_client.client import API_VERSION, Client
from mistudio_client.errors import (
    ApiError,
    BadRequest,
    Conflict,
    JobFailed,
    MistudioError,
    NotFound,
    PermissionDenied,
    RateLimited,
    ServerError,
    Unauthorized,
    VersionMismatch,
)
from mistudio_client.generation import Generation, GenerationStream
from mistudio_client.interventions import Ablate, Add, AddFeature, AddSteeringVector, ClampFeature, Replace
from mistudio_client.jobs import Job

__version__ = "0.1.0"
__all__ = [
    "API_VERSION",
    "Ablate",
    "Add",
    "AddFeature",
    "AddSteeringVector",
    "ApiError",
    "BadRequest",
    "Cache",
    "ClampFeature",
    "Client",
    "Conflict",
    "Generation",
    "GenerationStream",
    "HookArray",
    "Job",
    "JobFailed",
    "MistudioError",
    "NotFound",
    "PermissionDenied",
    "RateLimited",
    "Replace",
    "ServerError",
    "Unauthorized",
    "VersionMismatch",
]
