// The decode rows of a Llama-form decoder in one native call (runtime/kernels/native_step.py builds it and
// runtime/models/llama.py calls it): every layer's norms, rotary, KV append into the paged cache, decode
// attention, the W8A8 linears (qkv, o, gate_up, down), the activation and the residual adds, then the final norm.
// The form's variants are data per layer: q/k/v biases, per-head q/k norms, sandwich norms, soft-capped scores,
// sliding windows, a rotary per layer type (all or the first dims of each head), a residual multiplier, and a KV
// cache in the compute dtype or int8/fp8 codes.
//
// In eager torch a batch-1 step of SmolLM2-135M is ~30 layers x a dozen calls, and each linear opened its own
// parallel region (fork, join). Here one parallel region runs the whole step; its threads split each linear's
// 16-row weight tiles, the attention's (sequence, KV head) units, and meet at 5 barriers a layer (after qkv,
// attention, o, gate_up, down). Work too small to share (quantizing a row's activations to int8, a norm of
// 576 values, the activation of the gate) is done by every thread on its own copy instead of by one thread
// between two barriers; thread 0 alone writes the residual stream back, after the next barrier.
//
// Numerics are the fused ops' (fused_rows.h, qgemv.h, paged_attention.h: the same functions), op for op: the same
// roundings of the compute dtype between ops, the same int8 activations, the same softmax. Where units split a
// sequence's keys (long contexts, many threads) they merge as decode_attention.cpp's op merges them.
#include "fused_rows.h"
#include "paged_attention.h"
#include "qgemv.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace compress_cpu;

enum { QKV, O, GATE_UP, DOWN };

struct Linear {
  at::Tensor w, scale, szero, lut, bias;  // bias in the compute dtype, or undefined
  QWeight q;
  std::vector<int32_t> gidx;  // weight group of each 32-block of the input
};

struct Layer {
  at::Tensor input_norm, mlp_norm, k_cache, v_cache;
  at::Tensor q_norm, k_norm;               // per-head RMSNorm weights [D] before rotary (Qwen3, Gemma 3), or undefined
  at::Tensor attn_out_norm, mlp_out_norm;  // sandwich norms on each branch's output (Gemma 2/3), or undefined
  at::Tensor k_scale, v_scale;             // an 8-bit cache's fp16 scales [blocks, block, Hkv], or undefined
  int64_t window;                          // 0: none
  double softcap;                          // attention scores s -> tanh(s / cap) * cap; 0: none
  int64_t rope;                            // which of the step's rotaries rotates this layer
  double residual_multiplier;              // each branch's output times this before the add (Granite; 1: none)
  std::vector<Linear> lin;                 // QKV, O, GATE_UP, DOWN
};

// one thread's copies: the normalized row(s), the stream's next value, int8 activations, attention scratch
template <typename T>
struct Private {
  std::vector<T> h, s, act, t;
  std::vector<int8_t> xq;
  std::vector<float> sa, gsum, a, qf, scores, o;
  std::vector<int64_t> rows;
};

class DecodeStep : public torch::CustomClassHolder {
 public:
  DecodeStep(int64_t hq, int64_t hkv, int64_t d, int64_t hidden, int64_t inter, double eps, double offset,
             double scale, int64_t act, at::Tensor final_norm)
      : hq_(hq), hkv_(hkv), d_(d), hidden_(hidden), inter_(inter), eps_(eps), offset_(offset), scale_(scale),
        act_(act), final_norm_(final_norm) {
    TORCH_CHECK(has_vnni(), "the native decode step needs AVX512-VNNI, which this build of the kernels lacks");
    TORCH_CHECK(hq % hkv == 0 && d % 2 == 0 && d <= 1024 && act >= 0 && act <= 2, "bad heads, head_dim or act");
    check_cpu(final_norm, "final_norm");
  }

