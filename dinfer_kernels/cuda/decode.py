"""decode_step on a GPU through the compiled CUDA kernels.

The workspace comes from torch's caching allocator (capture-safe) and the kernels run on the current
stream, so the call can sit inside a CUDA graph.
"""

import torch

from .._backend import compiled


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
    ext = compiled()
    N, V = logits.shape
    workspace = torch.empty(ext.decode_step_workspace_bytes(N, V), dtype=torch.uint8, device=logits.device)
    stream = torch.cuda.current_stream(logits.device).cuda_stream
    with torch.cuda.device(logits.device):  # launches go to the current device
        ext.decode_step(
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
            mask_id=mask_id,
            rule=rule,
            low_threshold=low_threshold,
            temperature=temperature,
            seed=seed,
            offset=offset,
            credit_alpha=credit_alpha,
            credit_beta=credit_beta,
            credit_gamma=credit_gamma,
            workspace=workspace,
            stream=stream,
            row_keys=row_keys,
            nonfinite=nonfinite,
            editable=editable,
            edit_threshold=edit_threshold,
        )
