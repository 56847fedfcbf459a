// The routing and alignment of the CUDA MoE kernel (route_kernel in csrc/moe/moe.cu, from given router
// logits) executed on the host: the kernel's own moe_route.h code, every CTA's 256 threads run as
// fibers by the SIMT emulator (simt_host.h), the CTAs in a caller-chosen order (on the GPU any CTA
// may finish last and align). Built and loaded by tests/kernels/test_device_logic.py through ctypes.
#include <cstdint>
#include <memory>
#include <vector>

#include "dinfer_kernels/detail/moe_route.h"
#include "simt_host.h"

namespace {

using namespace dinfer_kernels;
using namespace dinfer_kernels::moe_route;

template <int TT>
int run(const RouteArgs& a, const int32_t* cta_order, int num_ctas) {
  auto sh = std::make_unique<RouteShared>();
  for (int i = 0; i < num_ctas; ++i) {
    const int tile = cta_order[i];
    if (!simt::host::run_cta(kRouteThreads, [&] {
          score_and_align<TT>(a, *sh, tile, num_ctas, simt::thread_index() / 32, simt::thread_index() % 32);
        }))
      return 2;  // deadlock
  }
  return 0;
}

}  // namespace

// cta_order: a permutation of the token tiles [0, cdiv(T, tokens_per_cta(T))).
extern "C" int dinfer_moe_route_cuda_on_host(const float* logits, int32_t T, int32_t E, int32_t top_k,
                                             int32_t scoring, int32_t renormalize, const float* bias,
                                             int32_t num_groups, int32_t topk_groups, float scaling,
                                             int32_t e0, int32_t e1, int32_t shared_experts, int32_t bm,
                                             const int32_t* cta_order, int32_t* topk_ids, float* topk_w,
                                             int32_t* sorted_ids, int32_t* tile_expert, int32_t* num_tiles) {
  if (E > kMoeMaxExperts || top_k > kMoeMaxTopK || top_k > E || e1 - e0 + shared_experts > kMoeMaxExperts)
    return 1;
  RouteArgs a{};
  a.given_logits = logits;
  a.T = T;
  a.E = E;
  a.top_k = top_k;
  a.scoring = static_cast<MoeScoring>(scoring);
  a.renormalize = renormalize != 0;
  a.bias = bias;
  a.num_groups = num_groups;
  a.topk_groups = topk_groups;
  a.scaling = scaling;
  a.e0 = e0;
  a.e1 = e1;
  a.shared_experts = shared_experts;
  a.bm = bm;
  int32_t done_counter = 0;  // zeroed before the launch, as the launcher's memset does
  a.done_counter = &done_counter;
  a.topk_ids = topk_ids;
  a.topk_w = topk_w;
  a.sorted_ids = sorted_ids;
  a.tile_expert = tile_expert;
  a.num_tiles = num_tiles;
  const int tt = tokens_per_cta(T);
  const int ctas = (T + tt - 1) / tt;
  return tt == 4 ? run<4>(a, cta_order, ctas) : run<16>(a, cta_order, ctas);
}
