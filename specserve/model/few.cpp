// The forward of a few rows on the CPU (a decode step, a draft level, a verify at low batch),
// written by hand: model/compiled.py's dense_forward for T = B * q rows, the LM head included,
// in one OpenMP parallel region. A step of a few rows reads every weight once and does little
// arithmetic on it, so its speed is the memory's: each matmul's weight rows are split into one
// contiguous range a thread, every thread streams its range once and reuses each row (from L1)
// for the T rows of x. Between the phases of a layer the threads meet at a barrier, about five a
// layer, where a call per operation would cost microseconds each.
//
// Row t = b * q + i is new row i of sequence b. It sees the first ctx_lens[b] keys of sequence b,
// read from the pool through its block table, and its own new rows u where mask[b, i, u]. The
// new rows' keys and values are written into the pool at slots[t] (a slot < 0 is a padding row,
// written nowhere); the attention takes them from this call's own buffers, so a row never reads
// a slot another row of the call writes. Same arithmetic as model/llama.py, summed in another
// order: the logits agree to float32 rounding (tests/engine/test_compiled.py).

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <utility>
#include <vector>

namespace {

struct Layer {
  const float* attn_norm;  // [H]
  const float* wqkv;       // [(Hq + 2 Hkv) D, H]: q heads, then k heads, then v heads
  const float* bqkv;       // [(Hq + 2 Hkv) D] or null
  const float* q_norm;     // [D] or null (with k_norm: per-head RMSNorm of q and k)
  const float* k_norm;     // [D] or null
  const float* wo;         // [H, Hq D]
  const float* ffn_norm;   // [H]
  const float* w13;        // [2 I, H]: gate rows, then up rows
  const float* w2;         // [H, I]
};

struct Model {
  int64_t hidden, num_layers, num_heads, num_kv_heads, head_dim, inter, vocab, max_pos;
  float eps, scale;
  const float* embed;     // [V, H]
  const float* norm;      // [H]
  const float* output;    // [V, H]
  const float* rope_cos;  // [max_pos, D / 2]
  const float* rope_sin;  // [max_pos, D / 2]
  const Layer* layers;    // [num_layers]
};

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t k = 0; k < n; ++k) s += a[k] * b[k];
  return s;
}

typedef float vf __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register, or two or four narrower

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The sum of v's lanes: halves added until four lanes are left (memcpy of a half is one
// extract instruction; no shuffle builtin, which GCC has only from version 12).
inline float hsum(vf v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  const v8 a = lo + hi;
  v4 l4, h4;
  std::memcpy(&l4, &a, sizeof l4);
  std::memcpy(&h4, reinterpret_cast<const char*>(&a) + sizeof l4, sizeof h4);
  const v4 c = l4 + h4;
  return (c[0] + c[2]) + (c[1] + c[3]);
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// out += p * v over a head's n elements
inline void axpy(float* __restrict out, float p, const float* __restrict v, int64_t n) {
  if (n % 16 == 0) {
    for (int64_t k = 0; k < n; k += 16) store(out + k, load(out + k) + p * load(v + k));
    return;
  }
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) out[k] += p * v[k];
}

// e^x, x in [-87, 0] (a softmax's scores less their max) to float32 rounding: x = n ln2 + r with
// |r| <= ln2 / 2 (ln2 in two parts, Cody and Waite), e^r by its Taylor series to r^6 (the rest
// is below 1.2e-7 relative), 2^n put into the exponent's bits.
inline vf exp_nonpositive(vf x) {
  typedef int32_t vi __attribute__((vector_size(64)));
  x = x < -87.f ? vf{} - 87.f : x;
  const vf n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
  const vf r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-6f;
  vf e = vf{} + 1.f / 720;
  e = e * r + 1.f / 120;
  e = e * r + 1.f / 24;
  e = e * r + 1.f / 6;
  e = e * r + 0.5f;
  e = e * r + 1.f;
  e = e * r + 1.f;
  return e * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
}

