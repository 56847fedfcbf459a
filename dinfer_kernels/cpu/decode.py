"""decode_step on the host through the compiled C++ kernel (all values validated by the binding)."""

from .._backend import compiled
from . import capsules


def decode_step(
    logits, tokens, seq_offsets, credit_ids, credit_vals, candidate, confidence, commit, nonfinite, params
) -> None:
    rule, sampling, credit, edit = params.rule, params.sampling, params.credit, params.edit
    arrays = capsules(
        logits,
        tokens,
        seq_offsets,
        rule.threshold,
        rule.num_commit,
        credit_ids,
        credit_vals,
        candidate,
        confidence,
        commit,
        sampling.row_keys,
        nonfinite,
        edit.editable,
    )
    compiled().decode_step(
        *arrays[:-3],
        mask_id=params.mask_id,
        rule=rule.code,
        low_threshold=rule.low_threshold,
        temperature=sampling.temperature,
        seed=sampling.seed,
        offset=sampling.offset,
        credit_alpha=credit.alpha,
        credit_beta=credit.beta,
        credit_gamma=credit.gamma,
        row_keys=arrays[-3],
        nonfinite=arrays[-2],
        editable=arrays[-1],
        edit_threshold=edit.kernel_threshold,
    )
