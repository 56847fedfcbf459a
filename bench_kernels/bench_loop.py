"""The generation loop's own overhead on the host: everything outside model forwards, decode steps and
smoothing, as a fraction of the run, on a small random LLaDA-MoE-shaped model (target: < 10%).

    python bench_kernels/bench_loop.py [--hidden 256] [--layers 4] [--experts 16] [--vocab 8192]
                                       [--gen-length 128] [--block-length 32] [--batch 1] [--device cpu]
                                       [--quick] [--json out.json]
"""

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkout  # noqa: F401  (puts the checkout's dinfer and dinfer_kernels on sys.path)
import environment
import markdown_tables
import results_json

from dinfer.decoders import DecoderConfig
from dinfer.generate import GenerationConfig, generate
from dinfer.models.checkpoint import random_weights
from dinfer.models.config import ModelConfig
from dinfer.models.transformer import DiffusionLM


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--gen-length", type=int, default=128)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="a shorter generation (the GPU check script)")
    p.add_argument("--json", default=None, type=results_json.json_path)
    a = p.parse_args(argv)
    if a.quick:
        a.gen_length = min(a.gen_length, 64)
    heads = a.hidden // 64
    cfg = ModelConfig(
        family="llada_moe",
        hidden_size=a.hidden,
        num_layers=a.layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=64,
        vocab_size=a.vocab,
        intermediate_size=None,
        num_experts=a.experts,
        top_k=min(8, a.experts),
        expert_intermediate_size=a.hidden // 2,
        qk_norm=True,
        rope_theta=50000.0,
        rotary_dim=64,
        rms_eps=1e-5,
        max_positions=4096,
        mask_id=a.vocab - 2,
        eos_id=a.vocab - 1,
        pad_id=a.vocab - 1,
        tie_embeddings=False,
        router_renormalize=False,
        expert_bias=False,
        architectures=("LLaDAMoEModelLM",),
    )
    weights = random_weights(cfg, seed=0)
    weights["lm_head"] = weights["lm_head"] * 30  # confident enough that several tokens commit per step
    model = DiffusionLM(cfg, {k: v.to(a.device) for k, v in weights.items()})
    prompts = [list(range(1, 40))] * a.batch
    rows = []
    credit = DecoderConfig(name="credit")
    for name, kw in [
        ("threshold, vicinity + write-back", {}),
        ("threshold, vicinity (dInfer: no write-back)", {"write_back": False}),
        ("threshold, dual", {"cache": "dual"}),
        ("credit + smoothing, vicinity", {"smoothing": True, "decoder": credit}),
        ("threshold, no cache", {"cache": "none"}),
    ]:
        g = dataclasses.replace(
            GenerationConfig(
                gen_length=a.gen_length, block_length=a.block_length, early_stop=False, time_phases=True
            ),
            **kw,
        )
        generate(model, prompts, g)  # warm-up
        _, stats = generate(model, prompts, g)
        d = stats.as_dict()
        rows.append({"config": name, **d})
        results_json.record(name, rows[-1])
        print(
            f"{name:44s} forwards {d['forwards']:4d}  TPF {d['tokens_per_forward']:.2f}  "
            f"TPS {d['tokens_per_second']:.1f}  phases {d['phase_seconds']}  "
            f"loop overhead {100 * d['loop_overhead_fraction']:.1f}%"
        )
    columns = [
        ("config", "config", None),
        ("forwards", "forwards", None),
        ("tokens/forward", "tokens_per_forward", ".2f"),
        ("tokens/s", "tokens_per_second", ".1f"),
        ("loop overhead", "loop_overhead_fraction", ".1%"),
    ]
    results_json.finish(
        "loop",
        environment.environment(a.device),
        a,
        None,
        rows,
        [markdown_tables.markdown_table(rows, columns)],
        [],
    )
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