// sr[0, n) replaced by e^(sr - max), 0 where sr is -inf; returns (max, sum).
inline std::pair<float, float> softmax_terms(float* __restrict sr, int64_t n) {
  float top = -INFINITY, sum = 0.f;
  for (int64_t j = 0; j < n; ++j) top = sr[j] > top ? sr[j] : top;
  int64_t j = 0;
  vf acc = {};
  for (; j + 16 <= n; j += 16) {
    const vf v = load(sr + j);
    const vf e = v == -INFINITY ? vf{} : exp_nonpositive(v - top);
    store(sr + j, e);
    acc += e;
  }
  sum = hsum(acc);
  for (; j < n; ++j) sum += (sr[j] = sr[j] == -INFINITY ? 0.f : std::exp(sr[j] - top));
  return {top, sum};
}

// a . b over n elements with four independent accumulators (four chains of fused multiply-adds
// in flight, where one chain waits on each add's latency).
inline float dot4(const float* __restrict a, const float* __restrict b, int64_t n) {
  vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t k = 0;
  for (; k + 64 <= n; k += 64) {
    a0 += load(a + k) * load(b + k);
    a1 += load(a + k + 16) * load(b + k + 16);
    a2 += load(a + k + 32) * load(b + k + 32);
    a3 += load(a + k + 48) * load(b + k + 48);
  }
  for (; k + 16 <= n; k += 16) a0 += load(a + k) * load(b + k);
  float s = hsum((a0 + a1) + (a2 + a3));
  for (; k < n; ++k) s += a[k] * b[k];
  return s;
}

// a . b over a head's n elements: one accumulator, no tail, where n is a multiple of 16
inline float dot_head(const float* __restrict a, const float* __restrict b, int64_t n) {
  if (n % 16) return dot4(a, b, n);
  vf acc = load(a) * load(b);
  for (int64_t k = 16; k < n; k += 16) acc += load(a + k) * load(b + k);
  return hsum(acc);
}

// y[0], y[ldy], y[2 ldy], y[3 ldy] = w . x[0..3] (x [4, K]): each vector of w loaded once for
// four rows of x, four independent chains.
inline void dot_rows4(const float* __restrict w, const float* __restrict x, int64_t K, float* __restrict y,
                      int64_t ldy) {
  vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const vf wv = load(w + k);
    a0 += wv * load(x + k);
    a1 += wv * load(x + K + k);
    a2 += wv * load(x + 2 * K + k);
    a3 += wv * load(x + 3 * K + k);
  }
  float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
  for (; k < K; ++k) {
    s0 += w[k] * x[k];
    s1 += w[k] * x[K + k];
    s2 += w[k] * x[2 * K + k];
    s3 += w[k] * x[3 * K + k];
  }
  y[0] = s0, y[ldy] = s1, y[2 * ldy] = s2, y[3 * ldy] = s3;
}

// y[t * ldy + j] = w[j] . x[t] for the n rows j of w ([n, K]) and the T rows t of x ([T, K]):
// the weight read once, in order (what the hardware prefetcher streams best), each row reused
// from L1 for the rows of x, four at a time.
inline void matvec(const float* __restrict w, int64_t n, const float* __restrict x, int64_t T, int64_t K,
                   float* __restrict y, int64_t ldy) {
  for (int64_t j = 0; j < n; ++j) {
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) dot_rows4(w + j * K, x + t * K, K, y + t * ldy + j, ldy);
    for (; t < T; ++t) y[t * ldy + j] = dot4(w + j * K, x + t * K, K);
  }
}


// x * rsqrt(mean(x^2) + eps) * w over n elements.
inline void rms_norm(const float* __restrict x, const float* __restrict w, int64_t n, float eps,
                     float* __restrict out) {
  float inv = 1.f / std::sqrt(dot(x, x, n) / n + eps);
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) out[k] = x[k] * inv * w[k];
}

// Rotate pairs (x[k], x[k + D/2]) by the position's angles (the "rotate_half" layout).
inline void rope(float* __restrict x, const float* __restrict cos, const float* __restrict sin, int64_t D) {
  int64_t h = D / 2;
  for (int64_t k = 0; k < h; ++k) {
    float a = x[k], b = x[k + h];
    x[k] = a * cos[k] - b * sin[k];
    x[k + h] = b * cos[k] + a * sin[k];
  }
}

