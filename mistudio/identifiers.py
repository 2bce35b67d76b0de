"""Prefixed opaque ids shown to users: ``m_``, ``ds_``, ``ext_``, ``act_``, ``gen_``, ``sae_``, ``fa_``…"""

import secrets

ALPHABET = "abcdefghijkmnopqrstuvwxyz23456789"  # no 0/1/l: ids get read aloud and copied by hand
ID_LENGTH = 12


def new_id(prefix: str) -> str:
    return f"{prefix}_" + "".join(secrets.choice(ALPHABET) for _ in range(ID_LENGTH))


def new_model_id() -> str:
    return new_id("m")


def new_dataset_id() -> str:
    return new_id("ds")


def new_extraction_id() -> str:
    return new_id("ext")


def new_cache_id() -> str:
    return new_id("act")


def new_generation_id() -> str:
    return new_id("gen")


def new_sae_id() -> str:
    return new_id("sae")


def new_sae_group_id() -> str:
    return new_id("grp")


def new_analysis_id() -> str:
    return new_id("fa")


def new_evaluation_id() -> str:
    return new_id("ev")


def new_steering_vector_id() -> str:
    return new_id("sv")


def new_explanation_job_id() -> str:
    return new_id("xj")


def new_graph_id() -> str:
    return new_id("ag")


def new_subgraph_id() -> str:
    return new_id("sg")


def new_bench_run_id() -> str:
    return new_id("sb")
