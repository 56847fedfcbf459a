// pybind11 entry for block-sparse window attention: validates every argument (dtype, shape, device,
// strides, alignment, scalars; with a block table the caches' shapes as page pools), then calls the
// torch-free launcher of the arrays' device: the host kernel (every build) or the CUDA one (CUDA
// builds; CUDA arrays are refused otherwise). Values (positions, page ids, block lists) are the
// kernels' to take safely, whatever they are.
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

#include "dinfer_kernels/attention.h"
#include "tensor_arg.h"

namespace dinfer_bindings {

using dinfer_kernels::AttentionParams;

namespace {

// The [.., D] arrays: last dimension contiguous; writes the three leading strides to `out`
// (strides of size-1 dimensions are never used: 0). The CUDA kernels copy them in 16-byte vectors,
// so for them (`vectors`) the other strides must be multiples of 8 elements and the data 16-byte
// aligned.
void row_layout(const TensorArg& t, bool vectors, int64_t (&out)[3]) {
  leading_strides(t, out);
  if (t.numel() == 0) return;
  for (int d = 0; d < 3; ++d) {
    if (vectors && out[d] % 8 != 0)
      throw_value_error(t.name() + ": the stride of dim " + std::to_string(d) + " (" +
                        std::to_string(out[d]) + ") must be a multiple of 8 elements");
  }
  if (vectors && reinterpret_cast<uintptr_t>(t.data<void>()) % 16 != 0)
    throw_value_error(t.name() + ": the data must be 16-byte aligned");
}

}  // namespace

void attention(py::handle q_o, py::handle k_o, py::handle v_o, py::handle k_cache_o, py::handle v_cache_o,
               py::handle positions_o, py::handle seq_lens_o, py::handle out_o, py::handle lse_o,
               py::handle block_mass_o, py::handle kv_num_blocks_o, py::handle kv_indices_o,
               py::handle block_table_o, py::handle write_back_o, py::handle q_block_o, py::handle kv_block_o,
               py::handle scale_o, py::handle workspace_o, py::handle stream_o, py::handle num_threads_o) {
  const bool write_back = bool_arg(write_back_o, "write_back");
  const int64_t q_block = int_arg(q_block_o, "q_block"), kv_block = int_arg(kv_block_o, "kv_block");
  const int64_t stream = int_arg(stream_o, "stream");
  const int num_threads = threads_arg(num_threads_o, "num_threads");
  const double scale = float_arg(scale_o, "scale");
  if (q_block < 1) throw_value_error("q_block: must be >= 1, got " + std::to_string(q_block));
  if (kv_block < 1) throw_value_error("kv_block: must be >= 1, got " + std::to_string(kv_block));
  if (!std::isfinite(scale) || !std::isfinite(static_cast<float>(scale)))
    throw_value_error("scale: must be a finite float32 value");

  AttentionParams p;
  TensorArg q(q_o, "q"), k(k_o, "k"), v(v_o, "v"), k_cache(k_cache_o, "k_cache"),
      v_cache(v_cache_o, "v_cache"), positions(positions_o, "positions"), seq_lens(seq_lens_o, "seq_lens"),
      out(out_o, "out");

  // The host kernel takes fp32 too, and any head dim; the CUDA kernels are tiled for 64 and 128.
  const bool on_host = !q.on_cuda();
  if (on_host)
    q.expect_dtype({DType::kFloat32, DType::kFloat16, DType::kBFloat16});
  else
    q.expect_dtype({DType::kFloat16, DType::kBFloat16});
  if (q.ndim() != 4) throw_value_error("q: expected a 4-D array [B, W, Hq, D]");
  const int64_t B = q.size(0), W = q.size(1), Hq = q.size(2), D = q.size(3);
  if (on_host ? D < 1 : (D != 64 && D != 128))
    throw_value_error("q: head dim must be " + std::string(on_host ? ">= 1" : "64 or 128") + ", got " +
                      std::to_string(D));
  if (Hq < 1) throw_value_error("q: needs at least one head");
  // With a block table the caches are page pools [P, page_size, Hkv, D] and S = MP * page_size.
  const std::unique_ptr<TensorArg> table = optional_arg(block_table_o, "block_table");
  if (table && table->ndim() != 2) throw_value_error("block_table: expected a 2-D array [B, max_pages]");
  if (k_cache.ndim() != 4)
    throw_value_error(table ? "k_cache: expected a 4-D page pool [P, page_size, Hkv, D]"
                            : "k_cache: expected a 4-D array [B, S, Hkv, D]");
  const int64_t Hkv = k_cache.size(2);
  int64_t S = k_cache.size(1);
  if (table) {
    const int64_t pages = k_cache.size(0), page_size = k_cache.size(1);
    if (pages < 1 || page_size < 1)
      throw_value_error("k_cache: a page pool needs >= 1 page of >= 1 row, got [" + std::to_string(pages) +
                        ", " + std::to_string(page_size) + ", ...]");
    // The kernels keep positions in int32 (the CUDA launcher below 2^30).
    if (table->size(1) >= ((int64_t{1} << 30) + page_size - 1) / page_size)
      throw_value_error("block_table: max_pages * page_size (" + std::to_string(table->size(1)) + " * " +
                        std::to_string(page_size) + " positions) must be below 2^30");
    S = table->size(1) * page_size;
    p.block_table = table->data<int32_t>();
    p.max_pages = table->size(1);
    p.page_size = page_size;
    p.num_pages = pages;
  }
  if (Hkv < 1 || Hq % Hkv != 0)
    throw_value_error("k_cache: query heads (" + std::to_string(Hq) + ") must be a multiple of kv heads (" +
                      std::to_string(Hkv) + ")");

  const int64_t nqb = dinfer_kernels::attention_num_q_blocks(W, q_block);
  const int64_t nkb = dinfer_kernels::attention_num_kv_blocks(S, kv_block);
  const bool has_counts = !kv_num_blocks_o.is_none(), has_indices = !kv_indices_o.is_none();
  if (has_counts != has_indices)
    throw_value_error(std::string(has_counts ? "kv_indices" : "kv_num_blocks") +
                      ": kv_num_blocks and kv_indices must be given together");
  // The optional arrays, kept alive until the launch.
  const std::unique_ptr<TensorArg> counts = optional_arg(kv_num_blocks_o, "kv_num_blocks"),
                                   indices = optional_arg(kv_indices_o, "kv_indices"),
                                   lse = optional_arg(lse_o, "lse"),
                                   mass = optional_arg(block_mass_o, "block_mass");
  if (indices && indices->ndim() != 4)
    throw_value_error("kv_indices: expected a 4-D array [B, Hkv, NQB, MAXB]");
  const int64_t max_blocks = indices ? indices->size(3) : -1;
  const auto dt = {q.dtype()};
  expect_arrays(q, {
                       {table.get(), {DType::kInt32}, {B, -1}, kContiguous},
                       // a page pool [P, page_size, Hkv, D] with a block table, else [B, S, Hkv, D]
                       {&k_cache, dt, {table ? -1 : B, -1, Hkv, D}, kWritable},
                       {&v_cache, dt, {k_cache.size(0), k_cache.size(1), Hkv, D}, kWritable},
                       {&k, dt, {B, W, Hkv, D}},
                       {&v, dt, {B, W, Hkv, D}},
                       {&positions, {DType::kInt64}, {B, W}, kContiguous},
                       {&seq_lens, {DType::kInt32}, {B}, kContiguous},
                       {&out, dt, {B, W, Hq, D}, kWritable},
                       {counts.get(), {DType::kInt32}, {B, Hkv, nqb}, kContiguous},
                       {indices.get(), {DType::kInt32}, {B, Hkv, nqb, max_blocks}, kContiguous},
                       {lse.get(), {DType::kFloat32}, {B, W, Hq}, kContiguous | kWritable},
                       {mass.get(), {DType::kFloat32}, {B, Hq, nkb}, kContiguous | kWritable},
                   });
  row_layout(q, !on_host, p.q_stride);
  row_layout(k, !on_host, p.k_stride);
  row_layout(v, !on_host, p.v_stride);
  row_layout(k_cache, !on_host, p.k_cache_stride);
  row_layout(v_cache, !on_host, p.v_cache_stride);
  row_layout(out, !on_host, p.out_stride);
  if (counts) {
    p.kv_num_blocks = counts->data<int32_t>();
    p.kv_indices = indices->data<int32_t>();
  }
  if (lse) p.lse = lse->data<float>();
  if (mass) p.block_mass = mass->data<float>();
  // The caches are only written with write_back (without it they are read like q, k and v).
  const TensorArg* kc_written = write_back ? &k_cache : nullptr;
  const TensorArg* vc_written = write_back ? &v_cache : nullptr;
  expect_disjoint({&out, lse.get(), mass.get(), kc_written, vc_written},
                  {&q, &k, &v, &positions, &seq_lens, counts.get(), indices.get(), table.get(),
                   write_back ? nullptr : &k_cache, write_back ? nullptr : &v_cache});
  p.batch = B;
  p.window = W;
  p.heads_q = Hq;
  p.heads_kv = Hkv;
  p.head_dim = D;
  p.cache_len = S;
  p.dtype = scalar_type(q.dtype());
  p.q = q.data<void>();
  p.k = k.data<void>();
  p.v = v.data<void>();
  p.k_cache = k_cache.data<void>();
  p.v_cache = v_cache.data<void>();
  p.positions = positions.data<int64_t>();
  p.seq_lens = seq_lens.data<int32_t>();
  p.write_back = write_back;
  p.max_blocks = max_blocks < 0 ? 0 : max_blocks;
  p.q_block = q_block;
  p.kv_block = kv_block;
  p.scale = static_cast<float>(scale);
  p.out = out.data<void>();

  if (on_host) {
    py::gil_scoped_release release;
    dinfer_kernels::attention_cpu(p, num_threads);
    return;
  }
  run_cuda(
      "attention_cuda", "attention_workspace_bytes", q, workspace_o, stream,
      {&q, &k, &v, &k_cache, &v_cache, &positions, &seq_lens, &out, counts.get(), indices.get(), lse.get(),
       mass.get(), table.get()},
      [&] {
        return dinfer_kernels::attention_cuda_workspace_bytes(
            B, W, Hq, Hkv, D, S, q_block, kv_block, max_blocks, write_back, p.block_mass != nullptr);
      },
      [&](void* ws, size_t bytes, cudaStream_t s) {
        return dinfer_kernels::attention_cuda(p, ws, bytes, s);
      });
}

void register_attention(py::module_& m) {
  m.def("attention", &attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("positions"), py::arg("seq_lens"), py::arg("out"),
        py::arg("lse") = py::none(), py::arg("block_mass") = py::none(),
        py::arg("kv_num_blocks") = py::none(), py::arg("kv_indices") = py::none(),
        py::arg("block_table") = py::none(), py::kw_only(), py::arg("write_back"), py::arg("q_block"),
        py::arg("kv_block"), py::arg("scale"), py::arg("workspace") = py::none(),
        py::arg("stream") = py::int_(0), py::arg("num_threads") = py::int_(0),
        "Block-sparse window attention with partial KV refresh over DLPack arrays (contract: "
        "dinfer_kernels/reference/attention.py). Outputs are caller-allocated; the caches are "
        "updated in place (write_back) or left as they were (not). block_table [B, max_pages] int32: "
        "the caches are page pools [P, page_size, Hkv, D] and S = max_pages * page_size. CUDA "
        "arrays: needs a uint8 workspace of attention_workspace_bytes(...) bytes and runs on "
        "`stream`. Host arrays (also fp32, any head dim): runs on num_threads OpenMP threads (0: "
        "OpenMP's default).");
#ifdef DINFER_WITH_CUDA
  m.def(
      "attention_workspace_bytes",
      [](int64_t batch, int64_t window, int64_t heads_q, int64_t heads_kv, int64_t head_dim,
         int64_t cache_len, int64_t q_block, int64_t kv_block, int64_t max_blocks, bool write_back,
         bool block_mass) {
        return dinfer_kernels::attention_cuda_workspace_bytes(batch, window, heads_q, heads_kv, head_dim,
                                                              cache_len, q_block, kv_block, max_blocks,
                                                              write_back, block_mass);
      },
      py::arg("batch"), py::arg("window"), py::arg("heads_q"), py::arg("heads_kv"), py::arg("head_dim"),
      py::arg("cache_len"), py::arg("q_block"), py::arg("kv_block"), py::arg("max_blocks"),
      py::arg("write_back"), py::arg("block_mass"),
      "Workspace bytes of the CUDA attention; max_blocks = kv_indices.shape[-1], or -1 without a "
      "block list.");
  m.def("attention_num_splits", &dinfer_kernels::attention_cuda_num_splits, py::arg("batch"),
        py::arg("window"), py::arg("heads_q"), py::arg("heads_kv"), py::arg("cache_len"), py::arg("q_block"),
        py::arg("kv_block"), py::arg("max_blocks"), py::arg("block_mass"),
        "Key-list splits per query tile the CUDA attention uses (a pure function of the shapes).");
#endif
}

}  // namespace dinfer_bindings