// The share [begin, end) of n items that thread tid of nt takes, in whole multiples of `align`.
inline void share(int64_t n, int64_t align, int tid, int nt, int64_t* begin, int64_t* end) {
  int64_t units = (n + align - 1) / align;
  *begin = std::min(n, units * tid / nt * align);
  *end = std::min(n, units * (tid + 1) / nt * align);
}

// A piece of one sequence's attention: its context keys [j0, j1) (whole blocks), and its new rows
// when it is the sequence's last piece.
struct Piece {
  int64_t b, j0, j1;
  bool last;
};

}  // namespace

// Returns 0; 1 where a context length or block id is out of range, 2 a token, position or slot,
// 3 where the buffers cannot be had. Nothing is read or written out of bounds first.
extern "C" int specserve_few_forward(const Model* m, int64_t B, int64_t q, const int64_t* ids, const int64_t* pos,
                                     float* k_pool, float* v_pool, int64_t num_blocks, int64_t block_size,
                                     const int64_t* tables, int64_t W, const int64_t* ctx_lens, const bool* mask,
                                     const int64_t* slots, float* hidden, float* logits) {
  const int64_t T = B * q, H = m->hidden, Hq = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim;
  const int64_t G = Hq / Hkv, I = m->inter, QKV = (Hq + 2 * Hkv) * D, L = m->num_layers, HD = Hq + Hkv;
  const int64_t layer_stride = num_blocks * block_size * Hkv * D;  // one layer of the pool
  const int64_t key_stride = Hkv * D;                              // one position of a block
  for (int64_t b = 0; b < B; ++b) {
    if (ctx_lens[b] < 0 || ctx_lens[b] > W * block_size) return 1;
    for (int64_t w = 0; w * block_size < ctx_lens[b]; ++w)
      if (tables[b * W + w] < 0 || tables[b * W + w] >= num_blocks) return 1;
  }
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= m->vocab || pos[t] < 0 || pos[t] >= m->max_pos ||
        slots[t] >= num_blocks * block_size)
      return 2;

  // Each sequence's context cut into as many pieces as there are threads a sequence (in whole
  // blocks): at batch 1 the threads share one context, each streaming its piece's keys and values
  // in the pool's order. A piece's softmax is partial (its max, its sum, its unnormalised output)
  // and the pieces of a row are combined after (as flash-decoding does).
  const int64_t per_seq = std::max<int64_t>(1, (omp_get_max_threads() + B - 1) / B);
  std::vector<Piece> pieces;
  std::vector<int64_t> first_piece(B + 1);
  int64_t max_keys = 0;
  for (int64_t b = 0; b < B; ++b) {
    first_piece[b] = pieces.size();
    const int64_t blocks = (ctx_lens[b] + block_size - 1) / block_size;
    const int64_t P = std::max<int64_t>(1, std::min(blocks, per_seq));
    for (int64_t p = 0; p < P; ++p) {
      const int64_t j0 = blocks * p / P * block_size, j1 = std::min(ctx_lens[b], blocks * (p + 1) / P * block_size);
      pieces.push_back({b, j0, j1, p == P - 1});
      max_keys = std::max(max_keys, j1 - j0);
    }
  }
  first_piece[B] = pieces.size();
  const int64_t R = q * Hq, NP = pieces.size();  // a sequence's query rows: new row i, head hd at i Hq + hd

  // Shared: x the residual stream, h the residual after attention, the pieces' partial outputs
  // (R rows of D outputs, max, sum a piece). Then each thread's own: the normalised rows, the q
  // and k heads after norms and RoPE, the attention's output, one piece's scores, its gate and
  // up rows. All taken here, where a failure is an error code and not an exception in a thread.
  const int max_threads = omp_get_max_threads();
  const int64_t own = T * H + T * HD * D + T * Hq * D + R * (max_keys + q) + T * 2 * I;
  float* shared;
  try {
    shared = new float[T * (2 * H + QKV + I) + NP * R * (D + 2) + max_threads * own];
  } catch (const std::bad_alloc&) {
    return 3;
  }
  const std::unique_ptr<float[]> owner(shared);
  float* x = shared;
  float* h = x + T * H;
  float* qkv = h + T * H;
  float* act = qkv + T * QKV;
  float* part = act + T * I;
  for (int64_t t = 0; t < T; ++t) std::memcpy(x + t * H, m->embed + ids[t] * H, H * sizeof(float));

