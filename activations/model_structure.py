"""A model's module structure without its weights, for the web process (hook names and shapes).

Built from the row's config on PyTorch's meta device: no memory for parameters, no files read.
"""

import functools
import json
import threading

from engine.inspection import ENCODER_MODEL_TYPES
from models_app.models import LanguageModel

# transformers' lazy first import is not thread-safe: two requests building a skeleton at once
# in a fresh web process got "cannot import name 'AutoConfig'". One build at a time.
_BUILDING = threading.Lock()


def _skeleton(config_json: str):
    with _BUILDING:
        return _built_skeleton(config_json)


@functools.lru_cache(maxsize=16)
def _built_skeleton(config_json: str):
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = json.loads(config_json)
    model_type = config.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **config)
    model_class = AutoModel if model_type in ENCODER_MODEL_TYPES else AutoModelForCausalLM
    with torch.device("meta"):
        return model_class.from_config(hf_config, trust_remote_code=False)


def skeleton(model: LanguageModel):
    """The model's modules on the meta device (cached per config)."""
    return _skeleton(json.dumps(model.config, sort_keys=True))
