// Fused mixture-of-experts layer (router + top-k + grouped expert GEMMs + weighted combine):
// torch-free launchers, CUDA (moe_cuda) and host (moe_cpu).
//
// The contract (shapes, dtypes, rounding points, tie rules) is the pure-torch reference
// dinfer_kernels/reference/moe.py; every pointer below mirrors one of its arguments. All arrays are
// dense row-major on one device; nothing here synchronises or allocates, so the call can be
// captured in a CUDA graph.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dinfer_kernels/types.h"

namespace dinfer_kernels {

enum class MoeScoring : int32_t { kSoftmax = 0, kSigmoid = 1 };

// Limits of the CUDA kernels (the bindings check them and name the argument); the host kernel has none.
constexpr int64_t kMoeMaxExperts = 512;  // E: the router keeps 16 scores per lane of a warp
constexpr int32_t kMoeMaxTopK = 32;  // top_k: one chosen expert per lane
// FP8 weights: one fp32 scale per block of kMoeFp8Block x kMoeFp8Block weights (dk.FP8_BLOCK).
constexpr int64_t kMoeFp8Block = 128;

struct MoeParams {
  // ---- inputs -------------------------------------------------------------------------------
  const void* hidden = nullptr;  // [T, H] in `dtype`
  ScalarType dtype = ScalarType::kBFloat16;  // of hidden and out (and of the weights unless FP8)
  int64_t num_tokens = 0;  // T
  int64_t hidden_size = 0;  // H
  // Routing: exactly one of router_weight / router_logits / topk_ids is set.
  const void* router_weight = nullptr;  // [E, H] in router_dtype (fp32 or `dtype`)
  ScalarType router_dtype = ScalarType::kFloat32;
  const float* router_logits = nullptr;  // [T, E] fp32: precomputed logits
  const int32_t* topk_ids = nullptr;  // [T, top_k] global expert ids: a given routing (the all-to-all
  const float* topk_weights = nullptr;  // path), with [T, top_k] fp32 weights used as they are
  // The local experts: w13 / w2 hold experts [expert_offset, expert_offset + local_experts) of the E
  // the router scores; a (token, slot) pair routed outside them contributes nothing.
  const void* w13 = nullptr;  // [local_experts, 2I, H] in weight_dtype: rows [0, I) gate, [I, 2I) up
  const void* w2 = nullptr;  // [local_experts, H, I] in weight_dtype
  int64_t num_experts = 0;  // E: the router's experts (unused with a given top-k)
  int64_t local_experts = 0;  // E_local >= 1
  int32_t expert_offset = 0;  // the global id of w13[0]
  int64_t inter_size = 0;  // I
  int32_t top_k = 1;
  bool renormalize = false;
  MoeScoring scoring = MoeScoring::kSoftmax;
  const float* expert_bias = nullptr;  // [E] fp32 or null: added to the selection scores
  int32_t num_groups = 1;  // grouped top-k (sigmoid scoring) when > 1; divides E
  int32_t topk_groups = 1;  // groups kept, 1 <= topk_groups <= num_groups
  float routed_scaling = 1.0f;  // multiplies the final routing weights
  // A shared expert (shared_inter_size S > 0; 0: none): every token takes it with weight 1 (not
  // renormalised, not scaled), whatever the routing; added to the routed fp32 sum before the rounding.
  const void* shared_w13 = nullptr;  // [2S, H] in weight_dtype: rows [0, S) gate, [S, 2S) up
  const void* shared_w2 = nullptr;  // [H, S] in weight_dtype
  int64_t shared_inter_size = 0;  // S
  // The weights' element type: `dtype`, or kFloat8E4M3 (FP8 experts, W8A16) with the fp32 128 x 128
  // block scales below (dinfer_kernels/fp8.py): each weight is used as fp32(q) * scale rounded to `dtype`.
  // The launchers look only at whether it is kFloat8E4M3 (any other value: the weights are in `dtype`),
  // so callers that never set it keep working.
  ScalarType weight_dtype = ScalarType::kBFloat16;
  const float* w13_scale = nullptr;  // [local_experts, 2 cdiv(I, 128), cdiv(H, 128)]: gate blocks, up blocks
  const float* w2_scale = nullptr;  // [local_experts, cdiv(H, 128), cdiv(I, 128)]
  const float* shared_w13_scale = nullptr;  // [2 cdiv(S, 128), cdiv(H, 128)]
  const float* shared_w2_scale = nullptr;  // [cdiv(H, 128), cdiv(S, 128)]
  // ---- output (caller-allocated) ----------------------------------------------------------------
  void* out = nullptr;  // [T, H] in `dtype`
};

// Bytes of device workspace moe_cuda needs for these sizes (any dtype, any expert offset; num_experts:
// the router's E, 0 with a given top-k; shared_inter_size: S of a shared expert, 0 without one).
size_t moe_cuda_workspace_bytes(int64_t num_tokens, int64_t num_experts, int64_t local_experts, int32_t top_k,
                                int64_t hidden_size, int64_t inter_size, int64_t shared_inter_size = 0);

// Launches the routing, the two grouped GEMMs and the combine on `stream`. Never synchronises.
// Returns 0 (cudaSuccess) or the cudaError_t of the first failing call.
int moe_cuda(const MoeParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Host launcher over host arrays: math in fp32 (g, u and W2 a kept in fp32; a rounded to the dtype),
// the k slots of a token summed in expert order. Runs on num_threads OpenMP threads (0: OpenMP's
// default) when the call is large enough; the result does not depend on the thread count. Allocates
// its scratch (host memory), needs no workspace.
void moe_cpu(const MoeParams& p, int num_threads);

}  // namespace dinfer_kernels
