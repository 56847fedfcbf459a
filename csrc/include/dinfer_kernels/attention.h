// Block-sparse bidirectional window attention with partial KV refresh: torch-free launcher.
//
// Contract: dinfer_kernels/reference/attention.py (the torch reference is the truth). A window of W
// query rows per sequence sits at absolute cache positions; the window's fresh K/V replace those
// cache rows (in place with write_back, for this call only without), and every valid row attends
// bidirectionally to the keys [0, seq_lens[b]) of the key blocks its query block lists.
// Two launchers take the same parameters: attention_cuda (device arrays) and attention_cpu (host).
#pragma once

#include <cstddef>
#include <cstdint>

#include "dinfer_kernels/types.h"

namespace dinfer_kernels {

// Sizes are element counts; strides are in elements. The last dimension of every [.., D] array is
// contiguous; for attention_cuda the other strides of q/k/v/k_cache/v_cache/out must also be
// multiples of 8 and the data 16-byte aligned (16-byte vector copies). positions, seq_lens, the
// block table, the block lists, lse and block_mass are contiguous.
struct AttentionParams {
  // ---- shapes ----------------------------------------------------------------------------------
  int64_t batch = 0;  // B
  int64_t window = 0;  // W: query rows per sequence
  int64_t heads_q = 0;  // Hq, a multiple of heads_kv (GQA: head h reads kv head h / (Hq/Hkv))
  int64_t heads_kv = 0;  // Hkv
  int64_t head_dim = 0;  // D: 64 or 128 (attention_cuda); any >= 1 (attention_cpu)
  int64_t cache_len = 0;  // S: rows of the per-layer cache (paged: max_pages * page_size positions)
  // of q, k, v, the caches and out: bf16 or fp16 (attention_cuda); also fp32 (attention_cpu)
  ScalarType dtype = ScalarType::kBFloat16;
  // ---- inputs ----------------------------------------------------------------------------------
  const void* q = nullptr;  // [B, W, Hq, D]
  int64_t q_stride[3] = {0, 0, 0};
  const void* k = nullptr;  // [B, W, Hkv, D] fresh keys of the window rows
  int64_t k_stride[3] = {0, 0, 0};
  const void* v = nullptr;  // [B, W, Hkv, D]
  int64_t v_stride[3] = {0, 0, 0};
  void* k_cache = nullptr;  // [B, S, Hkv, D] in/out, or with a block table [P, page_size, Hkv, D]
  int64_t k_cache_stride[3] = {0, 0, 0};
  void* v_cache = nullptr;  // same shape as k_cache, in/out
  int64_t v_cache_stride[3] = {0, 0, 0};
  // Paged layout (vLLM style): with a block table the caches are page pools shared by the sequences
  // (their strides are the pool's) and cache_len = max_pages * page_size: position s of sequence b
  // is row s % page_size of page block_table[b, s / page_size]. A page id outside [0, num_pages)
  // makes the position absent: never attended (even where a window row sits), never written. The
  // pool row of a valid window row must be no other position's below seq_lens (window rows are
  // written into the pool for the call, also without write_back on the GPU).
  const int32_t* block_table = nullptr;  // [B, max_pages] contiguous, or null: caches [B, S, Hkv, D]
  int64_t max_pages = 0;  // MP
  int64_t page_size = 0;  // rows per page, >= 1 (with a block table)
  int64_t num_pages = 0;  // P: pages in the pool
  const int64_t* positions = nullptr;  // [B, W]: row w of sequence b sits at cache row positions[b, w]
  const int32_t* seq_lens = nullptr;  // [B]: keys [0, seq_lens[b]) exist; row valid iff pos < seq_len
  bool write_back = true;  // false: the caches hold their old rows when the call returns
  // Block sparsity (FlexAttention BlockMask): query block j = rows [j*q_block, (j+1)*q_block),
  // key block kb = keys [kb*kv_block, (kb+1)*kv_block). Query block j of kv-head group g attends
  // the key blocks kv_indices[b, g, j, :kv_num_blocks[b, g, j]]; both null = every key block.
  const int32_t* kv_num_blocks = nullptr;  // [B, Hkv, NQB]
  const int32_t* kv_indices = nullptr;  // [B, Hkv, NQB, max_blocks]
  int64_t max_blocks = 0;  // MAXB (ignored without a list)
  int64_t q_block = 1;
  int64_t kv_block = 1;
  float scale = 1.0f;  // softmax scale
  // ---- outputs (caller-allocated) ----------------------------------------------------------------
  void* out = nullptr;  // [B, W, Hq, D]; padding rows and rows with no key get 0
  int64_t out_stride[3] = {0, 0, 0};
  float* lse = nullptr;  // [B, W, Hq] natural-log log-sum-exp or null; -inf: no key
  float* block_mass = nullptr;  // [B, Hq, NKB] or null: sum over valid rows of each block's mass
};

inline int64_t attention_num_q_blocks(int64_t window, int64_t q_block) {
  return q_block > 0 ? (window + q_block - 1) / q_block : 0;
}
inline int64_t attention_num_kv_blocks(int64_t cache_len, int64_t kv_block) {
  return kv_block > 0 ? (cache_len + kv_block - 1) / kv_block : 0;
}

// Key-list splits per (sequence, kv head, query tile) of the CUDA kernel: a pure function of the
// shapes (never of the GPU or of the data), so results are reproducible across devices.
// max_blocks < 0: no block list (every key block).
// With block_mass a block is never split across CTAs (its mass is finished by one CTA).
int attention_cuda_num_splits(int64_t batch, int64_t window, int64_t heads_q, int64_t heads_kv,
                              int64_t cache_len, int64_t q_block, int64_t kv_block, int64_t max_blocks,
                              bool block_mass);

// Bytes of device workspace attention_cuda needs (partial outputs of the splits, per-block
// statistics, saved cache rows when write_back is false). max_blocks < 0: no block list.
size_t attention_cuda_workspace_bytes(int64_t batch, int64_t window, int64_t heads_q, int64_t heads_kv,
                                      int64_t head_dim, int64_t cache_len, int64_t q_block, int64_t kv_block,
                                      int64_t max_blocks, bool write_back, bool block_mass);

// Launches the refresh prologue, the attention kernel and (when needed) the epilogue on `stream`.
// Never synchronises, never allocates (CUDA-graph capturable). Returns 0 (cudaSuccess) or a
// cudaError_t (cudaErrorInvalidValue for bad parameters, before anything is launched).
int attention_cuda(const AttentionParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Host launcher: math in fp32, OpenMP over (sequence, query head) tasks, each owning its output
// rows and its row of block_mass, so the result is the same for any thread count. Needs no
// workspace; without write_back the caches are only read (never copied, never restored).
// num_threads <= 0: OpenMP's default. Parameters must already be checked (the binding does).
void attention_cpu(const AttentionParams& p, int num_threads);

}  // namespace dinfer_kernels
