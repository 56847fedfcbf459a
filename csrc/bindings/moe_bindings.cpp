// pybind11 entry for the fused MoE layer: validates every argument (dtype, shape, device, layout,
// ranges) and names it in the error, then calls the torch-free launcher of the arrays' device: the
// host kernel (every build) or the CUDA one (CUDA builds; CUDA arrays are refused otherwise).
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

#include "dinfer_kernels/moe.h"
#include "tensor_arg.h"

namespace dinfer_bindings {

using dinfer_kernels::MoeParams;
using dinfer_kernels::MoeScoring;

namespace {

std::string type_name(py::handle o) { return std::string(py::str(py::type::of(o).attr("__name__"))); }

MoeScoring scoring_arg(py::handle o) {
  if (!PyUnicode_Check(o.ptr())) throw_type_error("scoring: expected a str, got " + type_name(o));
  const std::string s = o.cast<std::string>();
  if (s == "softmax") return MoeScoring::kSoftmax;
  if (s == "sigmoid") return MoeScoring::kSigmoid;
  throw_value_error("scoring: expected 'softmax' or 'sigmoid', got '" + s + "'");
}

void in_range(int64_t v, int64_t lo, int64_t hi, const char* name) {  // [lo, hi]
  if (v < lo || v > hi)
    throw_value_error(std::string(name) + ": " + std::to_string(v) + " is outside [" + std::to_string(lo) +
                      ", " + std::to_string(hi) + "]");
}

}  // namespace

void moe(py::handle hidden_o, py::handle router_weight_o, py::handle router_logits_o, py::handle w13_o,
         py::handle w2_o, py::handle top_k_o, py::handle renormalize_o, py::handle scoring_o,
         py::handle expert_bias_o, py::handle num_groups_o, py::handle topk_groups_o,
         py::handle routed_scaling_o, py::handle expert_offset_o, py::handle out_o, py::handle topk_ids_o,
         py::handle topk_weights_o, py::handle shared_w13_o, py::handle shared_w2_o, py::handle w13_scale_o,
         py::handle w2_scale_o, py::handle shared_w13_scale_o, py::handle shared_w2_scale_o,
         py::handle workspace_o, py::handle stream_o, py::handle num_threads_o) {
  const int64_t top_k = int_arg(top_k_o, "top_k"), num_groups = int_arg(num_groups_o, "num_groups"),
                topk_groups = int_arg(topk_groups_o, "topk_groups"),
                expert_offset = int_arg(expert_offset_o, "expert_offset"),
                stream = int_arg(stream_o, "stream");
  const int num_threads = threads_arg(num_threads_o, "num_threads");
  const bool renormalize = bool_arg(renormalize_o, "renormalize");
  const MoeScoring scoring = scoring_arg(scoring_o);
  const double routed_scaling = float_arg(routed_scaling_o, "routed_scaling");
  if (!std::isfinite(static_cast<float>(routed_scaling)))
    throw_value_error("routed_scaling: must be finite (in fp32), got " + std::to_string(routed_scaling));

  TensorArg hidden(hidden_o, "hidden");
  hidden.expect_dtype({DType::kFloat32, DType::kFloat16, DType::kBFloat16});
  if (hidden.ndim() != 2) throw_value_error("hidden: expected a 2-D array [T, H]");
  hidden.expect_contiguous();
  const int64_t T = hidden.size(0), H = hidden.size(1);
  const DType dt = hidden.dtype();
  const bool on_host = !hidden.on_cuda();

  TensorArg w13(w13_o, "w13"), w2(w2_o, "w2"), out(out_o, "out");
  if (w13.ndim() != 3) throw_value_error("w13: expected a 3-D array [E_local, 2I, H]");
  const int64_t El = w13.size(0), two_i = w13.size(1);
  if (El < 1) throw_value_error("w13: expected at least one local expert");
  if (!on_host && El > dinfer_kernels::kMoeMaxExperts)
    throw_value_error("w13: the CUDA kernels take at most " + std::to_string(dinfer_kernels::kMoeMaxExperts) +
                      " experts, got " + std::to_string(El));
  if (two_i < 2 || two_i % 2)
    throw_value_error("w13: the middle dimension is gate + up rows (2 * I), got " + std::to_string(two_i));
  const int64_t I = two_i / 2;
  const bool given = !topk_ids_o.is_none();
  if (given != !topk_weights_o.is_none())
    throw_value_error("topk_ids: topk_ids and topk_weights come together");
  if (static_cast<int>(!router_weight_o.is_none()) + static_cast<int>(!router_logits_o.is_none()) +
          static_cast<int>(given) !=
      1)
    throw_value_error(
        "router_weight: give exactly one of router_weight [E, H], router_logits [T, E] and topk_ids [T, k]");
  // Kept alive until the launch.
  const std::unique_ptr<TensorArg> router_weight = optional_arg(router_weight_o, "router_weight"),
                                   router_logits = optional_arg(router_logits_o, "router_logits"),
                                   ids = optional_arg(topk_ids_o, "topk_ids"),
                                   weights = optional_arg(topk_weights_o, "topk_weights"),
                                   bias = optional_arg(expert_bias_o, "expert_bias");
  const TensorArg* router = router_weight ? router_weight.get() : router_logits.get();
  // The router's experts (all E; w13 / w2 hold the local ones), read before the table checks the rest.
  int64_t E = 0;
  if (router_weight) {
    if (router_weight->ndim() != 2) throw_value_error("router_weight: expected a 2-D array [E, H]");
    E = router_weight->size(0);
  } else if (router_logits) {
    if (router_logits->ndim() != 2) throw_value_error("router_logits: expected a 2-D array [T, E]");
    E = router_logits->size(1);
  }
  // The weights: hidden's dtype, or FP8 (float8_e4m3fn) with their fp32 block scales.
  w13.expect_dtype({dt, DType::kFloat8E4M3});
  const DType wt = w13.dtype();
  const bool fp8 = wt == DType::kFloat8E4M3;
  if ((shared_w13_o.is_none()) != (shared_w2_o.is_none()))
    throw_value_error(std::string(shared_w13_o.is_none() ? "shared_w13" : "shared_w2") +
                      ": shared_w13 and shared_w2 come together (the shared expert)");
  const std::unique_ptr<TensorArg> shared_w13 = optional_arg(shared_w13_o, "shared_w13"),
                                   shared_w2 = optional_arg(shared_w2_o, "shared_w2"),
                                   w13_scale = optional_arg(w13_scale_o, "w13_scale"),
                                   w2_scale = optional_arg(w2_scale_o, "w2_scale"),
                                   shared_w13_scale = optional_arg(shared_w13_scale_o, "shared_w13_scale"),
                                   shared_w2_scale = optional_arg(shared_w2_scale_o, "shared_w2_scale");
  int64_t S = 0;
  if (shared_w13) {
    if (shared_w13->ndim() != 2) throw_value_error("shared_w13: expected a 2-D array [2S, H]");
    if (shared_w13->size(0) < 2 || shared_w13->size(0) % 2)
      throw_value_error("shared_w13: the first dimension is gate + up rows (2 * S), got " +
                        std::to_string(shared_w13->size(0)));
    S = shared_w13->size(0) / 2;
  }
  struct Scale {
    const TensorArg* array;
    const char* name;
    bool wanted;  // FP8 weights, and the shared expert's scales only with a shared expert
  };
  const Scale scales[] = {{w13_scale.get(), "w13_scale", fp8},
                          {w2_scale.get(), "w2_scale", fp8},
                          {shared_w13_scale.get(), "shared_w13_scale", fp8 && S > 0},
                          {shared_w2_scale.get(), "shared_w2_scale", fp8 && S > 0}};
  for (const Scale& sc : scales) {
    if (sc.array != nullptr && !sc.wanted)
      throw_value_error(std::string(sc.name) + ": block scales go with FP8 weights only (" +
                        (fp8 ? "there is no shared expert)" : "the weights are not float8_e4m3fn)"));
    if (sc.array == nullptr && sc.wanted)
      throw_value_error(std::string(sc.name) + ": FP8 weights need their fp32 block scales");
  }
  const int64_t blk = dinfer_kernels::kMoeFp8Block;
  const int64_t cH = (H + blk - 1) / blk, cI = (I + blk - 1) / blk, cS = (S + blk - 1) / blk;
  expect_arrays(hidden, {
                            {&w13, {wt}, {El, two_i, H}, kContiguous},
                            {&w2, {wt}, {El, H, I}, kContiguous},
                            {shared_w13.get(), {wt}, {2 * S, H}, kContiguous},
                            {shared_w2.get(), {wt}, {H, S}, kContiguous},
                            {w13_scale.get(), {DType::kFloat32}, {El, 2 * cI, cH}, kContiguous},
                            {w2_scale.get(), {DType::kFloat32}, {El, cH, cI}, kContiguous},
                            {shared_w13_scale.get(), {DType::kFloat32}, {2 * cS, cH}, kContiguous},
                            {shared_w2_scale.get(), {DType::kFloat32}, {cH, cS}, kContiguous},
                            {router_weight.get(), {DType::kFloat32, dt}, {E, H}, kContiguous},
                            {router_logits.get(), {DType::kFloat32}, {T, E}, kContiguous},
                            {ids.get(), {DType::kInt32}, {T, top_k}, kContiguous},
                            {weights.get(), {DType::kFloat32}, {T, top_k}, kContiguous},
                            {bias.get(), {DType::kFloat32}, {E}, kContiguous},
                            {&out, {dt}, {T, H}, kContiguous | kWritable},
                        });
  if (!given && (E < El || (!on_host && E > dinfer_kernels::kMoeMaxExperts)))
    throw_value_error(std::string(router_weight ? "router_weight" : "router_logits") + ": the router's " +
                      std::to_string(E) + " experts must be >= the " + std::to_string(El) + " local ones" +
                      (on_host ? "" : " and <= " + std::to_string(dinfer_kernels::kMoeMaxExperts)));
  if (!on_host && El + (S + I - 1) / I > dinfer_kernels::kMoeMaxExperts)
    throw_value_error("shared_w13: the CUDA kernels take at most " +
                      std::to_string(dinfer_kernels::kMoeMaxExperts) +
                      " experts, the local ones plus ceil(S / I) for the shared expert; got " +
                      std::to_string(El) + " + " + std::to_string((S + I - 1) / I));
  const std::initializer_list<const TensorArg*> read = {&hidden,
                                                        &w13,
                                                        &w2,
                                                        router,
                                                        ids.get(),
                                                        weights.get(),
                                                        bias.get(),
                                                        shared_w13.get(),
                                                        shared_w2.get(),
                                                        w13_scale.get(),
                                                        w2_scale.get(),
                                                        shared_w13_scale.get(),
                                                        shared_w2_scale.get()};
  expect_disjoint({&out}, read);
  MoeParams p;
  if (router_weight) {
    p.router_weight = router_weight->data<void>();
    p.router_dtype = scalar_type(router_weight->dtype());
  } else if (router_logits) {
    p.router_logits = router_logits->data<float>();
  } else {
    p.topk_ids = ids->data<int32_t>();
    p.topk_weights = weights->data<float>();
  }
  if (bias) p.expert_bias = bias->data<float>();

  if (given) {
    if (num_groups != 1 || topk_groups != 1 || bias)
      throw_value_error("num_groups: the router's options do not apply to a given top-k (topk_ids)");
    const int64_t max_k = on_host ? INT32_MAX : dinfer_kernels::kMoeMaxTopK;
    in_range(top_k, 1, max_k, "top_k");
    in_range(expert_offset, 0, INT32_MAX - El, "expert_offset");
  } else {
    in_range(num_groups, 1, E, "num_groups");
    if (E % num_groups)
      throw_value_error("num_groups: must divide the number of experts E=" + std::to_string(E) + ", got " +
                        std::to_string(num_groups));
    in_range(topk_groups, 1, num_groups, "topk_groups");
    const int64_t selectable = topk_groups * (E / num_groups);
    const int64_t max_k =
        on_host || selectable < dinfer_kernels::kMoeMaxTopK ? selectable : dinfer_kernels::kMoeMaxTopK;
    if (top_k < 1 || top_k > max_k)
      throw_value_error(
          "top_k: " + std::to_string(top_k) + " is outside [1, " + std::to_string(max_k) +
          "] (experts that can be chosen: " + std::to_string(selectable) +
          (on_host ? std::string(")")
                   : "; the CUDA kernels take at most " + std::to_string(dinfer_kernels::kMoeMaxTopK) + ")"));
    in_range(expert_offset, 0, E - El, "expert_offset");
  }
  if (T * top_k > INT32_MAX) throw_value_error("hidden: T * top_k must be < 2^31");
  if (H > INT32_MAX || I > INT32_MAX) throw_value_error("hidden: H and I must be < 2^31");
  if (S > INT32_MAX) throw_value_error("shared_w13: S must be < 2^31");

  p.hidden = hidden.data<void>();
  p.dtype = scalar_type(dt);
  p.num_tokens = T;
  p.hidden_size = H;
  p.w13 = w13.data<void>();
  p.w2 = w2.data<void>();
  p.num_experts = E;
  p.local_experts = El;
  p.expert_offset = static_cast<int32_t>(expert_offset);
  p.inter_size = I;
  p.top_k = static_cast<int32_t>(top_k);
  p.renormalize = renormalize;
  p.scoring = scoring;
  p.num_groups = static_cast<int32_t>(num_groups);
  p.topk_groups = static_cast<int32_t>(topk_groups);
  p.routed_scaling = static_cast<float>(routed_scaling);
  p.weight_dtype = scalar_type(wt);
  if (shared_w13) {
    p.shared_w13 = shared_w13->data<void>();
    p.shared_w2 = shared_w2->data<void>();
    p.shared_inter_size = S;
  }
  if (fp8) {
    p.w13_scale = w13_scale->data<float>();
    p.w2_scale = w2_scale->data<float>();
    if (shared_w13) {
      p.shared_w13_scale = shared_w13_scale->data<float>();
      p.shared_w2_scale = shared_w2_scale->data<float>();
    }
  }
  p.out = out.data<void>();
  if (on_host) {
    py::gil_scoped_release release;
    dinfer_kernels::moe_cpu(p, num_threads);
    return;
  }
  run_cuda(
      "moe_cuda", "moe_workspace_bytes", hidden, workspace_o, stream,
      {&hidden, &w13, &w2, router, ids.get(), weights.get(), bias.get(), shared_w13.get(), shared_w2.get(),
       w13_scale.get(), w2_scale.get(), shared_w13_scale.get(), shared_w2_scale.get(), &out},
      [&] {
        return dinfer_kernels::moe_cuda_workspace_bytes(T, E, El, static_cast<int32_t>(top_k), H, I, S);
      },
      [&](void* ws, size_t bytes, cudaStream_t s) { return dinfer_kernels::moe_cuda(p, ws, bytes, s); });
}

void register_moe(py::module_& m) {
  m.def("moe", &moe, py::arg("hidden"), py::arg("router_weight"), py::arg("router_logits"), py::arg("w13"),
        py::arg("w2"), py::arg("top_k"), py::arg("renormalize"), py::arg("scoring"), py::arg("expert_bias"),
        py::arg("num_groups"), py::arg("topk_groups"), py::arg("routed_scaling"), py::arg("expert_offset"),
        py::arg("out"), py::kw_only(), py::arg("topk_ids") = py::none(), py::arg("topk_weights") = py::none(),
        py::arg("shared_w13") = py::none(), py::arg("shared_w2") = py::none(),
        py::arg("w13_scale") = py::none(), py::arg("w2_scale") = py::none(),
        py::arg("shared_w13_scale") = py::none(), py::arg("shared_w2_scale") = py::none(),
        py::arg("workspace") = py::none(), py::arg("stream") = py::int_(0),
        py::arg("num_threads") = py::int_(0),
        "Fused MoE layer over DLPack arrays (contract: dinfer_kernels/reference/moe.py): router (or the "
        "given int32 topk_ids / fp32 topk_weights), top-k, grouped GEMMs of the local experts w13 / w2 "
        "(global ids [expert_offset, expert_offset + E_local)) and the weighted combine, written to `out` "
        "[T, H]. A shared expert shared_w13 [2S, H] / shared_w2 [H, S] adds to every token with weight 1. "
        "FP8 weights: w13 / w2 (and the shared pair) float8_e4m3fn with their fp32 128 x 128 block scales "
        "w13_scale / w2_scale (shared_w13_scale / shared_w2_scale). CUDA arrays: needs a uint8 workspace of "
        "moe_workspace_bytes(T, E, E_local, top_k, H, I, S) bytes (E: the router's experts, 0 with a given "
        "top-k; S: 0 without a shared expert) and runs on `stream`. "
        "Host arrays: runs on num_threads OpenMP threads (0: OpenMP's default).");
#ifdef DINFER_WITH_CUDA
  m.def("moe_workspace_bytes", &dinfer_kernels::moe_cuda_workspace_bytes, py::arg("num_tokens"),
        py::arg("num_experts"), py::arg("local_experts"), py::arg("top_k"), py::arg("hidden_size"),
        py::arg("inter_size"), py::arg("shared_inter_size") = 0);
#endif
}

}  // namespace dinfer_bindings