  // a rotary's fp32 tables cos, sin [positions, R/2] (runtime/models/layers.py's Rotary: the first R <= D dims of
  // each head rotated); returns its index for add_layer
  int64_t add_rotary(at::Tensor cos, at::Tensor sin) {
    TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.dim() == 2 && cos.size(1) * 2 <= d_ && cos.size(1) > 0 &&
                sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                sin.is_contiguous(), "cos/sin: contiguous fp32 [positions, R / 2], R <= head_dim");
    rotaries_.push_back({cos, sin});
    return static_cast<int64_t>(rotaries_.size()) - 1;
  }

  // a layer's tensors by name: input_norm, mlp_norm, k_cache, v_cache, and where the layer has them q_norm and
  // k_norm, attn_out_norm and mlp_out_norm, k_scale and v_scale (an 8-bit cache)
  void add_layer(c10::Dict<std::string, at::Tensor> t, int64_t window, double softcap, int64_t rope,
                 double residual_multiplier) {
    TORCH_CHECK(rope >= 0 && rope < static_cast<int64_t>(rotaries_.size()), "rope ", rope, ": add_rotary first");
    auto get = [&](const char* name) { return t.contains(name) ? t.at(name) : at::Tensor(); };
    Layer l{get("input_norm"), get("mlp_norm"), get("k_cache"), get("v_cache"), get("q_norm"), get("k_norm"),
            get("attn_out_norm"), get("mlp_out_norm"), get("k_scale"), get("v_scale"), window, softcap, rope,
            residual_multiplier, {}};
    const auto dtype = final_norm_.scalar_type();
    auto weight = [&](const at::Tensor& w, int64_t n, bool needed, const char* name) {
      TORCH_CHECK(w.defined() ? (w.numel() == n && w.is_contiguous() && w.scalar_type() == dtype) : !needed, name,
                  ": [", n, "] in the compute dtype", needed ? "" : ", or absent");
    };
    weight(l.input_norm, hidden_, true, "input_norm");
    weight(l.mlp_norm, hidden_, true, "mlp_norm");
    weight(l.q_norm, d_, false, "q_norm");
    weight(l.k_norm, d_, l.q_norm.defined(), "k_norm");
    weight(l.attn_out_norm, hidden_, false, "attn_out_norm");
    weight(l.mlp_out_norm, hidden_, l.attn_out_norm.defined(), "mlp_out_norm");
    TORCH_CHECK(l.k_cache.defined() && l.v_cache.defined(), "k_cache and v_cache are needed");
    const bool coded = l.k_scale.defined();  // an int8 or fp8 cache (dispatch_codes checks which)
    TORCH_CHECK(coded == l.v_scale.defined(), "k_scale and v_scale come together");
    TORCH_CHECK(layers_.empty() || l.k_cache.scalar_type() == layers_[0].k_cache.scalar_type(), "one cache dtype");
    for (const at::Tensor* c : {&l.k_cache, &l.v_cache})
      TORCH_CHECK(c->dim() == 4 && c->size(2) == hkv_ && c->size(3) == d_ && c->is_contiguous() &&
                  (coded || c->scalar_type() == dtype) && c->sizes() == l.k_cache.sizes(),
                  "caches: [blocks, block, Hkv, D], in the compute dtype or 8-bit codes with scales");
    for (const at::Tensor* c : {&l.k_scale, &l.v_scale})
      TORCH_CHECK(!coded || (c->scalar_type() == at::kHalf && c->is_contiguous() &&
                  c->sizes() == l.k_cache.sizes().slice(0, 3)), "scales: fp16 [blocks, block, Hkv]");
    layers_.push_back(std::move(l));
  }

  // the last added layer's next linear, in the order qkv, o, gate_up, down (qgemv.cpp's w8a8_linear arguments)
  void add_linear(at::Tensor w, at::Tensor scale, at::Tensor szero, double unscale, int64_t bits, int64_t group,
                  int64_t n_out, std::optional<at::Tensor> lut, std::optional<at::Tensor> bias) {
    TORCH_CHECK(!layers_.empty() && layers_.back().lin.size() < 4, "add_layer first; four linears a layer");
    const int64_t which = static_cast<int64_t>(layers_.back().lin.size());
    const int64_t k = which == DOWN ? inter_ : which == O ? hq_ * d_ : hidden_;
    const int64_t want = which == QKV ? (hq_ + 2 * hkv_) * d_ : which == GATE_UP ? 2 * inter_ : hidden_;
    TORCH_CHECK(n_out == want && w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) * 8 == k * 16 * bits &&
                k % group == 0 && group % QB == 0 && (bits == 4 || bits == 8), "linear ", which, ": a [", want, ", ",
                k, "] weight in qgemv.cpp's tiles");
    const uint16_t* scale_p = half_scales(scale, w.size(0), k / group, "scale");
    const uint16_t* szero_p = half_scales(szero, w.size(0), k / group, "szero");
    Linear l{w, scale, szero, lut.value_or(at::Tensor()), bias.value_or(at::Tensor()), {}, {}};
    TORCH_CHECK(!l.lut.defined() || (l.lut.scalar_type() == at::kByte && l.lut.numel() == 16 && bits == 4), "lut");
    TORCH_CHECK(!l.bias.defined() || (l.bias.numel() == n_out && l.bias.scalar_type() == final_norm_.scalar_type()),
                "bias: [n_out] in the compute dtype");
    l.q = {w.data_ptr<uint8_t>(), scale_p, szero_p, static_cast<float>(unscale),
           l.lut.defined() ? l.lut.data_ptr<uint8_t>() : nullptr, bits, group, k, n_out, w.size(0)};
    for (int64_t b = 0; b < k / QB; ++b) l.gidx.push_back(static_cast<int32_t>(b * QB / group));
    layers_.back().lin.push_back(std::move(l));
  }

  // x [B, hidden]: the embedded tokens, the residual stream (in place); positions, slots int64 [B]; block_tables
  // int32 [B, W], seq_lens int32 [B] (the new token included). Returns the final norm of the stream [B, hidden].
  at::Tensor run(at::Tensor x, at::Tensor positions, at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens);

 private:
  template <typename T, typename C>
  struct Run;

  int64_t hq_, hkv_, d_, hidden_, inter_;
  double eps_, offset_, scale_;
  int64_t act_;
  at::Tensor final_norm_;
  std::vector<std::pair<at::Tensor, at::Tensor>> rotaries_;  // (cos, sin)
  std::vector<Layer> layers_;
};