#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
    float* const normed = part + NP * R * (D + 2) + tid * own;
    float* const qk = normed + T * H;
    float* const att = qk + T * HD * D;
    float* const scores = att + T * Hq * D;
    float* const gate_up = scores + R * (max_keys + q);
    auto head = [&](int64_t t, int64_t hd) { return qk + (t * HD + hd) * D; };
    int64_t j0, j1;
    for (int64_t l = 0; l < L; ++l) {
      const Layer& ly = m->layers[l];
      float* kp = k_pool + l * layer_stride;
      float* vp = v_pool + l * layer_stride;
      // q, k, v of every row.
      for (int64_t t = 0; t < T; ++t) rms_norm(x + t * H, ly.attn_norm, H, m->eps, normed + t * H);
      share(QKV, 16, tid, nt, &j0, &j1);
      matvec(ly.wqkv + j0 * H, j1 - j0, normed, T, H, qkv + j0, QKV);
      if (ly.bqkv)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t j = j0; j < j1; ++j) qkv[t * QKV + j] += ly.bqkv[j];
#pragma omp barrier
      // Every thread: the norms and RoPE of every q and k head (a few thousand numbers), and the
      // keys and values of its rows t = tid (mod threads) into the pool.
      for (int64_t t = 0; t < T; ++t) {
        const float* c = m->rope_cos + pos[t] * (D / 2);
        const float* s = m->rope_sin + pos[t] * (D / 2);
        for (int64_t hd = 0; hd < HD; ++hd) {
          const float* norm = hd < Hq ? ly.q_norm : ly.k_norm;
          if (norm)
            rms_norm(qkv + t * QKV + hd * D, norm, D, m->eps, head(t, hd));
          else
            std::memcpy(head(t, hd), qkv + t * QKV + hd * D, D * sizeof(float));
          rope(head(t, hd), c, s, D);
        }
        if (t % nt == tid && slots[t] >= 0) {
          std::memcpy(kp + slots[t] * key_stride, head(t, Hq), key_stride * sizeof(float));
          std::memcpy(vp + slots[t] * key_stride, qkv + t * QKV + HD * D, key_stride * sizeof(float));
        }
      }
      // The pieces: scores[r S + j] of query row r and key j of the piece (its context keys, then
      // its sequence's new rows u where the mask shows them), then exp(score - max) and the sum.
      for (int64_t p = tid; p < NP; p += nt) {
        const Piece pc = pieces[p];
        const int64_t b = pc.b, n = pc.j1 - pc.j0, S = n + (pc.last ? q : 0);
        for (int64_t j = pc.j0; j < pc.j1; j += block_size) {
          const float* keys = kp + tables[b * W + j / block_size] * block_size * key_stride;
          for (int64_t o = 0, cnt = std::min(block_size, pc.j1 - j); o < cnt; ++o)
            for (int64_t kv = 0; kv < Hkv; ++kv) {
              const float* key = keys + o * key_stride + kv * D;
              for (int64_t i = 0; i < q; ++i)
                for (int64_t hd = kv * G; hd < (kv + 1) * G; ++hd)
                  scores[(i * Hq + hd) * S + j - pc.j0 + o] = dot_head(head(b * q + i, hd), key, D) * m->scale;
            }
        }
        if (pc.last)
          for (int64_t u = 0; u < q; ++u)
            for (int64_t i = 0; i < q; ++i)
              for (int64_t hd = 0; hd < Hq; ++hd)
                scores[(i * Hq + hd) * S + n + u] = mask[(b * q + i) * q + u]
                    ? dot_head(head(b * q + i, hd), head(b * q + u, Hq + hd / G), D) * m->scale : -INFINITY;
        float* out = part + p * R * (D + 2);  // row r: D outputs, then max and sum
        for (int64_t r = 0; r < R; ++r) {
          float* sr = scores + r * S;
          const auto [top, sum] = softmax_terms(sr, S);
          std::fill(out + r * (D + 2), out + r * (D + 2) + D, 0.f);
          out[r * (D + 2) + D] = top;
          out[r * (D + 2) + D + 1] = sum;
        }
        for (int64_t j = pc.j0; j < pc.j1; j += block_size) {  // exp(score - max) times the values
          const float* vals = vp + tables[b * W + j / block_size] * block_size * key_stride;
          for (int64_t o = 0, cnt = std::min(block_size, pc.j1 - j); o < cnt; ++o)
            for (int64_t kv = 0; kv < Hkv; ++kv) {
              const float* val = vals + o * key_stride + kv * D;
              for (int64_t i = 0; i < q; ++i)
                for (int64_t hd = kv * G; hd < (kv + 1) * G; ++hd) {
                  const int64_t r = i * Hq + hd;
                  axpy(out + r * (D + 2), scores[r * S + j - pc.j0 + o], val, D);
                }
            }
        }
        if (pc.last)
          for (int64_t u = 0; u < q; ++u)
            for (int64_t r = 0; r < R; ++r)
              if (const float e = scores[r * S + n + u]; e != 0.f)
                axpy(out + r * (D + 2), e, qkv + (b * q + u) * QKV + HD * D + (r % Hq) / G * D, D);
      }
