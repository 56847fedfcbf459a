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
    mask_id,
    rule,
    low_threshold,
    temperature,
    seed,
    offset,
    alpha,
    beta,
    gamma,
    candidate,
    confidence,
    commit,
    row_max,
    row_lse,
    nonfinite=None,
    row_keys=None,
):
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
        row_max,
        row_lse,
        row_keys,
        nonfinite,
    )
    compiled().decode_step(
        *arrays[:-2],
        mask_id=mask_id,
        rule=rule,
        low_threshold=low_threshold,
        temperature=temperature,
        seed=seed,
        offset=offset,
        credit_alpha=alpha,
        credit_beta=beta,
        credit_gamma=gamma,
        row_keys=arrays[-2],
        nonfinite=arrays[-1],
    )