// one step in compute dtype T over a cache of C (T itself, or int8 / fp8 codes with fp16 scales)
template <typename T, typename C>
struct DecodeStep::Run {
  const DecodeStep& m;
  T* x;
  const int64_t* positions;
  const int64_t* slots;
  const at::Tensor& tables;
  const int32_t* lens;
  T* out;
  int64_t b;
  // shared between the threads
  std::vector<T> cs, qkv, attn, delta, gu;
  std::vector<Plan> plans;   // one per layer (windows differ)
  std::vector<Problem> problems;
  std::vector<float> stats;
  int64_t qkv_dim = 0;

  void go();
  void prepare(int64_t threads);
  void layer(int64_t li, Private<T>& p, int64_t tid, int64_t nt);
  void linear(const Linear& l, const T* in, T* dst, Private<T>& p, int64_t tid, int64_t nt);
  void attention(int64_t li, Private<T>& p, int64_t tid, int64_t nt);
  void rope_and_store(int64_t li, int64_t seq, int64_t g0, int64_t g1);
  // what a branch's output delta adds to the stream: delta, its sandwich norm, times the residual multiplier
  // (each rounded to T, as the per-op path's tensors are), in this thread's p.t
  const T* branch(T* delta, const at::Tensor& w, double multiplier, Private<T>& p) {
    if (!w.defined() && multiplier == 1.) return delta;
    const int64_t n = b * m.hidden_;
    if (w.defined()) {
      for (int64_t r = 0; r < b; ++r)
        rms_row(delta + r * m.hidden_, static_cast<const T*>(nullptr), w.data_ptr<T>(), p.t.data() + r * m.hidden_,
                m.hidden_, static_cast<float>(m.eps_), static_cast<float>(m.offset_));
    } else {
      std::memcpy(p.t.data(), delta, sizeof(T) * n);
    }
    const float f = static_cast<float>(multiplier);
    if (multiplier != 1.)
      for (int64_t i = 0; i < n; ++i) st(p.t.data(), i, ld(p.t.data(), i) * f);
    return p.t.data();
  }
  // p.h <- norm(stream + delta) on this thread's copy p.s of the stream (delta null: the stream as it is)
  void norm(const T* delta, const at::Tensor& w, Private<T>& p) {
    const T* wp = w.data_ptr<T>();
    std::memcpy(p.s.data(), x, sizeof(T) * b * m.hidden_);
    for (int64_t r = 0; r < b; ++r)
      rms_row(p.s.data() + r * m.hidden_, delta == nullptr ? nullptr : delta + r * m.hidden_, wp,
              p.h.data() + r * m.hidden_, m.hidden_, static_cast<float>(m.eps_), static_cast<float>(m.offset_));
  }
};

