"""The kinds of dictionary a training group's member or an imported SAE is: an SAE reconstructs
the hook it reads; a transcoder reads one hook and predicts another (its ``b_dec`` in the output
space, so not subtracted from the input); a skip transcoder adds a linear path ``W_skip``.

Each kind names what it reads and writes, its extra parameters, and the architecture name SAELens
saves it under. Torch-free, like the architectures.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sae_architectures.base import REGISTRY, Architecture, saelens_form

__all__ = ["MEMBER_KINDS", "MemberKind", "member_kind", "saelens_member"]


@dataclass(frozen=True)
class MemberKind:
    name: str
    label: str
    # Reads one hook point and writes another (d_out wide), rather than reconstructing its input.
    transcoder: bool
    # Parameters beyond W_enc, W_dec, b_enc, b_dec (and a threshold).
    extra_parameters: tuple[str, ...] = ()

    @property
    def skip(self) -> bool:
        return "W_skip" in self.extra_parameters

    def saelens_name(self, form: Architecture) -> str:
        """The ``architecture`` SAELens' ``cfg.json`` says for this kind of inference form ``form``:
        the form itself for an SAE; SAELens' transcoder class of it (``jumprelu_skip_transcoder``…)
        where SAELens has one; else the form, told apart by ``d_out`` (miStudio's TopK ones)."""
        if not self.transcoder or form.saelens_transcoder_prefix is None:
            return form.name
        return f"{form.saelens_transcoder_prefix}{self.name}"


MEMBER_KINDS: dict[str, MemberKind] = {
    kind.name: kind
    for kind in (
        MemberKind("sae", "SAE", transcoder=False),
        MemberKind("transcoder", "transcoder", transcoder=True),
        MemberKind("skip_transcoder", "skip transcoder", transcoder=True, extra_parameters=("W_skip",)),
    )
}


def member_kind(*, transcoder: bool, skip: bool) -> MemberKind:
    """The kind with these traits (a skip path needs a transcoder: ValueError otherwise)."""
    if skip and not transcoder:
        raise ValueError("a skip connection needs a transcoder (d_out)")
    return MEMBER_KINDS["skip_transcoder" if skip else "transcoder" if transcoder else "sae"]


def saelens_member(
    name: object, *, has_d_out: bool, has_skip: bool
) -> tuple[MemberKind, Architecture] | None:
    """What a SAELens ``cfg.json`` whose ``architecture`` is ``name`` holds: its kind and inference
    form; None for an architecture miStudio does not read. ``has_d_out`` (the cfg has ``d_out``)
    and ``has_skip`` (the weights have ``W_skip``) tell miStudio's TopK transcoders apart."""
    form = saelens_form(name)
    if form is not None:
        if form.saelens_transcoder_prefix is not None or not has_d_out:
            return MEMBER_KINDS["sae"], form
        return member_kind(transcoder=True, skip=has_skip), form
    forms = [saelens_form(architecture.name) for architecture in REGISTRY.values()]
    for kind in MEMBER_KINDS.values():
        for candidate in forms:
            if kind.transcoder and candidate is not None and kind.saelens_name(candidate) == name:
                return kind, candidate
    return None