#pragma omp barrier
      // Every thread: each row's pieces combined, softmax(scores) v = sum_p e^(max_p - M) out_p /
      // sum_p e^(max_p - M) sum_p with M the largest max_p.
      for (int64_t b = 0; b < B; ++b)
        for (int64_t r = 0; r < R; ++r) {
          float top = -INFINITY, sum = 0.f;
          for (int64_t p = first_piece[b]; p < first_piece[b + 1]; ++p)
            top = std::max(top, part[(p * R + r) * (D + 2) + D]);
          float* out = att + (b * q + r / Hq) * Hq * D + (r % Hq) * D;
          std::fill(out, out + D, 0.f);
          for (int64_t p = first_piece[b]; p < first_piece[b + 1]; ++p) {
            const float* pr = part + (p * R + r) * (D + 2);
            const float w = pr[D] == -INFINITY ? 0.f : std::exp(pr[D] - top);
            sum += w * pr[D + 1];
            axpy(out, w, pr, D);
          }
          const float inv = 1.f / sum;
          for (int64_t d = 0; d < D; ++d) out[d] *= inv;
        }
      // h = x + wo att
      share(H, 16, tid, nt, &j0, &j1);
      matvec(ly.wo + j0 * Hq * D, j1 - j0, att, T, Hq * D, h + j0, H);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = j0; j < j1; ++j) h[t * H + j] += x[t * H + j];
#pragma omp barrier
      // act = silu(gate) * up, gate and up rows j and I + j of w13 taken together
      for (int64_t t = 0; t < T; ++t) rms_norm(h + t * H, ly.ffn_norm, H, m->eps, normed + t * H);
      share(I, 16, tid, nt, &j0, &j1);
      const int64_t n = j1 - j0;
      matvec(ly.w13 + j0 * H, n, normed, T, H, gate_up, 2 * n);
      matvec(ly.w13 + (I + j0) * H, n, normed, T, H, gate_up + n, 2 * n);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < n; ++j) {
          const float g = gate_up[t * 2 * n + j], u = gate_up[t * 2 * n + n + j];
          act[t * I + j0 + j] = g / (1.f + std::exp(-g)) * u;
        }
#pragma omp barrier
      // x = h + w2 act
      share(H, 16, tid, nt, &j0, &j1);
      matvec(ly.w2 + j0 * I, j1 - j0, act, T, I, x + j0, H);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = j0; j < j1; ++j) x[t * H + j] += h[t * H + j];
#pragma omp barrier
    }
    // The final norm, then the LM head.
    for (int64_t t = 0; t < T; ++t) rms_norm(x + t * H, m->norm, H, m->eps, normed + t * H);
    if (tid == 0) std::memcpy(hidden, normed, T * H * sizeof(float));
    share(m->vocab, 16, tid, nt, &j0, &j1);
    matvec(m->output + j0 * H, j1 - j0, normed, T, H, logits + j0, m->vocab);
  }
  return 0;
}
