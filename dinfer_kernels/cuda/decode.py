"""decode_step on a GPU through the compiled CUDA kernels.

The workspace comes from torch's caching allocator (capture-safe) and the kernels run on the current
stream, so the call can sit inside a CUDA graph.
"""

import torch

from .._backend import compiled


def decode_step(
    logits, tokens, seq_offsets, credit_ids, credit_vals, candidate, confidence, commit, nonfinite, params
) -> None:
    ext = compiled()
    N, V = logits.shape
    rule, sampling, credit, edit = params.rule, params.sampling, params.credit, params.edit
    workspace = torch.empty(ext.decode_step_workspace_bytes(N, V), dtype=torch.uint8, device=logits.device)
    stream = torch.cuda.current_stream(logits.device).cuda_stream
    with torch.cuda.device(logits.device):  # launches go to the current device
        ext.decode_step(
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
            mask_id=params.mask_id,
            rule=rule.code,
            low_threshold=rule.low_threshold,
            temperature=sampling.temperature,
            seed=sampling.seed,
            offset=sampling.offset,
            credit_alpha=credit.alpha,
            credit_beta=credit.beta,
            credit_gamma=credit.gamma,
            workspace=workspace,
            stream=stream,
            row_keys=sampling.row_keys,
            nonfinite=nonfinite,
            editable=edit.editable,
            edit_threshold=edit.kernel_threshold,
        )
