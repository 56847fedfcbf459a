// pybind11 entry for the decode step: validates every argument (dtype, shape, device, strides,
// ranges; on CPU also the data), then calls the torch-free launcher.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dinfer_kernels/decode.h"
#include "tensor_arg.h"

namespace dinfer_bindings {

using dinfer_kernels::CommitRule;
using dinfer_kernels::DecodeStepParams;

namespace {

void check_finite(float v, const char* name) {
  if (!std::isfinite(v)) throw_value_error(std::string(name) + ": must be finite, got " + std::to_string(v));
}

// A hand-built credit state must look like one the op keeps: every value finite and >= 0, ids in
// [-1, V), an empty slot (-1) holding 0, no id twice in a row. Else credit turns into NaN or
// confidences above 1.
void check_credit(const TensorArg& credit_ids, const TensorArg& credit_vals, int64_t V) {
  const int64_t N = credit_ids.size(0), K = credit_ids.size(1);
  const int32_t* ids = credit_ids.data<int32_t>();
  const float* vals = credit_vals.data<float>();
  std::vector<int32_t> row;
  row.reserve(K);
  for (int64_t n = 0; n < N; ++n) {
    row.clear();
    for (int64_t j = 0; j < K; ++j) {
      const int32_t id = ids[n * K + j];
      const float v = vals[n * K + j];
      auto at = [&] { return " at row " + std::to_string(n) + ", slot " + std::to_string(j); };
      if (id < -1 || id >= V)
        throw_value_error("credit_ids: slot id " + std::to_string(id) + at() + " is outside [-1, " +
                          std::to_string(V) + ")");
      if (!std::isfinite(v) || v < 0)
        throw_value_error("credit_vals: value " + std::to_string(v) + at() + " must be finite and >= 0");
      if (id == -1 && v != 0)
        throw_value_error("credit_vals: the empty slot" + at() + " holds " + std::to_string(v) +
                          " (must be 0)");
      if (id >= 0) row.push_back(id);
    }
    std::sort(row.begin(), row.end());
    const auto dup = std::adjacent_find(row.begin(), row.end());
    if (dup != row.end())
      throw_value_error("credit_ids: token id " + std::to_string(*dup) + " is in two slots of row " +
                        std::to_string(n));
  }
}

// Data checks that need to read device memory are only possible on the host without a sync.
void check_host_data(const TensorArg& tokens, const TensorArg& offsets, const TensorArg& num_commit,
                     const TensorArg& credit_ids, const TensorArg& credit_vals, const TensorArg& threshold,
                     int64_t N, int64_t V, CommitRule rule) {
  const int64_t* tok = tokens.data<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    if (tok[i] < 0 || tok[i] >= V)
      throw_value_error("tokens: token id " + std::to_string(tok[i]) + " at row " + std::to_string(i) +
                        " is outside [0, " + std::to_string(V) + ")");
  const int32_t* off = offsets.data<int32_t>();
  const int64_t B = offsets.size(0) - 1;
  if (off[0] != 0 || off[B] != N)
    throw_value_error("seq_offsets: must start at 0 and end at N=" + std::to_string(N));
  for (int64_t b = 0; b < B; ++b)
    if (off[b + 1] < off[b]) throw_value_error("seq_offsets: must be non-decreasing");
  if (rule == CommitRule::kFixed) {
    const int32_t* k = num_commit.data<int32_t>();
    for (int64_t b = 0; b < B; ++b)
      if (k[b] < 0) throw_value_error("num_commit: must be >= 0");
  }
  const float* tau = threshold.data<float>();
  for (int64_t b = 0; b < B; ++b)
    if (std::isnan(tau[b])) throw_value_error("threshold: must not be NaN");
  check_credit(credit_ids, credit_vals, V);
}

}  // namespace

void decode_step(py::handle logits_o, py::handle tokens_o, py::handle offsets_o, py::handle threshold_o,
                 py::handle num_commit_o, py::handle credit_ids_o, py::handle credit_vals_o,
                 py::handle candidate_o, py::handle confidence_o, py::handle commit_o, py::handle mask_id_o,
                 py::handle rule_o, py::handle low_threshold_o, py::handle temperature_o, py::handle seed_o,
                 py::handle offset_o, py::handle alpha_o, py::handle beta_o, py::handle gamma_o,
                 py::handle workspace_o, py::handle stream_o, py::handle num_threads_o, py::handle row_keys_o,
                 py::handle nonfinite_o, py::handle editable_o, py::handle edit_threshold_o) {
  const int64_t mask_id = int_arg(mask_id_o, "mask_id"), seed = int_arg(seed_o, "seed"),
                offset = int_arg(offset_o, "offset"), stream = int_arg(stream_o, "stream");
  const int64_t rule = int_arg(rule_o, "rule");
  const int num_threads = threads_arg(num_threads_o, "num_threads");
  const double low_threshold = float_arg(low_threshold_o, "low_threshold"),
               temperature = float_arg(temperature_o, "temperature"),
               alpha = float_arg(alpha_o, "credit_alpha"), beta = float_arg(beta_o, "credit_beta"),
               gamma = float_arg(gamma_o, "credit_gamma"),
               edit_threshold = float_arg(edit_threshold_o, "edit_threshold");
  TensorArg logits(logits_o, "logits"), tokens(tokens_o, "tokens"), offsets(offsets_o, "seq_offsets"),
      threshold(threshold_o, "threshold"), num_commit(num_commit_o, "num_commit"),
      credit_ids(credit_ids_o, "credit_ids"), credit_vals(credit_vals_o, "credit_vals"),
      candidate(candidate_o, "candidate"), confidence(confidence_o, "confidence"), commit(commit_o, "commit");

  logits.expect_dtype({DType::kFloat32, DType::kFloat16, DType::kBFloat16});
  if (logits.ndim() != 2) throw_value_error("logits: expected a 2-D array [N, V]");
  const int64_t N = logits.size(0), V = logits.size(1);
  if (V < 1) throw_value_error("logits: the vocabulary dimension must be >= 1");
  if (V >= INT32_MAX) throw_value_error("logits: the vocabulary must be < 2^31");
  if (V > 1 && logits.stride(1) != 1) throw_value_error("logits: the last dimension must be contiguous");
  const int64_t row_stride = N > 1 ? logits.stride(0) : V;
  if (N > 1 && row_stride < V) throw_value_error("logits: the row stride must be >= V");

  if (offsets.ndim() != 1 || offsets.size(0) < 1)
    throw_value_error("seq_offsets: expected a 1-D array [B + 1] with B >= 0");
  const int64_t B = offsets.size(0) - 1;
  if (credit_ids.ndim() != 2) throw_value_error("credit_ids: expected a 2-D array [N, K]");
  const int64_t K = credit_ids.size(1);
  if (K > 1024) throw_value_error("credit_ids: at most 1024 slots per row");
  // Optional: per-row noise keys (any values: they only feed the hash), the non-finite flags and the
  // joint rule's editable rows (any values: nonzero is editable). Held until the launch: a TensorArg
  // owns its DLPack reference.
  const std::unique_ptr<TensorArg> row_keys = optional_arg(row_keys_o, "row_keys"),
                                   nonfinite = optional_arg(nonfinite_o, "nonfinite"),
                                   editable = optional_arg(editable_o, "editable");
  const auto flags = {DType::kBool, DType::kUInt8};
  expect_arrays(logits, {
                            {&tokens, {DType::kInt64}, {N}, kContiguous | kWritable},
                            {&offsets, {DType::kInt32}, {}, kContiguous},  // 1-D: checked above
                            {&threshold, {DType::kFloat32}, {B}, kContiguous},
                            {&num_commit, {DType::kInt32}, {B}, kContiguous},
                            {&credit_ids, {DType::kInt32}, {N, K}, kContiguous | kWritable},
                            {&credit_vals, {DType::kFloat32}, {N, K}, kContiguous | kWritable},
                            {&candidate, {DType::kInt64}, {N}, kContiguous | kWritable},
                            {&confidence, {DType::kFloat32}, {N}, kContiguous | kWritable},
                            {&commit, flags, {N}, kContiguous | kWritable},
                            {row_keys.get(), {DType::kInt64}, {N}, kContiguous},
                            {nonfinite.get(), flags, {N}, kContiguous | kWritable},
                            {editable.get(), flags, {N}, kContiguous},
                        });
  expect_disjoint({&tokens, &credit_ids, &credit_vals, &candidate, &confidence, &commit, nonfinite.get()},
                  {&logits, &offsets, &threshold, &num_commit, row_keys.get(), editable.get()});

  if (mask_id < 0 || mask_id >= V)
    throw_value_error("mask_id: " + std::to_string(mask_id) + " is outside [0, " + std::to_string(V) + ")");
  if (rule < 0 || rule > 3)
    throw_value_error("rule: expected 0 (threshold), 1 (hierarchical), 2 (fixed) or 3 (joint)");
  // +inf (the default) turns editing off; NaN would do the same silently, so it is refused.
  if (std::isnan(edit_threshold)) throw_value_error("edit_threshold: must not be NaN");
  if (rule != static_cast<int64_t>(CommitRule::kJoint)) {
    if (editable) throw_value_error("editable: only rule 3 (joint) edits tokens");
    if (edit_threshold != INFINITY) throw_value_error("edit_threshold: only rule 3 (joint) edits tokens");
  }
  if (!(temperature >= 0.0) || !std::isfinite(temperature))
    throw_value_error("temperature: must be a finite number >= 0");
  if (seed < 0 || seed > UINT32_MAX) throw_value_error("seed: must be in [0, 2^32)");
  if (offset < 0 || offset > UINT32_MAX) throw_value_error("offset: must be in [0, 2^32)");
  check_finite(static_cast<float>(low_threshold), "low_threshold");
  check_finite(static_cast<float>(alpha), "credit_alpha");
  check_finite(static_cast<float>(beta), "credit_beta");
  check_finite(static_cast<float>(gamma), "credit_gamma");
  if (alpha < 0) throw_value_error("credit_alpha: must be >= 0");
  if (beta < 0 || beta > 1) throw_value_error("credit_beta: must be in [0, 1]");
  if (gamma < 0) throw_value_error("credit_gamma: must be >= 0");

  DecodeStepParams p;
  p.row_keys = row_keys ? row_keys->data<int64_t>() : nullptr;
  p.nonfinite = nonfinite ? nonfinite->data<uint8_t>() : nullptr;
  p.editable = editable ? editable->data<uint8_t>() : nullptr;
  p.edit_threshold = static_cast<float>(edit_threshold);
  p.logits = logits.data<void>();
  p.logits_dtype = scalar_type(logits.dtype());
  p.num_rows = N;
  p.vocab = V;
  p.row_stride = row_stride;
  p.tokens = tokens.data<int64_t>();
  p.seq_offsets = offsets.data<int32_t>();
  p.num_seqs = B;
  p.mask_id = mask_id;
  p.rule = static_cast<CommitRule>(rule);
  p.threshold = threshold.data<float>();
  p.num_commit = num_commit.data<int32_t>();
  p.low_threshold = static_cast<float>(low_threshold);
  p.temperature = static_cast<float>(temperature);
  p.seed = static_cast<uint32_t>(seed);
  p.offset = static_cast<uint32_t>(offset);
  p.credit_ids = credit_ids.data<int32_t>();
  p.credit_vals = credit_vals.data<float>();
  p.num_slots = static_cast<int32_t>(K);
  p.credit_alpha = static_cast<float>(alpha);
  p.credit_beta = static_cast<float>(beta);
  p.credit_gamma = static_cast<float>(gamma);
  p.candidate = candidate.data<int64_t>();
  p.confidence = confidence.data<float>();
  p.commit = commit.data<uint8_t>();

  if (!logits.on_cuda()) {
    check_host_data(tokens, offsets, num_commit, credit_ids, credit_vals, threshold, N, V, p.rule);
    py::gil_scoped_release release;
    dinfer_kernels::decode_step_cpu(p, num_threads);
    return;
  }
  run_cuda(
      "decode_step_cuda", "decode_step_workspace_bytes", logits, workspace_o, stream,
      {&logits, &tokens, &offsets, &threshold, &num_commit, &credit_ids, &credit_vals, &candidate,
       &confidence, &commit, row_keys.get(), nonfinite.get(), editable.get()},
      [&] { return dinfer_kernels::decode_step_cuda_workspace_bytes(N, V); },
      [&](void* ws, size_t bytes, cudaStream_t s) {
        return dinfer_kernels::decode_step_cuda(p, ws, bytes, s);
      });
}

void register_decode(py::module_& m) {
  m.def("decode_step", &decode_step, py::arg("logits"), py::arg("tokens"), py::arg("seq_offsets"),
        py::arg("threshold"), py::arg("num_commit"), py::arg("credit_ids"), py::arg("credit_vals"),
        py::arg("candidate"), py::arg("confidence"), py::arg("commit"), py::kw_only(), py::arg("mask_id"),
        py::arg("rule"), py::arg("low_threshold"), py::arg("temperature"), py::arg("seed"), py::arg("offset"),
        py::arg("credit_alpha"), py::arg("credit_beta"), py::arg("credit_gamma"),
        py::arg("workspace") = py::none(), py::arg("stream") = py::int_(0),
        py::arg("num_threads") = py::int_(0), py::arg("row_keys") = py::none(),
        py::arg("nonfinite") = py::none(), py::arg("editable") = py::none(),
        py::arg("edit_threshold") = py::float_(INFINITY),
        "Fused decode step over DLPack arrays (contract: dinfer_kernels/reference/decode.py). "
        "Outputs are caller-allocated; tokens and credit slots are updated in place; row_keys [N] int64 "
        "(noise keys, default the row index) and the output nonfinite [N] bool are optional. Rule 3 "
        "(joint) also rewrites committed rows whose candidate differs from their token with confidence "
        "> edit_threshold (+inf, the default: never), among the rows of editable [N] bool (None: all). "
        "CUDA arrays need a uint8 workspace of decode_step_workspace_bytes(N, V) bytes and run on "
        "`stream`.");
#ifdef DINFER_WITH_CUDA
  m.def("decode_step_workspace_bytes", &dinfer_kernels::decode_step_cuda_workspace_bytes, py::arg("num_rows"),
        py::arg("vocab"));
#endif
}

}  // namespace dinfer_bindings