template <typename T, typename C>
void DecodeStep::Run<T, C>::prepare(int64_t threads) {
  const int64_t d = m.d_;
  qkv_dim = (m.hq_ + 2 * m.hkv_) * d;
  // per rotary and sequence: cos row [c, c], sin row [-s, s] (R of D values used), rounded to T as Rotary does
  cs.resize(m.rotaries_.size() * b * 2 * d);
  for (size_t ri = 0; ri < m.rotaries_.size(); ++ri) {
    const int64_t half = m.rotaries_[ri].first.size(1);
    for (int64_t i = 0; i < b; ++i) {
      const float* c = m.rotaries_[ri].first.data_ptr<float>() + positions[i] * half;
      const float* s = m.rotaries_[ri].second.data_ptr<float>() + positions[i] * half;
      T* row = cs.data() + (ri * b + i) * 2 * d;
      for (int64_t j = 0; j < 2 * half; ++j) {
        st(row, j, c[j % half]);
        st(row, d + j, j < half ? -s[j] : s[j - half]);
      }
    }
  }
  qkv.resize(b * qkv_dim);
  attn.resize(b * m.hq_ * d);
  delta.resize(b * m.hidden_);
  gu.resize(b * 2 * m.inter_);
  size_t most = 0;
  for (const Layer& l : m.layers_) {
    const Problem pr{qkv_dim, d, m.hq_, m.hkv_, d, l.k_cache.size(1), tables.size(1), l.window,
                     static_cast<float>(m.scale_), static_cast<float>(l.softcap), tables.data_ptr<int32_t>(), lens};
    problems.push_back(pr);
    plans.push_back(plan_units(pr, b, threads, true));
    most = std::max(most, plans.back().units.size());
  }
  stats.resize(most * m.hq_ * (d + 2));
}

template <typename T, typename C>
void DecodeStep::Run<T, C>::go() {
  const int64_t threads = at::get_num_threads();
  prepare(threads);
  const int64_t n_layers = static_cast<int64_t>(m.layers_.size());
#pragma omp parallel num_threads(threads)
  {
    const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
    Private<T> p;
    p.h.resize(b * m.hidden_);
    p.s.resize(b * m.hidden_);
    p.t.resize(b * m.hidden_);
    p.act.resize(b * m.inter_);
    p.xq.resize(b * std::max(m.inter_, std::max(m.hidden_, m.hq_ * m.d_)));
    p.sa.resize(p.xq.size() / QB);
    p.gsum.resize(p.xq.size() / QB);
    p.a.resize(m.inter_);
    p.o.resize(m.d_);
    norm(nullptr, m.layers_[0].input_norm, p);
    for (int64_t li = 0; li < n_layers; ++li) layer(li, p, tid, nt);
#pragma omp barrier
    if (tid == 0) {  // the stream's last value, and its final norm
      std::memcpy(x, p.s.data(), sizeof(T) * b * m.hidden_);
      std::memcpy(out, p.h.data(), sizeof(T) * b * m.hidden_);
    }
  }
}

// one layer; on entry p.h is this layer's normalized input and p.s the stream's value (thread 0 stores it), on exit
// p.h is the next layer's input (or the final norm) and p.s the stream after this layer
template <typename T, typename C>
void DecodeStep::Run<T, C>::layer(int64_t li, Private<T>& p, int64_t tid, int64_t nt) {
  const Layer& l = m.layers_[li];
  linear(l.lin[QKV], p.h.data(), qkv.data(), p, tid, nt);
#pragma omp barrier
  if (tid == 0) std::memcpy(x, p.s.data(), sizeof(T) * b * m.hidden_);  // past a barrier: every thread has read x
  attention(li, p, tid, nt);
  linear(l.lin[O], attn.data(), delta.data(), p, tid, nt);
#pragma omp barrier
  norm(branch(delta.data(), l.attn_out_norm, l.residual_multiplier, p), l.mlp_norm, p);
  linear(l.lin[GATE_UP], p.h.data(), gu.data(), p, tid, nt);
#pragma omp barrier
  if (tid == 0) std::memcpy(x, p.s.data(), sizeof(T) * b * m.hidden_);
  for (int64_t r = 0; r < b; ++r)
    act_row(gu.data() + r * 2 * m.inter_, p.act.data() + r * m.inter_, m.inter_, m.act_, p.a.data());
  linear(l.lin[DOWN], p.act.data(), delta.data(), p, tid, nt);
#pragma omp barrier
  const bool last = li + 1 == static_cast<int64_t>(m.layers_.size());
  const at::Tensor& next = last ? m.final_norm_ : m.layers_[li + 1].input_norm;
  norm(branch(delta.data(), l.mlp_out_norm, l.residual_multiplier, p), next, p);
}

