"""decode_step on the host through the compiled C++ kernel (all values validated by the binding)."""

from .._backend import compiled
from . import capsules


def decode_step(
    logits,
    tokens,
    seq_offsets,
    threshold,
    num_commit,
    credit_ids,
    credit_vals,
    candidate,
    confidence,
    commit,
    nonfinite,
    *,
    mask_id: int,
    rule: int,
    low_threshold: float,
    temperature: float,
    seed: int,
    offset: int,
    credit_alpha: float,
    credit_beta: float,
    credit_gamma: float,
    row_keys=None,
    editable=None,
    edit_threshold: float = float("inf"),
) -> None:
    arrays = capsules(
        logits,
        tokens,
        seq_offsets,
        threshold,
        num_commit,
        credit_ids,
        credit_vals,
        candidate,
        confidence,
        commit,
        row_keys,
        nonfinite,
        editable,
    )
    compiled().decode_step(
        *arrays[:-3],
        mask_id=mask_id,
        rule=rule,
        low_threshold=low_threshold,
        temperature=temperature,
        seed=seed,
        offset=offset,
        credit_alpha=credit_alpha,
        credit_beta=credit_beta,
        credit_gamma=credit_gamma,
        row_keys=arrays[-3],
        nonfinite=arrays[-2],
        editable=arrays[-1],
        edit_threshold=edit_threshold,
    )
