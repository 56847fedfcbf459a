"""`dinfer serve` on the embedded model with its EOS logit pushed far down: it never ends an answer
early, so a request with a large max_tokens and small blocks stays in flight for many rounds -- what
the tests of disconnects, backpressure and cancellation need to hold the engine's slots on purpose.

    python tests/helpers/endless_server.py --port P [dinfer serve options]
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from dinfer import LLM  # noqa: E402
from dinfer.cli import _parser  # noqa: E402
from dinfer.serve import serve  # noqa: E402


def endless(llm: LLM) -> LLM:
    """llm with a model whose logits never favour EOS (finite: a NaN or inf would stop the run)."""
    model, forward, eos = llm.model, llm.model.forward, llm.model.config.eos_id

    def no_eos(*args, **kwargs):
        logits = forward(*args, **kwargs)
        logits[..., eos] = -1e4
        return logits

    model.forward = no_eos
    return llm


def main(argv=None):
    args = _parser(["serve"]).parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    serve(
        llm=endless(LLM(args.model)),
        name=args.served_model_name or "tiny-llada-moe",
        port=args.port,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_len=args.max_len,
        max_lanes=args.max_lanes,
        log_level=args.log_level,
    )


if __name__ == "__main__":
    main()