// dst [B, n_out] <- in [B, K] through l: this thread's share of the tiles, from its own int8 copy of `in`
template <typename T, typename C>
void DecodeStep::Run<T, C>::linear(const Linear& l, const T* in, T* dst, Private<T>& p, int64_t tid, int64_t nt) {
  const QWeight& q = l.q;
  const int64_t t0 = q.tiles * tid / nt, t1 = q.tiles * (tid + 1) / nt;
  if (t0 == t1) return;
  quantize_rows<T>(in, b, q.k, q.group, p.xq.data(), p.sa.data(), p.gsum.data());
  gemv_range<T>(q, p.xq.data(), p.sa.data(), p.gsum.data(), l.gidx.data(), dst, b, t0, t1);
  if (l.bias.defined()) {  // y + bias.to(y.dtype), as W8A8Linear adds it
    const T* bias = l.bias.data_ptr<T>();
    const int64_t c0 = t0 * 16, c1 = std::min(t1 * 16, q.n_out);
    for (int64_t r = 0; r < b; ++r)
      for (int64_t c = c0; c < c1; ++c) st(dst, r * q.n_out + c, ld(dst, r * q.n_out + c) + ld(bias, c));
  }
}

// KV heads [g0, g1) of sequence seq: normalize (q/k norms) and rotate their k and their query heads, store k and v
// at the token's slot
template <typename T, typename C>
void DecodeStep::Run<T, C>::rope_and_store(int64_t li, int64_t seq, int64_t g0, int64_t g1) {
  const Layer& l = m.layers_[li];
  const int64_t d = m.d_, hq = m.hq_, hkv = m.hkv_, group = hq / hkv;
  T* row = qkv.data() + seq * qkv_dim;
  const T* c = cs.data() + (l.rope * b + seq) * 2 * d;
  const int64_t rot = 2 * m.rotaries_[l.rope].first.size(1);  // dims rotated; the rest pass through
  const float eps = static_cast<float>(m.eps_), offset = static_cast<float>(m.offset_);
  const bool qk = l.q_norm.defined();
  for (int64_t h = g0 * group; h < g1 * group; ++h) {
    if (qk) rms_row(row + h * d, static_cast<const T*>(nullptr), l.q_norm.data_ptr<T>(), row + h * d, d, eps, offset);
    rope_row(row + h * d, c, c + d, rot);
  }
  for (int64_t g = g0; g < g1; ++g) {
    T* k = row + (hq + g) * d;
    if (qk) rms_row(k, static_cast<const T*>(nullptr), l.k_norm.data_ptr<T>(), k, d, eps, offset);
    rope_row(k, c, c + d, rot);
    const int64_t r = slots[seq] * hkv + g;  // the token's row of this KV head
    C* kc = static_cast<C*>(l.k_cache.data_ptr()) + r * d;
    C* vc = static_cast<C*>(l.v_cache.data_ptr()) + r * d;
    if constexpr (kCoded<C>) {  // quantized as write_kv_q8_ does
      quantize_row(k, d, kc, l.k_scale.data_ptr<at::Half>() + r);
      quantize_row(row + (hq + hkv + g) * d, d, vc, l.v_scale.data_ptr<at::Half>() + r);
    } else {
      std::memcpy(kc, k, sizeof(T) * d);
      std::memcpy(vc, row + (hq + hkv + g) * d, sizeof(T) * d);
    }
  }
}

