// Decode attention over the paged KV cache on CPU: one new query per sequence (runtime/kernels/cpu_ext.py
// builds and loads this with the other kernels).
//
// The work of a decode step is tiny at batch 1 (SmolLM2, 140 keys: ~80k products per layer), so the cost is
// in how it is spread: a parallel region over 3 KV heads on 2 threads waits for the slower thread and pays
// the fork and join, which made this op 2x slower than one thread doing it all. Small calls therefore run
// inline; large ones split each sequence's keys into chunks ("flash decoding"), each chunk keeps its own
// softmax max and sum, and the chunks merge at the end, so a single long sequence uses every thread.
// Softmax in fp32; a sequence that is one chunk normalizes its probabilities before the value sum, as the
// torch reference does.
//
// An 8-bit cache (runtime/kernels/kv_quant.py: int8 or fp8 e4m3 codes, one fp16 scale per token and KV head)
// is read as codes and dequantized in registers: a key's dot product runs over its codes and is scaled once,
// a value's codes are added with the probability times its scale. write_kv_q8_ quantizes new tokens the way
// quantize_kv does, bit for bit (the same fp32 divisions and roundings).
//
// A softcap > 0 (Gemma 2's attn_logit_softcapping) bounds each score s = scale * q.k to tanh(s / cap) * cap
// before the softmax, as the torch path does.
#include "paged_attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

using namespace compress_cpu;

template <typename T, typename C>
void decode_attention_kernel(const Problem& p, const T* q, const C* kc, const C* vc, const at::Half* ks,
                             const at::Half* vs, T* out, int64_t b_count) {
  const int64_t threads = at::get_num_threads(), stride = p.hq * (p.d + 2);
  const Plan plan = plan_units(p, b_count, threads, false);
  const int64_t n_units = static_cast<int64_t>(plan.units.size());
  std::vector<float> stats(n_units * stride);
  at::parallel_for(0, n_units, plan.small ? n_units + 1 : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, scores;
    std::vector<int64_t> rows;
    for (int64_t i = begin; i < end; ++i)
      attend(plan.units[i], p, q, kc, vc, ks, vs, stats.data() + i * stride, qf, scores, rows);
  });
  float o[1024];  // d <= 1024 (checked)
  for (int64_t b = 0; b < b_count; ++b)  // merge the chunks of each sequence
    for (int64_t h = 0; h < p.hq; ++h) merge_head(p, plan, stats.data(), b, h, out, o);
}

void check_scales(const at::Tensor& scales, const at::Tensor& cache, const char* name) {
  check_cpu(scales, name);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 3 && scales.size(0) == cache.size(0) &&
              scales.size(1) == cache.size(1) && scales.size(2) == cache.size(2),
              name, " must be fp16 [blocks, block, Hkv], parallel to the cache");
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window, const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale, double softcap) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1, "q must be a CPU [B, Hq, D] tensor, "
              "contiguous in D");
  check_cpu(k_cache, "k_cache");
  check_cpu(v_cache, "v_cache");
  check_cpu(block_tables, "block_tables");
  check_cpu(seq_lens, "seq_lens");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "caches must be [blocks, block, Hkv, D], of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  const bool scaled = k_scale.has_value();
  TORCH_CHECK(scaled == v_scale.has_value(), "give both k_scale and v_scale, or neither");
  if (scaled) {
    check_scales(*k_scale, k_cache, "k_scale");
    check_scales(*v_scale, v_cache, "v_scale");
  }
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && hq % hkv == 0 && d <= 1024, "head_dim (<= 1024) or head counts do not "
              "match the cache");
  TORCH_CHECK(block_tables.size(0) == b && seq_lens.numel() == b, "one table row and length per sequence");
  auto out = at::empty({b, hq, d}, q.options());
  if (b == 0) return out;
  const Problem p{q.stride(0), q.stride(1), hq, hkv, d, k_cache.size(1), block_tables.size(1), window,
                  static_cast<float>(scale), static_cast<float>(softcap), block_tables.data_ptr<int32_t>(),
                  seq_lens.data_ptr<int32_t>()};
  const at::Half* ks = scaled ? k_scale->data_ptr<at::Half>() : nullptr;
  const at::Half* vs = scaled ? v_scale->data_ptr<at::Half>() : nullptr;
  DISPATCH_F32_BF16(q.scalar_type(), "paged_decode_attention", [&] {
    dispatch_codes<scalar_t>(k_cache, scaled, [&](auto code) {
      using C = decltype(code);
      decode_attention_kernel<scalar_t, C>(p, q.data_ptr<scalar_t>(), static_cast<const C*>(k_cache.data_ptr()),
                                           static_cast<const C*>(v_cache.data_ptr()), ks, vs,
                                           out.data_ptr<scalar_t>(), b);
    });
  });
  return out;
}

// 8-bit caches [blocks, block, Hkv, D] and their scales [blocks, block, Hkv] at `slots` [T] <- k, v [T, Hkv, D]
void write_kv_q8_(at::Tensor k_cache, at::Tensor v_cache, at::Tensor k_scale, at::Tensor v_scale, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& slots) {
  check_cpu(k_cache, "k_cache");
  check_cpu(v_cache, "v_cache");
  check_cpu(slots, "slots");
  check_scales(k_scale, k_cache, "k_scale");
  check_scales(v_scale, v_cache, "v_scale");
  const int64_t t = k.size(0), hkv = k_cache.size(2), d = k_cache.size(3);
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK(x->device().is_cpu() && x->dim() == 3 && x->size(0) == t && x->size(1) == hkv && x->size(2) == d &&
                x->stride(2) == 1 && x->stride(1) == d && x->scalar_type() == k.scalar_type(),
                "k and v must be [T, Hkv, D] with each token's heads contiguous, of one dtype");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must match");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == t, "slots: int64, one per token");
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < capacity, "slot ", sp[i], " is outside the cache");
  DISPATCH_F32_BF16(k.scalar_type(), "write_kv_q8_", [&] {
    dispatch_codes<scalar_t>(k_cache, true, [&](auto code) {
      using C = decltype(code);
      if constexpr (kCoded<C>) {
        for (int64_t i = 0; i < t; ++i)
          for (int64_t h = 0; h < hkv; ++h) {
            const int64_t r = sp[i] * hkv + h;
            quantize_row(k.data_ptr<scalar_t>() + i * k.stride(0) + h * d, d,
                         static_cast<C*>(k_cache.data_ptr()) + r * d, k_scale.data_ptr<at::Half>() + r);
            quantize_row(v.data_ptr<scalar_t>() + i * v.stride(0) + h * d, d,
                         static_cast<C*>(v_cache.data_ptr()) + r * d, v_scale.data_ptr<at::Half>() + r);
          }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compress_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window, Tensor? k_scale=None, Tensor? v_scale=None, float softcap=0.0) -> Tensor", &paged_decode_attention);
  m.def("write_kv_q8_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor k, "
        "Tensor v, Tensor slots) -> ()", &write_kv_q8_);
}