// attn [B, Hq * D] <- attention of this layer; ends with every thread past a barrier
template <typename T, typename C>
void DecodeStep::Run<T, C>::attention(int64_t li, Private<T>& p, int64_t tid, int64_t nt) {
  const Layer& l = m.layers_[li];
  const Plan& plan = plans[li];
  const Problem& pr = problems[li];
  const int64_t n_units = static_cast<int64_t>(plan.units.size()), stride = m.hq_ * (m.d_ + 2);
  const int64_t group = m.hq_ / m.hkv_;
  const C* kc = static_cast<const C*>(l.k_cache.data_ptr());
  const C* vc = static_cast<const C*>(l.v_cache.data_ptr());
  const at::Half* ks = kCoded<C> ? l.k_scale.data_ptr<at::Half>() : nullptr;
  const at::Half* vs = kCoded<C> ? l.v_scale.data_ptr<at::Half>() : nullptr;
  bool whole = true;  // no sequence's keys split: each unit owns its heads, start to end
  for (const Unit& u : plan.units) whole = whole && u.whole;
  if (!whole) {  // every head rotated and stored before any unit reads the keys
    for (int64_t i = tid; i < b * m.hkv_; i += nt) rope_and_store(li, i / m.hkv_, i % m.hkv_, i % m.hkv_ + 1);
#pragma omp barrier
  }
  for (int64_t i = tid; i < n_units; i += nt) {
    const Unit& u = plan.units[i];
    if (whole) rope_and_store(li, u.b, u.g0, u.g1);
    attend(u, pr, qkv.data(), kc, vc, ks, vs, stats.data() + i * stride, p.qf, p.scores, p.rows);
    if (whole)
      for (int64_t h = u.g0 * group; h < u.g1 * group; ++h) merge_head(pr, plan, stats.data(), u.b, h, attn.data(),
                                                                     p.o.data());
  }
#pragma omp barrier
  if (!whole) {
    for (int64_t i = tid; i < b * m.hq_; i += nt) merge_head(pr, plan, stats.data(), i / m.hq_, i % m.hq_,
                                                             attn.data(), p.o.data());
#pragma omp barrier
  }
}

at::Tensor DecodeStep::run(at::Tensor x, at::Tensor positions, at::Tensor slots, at::Tensor block_tables,
                         at::Tensor seq_lens) {
  check_cpu(x, "x");
  const int64_t b = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == final_norm_.scalar_type(),
              "x: [B, hidden] in the compute dtype");
  TORCH_CHECK(!layers_.empty() && layers_.back().lin.size() == 4, "every layer needs its four linears");
  for (const at::Tensor* t : {&positions, &slots, &block_tables, &seq_lens}) check_cpu(*t, "metadata");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && positions.numel() == b &&
              slots.numel() == b, "positions and slots: int64 [B]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              block_tables.dim() == 2 && block_tables.size(0) == b && seq_lens.numel() == b,
              "block_tables int32 [B, W], seq_lens int32 [B]");
  const int64_t capacity = layers_[0].k_cache.size(0) * layers_[0].k_cache.size(1);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t pos = positions.data_ptr<int64_t>()[i], slot = slots.data_ptr<int64_t>()[i];
    bool fits = true;
    for (const auto& r : rotaries_) fits = fits && pos < r.first.size(0);
    TORCH_CHECK(pos >= 0 && fits && slot >= 0 && slot < capacity, "position ", pos, " or slot ", slot,
                " out of range");
    const int64_t len = seq_lens.data_ptr<int32_t>()[i];
    TORCH_CHECK(len >= 1 && (len - 1) / layers_[0].k_cache.size(1) < block_tables.size(1), "sequence ", i, " of ",
                len, " tokens: empty, or longer than its block table");
  }
  auto out = at::empty_like(x);
  if (b == 0) return out;
  DISPATCH_F32_BF16(x.scalar_type(), "decode_step", [&] {
    dispatch_codes<scalar_t>(layers_[0].k_cache, layers_[0].k_scale.defined(), [&](auto code) {
      Run<scalar_t, decltype(code)> r{*this, x.data_ptr<scalar_t>(), positions.data_ptr<int64_t>(),
                                      slots.data_ptr<int64_t>(), block_tables, seq_lens.data_ptr<int32_t>(),
                                      out.data_ptr<scalar_t>(), b};
      r.go();
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compress_cpu, m) {
  m.class_<DecodeStep>("DecodeStep")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, double, int64_t, at::Tensor>())
      .def("add_rotary", &DecodeStep::add_rotary)
      .def("add_layer", &DecodeStep::add_layer)
      .def("add_linear", &DecodeStep::add_linear)
      .def("run", &DecodeStep::run);
}
